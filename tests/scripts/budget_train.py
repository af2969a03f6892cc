"""The child of tests/test_memory_budget.py: a small torch training (dropout, Adam, a shuffled loader)
saved every 2 steps under ``--budget`` (``memory_budget=``): a budget too small for a copy of the
state makes every save stream from the live tensors while the loop waits.

``--kill-at N``: after step N (the step after a save), once the save before it is committed, SIGKILL.
``--plain``: the same training without keepalive (the reference). ``--control``: the streamed write
goes to the background instead of blocking the loop, and starts only after the next step ran (what a
stream without waiting would write: the next step's weights under the save's counters). Prints
``STREAMED`` and ``HELD n`` (the full copy's buffer after the loop) at the end; final weights to ``--out``.
"""
import argparse
import os
import signal
import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--run", required=True)
p.add_argument("--out", required=True)
p.add_argument("--budget", default=None)
p.add_argument("--kill-at", type=int, default=-1)
p.add_argument("--plain", action="store_true")
p.add_argument("--control", action="store_true")
args = p.parse_args()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from childio import wait_committed  # noqa: E402

torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=8, shuffle=True)
STEPS = [0]

if args.control:
    from keepalive import writer as _writer

    stream_files, run_write = _writer.AsyncWriter._streamed_files, _writer.AsyncWriter._run

    def streamed_in_background(self, encoded, *, checked):
        files = stream_files(self, encoded, checked=checked)
        self.streamed = None  # as if a streamed save needed no wait: written by the writer's thread
        return files

    def write_after_next_step(self, job):
        start, deadline = STEPS[0], time.monotonic() + 5
        while STEPS[0] == start and time.monotonic() < deadline:
            time.sleep(0.01)
        run_write(self, job)

    _writer.AsyncWriter._streamed_files = streamed_in_background
    _writer.AsyncWriter._run = write_after_next_step


def train(epochs, batches, after_step):
    for _ in epochs:
        for x, y in batches(loader):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            STEPS[0] += 1
            after_step(STEPS[0])


if args.plain:
    train(range(3), iter, lambda step: None)
else:
    from keepalive.callbacks.torch import DriveCheckpoint

    ckpt = DriveCheckpoint(args.run, model=model, optimizer=opt, every=2, memory_budget=args.budget)
    STEPS[0] = ckpt.counters["step"]

    def maybe_kill(step):
        if step == args.kill_at:
            wait_committed(args.run, step - 1)
            print("KILL", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    train(ckpt.epochs(3), ckpt.batches, maybe_kill)
    writer = ckpt.core.writer
    print("STREAMED" if writer.streamed is not None else "COPIED", f"HELD {writer.snapshot.capacity}", flush=True)
torch.save(model.state_dict(), args.out)
print("DONE", flush=True)
