"""Lightning: checkpoint stall per save and mid-epoch resume time, keepalive vs Lightning's own.

* stall per save: the training loop's wait for one checkpoint of the same state, inside
  ``Trainer.fit``: ``DriveCheckpoint(every=N)`` (Lightning's ``dump_checkpoint`` + a copy to a reused
  host buffer; the write goes on in the background) vs ``ModelCheckpoint(every_n_train_steps=N)``
  (``trainer.save_checkpoint``: ``dump_checkpoint`` + ``torch.save``, the loop waits for the write).
  A ``--size-mb`` state (two square linear layers + SGD momentum).
* resume in the middle of a long epoch (``--items`` samples that cost ``--item-us`` each to load,
  stopped at ``--resume-frac`` of the epoch): wall time from ``trainer.fit(...)`` to the first training
  step of the resumed fit in a new Trainer. keepalive positions the sampler; Lightning's
  ``fit(ckpt_path=...)`` does not skip at all (its plain DataLoader restarts the epoch from its first
  batch: fast but not the same data, see README), so the exact alternative, skipping the done batches
  by iterating them, is measured too (Lightning's resume + iterating the done batches).

    python benchmarks/lightning_checkpoint.py [--size-mb 256] [--saves 4] [--items 40000] [--dir /tmp/x]

Needs lightning (extra ``lightning``); on a machine whose torchvision does not match torch, run it with
``PYTHONPATH=tests/shims`` (see DESIGN.md).
"""
from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from keepalive.callbacks.lightning import DriveCheckpoint  # noqa: E402


# ------------------------------------------------------------------------------------ stall
class Big(pl.LightningModule):
    def __init__(self, size_mb: int):
        super().__init__()
        n = int(((size_mb / 2) * 2**20 / 4 / 2) ** 0.5)  # weights half the state, momentum the other
        self.n = n
        self.net = torch.nn.Sequential(torch.nn.Linear(n, n, bias=False), torch.nn.Linear(n, n, bias=False))

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-6, momentum=0.9)


class Rows(Dataset):
    def __init__(self, n: int, dim: int, item_us: float = 0.0):
        self.n, self.dim, self.item_us = n, dim, item_us

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if self.item_us:  # decoding / augmentation cost of one sample
            end = time.perf_counter() + self.item_us / 1e6
            while time.perf_counter() < end:
                pass
        g = torch.Generator().manual_seed(i)
        return (torch.randn(self.dim, generator=g),)


def trainer(root: str, callbacks, **kw) -> pl.Trainer:
    return pl.Trainer(callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      accelerator="cpu", devices=1, num_sanity_val_steps=0, default_root_dir=root,
                      enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks), **kw)


def stall(root: str, size_mb: int, saves: int, every: int) -> dict:
    torch.manual_seed(0)
    model = Big(size_mb)
    data = DataLoader(Rows(every * saves * 4, model.n), batch_size=2, shuffle=True)
    steps = every * saves
    nbytes = 2 * sum(p.numel() * p.element_size() for p in model.parameters())

    # keepalive: time inside core.save (capture + copy to the host buffer; the write is in the background)
    ours = DriveCheckpoint(os.path.join(root, "ka"), every=every, keep=2, quiet=True)
    times = []
    save = ours.core.save

    def timed(*a, **k):
        t = time.perf_counter()
        save(*a, **k)
        times.append(time.perf_counter() - t)

    ours.core.save = timed
    trainer(root, [ours], max_steps=steps).fit(model, data)
    ka = times[:-1] or times  # the last one (end of training) waits for the write on purpose

    # Lightning: time inside trainer.save_checkpoint (dump_checkpoint + torch.save)
    torch.manual_seed(0)
    model = Big(size_mb)
    mc = ModelCheckpoint(dirpath=os.path.join(root, "lit"), every_n_train_steps=every, save_top_k=-1)
    t = trainer(root, [mc], max_steps=steps)
    lit = []
    original = t.save_checkpoint

    def timed_lit(*a, **k):
        t0 = time.perf_counter()
        original(*a, **k)
        lit.append(time.perf_counter() - t0)

    t.save_checkpoint = timed_lit
    t.fit(model, data)
    return {"state_mb": nbytes / 2**20, "keepalive_s": statistics.median(ka), "lightning_s": statistics.median(lit),
            "saves": (len(ka), len(lit))}


# ----------------------------------------------------------------------------------- resume
class Small(pl.LightningModule):
    def __init__(self, dim: int):
        super().__init__()
        self.net = torch.nn.Linear(dim, 1)

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class FirstStep(pl.Callback):
    """Stops the clock at the first training step of a fit."""

    def __init__(self):
        self.at = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.at is None:
            self.at = time.perf_counter()


class _Stop(Exception):
    pass


class SaveAndStop(pl.Callback):
    """Lightning's own checkpoint at step ``at``, then the process 'dies' (an exception)."""

    def __init__(self, path: str, at: int):
        self.path, self.at = path, at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.at:
            trainer.save_checkpoint(self.path)
            raise _Stop()


def resume(root: str, items: int, item_us: float, frac: float, batch: int = 20, dim: int = 32) -> dict:
    n_batches = items // batch
    at = int(n_batches * frac)

    def loader():
        return DataLoader(Rows(items, dim, item_us), batch_size=batch, shuffle=True)

    # keepalive: a deadline stop at step `at` (saved there), then a new fit resumes
    calls = itertools.count()
    torch.manual_seed(0)
    cb = DriveCheckpoint(os.path.join(root, "ka-resume"), every="epoch", quiet=True,
                         remaining_fn=lambda: 1e6 if next(calls) < at - 1 else 1.0)
    try:
        trainer(root, [cb], max_epochs=1).fit(Small(dim), loader())
    except SystemExit as stop:  # a script's stop exits 143 (EXIT_STOPPED) after its save
        assert stop.code == 143, stop.code
    assert cb.stopped and cb.step == at, (cb.stopped, cb.step, at)
    torch.manual_seed(0)
    first = FirstStep()
    cb2 = DriveCheckpoint(os.path.join(root, "ka-resume"), quiet=True)
    t0 = time.perf_counter()
    trainer(root, [cb2, first], max_epochs=1).fit(Small(dim), loader())
    ka = first.at - t0

    # Lightning: its checkpoint at the same step, then fit(ckpt_path=...)
    path = os.path.join(root, "lit-resume.ckpt")
    torch.manual_seed(0)
    try:
        trainer(root, [SaveAndStop(path, at)], max_epochs=1).fit(Small(dim), loader())
    except _Stop:
        pass
    torch.manual_seed(0)
    first = FirstStep()
    t0 = time.perf_counter()
    trainer(root, [first], max_epochs=1).fit(Small(dim), loader(), ckpt_path=path)
    lit = first.at - t0
    # the exact alternative: skip the epoch's done batches by iterating (loading) them
    t0 = time.perf_counter()
    for _ in itertools.islice(iter(loader()), at):
        pass
    skip = time.perf_counter() - t0
    return {"batches": n_batches, "resumed_at": at, "keepalive_s": ka, "lightning_s": lit,
            "lightning_skip_by_iteration_s": lit + skip}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=256)
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--items", type=int, default=40000)
    ap.add_argument("--item-us", type=float, default=200.0)
    ap.add_argument("--resume-frac", type=float, default=0.75)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="keepalive-lightning-bench-")
    os.makedirs(root, exist_ok=True)
    try:
        s = stall(root, args.size_mb, args.saves, args.every)
        print(f"stall per save, {s['state_mb']:.0f} MiB state (median of {s['saves']} saves): keepalive "
              f"{s['keepalive_s'] * 1e3:.0f} ms, Lightning save_checkpoint {s['lightning_s'] * 1e3:.0f} ms "
              f"-> {s['keepalive_s'] / s['lightning_s']:.2f}x")
        r = resume(root, args.items, args.item_us, args.resume_frac)
        print(f"resume at batch {r['resumed_at']} of {r['batches']} ({args.item_us:.0f} us per sample), to the first "
              f"step: keepalive {r['keepalive_s']:.2f} s, Lightning ckpt_path {r['lightning_s']:.2f} s (restarts the "
              f"epoch's data: not exact), Lightning + skip by iteration {r['lightning_skip_by_iteration_s']:.2f} s "
              f"-> keepalive {r['keepalive_s'] / r['lightning_s']:.2f}x Lightning's, "
              f"{r['keepalive_s'] / r['lightning_skip_by_iteration_s']:.3f}x the exact skip")
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
