"""A training as Accelerate users write it, with every prepared object registered as it is:
``torchrun --nproc_per_node=2 [--max-restarts=N] accel_prepared.py RUN_DIR OUT_DIR`` (gloo, CPU), or
``notebook_launcher`` (``python accel_prepared.py --notebook RUN_DIR OUT_DIR``: what a notebook cell
does). The child of tests/test_accelerate.py.

``Accelerator(cpu=True, gradient_accumulation_steps=4)`` creates the process group itself;
``accelerator.prepare`` returns the model (DDP), an ``AcceleratedOptimizer``, an
``AcceleratedScheduler`` and the loader (a ``DataLoaderShard``; with ACCEL_DISPATCH=1 a
``DataLoaderDispatcher``: rank 0 reads the batches of both ranks and sends each its part). The step is
written inside ``accelerator.accumulate(model)``: ``opt.step()`` / ``sched.step()`` / ``opt.zero_grad()``
are no-ops on the micro-batches where gradients are not synchronised (15 batches per rank and epoch:
steps after the 4th, 8th, 12th and, at the loader's end, the 15th). The dataset adds noise from the
global RNG, the model has dropout.

Each rank writes ``OUT_DIR/pid.<attempt>.<rank>`` at start (tests/torchrunkit.py reads them) and
``OUT_DIR/final.<rank>.pt`` (its model's weights) at the end; rank 0 prints ``STEP n attempt a`` after
each micro-batch that stepped, ``COMMITTED n`` after each checkpoint commit, every rank
``DONE rank r step n`` at the end.

Environment (test knobs): ACCEL_PLAIN=1 (the same training without keepalive), ACCEL_DISPATCH=1,
ACCEL_EPOCHS (3), ACCEL_EVERY (2 optimizer steps), ACCEL_STEP_SLEEP (seconds per micro-batch),
ACCEL_SLOW_WRITE (seconds each checkpoint file write takes: kills land inside saves),
ACCEL_RNG_TYPES (Accelerator(rng_types=...), comma-separated), ACCEL_TRACE=1 (each rank prints
the samples it trains, their sum and its RNG's),
ACCEL_SELF_KILL="rank:step" (in the first attempt, that rank SIGKILLs itself at the first micro-batch
after optimizer step ``step`` that does not step: between two accumulation micro-batches, once that
step's checkpoint is committed), ACCEL_CONTROL=no-accumulation-count (negative control: keepalive is
handed the micro-batches as steps, the way a loop that steps an unregistered optimizer counts them).
"""
import os
import signal
import sys
import time

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from childio import emit, exit_after_group, slow_writes, wait_committed
from torch.utils.data import DataLoader
from toydata import NoisyIndexed

N, DIM, CLASSES, BATCH, ACCUMULATE = 120, 12, 3, 4, 4  # 2 ranks: 15 batches of 4 per rank and epoch


def knob(name: str, default):
    return type(default)(os.environ.get(name, default))




def main(run_dir: str, out_dir: str) -> None:
    plain = bool(os.environ.get("ACCEL_PLAIN"))
    if not plain:
        # imported where users import it, before Accelerator() creates the process group: importing
        # keepalive makes a torchrun restart's rendezvous safe, whoever creates the group
        from keepalive.callbacks.torch import DriveCheckpoint
    torch.set_num_threads(1)
    rng_types = os.environ.get("ACCEL_RNG_TYPES")
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE,
                              rng_types=rng_types.split(",") if rng_types else None,
                              dataloader_config=DataLoaderConfiguration(
                                  dispatch_batches=bool(os.environ.get("ACCEL_DISPATCH"))))
    rank = accelerator.process_index
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", os.environ.get("ACCEL_ATTEMPT", "0")))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"pid.{attempt}.{rank}"), "w") as f:
        f.write(str(os.getpid()))
    slow = knob("ACCEL_SLOW_WRITE", 0.0)
    if slow:
        slow_writes(slow)
    set_seed(42)  # what Accelerate's examples do: the same seed on every rank

    model = torch.nn.Sequential(torch.nn.Linear(DIM, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(32, CLASSES))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.8)
    raw_model = model
    model, opt, dl, sched = accelerator.prepare(
        model, opt, DataLoader(NoisyIndexed(N, DIM, CLASSES, seed=3), shuffle=True, batch_size=BATCH), sched)
    epochs = knob("ACCEL_EPOCHS", 3)
    sleep = knob("ACCEL_STEP_SLEEP", 0.0)

    def train(x, y) -> None:
        with accelerator.accumulate(model):
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()

    def trace(rank: int, i, x) -> None:
        if os.environ.get("ACCEL_TRACE"):  # which samples each rank trains, their noise, its RNG
            emit(f"IDX rank {rank} {i.tolist()} {float(x.sum()):.6f} {int(torch.random.get_rng_state().sum())}")

    if plain:
        for _ in range(epochs):
            for x, y, i in dl:
                trace(rank, i, x)
                train(x, y)
        step = -1
    else:
        kill_rank, kill_step = [int(v) for v in os.environ.get("ACCEL_SELF_KILL", "-1:-1").split(":")]
        control = os.environ.get("ACCEL_CONTROL") == "no-accumulation-count"
        ckpt = DriveCheckpoint(run_dir, model=model, optimizer=None if control else opt, scheduler=sched,
                               every=knob("ACCEL_EVERY", 2), keep=None)
        if rank == 0:
            ckpt.core.on_commit.append(lambda r: emit(f"COMMITTED {r.info.step}"))
        for _ in ckpt.epochs(epochs):
            for x, y, i in ckpt.batches(dl):
                trace(rank, i, x)
                train(x, y)
                if sleep:
                    time.sleep(sleep)
                if accelerator.sync_gradients and rank == 0:
                    emit(f"STEP {ckpt.step + 1} attempt {attempt}")
                if rank == kill_rank and attempt == 0 and ckpt.step >= kill_step and \
                        not accelerator.sync_gradients:
                    wait_committed(run_dir, kill_step)
                    emit(f"KILL rank {rank} between two accumulation micro-batches after step {ckpt.step}")
                    os.kill(os.getpid(), signal.SIGKILL)
        step = ckpt.step
        if not ckpt.finished:
            sys.exit(3)
        ckpt.close()
    torch.save({k: v.detach().clone() for k, v in raw_model.state_dict().items()},
               os.path.join(out_dir, f"final.{rank}.pt"))
    emit(f"DONE rank {rank} step {step}")
    accelerator.wait_for_everyone()
    accelerator.end_training()  # destroys the process group


def notebook(run_dir: str, out_dir: str, restarts: int) -> None:
    """What a notebook cell does: ``notebook_launcher(fn, num_processes=2, max_restarts=...)``."""
    from accelerate import notebook_launcher

    if not os.environ.get("ACCEL_PLAIN"):
        import keepalive.callbacks.torch  # noqa: F401 - a cell before the launch imports it, as users do

    notebook_launcher(main, (run_dir, out_dir), num_processes=2, max_restarts=restarts,
                      use_port=os.environ["ACCEL_PORT"])


if __name__ == "__main__":
    if sys.argv[1] == "--notebook":
        notebook(sys.argv[2], sys.argv[3], int(os.environ.get("ACCEL_RESTARTS", "0")))
    else:
        main(sys.argv[1], sys.argv[2])
        exit_after_group()
