"""sentence-transformers' ``SentenceTransformerTrainer`` on a tiny model built here (no download): a BERT
from a config saved to a folder with a WordPiece vocabulary this script writes, loaded by
``models.Transformer``, and mean ``models.Pooling``; ``MultipleNegativesRankingLoss`` on 50 in-memory
(anchor, positive) pairs, some texts repeated (the batch sampler's choice matters), batch 4, ONE epoch
(13 steps), dropout.

``--sampler default|no_duplicates``: ``BatchSamplers.BATCH_SAMPLER`` (the default) or ``NO_DUPLICATES``.
Prints ``STEP n`` after each optimizer step and ``COMMITTED n`` after each keepalive commit; at the end
writes the weights and the log history (without timings) to ``--out``. ``--plain``: no callback (the
reference run); ``--from-epoch-start``: the control, a resumed epoch runs the library's iteration from its
first batch again instead of from the saved one (the position is not what keepalive saved).
"""
import os

import hf_script
import torch

p = hf_script.arguments()
p.add_argument("--sampler", default="default", choices=["default", "no_duplicates"])
p.add_argument("--from-epoch-start", action="store_true")
args = p.parse_args()
torch.set_num_threads(1)

WORDS = [f"w{i}" for i in range(30)]


def build_model(folder):
    """A tiny BERT and its WordPiece tokenizer, saved to ``folder`` (the same weights every run)."""
    from sentence_transformers import SentenceTransformer, models
    from transformers import BertConfig, BertModel

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "vocab.txt"), "w") as f:
        f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    from transformers import BertTokenizerFast

    BertTokenizerFast(os.path.join(folder, "vocab.txt"), do_lower_case=False).save_pretrained(folder)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=5 + len(WORDS), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=48, max_position_embeddings=32)).save_pretrained(folder)
    word = models.Transformer(folder, max_seq_length=16)
    return SentenceTransformer(modules=[word, models.Pooling(word.get_word_embedding_dimension(), "mean")],
                               device="cpu")


def pairs(n=50):
    g = torch.Generator().manual_seed(3)

    def text():
        return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (int(torch.randint(2, 7, (1,),
                                                                                     generator=g)),), generator=g))

    anchors = [text() for _ in range(n // 2)]
    anchors = anchors + anchors[: n - len(anchors)]  # every anchor twice: NO_DUPLICATES keeps them apart
    return {"anchor": anchors, "positive": [text() for _ in range(n)]}


def main():
    import datasets
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments, losses
    from sentence_transformers.base.sampler import BatchSamplers
    from transformers import logging as hf_logging

    hf_logging.set_verbosity_error()
    datasets.disable_progress_bars()
    here = os.path.dirname(args.out)
    model = build_model(os.path.join(here, "model"))
    sampler = BatchSamplers.NO_DUPLICATES if args.sampler == "no_duplicates" else BatchSamplers.BATCH_SAMPLER
    targs = SentenceTransformerTrainingArguments(
        output_dir=os.path.join(here, "hf-unused"), num_train_epochs=1, per_device_train_batch_size=4,
        learning_rate=5e-3, warmup_steps=2, logging_steps=1, report_to=[], disable_tqdm=True, use_cpu=True, seed=42,
        save_strategy="no", batch_sampler=sampler)
    callbacks = [hf_script.Steps(args.sleep)]
    if not args.plain:
        if args.from_epoch_start:
            from keepalive.callbacks import _hf_samplers

            batches = _hf_samplers.LibraryBatchSampler._batches
            _hf_samplers.LibraryBatchSampler._batches = lambda self, idx, start: batches(self, idx, 0)  # the control
        callbacks.append(hf_script.drive_checkpoint(args.run))
    trainer = SentenceTransformerTrainer(model=model, args=targs, train_dataset=datasets.Dataset.from_dict(pairs()),
                                         loss=losses.MultipleNegativesRankingLoss(model), callbacks=callbacks)
    trainer.train()
    hf_script.write_results(trainer, args.out)


main()
