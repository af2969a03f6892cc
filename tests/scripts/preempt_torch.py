"""A small torch training with a slow evaluation, checkpointed by keepalive, for the tests of saves
between steps and of the clouds' preemption notices (tests/test_preempt_torch.py):
``python preempt_torch.py RUN_DIR OUT_FILE``.

3 epochs of 10 batches (40 samples, batch 4, shuffled, dropout), each followed by an evaluation (4
batches of a validation set, a random draw per batch) and a StepLR step. Prints ``STEP n`` after each
optimizer step, ``LOSS e b <hex>`` per training batch, ``EVAL e <hex>`` per evaluation, ``EVAL START e``
/ ``EVAL END e`` around the slow one, ``COMMITTED n`` per checkpoint commit; at the end it saves the
weights, the optimizer's state, the EMA and a last random draw to OUT_FILE and prints ``DONE``. A
training keepalive stopped (the deadline, a notice) exits 143 from inside the loop, ``STOPPED n`` said
at exit.

Environment (test knobs):
PT_PLAIN=1: the same training without keepalive (the reference).
PT_EVAL=ka|plain: the evaluation iterates ``ckpt.batches(val_loader)`` (keepalive is called at each
    of its batches) or ``val_loader`` itself (keepalive is not called: its guard thread saves).
PT_SLOW_EVAL_EPOCH (1), PT_EVAL_SECONDS (8): the evaluation of that epoch sleeps that long in all.
PT_STEP_SLEEP: seconds after each step.  PT_EVERY: save every N steps (3).
PT_DEADLINE=s: the session's deadline comes s seconds after the slow evaluation starts.
PT_ON_PREEMPT: DriveCheckpoint's on_preempt.  PT_NOTICE_POLL=s: the cloud watcher polls every s seconds.
PT_STALL=k: the k-th item the training data set loads in this process takes PT_STALL_SECONDS (8).
PT_ACCUM=2: two micro-batches per optimizer step; PT_ACCUM_PAUSE=s: a pause of s seconds with the
    gradients of step PT_ACCUM_STEP's first micro-batch pending (prints ``PAUSE``).
PT_EMA=1: an EMA of the weights (registered as ``ema``) updated in place at the slow evaluation's start.
PT_SCHED_BEFORE_EVAL=1: the scheduler steps before the evaluation (not after it).
PT_NO_PAUSE_SAVE=1: negative control: saves between steps switched off.
PT_BROKEN_RNG=1: negative control: a save between steps keeps the random state of its moment.
"""
import atexit
import os
import sys
import time

import torch
from childio import emit
from torch.utils.data import DataLoader, Dataset, TensorDataset


def knob(name, default):
    return type(default)(os.environ.get(name, default))


class Stalling(Dataset):
    """The training data; its ``stall_at``-th item (counted in this process) takes ``seconds``."""

    def __init__(self, x, y, stall_at: int, seconds: float):
        self.x, self.y, self.stall_at, self.seconds, self.loaded = x, y, stall_at, seconds, 0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.loaded += 1
        if self.loaded == self.stall_at:
            emit("STALL")
            time.sleep(self.seconds)
        return self.x[i], self.y[i]


def main(run_dir: str, out_file: str) -> None:
    plain = bool(os.environ.get("PT_PLAIN"))
    eval_kind = os.environ.get("PT_EVAL", "ka")
    slow_epoch, eval_seconds = knob("PT_SLOW_EVAL_EPOCH", 1), knob("PT_EVAL_SECONDS", 8.0)
    step_sleep = knob("PT_STEP_SLEEP", 0.0)
    accum = knob("PT_ACCUM", 1)
    accum_pause, accum_step = knob("PT_ACCUM_PAUSE", 0.0), knob("PT_ACCUM_STEP", 14)
    use_ema = bool(os.environ.get("PT_EMA"))
    sched_before_eval = bool(os.environ.get("PT_SCHED_BEFORE_EVAL"))
    if os.environ.get("PT_NO_PAUSE_SAVE"):
        import keepalive.pauses
        from keepalive.core import Checkpointer

        keepalive.pauses.PAUSE_SECONDS = 1e9  # the guard's thread never finds a pause
        Checkpointer._pause_save = lambda self, capture, in_thread: None  # nor does the training thread
    if os.environ.get("PT_BROKEN_RNG"):
        from keepalive.core import Checkpointer

        build_tree = Checkpointer.build_tree
        # negative control: a save between steps takes the random state of now (after the evaluation's draws)
        Checkpointer.build_tree = lambda self, capture, rng_state=None: build_tree(self, capture)
    poll = knob("PT_NOTICE_POLL", 0.0)
    if poll and not plain:
        from keepalive.session import cloud

        # the watcher as keepalive starts it, polling faster than AWS's documented 5 s (a test's time)
        cloud._WATCHER, cloud._DECIDED = cloud.NoticeWatcher(cloud.detect(), interval=poll), True

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    train_set = Stalling(torch.randn(40, 8, generator=gen), torch.randn(40, 1, generator=gen),
                         knob("PT_STALL", 0), knob("PT_STALL_SECONDS", 8.0))
    val_set = TensorDataset(torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen))
    torch.manual_seed(1234)
    loader = DataLoader(train_set, batch_size=4, shuffle=True, num_workers=0)
    val_loader = DataLoader(val_set, batch_size=4, shuffle=False)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                torch.nn.Linear(16, 1))
    ema = torch.nn.Linear(8, 16)  # an EMA of the first layer
    with torch.no_grad():
        ema.weight.copy_(model[0].weight)
        ema.bias.copy_(model[0].bias)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    deadline = [None]
    if plain:
        ckpt = None
        epochs = range(3)

        def batches(loader_):
            return loader_

        enumerate_ = enumerate
    else:
        from keepalive.callbacks.torch import DriveCheckpoint

        options = {}
        if os.environ.get("PT_DEADLINE"):
            options.update(remaining_fn=lambda: 1e6 if deadline[0] is None else deadline[0] - time.time(),
                           deadline_margin="2s")
        if os.environ.get("PT_ON_PREEMPT"):
            options["on_preempt"] = os.environ["PT_ON_PREEMPT"]
        objects = {"ema": ema} if use_ema else {}
        ckpt = DriveCheckpoint(run_dir, model=model, optimizer=opt, scheduler=sched, every=knob("PT_EVERY", 3),
                               **objects, **options)
        ckpt.core.on_commit.append(lambda r: emit(f"COMMITTED {r.info.step}"))
        epochs = ckpt.epochs(3)
        batches = ckpt.batches
        enumerate_ = ckpt.enumerate  # a resumed epoch's batches keep their true index

    def evaluate(epoch: int) -> None:
        special = epoch == slow_epoch  # the evaluation that is slow (the EMA, the deadline: there too)
        slow = special and eval_seconds > 0
        model.eval()
        if special:
            emit(f"EVAL START {epoch}")
            if os.environ.get("PT_DEADLINE"):
                deadline[0] = time.time() + knob("PT_DEADLINE", 0.0)
            if use_ema:
                with torch.no_grad():  # in place: the state is no longer the last step's
                    ema.weight.mul_(0.5).add_(model[0].weight, alpha=0.5)
                    ema.bias.mul_(0.5).add_(model[0].bias, alpha=0.5)
        total = torch.zeros(())
        with torch.no_grad():
            val = batches(val_loader) if eval_kind == "ka" else val_loader
            for x, y in val:
                noise = torch.randn(x.shape) * 0.01  # the evaluation draws random numbers too
                total += torch.nn.functional.mse_loss(model(x + noise), y)
                if slow:
                    time.sleep(eval_seconds / len(val_loader))
        if special:
            emit(f"EVAL END {epoch}")
        emit(f"EVAL {epoch} {float(total).hex()}")
        model.train()

    if ckpt is not None:  # a stop before the end exits (143) from inside the loop: said at exit
        atexit.register(lambda: ckpt.core.stopped and emit(f"STOPPED {ckpt.step}"))
    steps = 0
    for epoch in epochs:
        for i, (x, y) in enumerate_(loader):
            loss = torch.nn.functional.mse_loss(model(x), y)
            (loss / accum).backward()
            emit(f"LOSS {epoch} {i} {float(loss.detach()).hex()}")
            if (i + 1) % accum:
                if accum_pause and steps + 1 == accum_step:
                    emit("PAUSE")  # gradients pending: no consistent state to save
                    time.sleep(accum_pause)
                continue
            opt.step()
            opt.zero_grad()
            steps = ckpt.step + 1 if ckpt is not None else steps + 1  # counted right after the batch
            emit(f"STEP {steps}")
            if step_sleep:
                time.sleep(step_sleep)
        if sched_before_eval:
            sched.step()
        evaluate(epoch)
        if not sched_before_eval:
            sched.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "ema": ema.state_dict(),
                "lr": sched.get_last_lr(), "draw": torch.rand(4)}, out_file)
    emit("DONE")
    if ckpt is not None:
        ckpt.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
