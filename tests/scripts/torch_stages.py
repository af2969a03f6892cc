"""A plain-torch training with two stages on one ``DriveCheckpoint``, for crash tests.

Stage 1 trains the head of a model whose backbone is frozen (``requires_grad = False``), with SGD.
Stage 2 registers a new optimizer (``ckpt.register("opt2", Adam(...))``) after the resume and, inside
its loop, unfreezes the backbone by ``p.requires_grad = True`` at one epoch: both are state that the
loop's code sets, which a resume later in stage 2 must restore. ``--scenario first``: one stage,
``every=1``, killed at the first optimizer step.

``--kill-at EPOCH:BATCH`` makes the first session SIGKILL itself at the start of that batch's body,
after the checkpoints written so far are durable (the moment that hits the risk, whatever the load).
``--control late|frozen|first`` switches off the piece of keepalive that makes the resume exact (the
negative controls). Prints ``DONE`` and writes the model's and optimizers' states with torch.save.
"""
import argparse
import os
import signal

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from toydata import NoisyIndexed

from keepalive.callbacks import _torch_objects as ka_torch_objects
from keepalive.callbacks import torch as ka_torch
from keepalive.callbacks.torch import DriveCheckpoint

p = argparse.ArgumentParser()
p.add_argument("--run", required=True)
p.add_argument("--out", required=True)
p.add_argument("--scenario", choices=["stages", "first"], default="stages")
p.add_argument("--kill-at", default="")
p.add_argument("--control", default="")
p.add_argument("--plain", action="store_true", help="the same training without keepalive")
args = p.parse_args()
torch.set_num_threads(1)
torch.manual_seed(11)

if args.control == "late":  # a saved optimizer registered after the resume stays fresh
    ka_torch_objects.TorchObjects.restore_late = lambda self, name, obj: None  # type: ignore[method-assign]
if args.control == "frozen":  # the parameters' requires_grad flags are not restored
    ka_torch_objects.restore_requires_grad = lambda module, frozen: 0
if args.control == "first":  # the first step's checkpoint as if the training loader were not known yet
    capture = ka_torch.DriveCheckpoint.capture

    def without_loader(self):
        tree = capture(self)
        if self.core.counters["step"] == 1:
            tree["data"].pop("streams", None)
            tree["data"]["train_loader"] = None
        return tree

    ka_torch.DriveCheckpoint.capture = without_loader  # type: ignore[method-assign]

KILL = tuple(int(v) for v in args.kill_at.split(":")) if args.kill_at else None
MARK = args.run + ".killed"

model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                            torch.nn.Linear(24, 3))
backbone, head = model[0], model[3]
loader = DataLoader(NoisyIndexed(60, 12, 3, seed=5), batch_size=8, shuffle=True)


def step(opt, x, y):
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


def maybe_kill(ckpt, epoch):
    if KILL == (epoch, ckpt.counters["batch"]) and not os.path.exists(MARK):
        ckpt.flush()
        open(MARK, "w").close()
        print("KILL", epoch, ckpt.counters["batch"], flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


if args.plain:
    for q in backbone.parameters():
        q.requires_grad = False
    opt1 = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    epochs = 3 if args.scenario == "first" else 2
    for epoch in range(epochs):
        for x, y, _ in loader:
            step(opt1, x, y)
    if args.scenario == "stages":
        opt2 = torch.optim.Adam(model.parameters(), lr=1e-3)
        for epoch in range(2, 5):
            if epoch == 3:
                for q in backbone.parameters():
                    q.requires_grad = True
            for x, y, _ in loader:
                step(opt2, x, y)
    torch.save({"model": model.state_dict(), "opt1": opt1.state_dict(),
                **({"opt2": opt2.state_dict()} if args.scenario == "stages" else {})}, args.out)
    print("DONE", flush=True)
    raise SystemExit(0)

for q in backbone.parameters():
    q.requires_grad = False
opt1 = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
ckpt = DriveCheckpoint(args.run, model=model, optimizer=opt1, every=1 if args.scenario == "first" else 3)
for epoch in ckpt.epochs(3 if args.scenario == "first" else 2):
    for x, y, _ in ckpt.batches(loader):
        maybe_kill(ckpt, epoch)
        step(opt1, x, y)
saved = {"model": model.state_dict(), "opt1": opt1.state_dict()}
if args.scenario == "stages":
    opt2 = torch.optim.Adam(model.parameters(), lr=1e-3)
    ckpt.register("opt2", opt2)
    for epoch in ckpt.epochs(5):
        if epoch == 3:  # the loop's own code: after a resume in epoch 4 it does not run again
            for q in backbone.parameters():
                q.requires_grad = True
        for x, y, _ in ckpt.batches(loader):
            maybe_kill(ckpt, epoch)
            step(opt2, x, y)
    saved["opt2"] = opt2.state_dict()
assert ckpt.finished
torch.save({**saved, "model": model.state_dict()}, args.out)
print("DONE", flush=True)
