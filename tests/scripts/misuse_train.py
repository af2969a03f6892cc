"""Distributed programs that use keepalive wrongly, and one that is preempted, under ``torchrun
--nproc_per_node=2`` (gloo, CPU): ``misuse_train.py RUN_DIR OUT_DIR``. Used by
tests/test_distributed_misuse.py, which asserts the one line keepalive says and that nothing hangs.

MISUSE (the environment) picks the program:

* ``save-on-rank0``: the epochs run on both ranks; then ``if rank == 0: ckpt.save()`` and exit;
* ``save-on-rank0-barrier``: the same, followed by ``dist.barrier()`` on every rank;
* ``uneven``: each rank slices the data itself (no DistributedSampler): rank 0 gets one batch more;
* ``folders``: each rank is given its own run folder (``RUN_DIR/rank<r>``): a run folder that is
  not shared between the nodes of a job;
* ``sigterm``: rank 1 sends itself SIGTERM after step 5 (a preempted VM): one save, every rank stops;
* ``teardown``: rank 0 SIGKILLs itself after step 5 (no restarts): torchrun's agent stops rank 1 with
  SIGTERM while no save can follow;
* ``warn``: a warning every rank gives, and one only rank 1 gives (its own problem).

MISUSE_ANNOUNCE_ALWAYS=1: the negative control of ``teardown`` (a signal is always announced).
MISUSE_CHECK_IN: how long a rank waits at a save for the others (keepalive's CHECK_IN_SECONDS).
Every rank prints ``DONE rank r`` when its program ends normally.
"""
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from childio import emit, exit_after_group
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import keepalive.distributed as kd  # the restart-safe rendezvous guard, before the group is made
from keepalive.callbacks.torch import DriveCheckpoint


def main(run_dir: str, out_dir: str) -> None:
    misuse = os.environ["MISUSE"]
    kd.CHECK_IN_SECONDS = float(os.environ.get("MISUSE_CHECK_IN", kd.CHECK_IN_SECONDS))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(out_dir, exist_ok=True)
    torch.set_num_threads(1)
    data = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(52, 4, generator=data), torch.randn(52, 1, generator=data))
    if misuse == "uneven":  # rank 0: samples 0..27 (7 batches), rank 1: 28..51 (6 batches)
        share = range(0, 28) if rank == 0 else range(28, 52)
        loader = DataLoader(torch.utils.data.Subset(dataset, list(share)), batch_size=4, shuffle=False)
    else:
        sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
        loader = DataLoader(dataset, batch_size=4, sampler=sampler)
    torch.manual_seed(5)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    folder = os.path.join(run_dir, f"rank{rank}") if misuse == "folders" else run_dir
    ckpt = DriveCheckpoint(folder, model=model, optimizer=opt, every=3)
    if os.environ.get("MISUSE_ANNOUNCE_ALWAYS"):  # negative control: "saving ..." said on every signal
        ckpt.core.signals._announce = lambda: True
    if misuse == "warn":
        ckpt.core.warn("every rank finds this", key="same-everywhere")
        if rank == 1:
            ckpt.core.warn("only rank 1 finds this", key="rank-1-own", own=True)
    for _ in ckpt.epochs(2):
        for x, y in ckpt.batches(loader):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if misuse == "sigterm" and rank == 1 and ckpt.step + 1 == 5:
                os.kill(os.getpid(), signal.SIGTERM)
            if misuse == "teardown" and ckpt.step + 1 == 5:
                if rank == 0:
                    os.kill(os.getpid(), signal.SIGKILL)
                while ckpt.core.pending_signal is None:  # rank 1: the agent's SIGTERM comes mid-step
                    time.sleep(0.05)
    if misuse.startswith("save-on-rank0") and rank == 0:
        ckpt.save(sync=True)
    if misuse == "save-on-rank0-barrier":
        dist.barrier()
    ckpt.close()
    emit(f"DONE rank {rank}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    exit_after_group()
