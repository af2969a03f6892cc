"""An epoch loop whose code after the batch loop reads the last batch's ``loss`` (``print(loss.item())``),
saved every 2 steps on a 4-batch epoch: a save falls on each epoch's last batch. The child of
tests/test_loop_state.py. ``--kill``: SIGKILL in epoch 0's code after its batch loop (after the newest
save is committed); ``--term``: SIGTERM during epoch 0's last batch. ``--in-main``: the loop
(between the markers) runs inside ``def main():``.
``--no-track``: ``track_globals=False``; ``--no-wait``: saves at the epoch's last batch are not moved
to its end (the controls). Each epoch's line goes to ``--log``; the final weights to ``--out``.
"""
import argparse
import os
import signal
import sys
import textwrap

import torch
from torch.utils.data import DataLoader, TensorDataset

from keepalive.callbacks import _torch_passes
from keepalive.callbacks.torch import DriveCheckpoint

p = argparse.ArgumentParser()
for name in ("--run", "--out", "--log"):
    p.add_argument(name, required=True)
for flag in ("--kill", "--term", "--in-main", "--no-track", "--no-wait"):
    p.add_argument(flag, action="store_true")
args = p.parse_args()
_torch_passes.WAIT_FOR_EPOCH_END = not args.no_wait
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=8, shuffle=True)
ckpt = DriveCheckpoint(args.run, model=model, optimizer=opt, every=2, track_globals=not args.no_track)
_LOG = os.open(args.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


def log(*words) -> None:
    os.write(_LOG, (" ".join(str(w) for w in words) + "\n").encode())


def maybe_kill(epoch) -> None:
    if args.kill and epoch == 0:
        ckpt.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_term(epoch) -> None:
    if args.term and epoch == 0 and ckpt.counters["batch"] == 3:  # the epoch's last batch (of 4)
        os.kill(os.getpid(), signal.SIGTERM)  # keepalive's handler: saved where it can be, then exit


if args.in_main:
    src = open(__file__).read().split("# ---- the loop ----\n")[1].split("# ---- end ----\n")[0]
    exec("def main():\n" + textwrap.indent(src, "    ") + "\nmain()\n")
    torch.save(model.state_dict(), args.out)
    sys.exit(0)
# ---- the loop ----
for epoch in ckpt.epochs(3):
    for x, y in ckpt.batches(loader):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        maybe_term(epoch)
    maybe_kill(epoch)
    log("EPOCH", epoch, f"{loss.item():.8f}")
# ---- end ----
torch.save(model.state_dict(), args.out)
