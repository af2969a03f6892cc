"""A training as Lightning Fabric users write it, checkpointed by keepalive: ``torchrun
--nproc_per_node=2 fabric_train.py RUN_DIR OUT_DIR`` (gloo, CPU). The child of tests/test_fabric.py.

``fabric.setup(model, opt)`` wraps the model (a ``_FabricModule`` around DDP) and the optimizer (a
``_FabricOptimizer`` posing as its class); ``fabric.setup_dataloaders`` gives a ``_FabricDataLoader``
(no DataLoader: it copies one's attributes, swaps its sampler for a shuffled ``DistributedSampler``, and
calls that sampler's ``set_epoch`` with its own count of ``iter()`` calls). All three go to keepalive as
they are. The dataset adds noise from the global RNG in ``__getitem__``, the model has dropout.

Each rank writes ``OUT_DIR/pid.<restart>.<rank>`` and ``OUT_DIR/final.<rank>.pt``; rank 0 prints
``COMMITTED n`` after each commit. Environment: FAB_PLAIN=1 (the same training without keepalive),
FAB_KILL="rank:step:saved" (that rank waits until the checkpoint of step ``saved`` is committed and
SIGKILLs itself before training step ``step``), FAB_CONTROL=no-counters (negative control: the resumed
epoch forgets the loader's recorded iter() count, so Fabric sets another epoch on the sampler).
"""
import os
import signal
import sys

import torch
import torch.nn.functional as F
from childio import emit, wait_committed
from lightning.fabric import Fabric
from torch.utils.data import DataLoader
from toydata import NoisyIndexed

from keepalive.callbacks.torch import DriveCheckpoint

N, DIM, CLASSES, BATCH = 96, 12, 3, 4  # 2 ranks: 12 batches of 4 per rank and epoch


def main(run_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    fabric = Fabric(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy="ddp")
    fabric.launch()
    rank = fabric.global_rank
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"pid.{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}.{rank}"), "w") as f:
        f.write(str(os.getpid()))
    fabric.seed_everything(42)
    net = torch.nn.Sequential(torch.nn.Linear(DIM, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                              torch.nn.Linear(32, CLASSES))
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
    loader = fabric.setup_dataloaders(DataLoader(NoisyIndexed(N, DIM, CLASSES, seed=3), shuffle=True,
                                                 batch_size=BATCH))

    def train(x, y):
        opt.zero_grad()
        fabric.backward(F.cross_entropy(model(x), y))
        opt.step()

    step = 0
    if os.environ.get("FAB_PLAIN"):
        for _ in range(3):
            for x, y, _i in loader:
                train(x, y)
                step += 1
    else:
        kill = [int(v) for v in os.environ.get("FAB_KILL", "").split(":") if v]
        ckpt = DriveCheckpoint(run_dir, model=model, optimizer=opt, every=3, keep=None)
        if rank == 0:
            ckpt.core.on_commit.append(lambda r: emit(f"COMMITTED {r.info.step}"))
        if os.environ.get("FAB_CONTROL") == "no-counters":
            ckpt.resume()
            for stream in (ckpt._saved_data.get("streams") or {}).values():
                (stream.get("at_iter") or {}).pop("counters", None)  # the wrapper's iter() count
        for _ in ckpt.epochs(3):
            for x, y, _i in ckpt.batches(loader):
                if kill and rank == kill[0] and ckpt.step + 1 == kill[1]:
                    wait_committed(run_dir, kill[2])
                    emit(f"KILL rank {rank} before step {ckpt.step + 1}")
                    os.kill(os.getpid(), signal.SIGKILL)
                train(x, y)
        step = ckpt.step
        ckpt.close()
    torch.save({k: v.detach().clone() for k, v in net.state_dict().items()},
               os.path.join(out_dir, f"final.{rank}.pt"))
    emit(f"DONE rank {rank} step {step}")
    fabric.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
