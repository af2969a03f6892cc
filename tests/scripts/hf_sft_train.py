"""TRL's ``SFTTrainer`` on a tiny GPT-2 built from a config and a word-level tokenizer built in memory (no
download): the trainer keeps its own counters beside ``TrainerState`` (``_metrics``: entropy and token
accuracy averaged into each log; ``_total_train_tokens``: logged as ``num_tokens``). 40 texts, batch 4,
2 epochs (20 steps), a log every 3 steps (the accumulators carry values across saves), dropout.

Prints ``STEP n`` after each optimizer step and ``COMMITTED n`` after each keepalive commit; at the end
writes the weights and the log history (the final summary's counters included, without timings) to
``--out``. ``--plain``: no callback (the reference run); ``--no-counters``: keepalive saves none of the
trainer's own counters (the control).
"""
import os

import hf_script
import torch

p = hf_script.arguments()
p.add_argument("--no-counters", action="store_true")
args = p.parse_args()
torch.set_num_threads(1)

WORDS = [f"w{i}" for i in range(40)]
SPECIAL = ["<pad>", "<unk>", "<eos>"]


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")


def texts(n=40):
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(n):
        length = int(torch.randint(3, 12, (1,), generator=g))  # lengths vary: num_tokens counts them
        out.append(" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (length,), generator=g)))
    return out


def main():
    import datasets
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers import logging as hf_logging
    from trl import SFTConfig, SFTTrainer

    hf_logging.set_verbosity_error()
    datasets.disable_progress_bars()
    tok = tokenizer()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=16, n_embd=32, n_layer=1, n_head=2,
                                       bos_token_id=2, eos_token_id=2, pad_token_id=0))
    cfg = SFTConfig(output_dir=os.path.join(os.path.dirname(args.out), "hf-unused"), per_device_train_batch_size=4,
                    num_train_epochs=2, learning_rate=5e-3, logging_steps=3, report_to=[], disable_tqdm=True,
                    use_cpu=True, seed=42, save_strategy="no", max_length=16, dataset_text_field="text",
                    packing=False, dataset_num_proc=None, bf16=False, fp16=False)
    callbacks = [hf_script.Steps(args.sleep)]
    if not args.plain:
        if args.no_counters:
            from keepalive.callbacks import _hf_counters

            _hf_counters.SubclassCounters.capture = lambda self: {}  # the control: none saved
        callbacks.append(hf_script.drive_checkpoint(args.run))
    trainer = SFTTrainer(model=model, args=cfg, train_dataset=datasets.Dataset.from_dict({"text": texts()}),
                         processing_class=tok, callbacks=callbacks)
    trainer.train()
    hf_script.write_results(trainer, args.out, summary=True)


main()
