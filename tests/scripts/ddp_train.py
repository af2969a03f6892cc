"""A tiny DDP training (gloo, CPU) with dropout and a shuffled DistributedSampler, checkpointed by
keepalive: ``torchrun --nproc_per_node=2 ddp_train.py RUN_DIR OUT_DIR`` (or plain ``python`` for one
process). Used by tests/test_distributed.py.

Each rank writes ``OUT_DIR/pid.<restart>.<rank>`` at start (the test kills ranks by these PIDs) and,
at the end, ``OUT_DIR/final.<rank>.pt`` (its model's weights). Rank 0 prints ``STEP n attempt a`` after each
step and ``COMMITTED n`` after each checkpoint commit; each rank ``STOPPED rank r step n exit c`` when
keepalive stops its training before the end (the script's code after it does not run).

Environment (test knobs): DDP_EPOCHS (3), DDP_EVERY (3 steps), DDP_STEP_SLEEP (seconds per step),
DDP_SLOW_WRITE (seconds each checkpoint file write takes: kills land inside saves),
DDP_SELF_KILL="rank:step" (that rank SIGKILLs itself after that step, in the first attempt only),
DDP_SIGTERM="rank:step" (that rank sends itself SIGTERM after that step, first attempt only),
DDP_DEADLINE="rank:step" (that rank's session deadline comes at that step),
DDP_BROKEN_RANKS=1 (negative control: every rank resumes with rank 0's part of the checkpoint),
DDP_PLAIN=1 (the same training without keepalive: the transparency test's other half),
DDP_SEED (the ranks' dropout seed base, 1234: another one is the transparency test's control).
"""
import os
import sys

import torch
import torch.distributed as dist
from childio import emit, exit_after_group, slow_writes
from rank_train import knob, pair, train
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from keepalive.callbacks.torch import DriveCheckpoint
from keepalive.distributed import init_process_group


def spawned(rank: int, world: int, port: int, run_dir: str, out_dir: str) -> None:
    """One process of the notebook launch (README "Several GPUs / machines"): what a notebook cell's
    function does under ``torch.multiprocessing.start_processes``."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    main(run_dir, out_dir)


def main(run_dir: str, out_dir: str) -> None:
    distributed = dist.is_initialized() or "WORLD_SIZE" in os.environ
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if distributed and not dist.is_initialized():
        init_process_group("gloo")  # keepalive.distributed: each torchrun restart's keys apart
    rank = dist.get_rank() if distributed else 0
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"pid.{restart}.{rank}"), "w") as f:
        f.write(str(os.getpid()))

    slow = knob("DDP_SLOW_WRITE", 0.0)
    if slow:
        slow_writes(slow)
    if os.environ.get("DDP_BROKEN_RANKS"):
        import keepalive.distributed as kd

        real = kd.localize
        kd.localize = lambda tree, rank, world: real(tree, 0, world)  # what "rank 0 saves all" would do

    torch.set_num_threads(1)
    data = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(96, 8, generator=data), torch.randn(96, 1, generator=data))
    world = dist.get_world_size() if distributed else 1
    # one process too (world size 1): the same global order, so a 2 -> 1 resume continues it
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=7)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                              torch.nn.Linear(16, 1))
    torch.manual_seed(99)  # the same initial weights on every rank
    for p in net.parameters():
        torch.nn.init.normal_(p, std=0.3)
    torch.manual_seed(int(knob("DDP_SEED", 1234)) + rank)  # ranks differ in their random streams (dropout)
    model = torch.nn.parallel.DistributedDataParallel(net) if distributed else net
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if os.environ.get("DDP_PLAIN"):  # the tutorial loop as it is, no keepalive
        for epoch in range(knob("DDP_EPOCHS", 3)):
            sampler.set_epoch(epoch)
            for x, y in loader:
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
        torch.save({k: v.detach().clone() for k, v in net.state_dict().items()},
                   os.path.join(out_dir, f"final.{rank}.pt"))
        emit(f"DONE rank {rank} plain")
        if distributed:
            # both ranks done with gloo before either tears it down: a rank that destroys the group
            # while its peer's last all-reduce is still in flight can abort the peer at exit (SIGABRT)
            dist.barrier()
            dist.destroy_process_group()
            exit_after_group()
        return
    deadline_rank, deadline_step = pair("DDP_DEADLINE")
    options = {}
    if deadline_rank == rank:  # this rank's session (alone) is about to end at that step
        options["remaining_fn"] = lambda: 1.0 if ckpt.step >= deadline_step else None
    ckpt = DriveCheckpoint(run_dir, model=model, optimizer=opt, every=knob("DDP_EVERY", 3),
                           keep=knob("DDP_KEEP", 3) or None, **options)
    if rank == 0:
        ckpt.core.on_commit.append(lambda r: emit(f"COMMITTED {r.info.step}"))
    try:
        train(ckpt, model, opt, sampler, loader, prefix="DDP", rank=rank, restart=restart)
    except SystemExit as stop:  # a stop before the end (the deadline, a notice): every rank exits 143
        emit(f"STOPPED rank {rank} step {ckpt.step} exit {stop.code}")
        raise
    torch.save({k: v.detach().clone() for k, v in net.state_dict().items()},
               os.path.join(out_dir, f"final.{rank}.pt"))
    emit(f"DONE rank {rank} step {ckpt.step}")
    ckpt.close()
    if distributed:
        dist.destroy_process_group()
        exit_after_group()


if __name__ == "__main__":
    if sys.argv[1] == "--spawn":  # python ddp_train.py --spawn PORT RUN_DIR OUT_DIR: a notebook cell
        import torch.multiprocessing as mp

        port, run, out = int(sys.argv[2]), sys.argv[3], sys.argv[4]
        mp.start_processes(spawned, args=(2, port, run, out), nprocs=2, start_method="fork")
    else:
        main(sys.argv[1], sys.argv[2])
