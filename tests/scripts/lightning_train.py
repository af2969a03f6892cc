"""A real Lightning ``Trainer.fit`` for crash tests: a ``LightningDataModule`` over synthetic tensors,
a tiny MLP with dropout, validation (also inside the epoch), ``EarlyStopping`` and ``ModelCheckpoint``
callbacks, and either automatic optimization with an LR scheduler stepped per step (``--mode auto``) or
manual optimization with two optimizers (``--mode manual``). The automatic mode follows Lightning's
OneCycleLR recipe: ``configure_optimizers`` reads ``trainer.estimated_stepping_batches``. Prints
``STEP n`` after each training batch (n = trainer.global_step) and ``COMMITTED n`` after each
keepalive commit; a file logger appends every ``log_metrics`` call to ``<run>/metrics.jsonl`` (it
survives kills: a restart appends). At the end writes the weights and optimizer states (safetensors)
and the logged history (JSON).

``--control-drop-position``: the negative control of the crash test: a resume does not apply the saved
data position (what a loader built before the loop state is restored did).

``--native``: no keepalive; Lightning's own ``ModelCheckpoint(save_last=True, every_n_train_steps=N)``
and ``fit(ckpt_path="last")``: the side-by-side comparison."""
import argparse
import json
import os
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("run")
p.add_argument("--out", required=True)
p.add_argument("--mode", default="auto", choices=["auto", "manual"])
p.add_argument("--epochs", type=int, default=4)
p.add_argument("--n-train", type=int, default=96)
p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--every", default="epoch")
p.add_argument("--hidden", type=int, default=32)
p.add_argument("--workers", type=int, default=0)
p.add_argument("--val-check", type=float, default=0.5)
p.add_argument("--native", action="store_true")
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--namespace", default="lightning", choices=["lightning", "pytorch_lightning"])
p.add_argument("--deadline-after", type=int, default=0, help="stop at the deadline after this many steps")
p.add_argument("--control-drop-position", action="store_true",
               help="negative control: a resume ignores the saved data position (the epoch's order made afresh)")
args = p.parse_args()

import torch  # noqa: E402

torch.set_num_threads(1)
if args.namespace == "lightning":
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
    from lightning.pytorch.loggers import Logger
else:
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint
    from pytorch_lightning.loggers import Logger
from childio import emit  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

os.makedirs(args.run, exist_ok=True)
PROGRESS = os.path.join(args.run, "steps.log")
with open(PROGRESS, "a") as _f:
    _f.write("START\n")


class FileLogger(Logger):
    """Appends each log_metrics call as one JSON line (what a CSV / TensorBoard logger would get)."""

    def __init__(self, path):
        super().__init__()
        self.path = path

    @property
    def name(self):
        return "file"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *a, **k):
        pass

    def log_metrics(self, metrics, step=None):
        line = json.dumps({"step": step, "metrics": {k: float(v) for k, v in metrics.items()}})
        with open(self.path, "a") as f:
            f.write(line + "\n")


class Data(pl.LightningDataModule):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(args.n_train + 32, 8, generator=g)
        self.y = (self.x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(args.n_train + 32, 1, generator=g))

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x[:args.n_train], self.y[:args.n_train]), batch_size=args.batch_size,
                          shuffle=True, num_workers=args.workers, persistent_workers=args.workers > 0)

    def val_dataloader(self):
        return DataLoader(TensorDataset(self.x[args.n_train:], self.y[args.n_train:]), batch_size=16)


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.save_hyperparameters({"hidden": args.hidden, "mode": args.mode})
        self.body = torch.nn.Sequential(torch.nn.Linear(8, args.hidden), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                        torch.nn.Linear(args.hidden, 1))
        self.critic = torch.nn.Linear(8, 1)
        self.automatic_optimization = args.mode == "auto"

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.body(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        if self.automatic_optimization:
            return loss
        opt_a, opt_b = self.optimizers()
        opt_a.zero_grad()
        self.manual_backward(loss)
        opt_a.step()
        noise = torch.randn_like(y)  # a second model trained on its own objective, global RNG drawn
        loss_b = torch.nn.functional.mse_loss(self.critic(x) + 0.01 * noise, y)
        opt_b.zero_grad()
        self.manual_backward(loss_b)
        opt_b.step()
        self.log("critic_loss", loss_b, on_step=False, on_epoch=True)
        sched = self.lr_schedulers()
        sched.step()

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.body(x), y), prog_bar=True)

    def configure_optimizers(self):
        if self.automatic_optimization:
            # Lightning's documented recipe: the schedule's length from estimated_stepping_batches, which
            # builds the training loader here, before the loop state of a resume is restored
            opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2,
                                                        total_steps=self.trainer.estimated_stepping_batches)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        opt_a = torch.optim.Adam(self.body.parameters(), lr=3e-3)
        opt_b = torch.optim.SGD(self.critic.parameters(), lr=1e-2, momentum=0.9)
        return [opt_a, opt_b], [torch.optim.lr_scheduler.StepLR(opt_a, step_size=5, gamma=0.9)]


class PrintSteps(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        if args.native and trainer.global_step:
            emit(f"resuming run 'native' from last.ckpt: epoch {trainer.current_epoch}, step {trainer.global_step}")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with open(PROGRESS, "a") as f:  # how far each process got, whatever the parent read before its kill
            f.write(f"{trainer.global_step}\n")
        emit(f"STEP {trainer.global_step}")
        if args.sleep:
            time.sleep(args.sleep)


pl.seed_everything(42, verbose=False)
every_n = int(args.every) if args.every.isdigit() else None
callbacks = [PrintSteps(),
             EarlyStopping(monitor="val_loss", patience=3, min_delta=1e-4),
             ModelCheckpoint(dirpath=os.path.join(args.run, "best"), monitor="val_loss", save_top_k=1,
                             save_weights_only=True)]
ckpt = None
if args.native:
    callbacks.append(ModelCheckpoint(dirpath=os.path.join(args.run, "last"), save_last=True, save_top_k=0,
                                     every_n_train_steps=every_n or 0))
else:
    from keepalive.callbacks.lightning import DriveCheckpoint

    if args.control_drop_position:
        from keepalive.callbacks import _lightning_data

        _real_resume_at = _lightning_data.TrainData.resume_at
        _lightning_data.TrainData.resume_at = lambda self, starts, gens: _real_resume_at(self, None, None)

    options = {}
    if args.deadline_after:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
        from fakeclock import deadline_after

        # the session's remaining time, as the trigger asks it after each step: plenty, then nearly none
        options["remaining_fn"] = deadline_after(args.deadline_after)
    ckpt = DriveCheckpoint(os.path.join(args.run, "ka"), every=every_n or args.every, **options)
    ckpt.core.on_commit.append(lambda r: emit(f"COMMITTED {r.info.step}"))
    callbacks.append(ckpt)

logger = FileLogger(os.path.join(args.run, "metrics.jsonl"))
trainer = pl.Trainer(max_epochs=args.epochs, callbacks=callbacks, logger=logger,
                     accelerator="cpu", devices=1, enable_progress_bar=False, enable_model_summary=False,
                     val_check_interval=args.val_check, log_every_n_steps=1, num_sanity_val_steps=2,
                     default_root_dir=args.run, deterministic=True)
model, dm = Net(), Data()
trainer.fit(model, datamodule=dm, ckpt_path="last" if args.native else None)
if ckpt is not None and ckpt.stopped:
    print("STOPPED", flush=True)
    sys.exit(3)
state = {f"model.{k}": v.contiguous() for k, v in model.state_dict().items()}
for i, opt in enumerate(trainer.optimizers):
    for pid, s in opt.state_dict()["state"].items():
        for k, v in s.items():
            if isinstance(v, torch.Tensor):
                state[f"opt{i}.{pid}.{k}"] = v.contiguous().clone()
save_file(state, args.out)
with open(args.out + ".json", "w") as f:
    json.dump({"global_step": trainer.global_step, "epoch": trainer.current_epoch,
               "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
               "lr": [g["lr"] for opt in trainer.optimizers for g in opt.param_groups]}, f)
print("DONE", flush=True)
