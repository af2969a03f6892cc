"""The PyTorch loops people actually write, for the crash tests of tests/test_realistic_loops.py.

One script, one ``--scenario`` per loop shape: gradient accumulation, a batch size changed
between sessions, saving by hand, ``batch_sampler=BatchSampler(SubsetRandomSampler(...))``, random
draws between ``for epoch`` and ``for batch``, ``ckpt.enumerate`` with ``CosineAnnealingWarmRestarts``,
private random generators, K-fold without a path. Each trains a tiny MLP with dropout on synthetic
data; every item carries its dataset index and fresh random noise (augmentation), the loader shuffles.

Kills hit exact moments: ``--kill-at`` / ``--kill-after-hand-save`` make the process SIGKILL itself
where the risk is (right after a batch that left gradients pending, right after a hand save was
committed), whatever the machine's load. Random kills come from tests/crashkit.py, which reads the
``STEP n`` / ``COMMITTED n`` lines printed here.

Outputs:
* ``--out``: ``torch.save`` of the final model, optimizer, scheduler and private-RNG states, the
  counters and the extras (K-fold: one file per fold, ``<out>.fold<k>``).
* ``--log``: one line per event, appended by every session of a run, each starting with the session's
  pid: ``EPOCH e batch step`` when an epoch's body begins, ``B e i step idx,idx,...`` per batch,
  ``COMMIT e batch step reason`` per committed checkpoint (the counters it holds), ``SCHED e
  last_epoch``, ``HANDSAVE e i``, ``KILL why``.

``--control X`` switches a piece of keepalive off from the outside (each a negative control: the test
that uses it must then fail to see bit-identical results).
"""
import argparse
import os
import random
import signal
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from childio import emit
from torch.utils.data import BatchSampler, DataLoader, Subset, SubsetRandomSampler
from toydata import NoisyIndexed

from keepalive.callbacks.torch import DriveCheckpoint

CONTROLS = {
    "guard-off": "accumulation: every batch counts as a step and none waits for pending gradients "
                 "(as keepalive once did)",
    "drop-position": "batch size: forget the saved sample position (resume at batch x new size)",
    "direct-save": "hand save: written at once with the counters of the running batch / epoch",
    "no-rng-restore": "the global RNG states are not restored on resume",
    "no-replay": "subset: the resumed epoch's loader starts from the saved step's random state, not its iter()'s",
    "no-prologue-replay": "the epoch's prologue runs with the mid-epoch RNG state",
    "plain-enumerate": "enumerate(ckpt.batches(loader)) instead of ckpt.enumerate(loader)",
    "no-register": "the private generators are not registered",
    "same-run": "every fold writes run 'default'",
}
SCENARIOS = ("accum", "batchsize", "handsave", "subset", "prologue", "cosine", "private", "kfold")

p = argparse.ArgumentParser()
p.add_argument("--scenario", required=True, choices=SCENARIOS)
p.add_argument("--run", default=None, help="the run folder; none: the default folder ($KEEPALIVE_DIR)")
p.add_argument("--out", required=True)
p.add_argument("--log", required=True)
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--samples", type=int, default=80)
p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--every", default="epoch")
p.add_argument("--accum", type=int, default=3)
p.add_argument("--no-epoch-flush", action="store_true",
               help="accumulation as the common snippet writes it: `if (i + 1) % ACC == 0: step`, with "
                    "plain enumerate(ckpt.batches(...)); the epoch's rest is carried into the next epoch")
p.add_argument("--hand-save", choices=("inside", "after-epoch"), default="inside")
p.add_argument("--val-through-ckpt", action="store_true",
               help="hand-save scenario: validate with `ckpt.batches(val_loader)`, not the loader itself")
p.add_argument("--sleep", type=float, default=0.0, help="seconds per batch (time-based saves)")
p.add_argument("--seed", type=int, default=1234)
p.add_argument("--kill-at", default=None,
               help="[FOLD:]EPOCH:BATCH: at the start of that batch's body (batches done in the epoch), "
                    "wait until the newest save is committed, then SIGKILL")
p.add_argument("--kill-after-batches", type=int, default=None,
               help="at the start of a batch's body after this many batches in this session, wait until "
                    "the newest save is committed, then SIGKILL")
p.add_argument("--kill-signal", choices=("KILL", "TERM", "INT"), default="KILL",
               help="TERM / INT: --kill-at sends this signal instead (no waiting) and training goes on")
p.add_argument("--kill-after-hand-save", type=int, default=None,
               help="SIGKILL the moment this session's N-th hand save is committed")
p.add_argument("--control", default=None, choices=sorted(CONTROLS))
args = p.parse_args()

torch.set_num_threads(1)
torch.manual_seed(args.seed)
np.random.seed(args.seed)
random.seed(args.seed)

DIM, CLASSES = 16, 4
SESSION = os.getpid()
_LOG = os.open(args.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


def log(*words) -> None:
    """One whole line per write (O_APPEND): the writer thread logs too."""
    os.write(_LOG, (" ".join(str(w) for w in (SESSION, *words)) + "\n").encode())


def die(why: str, ckpt=None) -> None:
    if ckpt is not None:
        ckpt.flush()  # the newest save is committed: the resume starts from it
    log("KILL", why)
    os.kill(os.getpid(), signal.SIGKILL)


KILL_AT = None
if args.kill_at:
    parts = [int(v) for v in args.kill_at.split(":")]
    KILL_AT = tuple(parts) if len(parts) == 3 else (0, *parts)


batches_this_session = 0


def maybe_kill(ckpt, epoch: int, fold: int = 0) -> None:
    """At the start of a batch's body: the previous batch's boundary has run. The KILL line says
    whether gradients are pending: accumulated since the last optimizer step, where the loop zeroes
    them right after its step (the accumulation loop; a loop that zeroes them before its backward
    always has some)."""
    global batches_this_session
    batches_this_session += 1
    if KILL_AT == (fold, epoch, ckpt.counters["batch"]) or batches_this_session - 1 == args.kill_after_batches:
        model = ckpt.objects["model"]
        grads = "pending" if any(p.grad is not None for p in model.parameters()) else "clean"
        where = f"fold {fold} epoch {epoch} batch {ckpt.counters['batch']} {grads}"
        if args.kill_signal != "KILL":  # keepalive's handler defers it to a boundary where it can save
            log("SIGNAL", args.kill_signal, where)
            os.kill(os.getpid(), getattr(signal, f"SIG{args.kill_signal}"))
            return
        die(where, ckpt)


class Indexed(NoisyIndexed):
    """Fixed inputs and labels; an item is (input + fresh noise, label, its index)."""

    def __init__(self, n: int):
        super().__init__(n, DIM, CLASSES, seed=7)


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(DIM, 64), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                               torch.nn.Linear(64, CLASSES))


def make_optimizer(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)


def indices(idx) -> str:
    return ",".join(str(int(i)) for i in idx)


hand_saves_committed = 0


def on_commit(result) -> None:
    global hand_saves_committed
    meta = (result.info.manifest or {}).get("metadata", {})
    c = meta.get("counters", {})
    reason = meta.get("reason", "?")
    log("COMMIT", c.get("epoch"), c.get("batch"), c.get("step"), reason)
    emit(f"COMMITTED {result.info.step}")
    if reason == "by hand":
        hand_saves_committed += 1
        if hand_saves_committed == args.kill_after_hand_save:
            die(f"hand save {hand_saves_committed} committed")  # from the writer thread


def checkpoint(**objects) -> DriveCheckpoint:
    ckpt = DriveCheckpoint(args.run, every=args.every, keep=None, **objects)
    ckpt.core.on_commit.append(on_commit)
    return ckpt


def epoch_began(ckpt, epoch: int) -> None:
    log("EPOCH", epoch, ckpt.counters["batch"], ckpt.step)


def finish(ckpt, out: str, **objects) -> None:
    if not ckpt.finished:
        print("NOT FINISHED", flush=True)
        sys.exit(3)
    state = {name: (obj.state_dict() if hasattr(obj, "state_dict") else obj) for name, obj in objects.items()}
    state["counters"] = dict(ckpt.counters)
    state["extras"] = dict(ckpt.extras)
    torch.save(state, out)


def loader_for(ds, batch_size=None) -> DataLoader:
    return DataLoader(ds, batch_size=batch_size or args.batch_size, shuffle=True)


# ------------------------------------------------------------------------------------ scenarios
def accum() -> None:
    """Gradient accumulation: `(loss / ACC).backward()`, a step every ACC batches."""
    model = make_model()
    opt = make_optimizer(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    loader = loader_for(Indexed(args.samples))
    ckpt = checkpoint(model=model, optimizer=opt, scheduler=sched)
    if args.control == "guard-off":
        import keepalive.callbacks._torch_passes as adapter

        adapter.gradients_pending = lambda optimizers: False  # the adapter's pending-gradient test
        advance = ckpt.core.advance  # every batch counts as one step, whatever the optimizer did

        def advance_every_batch(capture, *, steps=None, **kw):
            return advance(capture, steps=1 if steps is None else steps, **kw)

        ckpt.core.advance = advance_every_batch
        assert not adapter.gradients_pending(ckpt._objects.optimizers)  # the patch point exists
    acc, iters = args.accum, len(loader)
    for epoch in ckpt.epochs(args.epochs):
        epoch_began(ckpt, epoch)
        model.train()
        if args.no_epoch_flush:  # the snippet everyone copies; the rest rolls into the next epoch
            batches = enumerate(ckpt.batches(loader))
        else:
            batches = ckpt.enumerate(loader)
        for i, (x, y, idx) in batches:
            maybe_kill(ckpt, epoch)
            loss = F.cross_entropy(model(x), y) / acc
            loss.backward()
            stepped = (i + 1) % acc == 0 or (i + 1 == iters and not args.no_epoch_flush)
            if stepped:
                opt.step()
                opt.zero_grad()
            log("B", epoch, i, ckpt.step + int(stepped), indices(idx))
            emit(f"STEP {ckpt.step + int(stepped)}")
            if args.sleep:
                time.sleep(args.sleep)
        sched.step()
    finish(ckpt, args.out, model=model, optimizer=opt, scheduler=sched)


def batchsize() -> None:
    """The plain loop; the second session is started with another --batch-size (after an OOM)."""
    model = make_model()
    opt = make_optimizer(model)
    loader = loader_for(Indexed(args.samples))
    ckpt = checkpoint(model=model, optimizer=opt)
    if args.control == "drop-position":
        ckpt.resume()
        for stream in (ckpt._saved_data.get("streams") or {}).values():
            stream["samples"] = stream["batches"] * args.batch_size
    for epoch in ckpt.epochs(args.epochs):
        epoch_began(ckpt, epoch)
        model.train()
        for x, y, idx in ckpt.batches(loader):
            maybe_kill(ckpt, epoch)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            log("B", epoch, ckpt.counters["batch"], ckpt.step + 1, indices(idx))
    finish(ckpt, args.out, model=model, optimizer=opt)


def save_by_hand(ckpt) -> None:
    if args.control == "direct-save":  # what a hand save once did
        ckpt.core.save(ckpt.capture, reason="by hand")
    else:
        ckpt.save()


def handsave() -> None:
    """`ckpt.save()` in the batch loop after `opt.step()`, or after the epoch's scheduler step and
    validation."""
    ds = Indexed(args.samples + 32)
    train_ds, val_ds = Subset(ds, range(args.samples)), Subset(ds, range(args.samples, args.samples + 32))
    model = make_model()
    opt = make_optimizer(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    loader = loader_for(train_ds)
    val_loader = DataLoader(val_ds, batch_size=16)
    ckpt = checkpoint(model=model, optimizer=opt, scheduler=sched)
    for epoch in ckpt.epochs(args.epochs):
        epoch_began(ckpt, epoch)
        model.train()
        for i, (x, y, idx) in ckpt.enumerate(loader):
            maybe_kill(ckpt, epoch)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            log("B", epoch, i, ckpt.step + 1, indices(idx))
            if args.hand_save == "inside" and i % 4 == 3:
                log("HANDSAVE", epoch, i)
                save_by_hand(ckpt)
        sched.step()
        log("SCHED", epoch, sched.last_epoch)
        model.eval()
        with torch.no_grad():
            batches = ckpt.batches(val_loader) if args.val_through_ckpt else val_loader
            val = sum(F.cross_entropy(model(x), y, reduction="sum").item() for x, y, _ in batches)
        ckpt.extras["best"] = min(val, ckpt.extras.get("best", float("inf")))
        ckpt.extras["validations"] = ckpt.extras.get("validations", 0) + 1
        if args.hand_save == "after-epoch":
            log("HANDSAVE", epoch, "end")
            save_by_hand(ckpt)
    finish(ckpt, args.out, model=model, optimizer=opt, scheduler=sched)


def subset() -> None:
    """`DataLoader(ds, batch_sampler=BatchSampler(SubsetRandomSampler(idx), 4, False))`."""
    ds = Indexed(args.samples)
    keep = list(range(0, args.samples, 2))  # the subset: even indices only
    loader = DataLoader(ds, batch_sampler=BatchSampler(SubsetRandomSampler(keep), 4, False))
    model = make_model()
    opt = make_optimizer(model)
    ckpt = checkpoint(model=model, optimizer=opt)
    if args.control == "no-replay":
        ckpt.resume()
        ckpt._saved_data.pop("epoch_rng", None)
        for stream in (ckpt._saved_data.get("streams") or {}).values():
            stream["at_iter"] = None
    for epoch in ckpt.epochs(args.epochs):
        epoch_began(ckpt, epoch)
        model.train()
        for i, (x, y, idx) in enumerate(ckpt.batches(loader)):
            maybe_kill(ckpt, epoch)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            log("B", epoch, i, ckpt.step + 1, indices(idx))
    finish(ckpt, args.out, model=model, optimizer=opt)


def prologue() -> None:
    """Random draws between `for epoch` and `for batch`: a per-epoch subset of classes weighted in the
    loss (torch), a mixup lambda (numpy), a label-smoothing amount (python)."""
    model = make_model()
    opt = make_optimizer(model)
    loader = loader_for(Indexed(args.samples))
    ckpt = checkpoint(model=model, optimizer=opt)
    if args.control == "no-prologue-replay":
        ckpt.resume()
        ckpt._saved_data.pop("epoch_rng", None)
        ckpt._data.resume_rng = None
    for epoch in ckpt.epochs(args.epochs):
        epoch_began(ckpt, epoch)
        weights = torch.ones(CLASSES)
        weights[torch.randperm(CLASSES)[:2]] = 2.0
        lam = float(np.random.beta(0.4, 0.4))
        smoothing = random.uniform(0.0, 0.1)
        log("PROLOGUE", epoch, weights.tolist(), lam, smoothing)
        model.train()
        for i, (x, y, idx) in enumerate(ckpt.batches(loader)):
            maybe_kill(ckpt, epoch)
            opt.zero_grad()
            out = model(lam * x + (1 - lam) * x.flip(0))
            loss = (lam * F.cross_entropy(out, y, weight=weights, label_smoothing=smoothing)
                    + (1 - lam) * F.cross_entropy(out, y.flip(0), weight=weights, label_smoothing=smoothing))
            loss.backward()
            opt.step()
            log("B", epoch, i, ckpt.step + 1, indices(idx))
    finish(ckpt, args.out, model=model, optimizer=opt)


def cosine() -> None:
    """The PyTorch docs' pattern: `scheduler.step(epoch + i / iters)` in the batch loop."""
    model = make_model()
    opt = make_optimizer(model)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=2, eta_min=1e-4)
    loader = loader_for(Indexed(args.samples))
    ckpt = checkpoint(model=model, optimizer=opt, scheduler=sched)
    iters = len(loader)
    for epoch in ckpt.epochs(args.epochs):
        epoch_began(ckpt, epoch)
        model.train()
        if args.control == "plain-enumerate":
            batches = enumerate(ckpt.batches(loader))
        else:
            batches = ckpt.enumerate(loader)
        for i, (x, y, idx) in batches:
            maybe_kill(ckpt, epoch)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            sched.step(epoch + i / iters)
            log("B", epoch, i, ckpt.step + 1, indices(idx))
    finish(ckpt, args.out, model=model, optimizer=opt, scheduler=sched)


def private() -> None:
    """Augmentation from private generators: `np.random.default_rng(0)` and a `torch.Generator`."""
    model = make_model()
    opt = make_optimizer(model)
    loader = loader_for(Indexed(args.samples))
    aug_rng = np.random.default_rng(0)
    gen = torch.Generator().manual_seed(1)
    generators = {} if args.control == "no-register" else {"aug_rng": aug_rng, "gen": gen}
    ckpt = checkpoint(model=model, optimizer=opt, **generators)
    for epoch in ckpt.epochs(args.epochs):
        epoch_began(ckpt, epoch)
        model.train()
        for i, (x, y, idx) in enumerate(ckpt.batches(loader)):
            maybe_kill(ckpt, epoch)
            x = x + 0.1 * torch.randn(x.shape, generator=gen)
            if aug_rng.random() < 0.5:
                x = -x
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            log("B", epoch, i, ckpt.step + 1, indices(idx))
    finish(ckpt, args.out, model=model, optimizer=opt, aug_rng=aug_rng.bit_generator.state,
           gen=gen.get_state())


def kfold() -> None:
    """`for fold in range(3): ckpt = DriveCheckpoint(model=..., optimizer=...)`, no path, no run=."""
    ds = Indexed(args.samples)
    order = torch.randperm(args.samples, generator=torch.Generator().manual_seed(3)).tolist()
    for fold in range(3):
        held_out = set(order[fold::3])
        train_idx = [i for i in range(args.samples) if i not in held_out]
        model = make_model()
        opt = make_optimizer(model)
        loader = loader_for(Subset(ds, train_idx))
        named = {"run": "default"} if args.control == "same-run" else {}
        ckpt = DriveCheckpoint(model=model, optimizer=opt, every=args.every, keep=None, **named)
        ckpt.core.on_commit.append(on_commit)
        log("FOLD", fold, ckpt.url)
        for epoch in ckpt.epochs(args.epochs):
            epoch_began(ckpt, epoch)
            model.train()
            for x, y, idx in ckpt.batches(loader):
                maybe_kill(ckpt, epoch, fold)
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
                log("B", epoch, ckpt.counters["batch"], ckpt.step + 1, indices(idx))
        finish(ckpt, f"{args.out}.fold{fold}", model=model, optimizer=opt)


globals()[args.scenario]()
print("DONE", flush=True)
