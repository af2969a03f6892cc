"""The Lightning adapter iterates the user's training loaders as they are, and resumes inside an epoch by
replaying their own randomness (``keepalive.callbacks._lightning_data``):

* transparency: a fit with keepalive (no interruption) ends bit-identical to the same fit without it
  (``shuffle=True``, 0 and 2 workers with random augmentation in the dataset, dropout, the OneCycleLR
  recipe reading ``trainer.estimated_stepping_batches`` with a sanity check in between); its negative
  control: one extra draw from the global RNG before the fit's first batch (the sampler's seed) is caught;
* loader shapes (``shuffle=True`` with 0 / 2 workers and augmentation, a custom sampler with its own
  generator, ``batch_sampler=`` (custom and over a ``RandomSampler``), ``WeightedRandomSampler``,
  ``generator=``, torchdata's ``StatefulDataLoader``, a dict of two loaders; persistent workers): a fit
  stopped inside an epoch (the deadline stop) and resumed in the same process ends bit-identical to an
  uninterrupted one;
* a sampler whose order does not replay stays at epoch ends, said once.

In-process (no subprocess import cost); the SIGKILL crash tests are in test_lightning.py."""
import contextlib
import importlib.util
import os
import random

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _load_torchvision_shim():
    spec = importlib.util.spec_from_file_location("_keepalive_tv_shim", os.path.join(HERE, "shims", "sitecustomize.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


torch = pytest.importorskip("torch")
_load_torchvision_shim()
pl = pytest.importorskip("lightning.pytorch")
from torch.utils.data import BatchSampler, DataLoader, Dataset, Sampler, TensorDataset, WeightedRandomSampler  # noqa: E402

from crashkit import assert_differs, assert_same  # noqa: E402
from fakeclock import deadline_after  # noqa: E402
from keepalive.callbacks.lightning import DriveCheckpoint  # noqa: E402

N, BS = 48, 8  # 6 batches per epoch


class Augmented(Dataset):
    """Random augmentation in ``__getitem__`` (the global torch RNG: per worker with workers)."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.randn(self.x.shape[1]), self.y[i]


class OwnRngSampler(Sampler):
    """A custom sampler with its own numpy generator (replayed from its recorded state)."""

    def __init__(self, n, seed=7):
        import numpy as np

        self.n, self.rng = n, np.random.default_rng(seed)

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter(self.rng.permutation(self.n).tolist())


class ChunkBatches(Sampler):
    """A custom batch sampler: shuffled chunks drawn from the global torch RNG."""

    def __init__(self, n, bs):
        self.n, self.bs = n, bs

    def __len__(self):
        return self.n // self.bs

    def __iter__(self):
        order = torch.randperm(self.n).tolist()
        for k in range(len(self)):
            yield order[k * self.bs:(k + 1) * self.bs]


class Unreplayable(Sampler):
    """Draws from a source keepalive cannot save (a fresh python Random seeded by the OS)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter(random.Random().sample(range(self.n), self.n))


class GeneratorLoader(DataLoader):
    """A DataLoader subclass whose ``__iter__`` is a generator: it iterates after ``iter()`` returned."""

    def __iter__(self):
        yield from super().__iter__()


class Data(pl.LightningDataModule):
    def __init__(self, shape="shuffle", workers=0, persistent=False):
        super().__init__()
        self.persistent = persistent
        g = torch.Generator().manual_seed(5)
        self.x, self.y = torch.randn(N + 16, 4, generator=g), torch.randn(N + 16, 1, generator=g)
        self.shape, self.workers = shape, workers

    def train_dataloader(self):
        ds = Augmented(self.x[:N], self.y[:N]) if self.shape != "plain" else TensorDataset(self.x[:N], self.y[:N])
        kw = dict(num_workers=self.workers, persistent_workers=self.persistent)
        if self.shape in ("shuffle", "plain"):
            return DataLoader(ds, batch_size=BS, shuffle=True, **kw)
        if self.shape == "custom_sampler":
            return DataLoader(ds, batch_size=BS, sampler=OwnRngSampler(N), **kw)
        if self.shape == "batch_sampler":
            return DataLoader(ds, batch_sampler=ChunkBatches(N, BS), **kw)
        if self.shape == "batch_sampler_of_random":
            return DataLoader(ds, batch_sampler=BatchSampler(torch.utils.data.RandomSampler(ds), BS, False), **kw)
        if self.shape == "weighted":
            weights = torch.linspace(0.1, 1.0, N)
            return DataLoader(ds, batch_size=BS, sampler=WeightedRandomSampler(weights, N), **kw)
        if self.shape == "generator":
            return DataLoader(ds, batch_size=BS, shuffle=True, generator=torch.Generator().manual_seed(11), **kw)
        if self.shape == "stateful":
            stateful = pytest.importorskip("torchdata.stateful_dataloader")
            return stateful.StatefulDataLoader(ds, batch_size=BS, shuffle=True, **kw)
        if self.shape == "two_loaders":  # a dict of loaders (Lightning's CombinedLoader, max_size_cycle)
            return {"a": DataLoader(ds, batch_size=BS, shuffle=True, **kw),
                    "b": DataLoader(ds, batch_size=BS // 2, sampler=OwnRngSampler(N), **kw)}
        if self.shape == "generator_subclass":
            return GeneratorLoader(ds, batch_size=BS, shuffle=True, **kw)
        if self.shape == "unreplayable":
            return DataLoader(ds, batch_size=BS, sampler=Unreplayable(N), **kw)
        raise ValueError(self.shape)

    def val_dataloader(self):
        return DataLoader(TensorDataset(self.x[N:], self.y[N:]), batch_size=8)


class Net(pl.LightningModule):
    """Dropout, AdamW + OneCycleLR over ``trainer.estimated_stepping_batches`` (Lightning's recipe: the
    training loader is built inside ``configure_optimizers``, before the loop state is restored)."""

    def __init__(self, extra_draw=False):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
        self.extra_draw = extra_draw

    def on_train_start(self):
        if self.extra_draw:  # the negative control: the sampler's seed moves by one draw
            torch.rand(1)

    def training_step(self, batch, batch_idx):
        if isinstance(batch, dict):
            batch = [torch.cat([batch["a"][0], batch["b"][0]]), torch.cat([batch["a"][1], batch["b"][1]])]
        loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.log("loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-2,
                                                    total_steps=self.trainer.estimated_stepping_batches)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def fit(path=None, shape="shuffle", workers=0, epochs=3, extra_draw=False, persistent=False, stops=False,
        **options):
    """One fit (a keepalive run at ``path``, or without keepalive); its final weights and the trainer.
    ``stops``: stopped before its end, which exits a script with 143 (EXIT_STOPPED)."""
    pl.seed_everything(3, verbose=False)
    model = Net(extra_draw)
    callbacks = [DriveCheckpoint(str(path), quiet=True, **options)] if path is not None else []
    trainer = pl.Trainer(max_epochs=epochs, callbacks=callbacks, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                         num_sanity_val_steps=1, val_check_interval=0.5)
    with pytest.raises(SystemExit, match="^143$") if stops else contextlib.nullcontext():
        trainer.fit(model, datamodule=Data(shape, workers, persistent))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    return weights, trainer, (callbacks[0] if callbacks else None)


@pytest.mark.parametrize("workers", [0, 2])
def test_keepalive_trains_on_the_same_data_as_lightning_alone(tmp_path, workers):
    plain, _, _ = fit(None, workers=workers)
    kept, _, cb = fit(tmp_path / "run", workers=workers, every=2)
    assert cb.finished and cb.why_not is None
    assert_same(plain, kept, "weights with keepalive vs without")
    # the control: one more draw from the global RNG before the first batch (another sampler seed,
    # another dropout stream) is caught by the same comparison
    moved, _, _ = fit(None, workers=workers, extra_draw=True)
    assert_differs(plain, moved)


def _stop_then_resume(tmp_path, shape, workers=0, stop_after=8, extra_draw=False):
    """Stopped by the deadline after ``stop_after`` steps (8: inside epoch 1 of 6-batch epochs), then
    the same fit again in this process: it resumes from the mid-epoch checkpoint."""
    _, t1, cb1 = fit(tmp_path / "run", shape, workers, extra_draw=extra_draw, every=2,
                     remaining_fn=deadline_after(stop_after), stops=True)
    assert cb1.stopped and t1.global_step % 6, t1.global_step  # inside an epoch
    resumed, t2, cb2 = fit(tmp_path / "run", shape, workers, extra_draw=extra_draw, every=2)
    assert cb2.core.resumed_from is not None and cb2.finished
    return resumed, t2, cb2


@pytest.mark.parametrize("shape,workers,stop_after,extra_draw", [
    ("shuffle", 0, 8, False), ("shuffle", 2, 8, False), ("custom_sampler", 0, 8, False),
    ("batch_sampler", 0, 8, False), ("batch_sampler_of_random", 0, 8, False), ("weighted", 2, 8, False),
    ("generator", 0, 8, False), ("stateful", 0, 8, False), ("two_loaders", 0, 8, False),
    # inside epoch 0, whose iterator configure_optimizers created before on_train_start drew a random
    # number: the sampler's seed is drawn at the first batch, from the state after that draw
    ("shuffle", 0, 3, True)])
def test_mid_epoch_resume_is_exact_for_each_loader_shape(tmp_path, shape, workers, stop_after, extra_draw):
    ref, ref_trainer, _ = fit(None, shape, workers, extra_draw=extra_draw)
    resumed, trainer, cb = _stop_then_resume(tmp_path, shape, workers, stop_after, extra_draw)
    assert cb.why_not is None
    assert trainer.global_step == ref_trainer.global_step == (36 if shape == "two_loaders" else 18)
    assert_same(ref, resumed, f"{shape} with {workers} workers: resumed vs uninterrupted")
    assert {k: float(v) for k, v in trainer.callback_metrics.items()} == \
        {k: float(v) for k, v in ref_trainer.callback_metrics.items()}


@pytest.mark.parametrize("every", [2, "epoch"])
def test_persistent_workers_resume_exactly_or_are_told(tmp_path, capsys, every):
    """``persistent_workers=True``: an epoch after the first resets the running iterator (no workers'
    base seed drawn); a resume creates one: exact (mid-epoch and at an epoch end) when the workers draw
    nothing; when they do (augmentation), the checkpoint carries their seed and states, and nothing is
    said (the SIGKILL tests of that case: test_lightning_persistent.py)."""
    ref, _, _ = fit(None, "plain", 2, persistent=True)
    _, t1, cb1 = fit(tmp_path / "run", "plain", 2, persistent=True, every=every, remaining_fn=deadline_after(8),
                     stops=True)
    if every == "epoch":  # resume from the end of epoch 0 (the deadline's mid-epoch checkpoint dropped)
        for info in cb1.core.store.list():
            if info.step % 6:
                cb1.core.store.remove(info)
    resumed, _, cb = fit(tmp_path / "run", "plain", 2, persistent=True, every=every)
    assert cb.core.resumed_from is not None and cb.core.resumed_from.step == (8 if every == 2 else 6)
    assert_same(ref, resumed, "persistent workers: resumed vs uninterrupted")
    capsys.readouterr()
    fit(tmp_path / "aug", "shuffle", 2, persistent=True, every=every, epochs=1)
    out = capsys.readouterr()
    assert "persistent_workers=False" not in out.out + out.err, out.out + out.err


def test_mid_epoch_resume_control_position_dropped(tmp_path, monkeypatch):
    """The control of the shape tests: a resume whose saved position is not applied (the epoch's
    first iteration made afresh: the bug of a loader built before the loop state is restored) differs."""
    from keepalive.callbacks import _lightning_data

    ref, _, _ = fit(None)
    real = _lightning_data.TrainData.resume_at
    monkeypatch.setattr(_lightning_data.TrainData, "resume_at", lambda self, starts, gens: real(self, None, None))
    resumed, _, _ = _stop_then_resume(tmp_path, "shuffle")
    assert_differs(ref, resumed)


@pytest.mark.parametrize("shape,said", [("unreplayable", "Unreplayable"), ("generator_subclass", "GeneratorLoader")])
def test_unpositionable_loaders_save_at_epoch_ends_only(tmp_path, capsys, shape, said):
    """A sampler whose order does not replay (found when the callback starts), a subclass iterating
    outside its batch sampler (found at its first iteration): epoch ends only, said once."""
    _, _, cb = fit(tmp_path / "run", shape, every=2)
    out = capsys.readouterr()
    assert (out.out + out.err).count(said) == 1 and cb.why_not
    steps = sorted(info.step for info in cb.core.store.list())
    assert steps and all(s % 6 == 0 for s in steps), steps
