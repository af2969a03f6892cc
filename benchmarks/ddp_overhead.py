"""Per-step overhead of keepalive on a DDP training of 2 ranks (gloo, CPU): a small MLP, the DDP tutorial
loop (``DistributedSampler``, SGD with momentum) as it is, against the same loop through
``DriveCheckpoint(every=50)`` (a global checkpoint every 50 optimizer steps: each rank's state gathered
to rank 0, written in the background).

    python benchmarks/ddp_overhead.py [--steps 500] [--repeats 5] [--width 256] [--dir /tmp/ddp-bench]

starts ``torchrun --nproc_per_node=2`` on itself. Both variants run in the same process group, one
after the other, in alternating order (``--repeats`` times each): the load of a shared machine drifts
over minutes, neighbouring runs see the same. Per run: the step time is the time from the end of the
first step to the end of the last, divided by the steps in between (the saves in between included,
the end-of-training save not), the slower rank's. Prints the medians and their ratio (goal: <= 1.01).
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    from keepalive.callbacks.torch import DriveCheckpoint

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    batch, features = 32, 64
    data = torch.Generator().manual_seed(0)
    n = args.steps * batch * world
    dataset = TensorDataset(torch.randn(n, features, generator=data), torch.randn(n, 1, generator=data))

    def slowest(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def run(every: int, i: int) -> float:
        torch.manual_seed(99)
        net = torch.nn.Sequential(torch.nn.Linear(features, args.width), torch.nn.ReLU(),
                                  torch.nn.Linear(args.width, args.width), torch.nn.ReLU(),
                                  torch.nn.Linear(args.width, 1))
        model = torch.nn.parallel.DistributedDataParallel(net)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        sampler = DistributedSampler(dataset, shuffle=True, seed=7)
        loader = DataLoader(dataset, batch_size=batch, sampler=sampler)
        ends = []

        def step(x, y) -> None:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            ends.append(time.perf_counter())

        dist.barrier()
        if every:
            run_dir = os.path.join(args.dir, f"run-{i}")
            ckpt = DriveCheckpoint(run_dir, model=model, optimizer=opt, every=every, keep=2, quiet=True)
            for epoch in ckpt.epochs(1):
                sampler.set_epoch(epoch)
                for x, y in ckpt.batches(loader):
                    step(x, y)
            ckpt.close()
            dist.barrier()
            if rank == 0:
                shutil.rmtree(run_dir, ignore_errors=True)
        else:
            sampler.set_epoch(0)
            for x, y in loader:
                step(x, y)
        return slowest((ends[-1] - ends[0]) / (len(ends) - 1))

    # the third variant saves only at the end (not timed): what the per-step agreement and bookkeeping cost
    variants = {"without keepalive": 0, "DriveCheckpoint(every=50)": 50, "DriveCheckpoint(no save)": 10**9}
    times: dict = {name: [] for name in variants}
    for i in range(args.repeats):
        order = list(times) if i % 2 == 0 else list(times)[::-1]  # alternating: the drift favours none
        for name in order:
            times[name].append(run(variants[name], i))
    if rank == 0:
        print(f"DDP, {world} ranks (gloo, CPU), MLP {features}-{args.width}-{args.width}-1, batch {batch} per "
              f"rank, {args.steps} steps per run, {args.repeats} runs each (interleaved)")
        medians = {}
        for name, values in times.items():
            medians[name] = statistics.median(values)
            print(f"  {name:26s} median {medians[name] * 1e3:7.3f} ms per step   "
                  f"(runs: {', '.join(f'{v * 1e3:.3f}' for v in values)})")
        bare = medians["without keepalive"]
        for name in list(variants)[1:]:
            print(f"ratio {name} / without = {medians[name] / bare:.3f}")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=500, help="optimizer steps per run")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each variant")
    parser.add_argument("--width", type=int, default=256, help="hidden width of the MLP")
    parser.add_argument("--dir", default="/tmp/keepalive-ddp-bench")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1", KEEPALIVE_PROGRESS="0",
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{port}", os.path.abspath(__file__), "--worker",
           "--steps", str(args.steps), "--repeats", str(args.repeats), "--width", str(args.width),
           "--dir", args.dir]
    try:
        sys.exit(subprocess.call(cmd, env=env))
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
