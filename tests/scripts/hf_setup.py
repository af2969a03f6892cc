"""A masked-LM ``Trainer`` set up for the HF adapter's data tests: a tiny BERT built from a config (random
weights), a word-level tokenizer built in memory (no download), synthetic token rows, and
``DataCollatorForLanguageModeling``, whose masking draws from torch's global generator while batches are
made (in the main process, or in the loader's workers). Dropout draws in the main process.

Data shapes (``data=``): ``"map"`` (a map-style dataset, epochs), ``"stream"`` (a torch ``IterableDataset``
without a state: a deterministic generator, endless), ``"hfstream"`` (a Hugging Face
``datasets.IterableDataset`` built from in-memory rows: it has ``state_dict()``). Streams train ``max_steps``.
"""
from __future__ import annotations

import torch
from torch.utils.data import Dataset, IterableDataset

VOCAB, SEQ = 60, 12
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL), VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]")


def rows(n: int, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(len(SPECIAL), VOCAB, (n, SEQ), generator=g).tolist()


class Rows(Dataset):
    def __init__(self, n: int):
        self.rows = rows(n)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i]}


class Stream(IterableDataset):
    """Endless and the same on every pass: row i of a fixed table, then i + 1, ..."""

    def __init__(self, n: int = 64):
        self.rows = rows(n)

    def __iter__(self):
        i = 0
        while True:
            yield {"input_ids": self.rows[i % len(self.rows)]}
            i += 1


def dataset(kind: str, n: int = 44):
    if kind == "map":
        return Rows(n)
    if kind == "stream":
        return Stream()
    if kind == "hfstream":
        import datasets

        return datasets.Dataset.from_dict({"input_ids": rows(200)}).to_iterable_dataset(num_shards=1)
    raise ValueError(kind)


def model():
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    return BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=48, max_position_embeddings=SEQ, hidden_dropout_prob=0.1))


def trainer(out: str, callback=None, *, data: str = "map", workers: int = 0, epochs: int = 2, max_steps: int = 12,
            extra_callbacks=(), **targs):
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments
    from transformers import logging as hf_logging

    hf_logging.set_verbosity_error()
    stream = data != "map"
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=5e-3,
        lr_scheduler_type="linear", warmup_steps=2, logging_steps=1, report_to=[], disable_tqdm=True, use_cpu=True,
        seed=42, save_strategy="no", dataloader_num_workers=workers,
        **({"max_steps": max_steps} if stream else {"num_train_epochs": epochs}), **targs)
    collator = DataCollatorForLanguageModeling(tokenizer(), mlm_probability=0.3)
    callbacks = [*extra_callbacks, *([callback] if callback is not None else [])]
    return Trainer(model=model(), args=args, train_dataset=dataset(data), data_collator=collator,
                   callbacks=callbacks)
