"""A Lightning fit that logs to a ``CSVLogger`` (rows flushed every 4 logging steps), for the CSV-log crash
test: a tiny MLP with dropout over synthetic tensors, shuffled, 3 epochs of 12 batches, validation at
each epoch end. Prints ``STEP n`` after each training batch and ``COMMITTED n`` after each keepalive commit;
at the end writes the weights (safetensors).

``--mode keepalive`` (default): ``DriveCheckpoint(<root>/ka, every=--every)``; ``--mode plain``: without it.
``--control-new-version``: the negative control: a resume does not point the CSV logger back at the run's
version (what keepalive did before it kept the logger's place).
"""
import argparse
import os

p = argparse.ArgumentParser()
p.add_argument("root")
p.add_argument("--out", required=True)
p.add_argument("--mode", default="keepalive", choices=["keepalive", "plain"])
p.add_argument("--every", default="5")
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--control-new-version", action="store_true")
args = p.parse_args()

import time  # noqa: E402

import torch  # noqa: E402

torch.set_num_threads(1)
import lightning.pytorch as pl  # noqa: E402
from childio import emit  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

g = torch.Generator().manual_seed(5)
X = torch.randn(128, 6, generator=g)
Y = X @ torch.randn(6, 1, generator=g)


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                        torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.body(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.body(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class PrintSteps(pl.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        emit(f"STEP {trainer.global_step}")
        if args.sleep:
            time.sleep(args.sleep)


pl.seed_everything(3, verbose=False)
callbacks = [PrintSteps()]
if args.mode == "keepalive":
    from keepalive.callbacks.lightning import DriveCheckpoint

    if args.control_new_version:
        from keepalive.callbacks import _lightning_state

        _lightning_state.restore_csv = lambda trainer, saved, warn: None
    ckpt = DriveCheckpoint(os.path.join(args.root, "ka"), every=int(args.every))
    ckpt.core.on_commit.append(lambda r: emit(f"COMMITTED {r.info.step}"))
    callbacks.append(ckpt)
logger = CSVLogger(args.root, name="logs", flush_logs_every_n_steps=4)
trainer = pl.Trainer(max_epochs=args.epochs, callbacks=callbacks, logger=logger, accelerator="cpu", devices=1,
                     enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                     num_sanity_val_steps=0, deterministic=True)
model = Net()
trainer.fit(model, DataLoader(TensorDataset(X[:96], Y[:96]), batch_size=8, shuffle=True),
            DataLoader(TensorDataset(X[96:], Y[96:]), batch_size=16))
save_file({k: v.contiguous() for k, v in model.state_dict().items()}, args.out)
print("DONE", flush=True)
