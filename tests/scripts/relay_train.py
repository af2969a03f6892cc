"""A small torch training handed on from one place (or process) to the next: the child of
tests/test_resume_from.py, tests/test_supervise.py and tests/test_kaggle_chain.py.

``python relay_train.py RUN OUT [--resume-from FOLDER] [--kill-at N] [--stop-after N]``: 2 epochs of 6
batches (24 samples, batch 4, shuffled, dropout), SGD with momentum, a checkpoint every 2 steps. At
the end it saves the weights, the optimizer's state and a last random draw to OUT and prints ``DONE``.

``--resume-from``: DriveCheckpoint's ``resume_from=``. ``--kill-at N``: after step N, once its save is
committed, the process SIGKILLs itself (prints ``KILL``). ``--stop-after N``: the session's deadline
(``remaining_fn``) comes after step N of this process: keepalive saves and stops (exit 143).
``--plain``: the same training without keepalive (the reference). ``--seed``: the seed of the model's
initialisation, the dropout and the order (7): a resumed process given another one ends as the
uninterrupted run only when its state came from the checkpoint. Prints ``STEP n`` per step.
"""
import argparse
import os
import signal

import torch
from torch.utils.data import DataLoader, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("run")
p.add_argument("out")
p.add_argument("--resume-from", default=None)
p.add_argument("--kill-at", type=int, default=-1)
p.add_argument("--stop-after", type=int, default=-1)
p.add_argument("--plain", action="store_true")
p.add_argument("--seed", type=int, default=7)
args = p.parse_args()

torch.set_num_threads(1)
gen = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(24, 6, generator=gen), torch.randn(24, 1, generator=gen))
torch.manual_seed(args.seed)
loader = DataLoader(data, batch_size=4, shuffle=True)
model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
steps_here = [0]

if args.plain:
    ckpt = None
    epochs, batches = range(2), (lambda it: it)
else:
    from keepalive.callbacks.torch import DriveCheckpoint

    remaining = (lambda: 1e6 if steps_here[0] < args.stop_after else 0.5) if args.stop_after > 0 else None
    ckpt = DriveCheckpoint(args.run, model=model, optimizer=opt, every=2, resume_from=args.resume_from,
                           remaining_fn=remaining, deadline_margin="1s")
    epochs, batches = ckpt.epochs(2), ckpt.batches

for epoch in epochs:
    model.train()
    for x, y in batches(loader):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        steps_here[0] += 1
        step = ckpt.core.counters["step"] + 1 if ckpt is not None else None
        print(f"STEP {step}", flush=True)
        if ckpt is not None and step == args.kill_at:
            ckpt.flush()  # this step's save may still be on its way: the newest commit is durable
            print("KILL", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "draw": torch.rand(3)}, args.out)
print("DONE", flush=True)
