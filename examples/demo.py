"""keepalive demo: a PyTorch training that survives being killed.

It trains a small MLP with dropout, a shuffled DataLoader, SGD with momentum and a step LR schedule,
checkpointing every 10 steps to a local folder. The demo first runs it once without interruption,
then runs it again and SIGKILLs it at random moments (as a Colab/Kaggle reset would), restarting it
each time until it finishes; finally it compares the two final models bit for bit.

    python examples/demo.py [--dir ./demo-checkpoints] [--kills 3] [--seed N]

For each kill it shows the step the kill landed at, and for each restart where keepalive resumed
(the newest checkpoint written before the kill) and how many steps are therefore done again. The
training prints a ``STEP n epoch e`` line after each optimizer step (flushed, so it survives the
kill); the demo reads the child's output through a pipe as it comes.

The training code itself is :func:`train` below: that is all a user writes.
"""
from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import List, Optional, Tuple

EPOCHS, SAMPLES, BATCH = 4, 2048, 64
TOTAL_STEPS = EPOCHS * SAMPLES // BATCH


def train(run_dir: str, out: str, epochs: int = EPOCHS) -> None:
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from keepalive.callbacks.torch import DriveCheckpoint

    torch.manual_seed(0)
    torch.set_num_threads(1)
    x, y = torch.randn(SAMPLES, 64), torch.randint(0, 10, (SAMPLES,))
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                torch.nn.Linear(512, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)

    ckpt = DriveCheckpoint(run_dir, model=model, optimizer=opt, scheduler=sched, every=10)
    for epoch in ckpt.epochs(epochs):
        for xb, yb in ckpt.batches(loader):
            opt.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            # for the demo's parent: one whole line per write, flushed, so it survives a SIGKILL
            sys.stdout.write(f"STEP {ckpt.step + 1} epoch {epoch}\n")
            sys.stdout.flush()
            time.sleep(0.01)  # stand-in for a real model's step time
        sched.step()
        print(f"epoch {epoch}: loss {loss.item():.4f}", flush=True)
    torch.save(model.state_dict(), out)


# ------------------------------------------------------------------------------------ the parent
STEP_LINE = re.compile(r"^STEP (\d+) epoch (\d+)$")
RESUME_LINE = re.compile(r"resuming run '[^']*' from (?P<ckpt>\S+): epoch (?P<epoch>\d+), step (?P<step>\d+)")


class Child:
    """One start of the training in a subprocess; a thread reads its output line by line."""

    def __init__(self, run_dir: str, out: str):
        self.proc = subprocess.Popen([sys.executable, "-u", __file__, "--child", run_dir, out],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     bufsize=1)
        self.lines: List[str] = []
        self.steps: List[Tuple[float, int, int]] = []  # (time, step, epoch) of each STEP line
        self.resumed: Optional[Tuple[int, int, str]] = None  # (epoch, step, checkpoint name)
        self.training = threading.Event()  # set at the first step (or when the child's output ends)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.rstrip("\n")
            self.lines.append(line)
            step = STEP_LINE.match(line)
            if step:
                self.steps.append((time.monotonic(), int(step.group(1)), int(step.group(2))))
                self.training.set()
                continue
            resumed = RESUME_LINE.search(line)
            if resumed:
                self.resumed = (int(resumed["epoch"]), int(resumed["step"]), resumed["ckpt"])
        self.training.set()

    @property
    def last_step(self) -> Tuple[int, int]:
        """(step, epoch) of the last STEP line read, (0, 0) before any."""
        return self.steps[-1][1:] if self.steps else (0, 0)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.wait()

    def wait(self) -> int:
        code = self.proc.wait()
        self._reader.join()  # the pipe's end: every line the child flushed before it died is read
        return code

    def output(self) -> str:
        return "\n".join(line for line in self.lines if not STEP_LINE.match(line))


def describe_start(n: int, child: Child, killed_at: Optional[int]) -> str:
    if child.resumed is None:
        return f"   start {n}: a new run (no checkpoint yet)"
    epoch, step, name = child.resumed
    redone = "" if killed_at is None else f"; {killed_at - step} step(s) after it are done again"
    return f"   start {n}: resumed at epoch {epoch}, step {step} (checkpoint {name}){redone}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="demo-checkpoints", help="where the demo's runs go (default: %(default)s)")
    p.add_argument("--kills", type=int, default=3, help="how many times to SIGKILL the training")
    p.add_argument("--seed", type=int, default=None, help="seed for the kill moments")
    p.add_argument("--child", nargs=2, metavar=("RUN", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        train(*args.child)
        return 0

    import torch

    root = os.path.abspath(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    rng = random.Random(args.seed)

    print(f"1) uninterrupted run -> {root}/reference")
    t0 = time.time()
    ref = Child(f"{root}/reference", f"{root}/reference.pt")
    if ref.wait():
        print(ref.output())
        return 1
    if len(ref.steps) != TOTAL_STEPS:
        print(f"   expected {TOTAL_STEPS} steps, saw {len(ref.steps)}:\n{ref.output()}")
        return 1
    train_seconds = ref.steps[-1][0] - ref.steps[0][0]
    step_seconds = train_seconds / (len(ref.steps) - 1)
    print(f"   {TOTAL_STEPS} steps in {EPOCHS} epochs: {train_seconds:.1f} s of training, "
          f"{time.time() - t0:.1f} s with start-up")

    print(f"2) the same training, SIGKILLed {args.kills} time(s) at random moments -> {root}/crashy")
    killed_at: Optional[int] = None
    kills = 0
    for start in range(1, args.kills + 2):
        child = Child(f"{root}/crashy", f"{root}/crashy.pt")
        child.training.wait()
        print(describe_start(start, child, killed_at))
        if kills < args.kills and child.proc.poll() is None:
            # a random moment of the training still ahead of this start
            done = child.resumed[1] if child.resumed else 0
            time.sleep(rng.uniform(0.15, 0.85) * (TOTAL_STEPS - done) * step_seconds)
            if child.proc.poll() is None:
                child.kill()
                kills += 1
                killed_at, epoch = child.last_step
                print(f"   kill {kills}: SIGKILL at step {killed_at} of {TOTAL_STEPS} (epoch {epoch})")
                continue
        code = child.wait()
        if code:
            print(child.output())
            return 1
        last, epoch = child.last_step
        print(f"   ran to the end: step {last} (epoch {epoch})" if last else "   nothing left to train")
        break

    a = torch.load(f"{root}/reference.pt", weights_only=True)
    b = torch.load(f"{root}/crashy.pt", weights_only=True)
    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    print(f"3) after {kills} kill(s), the final weights "
          + ("are BIT-IDENTICAL to the uninterrupted run" if same else "DIFFER (bug!)"))
    print(f"   inspect: keepalive ls {root}/crashy   |   keepalive verify {root}/crashy")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
