"""A Lightning ``Trainer(strategy="ddp", devices=2)`` fit as Lightning users write it, checkpointed by
keepalive: ``torchrun --nproc_per_node=2 lightning_ddp.py RUN_DIR OUT_DIR`` (gloo, CPU). The child of
tests/test_lightning_ddp.py.

Lightning finds torchrun's environment (``TorchElasticEnvironment``), creates the process group itself
and gives each rank its shard of the shuffled data (``DistributedSampler``, ``set_epoch`` each epoch).
The dataset adds noise from the global RNG in ``__getitem__`` (each rank its own stream: the ranks are
seeded apart in ``on_fit_start``), the model has
dropout, validation also runs in the middle of each epoch, the LR schedule steps per step.

Each rank writes ``OUT_DIR/pid.<restart>.<rank>`` at start (tests/torchrunkit.py reads them) and
``OUT_DIR/final.<rank>.pt`` (its model's weights and optimizer state) at the end, Lightning's CSV
log (rank 0 writes it) to ``RUN_DIR-logs``; rank 0 prints
``COMMITTED n`` after each checkpoint commit, every rank ``DONE rank r step n`` at the end.

Environment (test knobs): LDDP_PLAIN=1 (the same fit without keepalive), LDDP_EPOCHS (3), LDDP_EVERY (3
optimizer steps), LDDP_KILL="rank:step:saved" (that rank waits until the checkpoint of step ``saved`` is
committed, prints ``KILL``, and SIGKILLs itself before training step ``step``), LDDP_SLOW_WRITE (seconds
each checkpoint file write takes: random kills land inside saves), LDDP_STEP_SLEEP (seconds per step),
LDDP_SIGTERM="rank:step" (that rank sends itself SIGTERM after that step), LDDP_ACCUMULATE
(``accumulate_grad_batches``, 1),
LDDP_STRATEGY=ddp_notebook (run as ``python lightning_ddp.py RUN OUT``: the notebook's launch, the two
processes forked from this one; it writes the model Lightning hands back, ``OUT_DIR/final.notebook.pt``),
LDDP_CONTROL=no-position (negative control: a resume ignores the saved data position and the loaders'
generators, as if keepalive did not capture them), LDDP_CONTROL=rank0-parts (negative control: every
rank resumes with rank 0's random state and data position, as if only rank 0's were saved).
"""
import os
import signal
import sys
import time

import lightning.pytorch as pl
import torch
from childio import emit, slow_writes, wait_committed
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader
from toydata import NoisyIndexed

N, DIM, CLASSES, BATCH = 96, 12, 3, 4  # 2 ranks: 12 batches of 4 per rank and epoch


def knob(name: str, default: float) -> float:
    return float(os.environ.get(name, default))




class Data(pl.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(NoisyIndexed(N, DIM, CLASSES, seed=3), batch_size=BATCH, shuffle=True)

    def val_dataloader(self):
        return DataLoader(NoisyIndexed(16, DIM, CLASSES, seed=5), batch_size=4)


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(DIM, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                        torch.nn.Linear(32, CLASSES))

    def on_fit_start(self):
        # the ranks' own random streams (dropout, the dataset's noise): Lightning's DDP setup seeds every
        # rank alike (seed_everything's seed again), so a per-rank seed goes here
        torch.manual_seed(1234 + self.global_rank)

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        loss = torch.nn.functional.cross_entropy(self.body(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y, _ = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self.body(x), y), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.8)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Steps(pl.Callback):
    """Prints each step; the kill knob."""

    def __init__(self, run_dir: str, kill):
        self.run_dir, self.kill = run_dir, kill

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        step = trainer.global_step + 1
        if self.kill and trainer.global_rank == self.kill[0] and step == self.kill[1]:
            wait_committed(self.run_dir, self.kill[2])
            emit(f"KILL rank {trainer.global_rank} before step {step}")
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank == 0:
            emit(f"STEP {trainer.global_step}")
        term = [int(v) for v in os.environ.get("LDDP_SIGTERM", "").split(":") if v]
        if term and trainer.global_rank == term[0] and trainer.global_step == term[1]:
            emit(f"SIGTERM rank {trainer.global_rank} after step {trainer.global_step}")
            os.kill(os.getpid(), signal.SIGTERM)
        sleep = knob("LDDP_STEP_SLEEP", 0.0)
        if sleep:
            time.sleep(sleep)


def main(run_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"pid.{restart}.{rank}"), "w") as f:
        f.write(str(os.getpid()))
    slow = knob("LDDP_SLOW_WRITE", 0.0)
    if slow:
        slow_writes(slow)

    pl.seed_everything(42, verbose=False)
    model = Net()  # the same initial weights on every rank
    kill = [int(v) for v in os.environ.get("LDDP_KILL", "").split(":") if v]
    callbacks = [Steps(run_dir, kill)]
    ckpt = None
    if not os.environ.get("LDDP_PLAIN"):
        from keepalive.callbacks.lightning import DriveCheckpoint

        if os.environ.get("LDDP_CONTROL") == "no-position":
            from keepalive.callbacks import _lightning_data

            real_resume_at = _lightning_data.TrainData.resume_at
            _lightning_data.TrainData.resume_at = lambda self, starts, gens: real_resume_at(self, None, None)
        if os.environ.get("LDDP_CONTROL") == "rank0-parts":
            import keepalive.distributed as kd

            real_localize = kd.localize
            kd.localize = lambda tree, rank, world: real_localize(tree, 0, world)
        ckpt = DriveCheckpoint(run_dir, every=int(knob("LDDP_EVERY", 3)), keep=None)
        if rank == 0:
            ckpt.core.on_commit.append(lambda r: emit(f"COMMITTED {r.info.step}"))
        callbacks.append(ckpt)
    strategy = os.environ.get("LDDP_STRATEGY", "ddp")
    trainer = pl.Trainer(max_epochs=int(knob("LDDP_EPOCHS", 3)), accelerator="cpu", devices=2,
                         strategy=strategy, callbacks=callbacks, logger=CSVLogger(run_dir + "-logs"),
                         log_every_n_steps=1, accumulate_grad_batches=int(knob("LDDP_ACCUMULATE", 1)),
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         val_check_interval=0.5, num_sanity_val_steps=0, default_root_dir=out_dir)
    trainer.fit(model, datamodule=Data())
    if strategy != "ddp":  # the processes forked from this one trained; the model came back from rank 0
        torch.save({f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()},
                   os.path.join(out_dir, "final.notebook.pt"))
        emit(f"DONE notebook step {trainer.global_step}")
        return
    final = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for pid, s in trainer.optimizers[0].state_dict()["state"].items():
        for k, v in s.items():
            if isinstance(v, torch.Tensor):
                final[f"opt.{pid}.{k}"] = v.detach().clone()
    torch.save(final, os.path.join(out_dir, f"final.{trainer.global_rank}.pt"))
    emit(f"DONE rank {trainer.global_rank} step {trainer.global_step}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
