"""A tiny FSDP2 training (``fully_shard``, gloo, CPU) with dropout and a shuffled DistributedSampler,
checkpointed by keepalive through DCP: ``torchrun --nproc_per_node=2 fsdp_train.py RUN_DIR OUT_DIR``
(or plain ``python`` for one process, a process group of one). Used by tests/test_fsdp.py.

Each rank writes ``OUT_DIR/pid.<restart>.<rank>`` at start (the test kills ranks by these PIDs); at
the end rank 0 writes ``OUT_DIR/final.pt``: the full model state gathered from the shards
(``get_model_state_dict(full_state_dict=True)``). Rank 0 prints ``STEP n attempt a`` after each step
and ``COMMITTED n`` after each checkpoint commit.

Environment (test knobs): FSDP_EPOCHS (3), FSDP_EVERY (3 steps), FSDP_KEEP (3; 0 = keep all),
FSDP_STEP_SLEEP (seconds per step), FSDP_SLOW_SHARD (seconds each DCP file write waits before its first byte: kills
land inside saves), FSDP_SELF_KILL="rank:step" (that rank SIGKILLs itself after that step, in the first
attempt only), FSDP_SIGTERM="rank:step" (that rank sends itself SIGTERM after that step, first attempt only),
FSDP_FAIL_SHARD="rank:n" (that rank's n-th shard file fails with ENOSPC),
FSDP_STORAGE_OPTIONS (JSON, for an s3:// RUN_DIR), FSDP_BROKEN=1 (negative control: the sharded state
is not restored on resume).
"""
import faulthandler
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from childio import emit, exit_after_group
from rank_train import knob, pair, train
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from keepalive.callbacks.torch import DriveCheckpoint
from keepalive.distributed import init_process_group


def init() -> None:
    if "MASTER_ADDR" not in os.environ:  # one plain process: a process group of one
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{knob('FSDP_PORT', 29577)}", rank=0,
                                world_size=1)
    else:  # under torchrun: keepalive's restart-safe init_process_group
        init_process_group("gloo")


def main(run_dir: str, out_dir: str) -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung rank's stacks, when asked
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    init()
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"pid.{restart}.{rank}"), "w") as f:
        f.write(str(os.getpid()))

    slow = knob("FSDP_SLOW_SHARD", 0.0)
    kill_in_rank, kill_in_file = pair("FSDP_KILL_IN_SHARD")
    fail_rank, fail_file = pair("FSDP_FAIL_SHARD")
    if slow or kill_in_rank is not None or fail_rank is not None:
        # each DCP file write takes a while: SIGKILLs land between shards and manifest; with
        # FSDP_KILL_IN_SHARD="rank:n" that rank SIGKILLs itself inside its n-th shard file
        from keepalive import dcp as kdcp

        original_write, original_stream = kdcp._HashingStream.write, kdcp._HashingStream.__init__
        opened = [0]

        def counting_init(self, raw, algorithm):
            original_stream(self, raw, algorithm)
            time.sleep(slow)  # once per file (torch.save makes many small writes)
            if raw.name.endswith(".distcp"):
                opened[0] += 1
                if rank == fail_rank and opened[0] == fail_file:
                    raise OSError(28, "No space left on device (injected by FSDP_FAIL_SHARD)")

        def slow_write(self, b):
            n = original_write(self, b)
            if rank == kill_in_rank and opened[0] == kill_in_file and restart == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            return n

        kdcp._HashingStream.__init__ = counting_init
        kdcp._HashingStream.write = slow_write
    if os.environ.get("FSDP_BROKEN"):
        from keepalive import dcp as kdcp

        kdcp.ShardedObjects.load = lambda *args, **kwargs: None

    torch.set_num_threads(1)
    data = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(96, 8, generator=data), torch.randn(96, 1, generator=data))
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=7)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                              torch.nn.Linear(16, 1))
    torch.manual_seed(99)  # the same initial weights on every rank (then sharded)
    for p in net.parameters():
        torch.nn.init.normal_(p, std=0.3)
    torch.manual_seed(1234 + rank)  # ranks differ in their random streams (dropout), as usual
    mesh = init_device_mesh("cpu", (world,))
    for layer in (net[0], net[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    options = json.loads(os.environ.get("FSDP_STORAGE_OPTIONS") or "null")  # an s3:// run (moto)
    ckpt = DriveCheckpoint(run_dir, model=net, optimizer=opt, every=knob("FSDP_EVERY", 3),
                           keep=knob("FSDP_KEEP", 3) or None, storage_options=options)
    if rank == 0:
        ckpt.core.on_commit.append(lambda r: emit(f"COMMITTED {r.info.step}"))
    train(ckpt, net, opt, sampler, loader, prefix="FSDP", rank=rank, restart=restart)
    full = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in full.items()}, os.path.join(out_dir, "final.pt"))
    emit(f"DONE rank {rank} step {ckpt.step}")
    threads = len(os.listdir("/proc/self/task"))  # native ones, gloo's worker threads included
    ckpt.close()
    # close() destroyed keepalive's side gloo group, joining its threads: left to interpreter exit,
    # such a group can abort the process after the training is done (keepalive/dcp.py)
    emit(f"THREADS rank {rank} {threads} -> {len(os.listdir('/proc/self/task'))}")
    dist.barrier()
    dist.destroy_process_group()
    exit_after_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
