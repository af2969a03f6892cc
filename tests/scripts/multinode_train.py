"""A small DDP training (gloo, CPU) whose process group is created the way a framework creates it, run
by torchrun agents that restart it: ``torchrun ... multinode_train.py RUN_DIR OUT_DIR``. The child of
tests/test_multinode.py (two agents of one node each, or one agent of two processes).

``MN_INIT`` says who creates the group through torch's ``env://`` rendezvous: ``torch``
(``dist.init_process_group("gloo")``), ``accelerate`` (``Accelerator(cpu=True)``), ``partialstate``
(HF's ``PartialState(cpu=True)``, what the HF Trainer uses), ``fabric`` (Lightning's
``Fabric(strategy="ddp").launch()``; tests/shims on PYTHONPATH where torchvision does not import).
The model is wrapped in DDP here and the data is a ``DistributedSampler`` loader whatever creates the
group: the test is about the rendezvous.

``keepalive`` is imported before the group is created, as the README says; ``MN_GUARD=0`` (negative
control) imports it only after, so torch's own rendezvous runs unguarded.

Each rank writes ``OUT_DIR/pid.<n>.<rank>`` (n counts this rank's starts) and, at the end,
``OUT_DIR/final.<rank>.pt``; rank 0 prints ``COMMITTED n`` after each commit, every rank ``START rank r``
once its group exists and ``DONE rank r step n`` at the end. ``MN_KILL="rank:step:saved"``: in the
first start of that rank only (a marker file in OUT_DIR), it waits until the checkpoint of step
``saved`` is committed and SIGKILLs itself before training step ``step``; with ``MN_SURVIVOR_WAITS=1``
the other rank waits there, outside any collective, until its agent stops it. ``MN_PLAIN=1``: the same
training without keepalive (the reference). ``MN_EPOCHS`` (2).
"""
import os
import signal
import sys
import time
from datetime import timedelta

if os.environ.get("MN_GUARD", "1") == "1" and not os.environ.get("MN_PLAIN"):
    import keepalive  # noqa: F401 - first: it installs the restart-safe rendezvous

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from childio import emit, exit_after_group, wait_committed  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402

#: a failed connect ends the attempt within this, not torch's 30 minutes (the test's timeouts are longer)
GROUP_TIMEOUT = timedelta(seconds=int(os.environ.get("MN_GROUP_TIMEOUT", "90")))


def create_group() -> None:
    how = os.environ.get("MN_INIT", "torch")
    if how == "torch":
        dist.init_process_group("gloo", timeout=GROUP_TIMEOUT)
    elif how == "accelerate":
        from accelerate import Accelerator
        from accelerate.utils import InitProcessGroupKwargs

        Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=GROUP_TIMEOUT)])
    elif how == "partialstate":
        from accelerate import PartialState

        PartialState(cpu=True, timeout=GROUP_TIMEOUT)
    elif how == "fabric":
        from lightning.fabric import Fabric
        from lightning.fabric.strategies import DDPStrategy

        local = int(os.environ["LOCAL_WORLD_SIZE"])
        Fabric(accelerator="cpu", devices=local, num_nodes=int(os.environ["WORLD_SIZE"]) // local,
               strategy=DDPStrategy(timeout=GROUP_TIMEOUT)).launch()
    else:
        raise SystemExit(f"MN_INIT={how!r}")
    assert dist.is_initialized() and dist.get_world_size() == 2




def main(run_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    create_group()
    rank = dist.get_rank()
    os.makedirs(out_dir, exist_ok=True)
    starts = sum(1 for n in os.listdir(out_dir) if n.startswith("pid.") and n.endswith(f".{rank}"))
    with open(os.path.join(out_dir, f"pid.{starts}.{rank}"), "w") as f:
        f.write(str(os.getpid()))
    emit(f"START rank {rank} start {starts} restart_count {os.environ.get('TORCHELASTIC_RESTART_COUNT')}")

    data = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(96, 8, generator=data), torch.randn(96, 1, generator=data))
    sampler = DistributedSampler(dataset, shuffle=True, seed=7)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                              torch.nn.Linear(16, 1))
    torch.manual_seed(99)  # the same initial weights on every rank
    for p in net.parameters():
        torch.nn.init.normal_(p, std=0.3)
    torch.manual_seed(1234 + rank)  # ranks differ in their random streams (dropout)
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    epochs = int(os.environ.get("MN_EPOCHS", "2"))

    def train(x, y) -> None:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    if os.environ.get("MN_PLAIN"):
        step = 0
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for x, y in loader:
                train(x, y)
                step += 1
    else:
        from keepalive.callbacks.torch import DriveCheckpoint

        kill = [int(v) for v in os.environ.get("MN_KILL", "").split(":") if v]
        marker = os.path.join(out_dir, "killed")
        first_start = not os.path.exists(marker)
        survivor_waits = os.environ.get("MN_SURVIVOR_WAITS") == "1"
        ckpt = DriveCheckpoint(run_dir, model=model, optimizer=opt, every=3, keep=None)
        if rank == 0:
            ckpt.core.on_commit.append(lambda r: emit(f"COMMITTED {r.info.step}"))
        for epoch in ckpt.epochs(epochs):
            sampler.set_epoch(epoch)
            for x, y in ckpt.batches(loader):
                if kill and rank == kill[0] and ckpt.step + 1 == kill[1] and not os.path.exists(marker):
                    wait_committed(run_dir, kill[2])
                    open(marker, "w").close()
                    emit(f"KILL rank {rank} before step {ckpt.step + 1}")
                    os.kill(os.getpid(), signal.SIGKILL)
                if (kill and survivor_waits and rank != kill[0] and ckpt.step + 1 == kill[1]
                        and first_start):
                    # healthy, outside any collective (a long evaluation, a slow batch) when the other
                    # node dies: its agent, not a gloo error, stops it (SIGTERM, its default action),
                    # so only the failed node's TORCHELASTIC_RESTART_COUNT moves
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                    emit(f"WAITING rank {rank} before step {ckpt.step + 1}")
                    time.sleep(120)
                    raise SystemExit("the agent did not stop this healthy worker in 120 s")
                train(x, y)
        step = ckpt.step
        ckpt.close()
    torch.save({k: v.detach().clone() for k, v in net.state_dict().items()},
               os.path.join(out_dir, f"final.{rank}.pt"))
    emit(f"DONE rank {rank} step {step}")
    dist.barrier()  # both ranks done with gloo before either tears it down
    dist.destroy_process_group()
    exit_after_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
