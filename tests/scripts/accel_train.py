"""A training as Accelerate users write it, checkpointed by keepalive: ``torchrun --nproc_per_node=2
accel_train.py RUN_DIR OUT_DIR`` (gloo, CPU). The child of tests/test_accelerate_data.py.

``accelerator.prepare`` turns ``DataLoader(shuffle=True)`` into Accelerate's ``DataLoaderShard``: a
``BatchSamplerShard`` deals the batches of a ``RandomSampler`` to the ranks, and that sampler draws
from a ``torch.Generator`` that Accelerate creates at ``prepare`` and broadcasts from rank 0 at every
``iter()`` (``synchronized_generator``); the shard counts its epochs itself (``iteration``). The
dataset adds noise from the global RNG in ``__getitem__``, the model has dropout.

Each rank writes ``OUT_DIR/pid.<restart>.<rank>`` at start (tests/torchrunkit.py reads them) and
``OUT_DIR/final.<rank>.pt`` (its model's weights) at the end; rank 0 prints ``COMMITTED n`` after
each checkpoint commit, every rank ``DONE rank r step n`` at the end.

Environment (test knobs): ACCEL_PLAIN=1 (the same training without keepalive), ACCEL_EPOCHS (3),
ACCEL_EVERY (3 optimizer steps), ACCEL_KILL="rank:step:saved" (that rank waits until the checkpoint
of step ``saved`` is committed, prints ``KILL``, and SIGKILLs itself before training step ``step``),
ACCEL_CONTROL=no-replay (negative control: the resumed epoch's loader forgets the generator states
and sampler counters recorded at its ``iter()``, as if keepalive did not capture them).
"""
import os
import signal
import sys

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from childio import emit, exit_after_group, wait_committed
from torch.utils.data import DataLoader
from toydata import NoisyIndexed

N, DIM, CLASSES, BATCH = 96, 12, 3, 4  # 2 ranks: 12 batches of 4 per rank and epoch




def main(run_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    os.makedirs(out_dir, exist_ok=True)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    with open(os.path.join(out_dir, f"pid.{restart}.{rank}"), "w") as f:
        f.write(str(os.getpid()))
    set_seed(42)  # what Accelerate's examples do: the same seed on every rank

    model = torch.nn.Sequential(torch.nn.Linear(DIM, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(32, CLASSES))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    raw_model, raw_opt = model, opt
    model, opt, dl = accelerator.prepare(model, opt, DataLoader(NoisyIndexed(N, DIM, CLASSES, seed=3),
                                                                shuffle=True, batch_size=BATCH))
    epochs = int(os.environ.get("ACCEL_EPOCHS", "3"))

    def train(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        accelerator.backward(loss)
        opt.step()

    step = 0
    if os.environ.get("ACCEL_PLAIN"):
        for _ in range(epochs):
            for x, y, _i in dl:
                train(x, y)
                step += 1
    else:
        from keepalive.callbacks.torch import DriveCheckpoint

        kill = [int(v) for v in os.environ.get("ACCEL_KILL", "").split(":") if v]
        # The raw model and optimizer, not the prepared ones (a shape users write too; the prepared ones
        # are tests/scripts/accel_prepared.py's): the DDP wrapper's module and the AcceleratedOptimizer's
        # inner optimizer are these very objects, so their state is the same.
        ckpt = DriveCheckpoint(run_dir, model=raw_model, optimizer=raw_opt,
                               every=int(os.environ.get("ACCEL_EVERY", "3")), keep=None)
        if rank == 0:
            ckpt.core.on_commit.append(lambda r: emit(f"COMMITTED {r.info.step}"))
        if os.environ.get("ACCEL_CONTROL") == "no-replay":
            ckpt.resume()
            for stream in (ckpt._saved_data.get("streams") or {}).values():
                at = stream.get("at_iter") or {}
                at.pop("generators", None)  # Accelerate's synchronized generator, as at the resume
                at.pop("counters", None)    # the shard's epoch count, as at the resume
        for _ in ckpt.epochs(epochs):
            for x, y, _i in ckpt.batches(dl):
                if kill and rank == kill[0] and ckpt.step + 1 == kill[1]:
                    wait_committed(run_dir, kill[2])
                    emit(f"KILL rank {rank} before step {ckpt.step + 1}")
                    os.kill(os.getpid(), signal.SIGKILL)
                train(x, y)
        step = ckpt.step
        if not ckpt.finished:
            sys.exit(3)
        ckpt.close()
    torch.save({k: v.detach().clone() for k, v in raw_model.state_dict().items()},
               os.path.join(out_dir, f"final.{rank}.pt"))
    emit(f"DONE rank {rank} step {step}")
    accelerator.wait_for_everyone()
    accelerator.end_training()  # destroys the process group


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    exit_after_group()
