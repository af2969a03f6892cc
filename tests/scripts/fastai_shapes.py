"""fastai's tabular and text default loaders on synthetic data of real shapes (shared by the fastai data
tests), and, run as a script, a training of one of them for crash tests.

* ``tabular``: a DataFrame with 2 categorical and 2 continuous columns and a 3-class target through
  ``TabularPandas`` (Categorify, FillMissing, Normalize) and ``tabular_learner`` (embedding and layer
  dropout): the training loader is a shuffling ``TabWeightedDL``, whose order comes from the global NumPy
  generator (``np.random.choice``).
* ``lm``: documents of token ids through ``LMDataLoader`` (a language model's default loader: each
  epoch's shuffle permutes the documents in place, from the last epoch's order; python's ``random``).
* ``text``: token-id sequences of varying length (a random token dropped per item: augmentation, in
  workers) through ``SortedDL`` with ``pad_input`` (a text classifier's default loader: its shuffle is
  NumPy's, sorted by length in chunks) and a small embedding-bag classifier with dropout.

As a script: prints ``STEP n`` after each optimizer step and ``COMMITTED n`` after each commit, and
writes the final weights (safetensors) and the Recorder history (JSON) for ``crashkit``.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import torch
from fastai.data.core import DataLoaders
from fastai.learner import Learner
from fastai.losses import CrossEntropyLossFlat
from fastai.metrics import accuracy
from fastai.tabular.all import (
    Categorify,
    CategoryBlock,
    FillMissing,
    Normalize,
    RandomSplitter,
    TabularPandas,
    range_of,
    tabular_config,
    tabular_learner,
)
from fastai.text.data import LMDataLoader, SortedDL, TensorText, pad_input
from fastai.torch_core import TensorCategory, set_seed
from torch import nn

VOCAB = 50


def make_tabular(seed: int = 42, n: int = 240, bs: int = 16, workers: int = 0, cbs=None) -> Learner:
    set_seed(seed)
    torch.set_num_threads(1)
    g = np.random.default_rng(0)
    df = pd.DataFrame({"a": g.choice(list("pqrst"), n), "b": g.choice(list("xyz"), n),
                       "u": g.normal(size=n), "v": g.normal(size=n)})
    df.loc[g.random(n) < 0.05, "v"] = np.nan
    df["t"] = ((df["u"] > 0).astype(int) + (df["a"] < "r").astype(int)).astype(str)
    to = TabularPandas(df, procs=[Categorify, FillMissing, Normalize], cat_names=["a", "b"],
                       cont_names=["u", "v"], y_names="t", y_block=CategoryBlock(),
                       splits=RandomSplitter(seed=0)(range_of(df)))
    dls = to.dataloaders(bs=bs, num_workers=workers, device="cpu")
    return tabular_learner(dls, layers=[32, 16], config=tabular_config(ps=[0.2, 0.1], embed_p=0.1),
                           metrics=accuracy, cbs=cbs)


class Tokens(torch.utils.data.Dataset):
    """Token-id sequences of 4..24 tokens (pad id 1 unused), label: is token 7 in the first half."""

    n_inp = 1

    def __init__(self, n: int, seed: int):
        g = np.random.default_rng(seed)
        self.seqs = [g.integers(2, VOCAB, int(g.integers(4, 25))) for _ in range(n)]
        self.y = [int((s[: len(s) // 2] < 12).any()) for s in self.seqs]

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i):
        s = self.seqs[i]
        drop = int(np.random.randint(len(s)))  # augmentation: one token dropped (global NumPy RNG)
        return TensorText(np.delete(s, drop)), TensorCategory(self.y[i])


class BagOfTokens(nn.Module):
    def __init__(self, hidden: int = 32):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16, padding_idx=1)
        self.head = nn.Sequential(nn.Dropout(0.3), nn.Linear(16, hidden), nn.ReLU(), nn.Dropout(0.2),
                                  nn.Linear(hidden, 2))

    def forward(self, x):
        mask = (x != 1).unsqueeze(-1).float()
        return self.head((self.emb(x) * mask).sum(1) / mask.sum(1).clamp(min=1))


def make_text(seed: int = 42, n: int = 160, bs: int = 16, workers: int = 2, cbs=None) -> Learner:
    set_seed(seed)
    torch.set_num_threads(1)
    train = SortedDL(Tokens(n, 1), bs=bs, shuffle=True, drop_last=True, num_workers=workers,
                     before_batch=pad_input, device="cpu")
    valid = SortedDL(Tokens(48, 2), bs=2 * bs, num_workers=0, before_batch=pad_input, device="cpu")
    return Learner(DataLoaders(train, valid), BagOfTokens(), loss_func=CrossEntropyLossFlat(),
                   metrics=accuracy, cbs=cbs)


class Texts(torch.utils.data.Dataset):
    """Documents of 20..60 token ids for a language model."""

    n_inp = 1

    def __init__(self, n: int, seed: int):
        g = np.random.default_rng(seed)
        self.docs = [TensorText(g.integers(2, VOCAB, int(g.integers(20, 61)))) for _ in range(n)]

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i):
        return self.docs[i]


class NextToken(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.head = nn.Sequential(nn.Dropout(0.2), nn.Linear(16, VOCAB))

    def forward(self, x):
        return self.head(self.emb(x))


def make_lm(seed: int = 42, n: int = 24, bs: int = 8, seq_len: int = 12, workers: int = 0, cbs=None) -> Learner:
    set_seed(seed)
    torch.set_num_threads(1)
    train = LMDataLoader(Texts(n, 1), bs=bs, seq_len=seq_len, shuffle=True, num_workers=workers, device="cpu")
    valid = LMDataLoader(Texts(12, 2), bs=bs, seq_len=seq_len, num_workers=0, device="cpu")
    return Learner(DataLoaders(train, valid), NextToken(), loss_func=CrossEntropyLossFlat(), cbs=cbs)


MAKERS = {"tabular": make_tabular, "text": make_text, "lm": make_lm}


def weights(learn: Learner) -> dict:
    return {k: v.detach().clone().contiguous() for k, v in learn.model.state_dict().items()}


def history(learn: Learner) -> dict:
    rec = learn.recorder
    return {"values": [[float(x) for x in v] for v in rec.values],
            "losses": [float(x) for x in rec.losses], "lrs": [float(x) for x in rec.lrs]}


def main() -> None:
    import argparse
    import json
    import sys
    import time

    from childio import emit
    from fastai.callback.core import Callback
    from safetensors.torch import save_file

    import keepalive.callbacks._fastai_data as fd
    from keepalive.callbacks.fastai import DriveCheckpoint

    p = argparse.ArgumentParser()
    p.add_argument("run")
    p.add_argument("--out", required=True)
    p.add_argument("--shape", choices=list(MAKERS), required=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--every", default="3")
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--break", dest="breaks", default="", help="negative controls: numpy = a resumed epoch does "
                   "not put back the global NumPy state (the order); workers = nor the workers' states; "
                   "lm_order = nor an LMDataLoader's document order")
    args = p.parse_args()
    if args.breaks:
        original = fd.resume_epoch

        def broken(learn, dl, start, batch, workers, on_positioned):
            if args.breaks == "numpy":
                start = dict(start, rng={k: v for k, v in start["rng"].items() if k != "numpy"})
            if args.breaks == "workers":
                workers = None
            if args.breaks == "lm_order":
                fd._lm_order = lambda dl: None
            return original(learn, dl, start, batch, workers, on_positioned)

        fd.resume_epoch = broken

    class PrintSteps(Callback):
        order = 200

        def after_batch(self):
            if self.learn.training:
                emit(f"STEP {ckpt.counters['step'] + 1}")
                if args.sleep:
                    time.sleep(args.sleep)

    ckpt = DriveCheckpoint(args.run, every=int(args.every) if args.every.isdigit() else args.every)
    ckpt.core.on_commit.append(lambda r: emit(f"COMMITTED {r.info.step}"))
    kwargs = {} if args.workers is None else {"workers": args.workers}
    learn = MAKERS[args.shape](**kwargs)
    if hasattr(learn, "progress"):
        learn.remove_cb(learn.progress)
    learn.fit_one_cycle(args.epochs, 1e-2, cbs=[ckpt, PrintSteps()])
    save_file(weights(learn), args.out)
    with open(args.out + ".json", "w") as f:
        json.dump(history(learn), f)
    print("DONE", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
