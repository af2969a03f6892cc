"""Stall and write time of one save of an FSDP2 state on 2 ranks (gloo, CPU): keepalive's
DriveCheckpoint (DCP shards + manifest, keepalive/dcp.py) against ``dcp.async_save`` of the same state
into a plain folder, as DCP's docs call it and with a stager kept across saves (DCP's best; keepalive
reuses its staging buffers the same way). The three run interleaved, in a rotating order, so
that the page cache's writeback state favours none of them.

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
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
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

    base = args.dir
    stager = DefaultStager(StagingOptions(False, False, False, False))
    ckpt = DriveCheckpoint(os.path.join(base, "keepalive-run"), model=net, optimizer=opt,
                           every=10 ** 9, keep=args.repeats + 1, quiet=True)
    # keep= all: retention (deleting older checkpoints, in the background) is work DCP's side does not do
    ckpt.resume()

    def dcp_save(i: int, name: str, **kwargs: object) -> float:
        """One dcp.async_save of the state (get_state_dict included, as keepalive's save does it)."""
        msd, osd = get_state_dict(net, [opt])
        future = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(base, f"{name}-{i}"),
                                process_group=side, **kwargs)  # type: ignore[arg-type]
        t = time.perf_counter()
        future.result()
        return t

    def dcp_default(i: int) -> float:
        return dcp_save(i, "dcp")

    def dcp_reused(i: int) -> float:  # DCP at its best: a stager kept across saves (reused buffers)
        return dcp_save(i, "dcpr", async_stager=stager)

    def keepalive(i: int) -> float:
        ckpt.core.counters["step"] = i + 1  # a new step each time (a save of the same step is skipped)
        ckpt.save()
        t = time.perf_counter()
        ckpt.flush()
        return t

    savers = {"dcp.async_save": dcp_default, "  reused stager": dcp_reused, "keepalive": keepalive}
    times: dict = {name: ([], []) for name in savers}
    for i in range(args.repeats):
        # interleaved, in a rotating order: the page cache's writeback state then favours no one
        order = list(savers)[i % 3:] + list(savers)[:i % 3]
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            t_return = savers[name](i)
            write = time.perf_counter() - t0
            times[name][0].append(slowest(t_return - t0))
            times[name][1].append(slowest(write))
    results = {name: (statistics.median(s), statistics.median(w)) for name, (s, w) in times.items()}
    stager.close()
    ckpt.close()
    if rank == 0:
        total = int(nbytes) / 1e6
        print(f"FSDP2 state: {total:.0f} MB on {world} ranks (params + AdamW), {args.repeats} saves each")
        for name, (stall, write) in results.items():
            print(f"  {name:16s} stall {stall * 1e3:8.1f} ms   write {write * 1e3:8.1f} ms   "
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
