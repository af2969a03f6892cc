"""keepalive demo: a PyTorch training that survives being killed.

It trains a small MLP with dropout, a shuffled DataLoader, SGD with momentum and a step LR schedule,
checkpointing every 10 steps to a local folder. The demo first runs it once without interruption,
then runs it again and SIGKILLs it at random moments (as a Colab/Kaggle reset would), restarting it
each time until it finishes; finally it compares the two final models bit for bit.

    python examples/demo.py [--dir ./demo-checkpoints] [--kills 3]

The training code itself is :func:`train` below: that is all a user writes.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import time


def train(run_dir: str, out: str, epochs: int = 4) -> None:
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from keepalive.callbacks.torch import DriveCheckpoint

    torch.manual_seed(0)
    torch.set_num_threads(1)
    x, y = torch.randn(2048, 64), torch.randint(0, 10, (2048,))
    loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)
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
            time.sleep(0.01)  # stand-in for a real model's step time
        sched.step()
        print(f"epoch {epoch}: loss {loss.item():.4f}", flush=True)
    torch.save(model.state_dict(), out)


def _child(run_dir: str, out: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, "--child", run_dir, out],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


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
    ref = _child(f"{root}/reference", f"{root}/reference.pt")
    ref_out, _ = ref.communicate()
    if ref.returncode:
        print(ref_out)
        return 1
    took = time.time() - t0
    print(f"   done in {took:.1f} s")

    print(f"2) the same training, SIGKILLed {args.kills} time(s) at random moments -> {root}/crashy")
    for i in range(args.kills + 1):
        proc = _child(f"{root}/crashy", f"{root}/crashy.pt")
        if i < args.kills:
            time.sleep(rng.uniform(0.3 * took, 0.9 * took))
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                resumed = [line for line in (proc.stdout.read() or "").splitlines() if "resuming" in line]
                print(f"   kill {i + 1}: SIGKILL" + (f" (that start had printed: {resumed[0]})" if resumed else ""))
                continue
        out, _ = proc.communicate()
        for line in out.splitlines():
            if "resuming" in line:
                print(f"   final start: {line}")
        if proc.returncode:
            print(out)
            return 1
        break

    a = torch.load(f"{root}/reference.pt", weights_only=True)
    b = torch.load(f"{root}/crashy.pt", weights_only=True)
    same = all(torch.equal(a[k], b[k]) for k in a)
    print("3) final weights " + ("are BIT-IDENTICAL to the uninterrupted run" if same else "DIFFER (bug!)"))
    print(f"   inspect: keepalive ls {root}/crashy   |   keepalive verify {root}/crashy")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
