"""What tests/scripts/ddp_train.py and fsdp_train.py share: their environment knobs and the training
loop with its test hooks (``<PREFIX>_STEP_SLEEP``, ``<PREFIX>_SELF_KILL``, ``<PREFIX>_SIGTERM``,
``<PREFIX>_EPOCHS``), run the same way on every rank."""
import os
import signal
import time

import torch
from childio import emit  # one write per line: the writer thread's COMMITTED never splits a STEP


def knob(name, default):
    return type(default)(os.environ.get(name, default))


def pair(name):
    """``"rank:n"`` from the environment as ``(rank, n)``, or ``(None, None)``."""
    value = os.environ.get(name)
    if not value:
        return None, None
    rank, step = value.split(":")
    return int(rank), int(step)


def train(ckpt, model, opt, sampler, loader, *, prefix: str, rank: int, restart: int) -> None:
    """The epochs of ``ckpt`` on ``loader`` (MSE); rank 0 prints ``STEP n attempt a`` after each step.
    ``<PREFIX>_SELF_KILL`` / ``<PREFIX>_SIGTERM`` = "rank:step": that rank SIGKILLs / SIGTERMs itself
    after that step, in the first attempt only."""
    step_sleep = knob(f"{prefix}_STEP_SLEEP", 0.0)
    kill_rank, kill_step = pair(f"{prefix}_SELF_KILL")
    term_rank, term_step = pair(f"{prefix}_SIGTERM")
    for epoch in ckpt.epochs(knob(f"{prefix}_EPOCHS", 3)):
        sampler.set_epoch(epoch)
        for x, y in ckpt.batches(loader):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            step = ckpt.step + 1  # this step, counted by the checkpointer right after the batch
            if rank == 0:
                emit(f"STEP {step} attempt {restart}")
            if step_sleep:
                time.sleep(step_sleep)
            if rank == kill_rank and step == kill_step and restart == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            if rank == term_rank and step == term_step and restart == 0:
                os.kill(os.getpid(), signal.SIGTERM)  # a preempted VM: save once, globally, all stop
