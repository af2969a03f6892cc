"""A Lightning fit whose training loader keeps its workers (``persistent_workers=True``) and augments in them:
random flips and noise from torch's generator in ``__getitem__`` (2 workers), dropout in the main process,
AdamW; 6 batches an epoch, 4 epochs.

``python lightning_persistent.py RUN_DIR OUT [--plain] [--every N|epoch] [--kill-after STEP] [--control]
[--reload [N]] [--workers N] [--transient] [--plain-data] [--generator-loader] [--unread-control]``:
with ``--kill-after`` the process waits, at the first batch end past that step, until the checkpoint of
that step is committed and SIGKILLs itself; a re-run without it resumes. ``--plain``: the same fit
without keepalive. ``--control``: a resume does not take the workers' seed and states from the
checkpoint (keepalive's former behaviour: new workers go on from their own). ``--reload [N]``:
``Trainer(reload_dataloaders_every_n_epochs=N)`` (1); ``--workers N`` (default 2), ``--transient``
(``persistent_workers=False``), ``--plain-data`` (no augmentation), ``--generator-loader`` (a subclass whose
``__iter__`` is a generator): the loader's settings.
``--unread-control``: a fit resumed at an epoch's start does not make the ``iter()`` that Lightning makes
and discards there on a reloaded loader (keepalive's former behaviour; the tests' control). OUT gets the
final weights and every step's loss (``step`` -> value; a re-run's lines replace those of the steps it ran
again).
"""
import argparse
import json
import os
import signal
import sys

import torch

torch.set_num_threads(1)
import lightning.pytorch as pl  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from childio import wait_committed  # noqa: E402

N, BATCH, WORKERS, EPOCHS = 48, 8, 2, 4
#: the loader's settings (--workers, --transient, --plain-data)
LOADER = {"num_workers": WORKERS, "persistent_workers": True, "augment": True, "generator": False}


class Augmented(Dataset):
    """Each fetch flips and adds noise from torch's generator (in the worker that fetches it)."""

    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(N, 6, generator=g)
        self.y = self.x.sum(1, keepdim=True)

    def __len__(self):
        return N

    def __getitem__(self, i):
        if not LOADER["augment"]:
            return self.x[i], self.y[i]
        x = self.x[i].flip(0) if torch.rand(()) < 0.5 else self.x[i]
        return x + 0.1 * torch.randn_like(x), self.y[i]


class GeneratorLoader(DataLoader):
    """A DataLoader subclass whose ``__iter__`` is a generator: it makes its iterator at the first ``next()``."""

    def __iter__(self):
        yield from super().__iter__()


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        workers = LOADER["num_workers"]
        cls = GeneratorLoader if LOADER["generator"] else DataLoader
        return cls(Augmented(), batch_size=BATCH, shuffle=True, num_workers=workers,
                          persistent_workers=bool(workers and LOADER["persistent_workers"]))


class Log(pl.Callback):
    """Notes each step's loss; with ``--kill-after``, kills the process once that step's checkpoint is in."""

    def __init__(self, out, run, kill_after):
        self.path, self.run, self.kill_after = out + ".log", run, kill_after
        self.losses = {}
        if os.path.exists(self.path):
            with open(self.path) as f:
                self.losses = json.load(f)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses[str(trainer.global_step)] = float(outputs["loss"])
        with open(self.path, "w") as f:
            json.dump(self.losses, f)
        if self.kill_after and trainer.global_step > self.kill_after:
            wait_committed(self.run, self.kill_after)
            os.kill(os.getpid(), signal.SIGKILL)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("out")
    ap.add_argument("--plain", action="store_true")
    ap.add_argument("--every", default="epoch")
    ap.add_argument("--kill-after", type=int, default=0)
    ap.add_argument("--control", action="store_true")
    ap.add_argument("--reload", type=int, nargs="?", const=1, default=0,
                    help="Trainer(reload_dataloaders_every_n_epochs=N) (N: 1 when not given)")
    ap.add_argument("--workers", type=int, default=WORKERS)
    ap.add_argument("--transient", action="store_true", help="persistent_workers=False")
    ap.add_argument("--plain-data", action="store_true", help="no augmentation in the dataset")
    ap.add_argument("--generator-loader", action="store_true", help="a DataLoader subclass, __iter__ a generator")
    ap.add_argument("--unread-control", action="store_true",
                    help="a fit resumed at an epoch's start skips the iter() Lightning discards (as before)")
    args = ap.parse_args()
    LOADER.update(num_workers=args.workers, persistent_workers=not args.transient, augment=not args.plain_data,
                  generator=args.generator_loader)
    pl.seed_everything(3, verbose=False)
    callbacks = [Log(args.out, args.run, args.kill_after)]
    if not args.plain:
        from keepalive.callbacks.lightning import DriveCheckpoint

        if args.control:
            from keepalive.callbacks import _lightning_data

            _lightning_data._Replay.load_persistent = lambda self, saved: None
        if args.unread_control:
            from keepalive.callbacks import _lightning_data

            _lightning_data.TrainData.iterate_unread = lambda self: None
        callbacks.append(DriveCheckpoint(args.run, every=int(args.every) if args.every.isdigit() else args.every))
    trainer = pl.Trainer(max_epochs=EPOCHS, callbacks=callbacks, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
                         num_sanity_val_steps=0, reload_dataloaders_every_n_epochs=int(args.reload))
    model = Net()
    trainer.fit(model)
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, args.out)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
