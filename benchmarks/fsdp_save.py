"""Stall and write time of one save of an FSDP2 state on 2 ranks (gloo, CPU): keepalive's
DriveCheckpoint (DCP shards + manifest, keepalive/dcp.py) against ``dcp.async_save`` of the same state
into a plain folder (issue 16).

    python benchmarks/fsdp_save.py [--params 8e6] [--repeats 5] [--dir /tmp/fsdp-bench]

starts ``torchrun --nproc_per_node=2`` on itself. Per save: *stall* = how long the training waits
(the save call), *write* = from the call until the checkpoint is durable (DCP: the future is done;
keepalive: the manifest is written). Prints medians (the slower rank's) and the ratios
(goal: stall <= 0.5x DCP's, write throughput >= 0.9x DCP's).
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
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from keepalive.callbacks.torch import DriveCheckpoint

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    width = int((float(args.params) / 4) ** 0.5)
    net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in net:
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    net(torch.randn(2, width)).sum().backward()
    opt.step()
    nbytes = torch.tensor([sum(p.to_local().numel() * 4 * 3 for p in net.parameters())])  # params + 2 Adam
    dist.all_reduce(nbytes)
    side = dist.new_group(backend="gloo")

    def slowest(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    results = {}
    base = args.dir
    # DCP alone: dcp.async_save of the same state (get_state_dict) into a fresh folder per save
    stalls, writes = [], []
    for i in range(args.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        msd, osd = get_state_dict(net, [opt])
        future = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(base, f"dcp-{i}"),
                                process_group=side)
        stall = time.perf_counter() - t0
        future.result()
        writes.append(slowest(time.perf_counter() - t0))
        stalls.append(slowest(stall))
    results["dcp.async_save"] = (statistics.median(stalls), statistics.median(writes))

    ckpt = DriveCheckpoint(os.path.join(base, "keepalive-run"), model=net, optimizer=opt,
                           every=10 ** 9, keep=2, quiet=True)
    ckpt.resume()
    stalls, writes = [], []
    for i in range(args.repeats):
        dist.barrier()
        ckpt.core.counters["step"] = i + 1  # a new step each time (a save of the same step is skipped)
        t0 = time.perf_counter()
        ckpt.save()
        stall = time.perf_counter() - t0
        ckpt.flush()
        writes.append(slowest(time.perf_counter() - t0))
        stalls.append(slowest(stall))
    results["keepalive"] = (statistics.median(stalls), statistics.median(writes))
    ckpt.close()
    if rank == 0:
        total = int(nbytes) / 1e6
        print(f"FSDP2 state: {total:.0f} MB on {world} ranks (params + AdamW), {args.repeats} saves each")
        for name, (stall, write) in results.items():
            print(f"  {name:15s} stall {stall * 1e3:8.1f} ms   write {write * 1e3:8.1f} ms   "
                  f"({total / write:6.0f} MB/s)")
        (ks, kw), (ds, dw) = results["keepalive"], results["dcp.async_save"]
        print(f"ratios: stall keepalive/DCP = {ks / ds:.2f} (goal <= 0.5); "
              f"write throughput keepalive/DCP = {dw / kw:.2f} (goal >= 0.9)")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", default="8e6", help="model parameters (all ranks together)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default="/tmp/keepalive-fsdp-bench")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{port}",
           os.path.abspath(__file__), "--worker", "--params", str(args.params),
           "--repeats", str(args.repeats), "--dir", args.dir]
    try:
        sys.exit(subprocess.call(cmd, env=env))
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
