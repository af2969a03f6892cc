"""A real training run for crash tests: dropout, shuffled DataLoader with random augmentation,
SGD with momentum, an LR scheduler. Prints `STEP n` after each optimizer step and `COMMITTED n`
after each checkpoint commit, and writes the final weights with safetensors.

`--accum N`: gradient accumulation, `(loss / N).backward()` and an optimizer step every N batches and
at the epoch's last one; `STEP n` is then printed after every batch (n: optimizer steps so far), so
kills land between two steps too."""
import argparse
import atexit
import sys
import time

import torch
import torch.nn.functional as F
from childio import emit
from safetensors.torch import save_file
from torch.utils.data import DataLoader, Dataset

from keepalive.callbacks.torch import DriveCheckpoint

p = argparse.ArgumentParser()
p.add_argument("run")
p.add_argument("--out", required=True)
p.add_argument("--workers", type=int, default=0)
p.add_argument("--every", default="5")
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--hidden", type=int, default=1024)
p.add_argument("--samples", type=int, default=300)
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--drop-last", action="store_true")
p.add_argument("--no-shuffle", action="store_true")
p.add_argument("--margin", default=None, help="deadline safety margin (e.g. 1s)")
p.add_argument("--budget", default=None, help="session budget counted from the start of training")
p.add_argument("--accum", type=int, default=1, help="gradient accumulation: a step every N batches")
p.add_argument("--hold-lazy-copy", type=float, default=0.0,
               help="print LAZY_COPY <step> when a save's background copy begins, and hold it this long")
p.add_argument("--skip-lazy-copy", action="store_true",
               help="a broken background copy that copies nothing (a negative control)")
args = p.parse_args()
torch.set_num_threads(1)
torch.manual_seed(1234)


class NoisyData(Dataset):
    """Fixed inputs plus random noise drawn per fetch (augmentation), in workers or in the main process."""

    def __init__(self, n):
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(n, 32, generator=g)
        self.y = torch.randint(0, 4, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.05 * torch.randn(32), self.y[i]


model = torch.nn.Sequential(
    torch.nn.Linear(32, args.hidden), torch.nn.ReLU(), torch.nn.Dropout(0.2),
    torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(), torch.nn.Dropout(0.2),
    torch.nn.Linear(args.hidden, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)
loader = DataLoader(NoisyData(args.samples), batch_size=16, shuffle=not args.no_shuffle,
                    num_workers=args.workers, drop_last=args.drop_last)
if args.budget:
    from keepalive import session

    session.configure(budget=args.budget, start=time.time())
every = int(args.every) if args.every.isdigit() else args.every
ckpt = DriveCheckpoint(args.run, model=model, optimizer=opt, scheduler=sched, every=every,
                       deadline_margin=args.margin)


ckpt.core.on_commit.append(lambda r: emit(f"COMMITTED {r.info.step}"))
if args.hold_lazy_copy or args.skip_lazy_copy:
    from keepalive.state import PendingCopy

    copy = PendingCopy.run

    def held_copy(self):
        emit(f"LAZY_COPY {ckpt.step}")
        time.sleep(args.hold_lazy_copy)
        if args.skip_lazy_copy:
            self._done.set()
        else:
            copy(self)

    PendingCopy.run = held_copy
    if args.skip_lazy_copy:
        # nobody copies, whichever thread comes first: the writer's (run, above) or the training's,
        # which helps with the copy when it must wait for it (PendingCopy.wait) before its next step
        def skipped_pieces(self, *_, **__):
            self._done.set()
            self._safe.set()

        PendingCopy._copy_pieces = skipped_pieces


def said_at_exit() -> None:
    """A stop before the session's end exits (143) from inside the loop: the time left said then."""
    if ckpt.stopped:
        from keepalive import session

        print(f"STOPPED remaining {session.remaining_seconds():.3f}", flush=True)


atexit.register(said_at_exit)
for epoch in ckpt.epochs(args.epochs):
    model.train()
    if args.accum > 1:
        for i, (x, y) in ckpt.enumerate(loader):
            (F.cross_entropy(model(x), y) / args.accum).backward()
            stepped = (i + 1) % args.accum == 0 or i + 1 == len(loader)
            if stepped:
                opt.step()
                opt.zero_grad()
            emit(f"STEP {ckpt.step + int(stepped)}")
            if args.sleep:
                time.sleep(args.sleep)
        sched.step()
        continue
    for x, y in ckpt.batches(loader):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        emit(f"STEP {ckpt.step + 1}")
        if args.sleep:
            time.sleep(args.sleep)
    sched.step()
if ckpt.finished:
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, args.out)
    print("DONE", flush=True)
else:
    sys.exit(3)
