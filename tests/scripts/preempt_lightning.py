"""A Lightning ``Trainer.fit`` whose validation is slow in one epoch, for the "save during validation" tests.

A tiny MLP with dropout (the global RNG is drawn every step), AdamW and a StepLR stepped per step;
8 batches per epoch, validation inside the epoch and at its end (``--val-check 0.5``). In the
validation after batch ``--slow-batch`` (8: the epoch-end one) of epoch ``--slow-epoch`` each
validation batch (4) sleeps ``--val-sleep`` s: in the module's
``validation_step`` (``--sleep-in step``: no keepalive hook runs meanwhile, so its guard thread saves)
or in a callback's ``on_validation_batch_end`` after keepalive's (``--sleep-in hook``: keepalive's
hook saves). Prints ``VAL_START <step>`` when that validation starts (after keepalive's boundary) and
``COMMITTED <step> <unix time>`` after each keepalive commit. ``--deadline-in-val S``: the session's
deadline falls S s after that validation started. Every training step's loss is appended to
``<run>/losses.jsonl``; at the end the weights, the optimizer state, the losses and a final draw of
the global RNG go to ``--out`` (safetensors + JSON).

Negative controls: ``--touch-before-val``: the module's ``on_validation_start`` changes a weight in
place (by nothing: ``mul_(1.0)``), so the state is no longer that of the last step; ``--no-pause-save``:
keepalive's saves between steps are switched off (the save waits for the next boundary);
``--control-live-progress``: a save during a validation holds the loops' progress as they are (Lightning
then skips the interrupted validation on resume: the run differs).
"""
import argparse
import json
import os
import time

p = argparse.ArgumentParser()
p.add_argument("run")
p.add_argument("--out", required=True)
p.add_argument("--keepalive", action="store_true")
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--val-check", type=float, default=0.5)
p.add_argument("--slow-epoch", type=int, default=1)
p.add_argument("--slow-batch", type=int, default=8, help="the validation after this batch of the epoch is slow")
p.add_argument("--val-sleep", type=float, default=0.0)
p.add_argument("--sleep-in", default="hook", choices=["hook", "step"])
p.add_argument("--deadline-in-val", type=float, default=0.0)
p.add_argument("--touch-before-val", action="store_true")
p.add_argument("--no-pause-save", action="store_true")
p.add_argument("--control-live-progress", action="store_true",
               help="negative control: a save during a validation holds Lightning's live loop progress")
args = p.parse_args()

import torch  # noqa: E402

torch.set_num_threads(1)
import lightning.pytorch as pl  # noqa: E402
from childio import emit  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

os.makedirs(args.run, exist_ok=True)
LOSSES = os.path.join(args.run, "losses.jsonl")
slow = {"on": False}
deadline = {"at": None}


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                        torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.body(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        with open(LOSSES, "a") as f:
            f.write(json.dumps({"step": self.trainer.global_step, "loss": outputs["loss"].item()}) + "\n")

    def on_validation_start(self):
        if args.touch_before_val and slow["on"]:
            with torch.no_grad():
                self.body[0].weight.mul_(1.0)  # in place: the state is no longer the last step's

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.body(x), y)
        self.log("val_loss", loss)
        if slow["on"] and args.sleep_in == "step":
            time.sleep(args.val_sleep)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class SlowValidation(pl.Callback):
    """After keepalive's hooks: says when the slow validation starts, and sleeps in its batches."""

    def on_validation_start(self, trainer, pl_module):
        slow["on"] = (not trainer.sanity_checking and trainer.current_epoch == args.slow_epoch and args.val_sleep > 0
                      and trainer.fit_loop.epoch_loop.batch_progress.current.completed == args.slow_batch)
        if slow["on"]:
            if args.deadline_in_val:
                deadline["at"] = time.time() + args.deadline_in_val
            emit(f"VAL_START {trainer.global_step}")

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if slow["on"] and args.sleep_in == "hook":
            time.sleep(args.val_sleep)

    def on_validation_end(self, trainer, pl_module):
        if slow["on"]:
            emit(f"VAL_END {trainer.global_step}")
        slow["on"] = False


g = torch.Generator().manual_seed(1234)
x = torch.randn(96, 8, generator=g)
y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(96, 1, generator=g)
train = DataLoader(TensorDataset(x[:64], y[:64]), batch_size=8, shuffle=True)
val = DataLoader(TensorDataset(x[64:], y[64:]), batch_size=8)

pl.seed_everything(7, verbose=False)
model = Net()
callbacks = []
if args.keepalive:
    import keepalive.pauses
    from keepalive.callbacks.lightning import DriveCheckpoint
    from keepalive.core import Checkpointer

    if args.control_live_progress:
        import keepalive.callbacks._lightning_state as lstate

        lstate.validation_again = lambda ckpt, at_start: ckpt
    if args.no_pause_save:
        keepalive.pauses.PAUSE_SECONDS = 1e9
        Checkpointer._pause_save = lambda self, capture, in_thread: None
    options = {}
    if args.deadline_in_val:
        options = {"remaining_fn": lambda: 1e9 if deadline["at"] is None else deadline["at"] - time.time(),
                   "deadline_margin": "2s"}
    ckpt = DriveCheckpoint(os.path.join(args.run, "ka"), every="epoch", **options)
    ckpt.core.on_commit.append(lambda r: emit(f"COMMITTED {r.info.step} {time.time():.3f}"))
    callbacks.append(ckpt)
callbacks.append(SlowValidation())
trainer = pl.Trainer(max_epochs=args.epochs, callbacks=callbacks, val_check_interval=args.val_check,
                     num_sanity_val_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, deterministic=True, accelerator="cpu")
try:
    trainer.fit(model, train_dataloaders=train, val_dataloaders=val)
except SystemExit:  # keepalive's exit (143) after a SIGTERM or a stop before the end
    if args.keepalive and ckpt.stopped:
        emit("STOPPED")
    raise

os.makedirs(args.out, exist_ok=True)
tensors = {f"model.{k}": v.contiguous() for k, v in model.state_dict().items()}
for i, st in trainer.optimizers[0].state_dict()["state"].items():
    for k, v in st.items():
        if isinstance(v, torch.Tensor):
            tensors[f"opt.{i}.{k}"] = v.reshape(-1).contiguous()
tensors["final_draw"] = torch.rand(4)
save_file(tensors, os.path.join(args.out, "final.safetensors"))
losses = {}
with open(LOSSES) as f:
    for line in f:
        rec = json.loads(line)
        losses[rec["step"]] = rec["loss"]  # a step redone after a resume replaces the earlier line
with open(os.path.join(args.out, "losses.json"), "w") as f:
    json.dump({"losses": losses, "global_step": trainer.global_step}, f)
emit("DONE")
