"""Transparency audit of every look keepalive takes into the user's data code, per adapter.

For each adapter -- a plain torch loop, the HF Trainer, Lightning, fastai, Keras on each backend
installed (JAX, torch, TensorFlow) -- a short training whose dataset augments with every global
generator runs without keepalive and with it (saving inside epochs where the adapter can; the plain
loop also over a stream). Each call of the dataset's ``__getitem__`` / ``__len__`` (``__iter__`` and
each item for a stream) and of the collate function
is noted with the state of Python's, NumPy's and torch's global generators at that moment
(tests/scripts/probe_audit.py). Asserted: the same calls, in the same order, each seeing the same
random state, and bit-identical weights. Documented exceptions, each drawing nothing: a plain torch
loop asks ``len()`` of the dataset once per epoch and of the loader once per ``ckpt.batches()`` pass
(never per step); Keras looks at one ``PyDataset`` batch when a fit starts, to build the model and
its compiled metrics before a checkpoint loads into them (one more ``__getitem__``, the generators
put back: tests/test_keras_transparency.py), and asks its ``len()`` once. Control: a probe that draws
once from the generators (the mistake this audit exists to catch) is seen.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
for _name in ("torchvision::nms", "torchvision::qnms"):  # the CUDA torchvision here (DESIGN.md)
    try:
        torch.library.define(_name, "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    except Exception:  # noqa: BLE001 - already defined
        pass

from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "scripts"))

from probe_audit import Probe, augment, first_difference  # noqa: E402  (tests/scripts/probe_audit.py)


class Counted(Dataset):
    """A map-style dataset that augments with every global generator and notes each call."""

    def __init__(self, probe: Probe, n: int = 24, dict_items: bool = False):
        g = torch.Generator().manual_seed(7)
        self.x, self.y = torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g)
        self.probe, self.dict_items = probe, dict_items

    def __len__(self):
        self.probe.note("__len__")
        return len(self.x)

    def __getitem__(self, i):
        self.probe.note("__getitem__")
        x = self.x[i] + augment()
        return {"x": x, "labels": self.y[i]} if self.dict_items else (x, self.y[i])


class CountedStream(IterableDataset):
    """A stream (no length) that augments each item with every global generator and notes each call."""

    def __init__(self, probe: Probe, n: int = 24):
        self.probe, self.n = probe, n

    def __iter__(self):
        self.probe.note("__iter__")
        g = torch.Generator().manual_seed(7)
        for _ in range(self.n):
            self.probe.note("item")
            yield torch.randn(4, generator=g) + augment(), torch.randn(2, generator=g)


def _seed(seed: int = 0) -> None:
    import random

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 2))


def _weights(model: torch.nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(without, with_, extra_len: int = 0):
    """Asserts two ``(probe, weights)`` results are the same training, naming where they part.
    ``extra_len``: the documented ``__len__`` calls keepalive adds at most (a length asked draws
    nothing: the other calls must still see the same random states, in the same order; where
    keepalive's own sampler stands in for the framework's, it may ask fewer)."""
    (p0, w0), (p1, w1) = without, with_
    c0, c1 = p0.counts(), p1.counts()
    assert c1.pop("__len__", 0) <= c0.pop("__len__", 0) + extra_len and c0 == c1, (p0.counts(), p1.counts())
    e0, e1 = ([e for e in p.events if e[0] != "__len__"] for p in (p0, p1))
    assert first_difference(e0, e1) is None, first_difference(e0, e1)
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0), "the weights differ"


# ------------------------------------------------------------------------------------ plain torch
def _torch_run(path=None, every=3, probe_hook=None, stream=False):
    _seed()
    probe = Probe()
    data = CountedStream(probe) if stream else Counted(probe)
    loader = DataLoader(data, batch_size=4, shuffle=not stream, collate_fn=probe.collate(default_collate))
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    epochs, batches = range(2), iter
    if path is not None:
        from keepalive.callbacks.torch import DriveCheckpoint

        ckpt = DriveCheckpoint(path, model=model, optimizer=opt, every=every, quiet=True)
        epochs, batches = ckpt.epochs(2), ckpt.batches
    for _ in epochs:
        for x, y in batches(loader):
            if probe_hook is not None:
                probe_hook()
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            probe.note("step")
    if path is not None:
        ckpt.close()
    return probe, _weights(model)


def test_torch_loop(tmp_path):
    """Documented: per epoch, one len(dataset) (which dataset a position belongs to) and one
    len(loader) per ckpt.batches() pass (whether it reached its end), never one per step."""
    without = _torch_run()
    _same(without, _torch_run(tmp_path / "run"), extra_len=2 * 2)
    _same(without, _torch_run(tmp_path / "epochs", every="epoch"), extra_len=2 * 2)


def test_torch_loop_over_a_stream(tmp_path):
    """An IterableDataset: one __iter__ per epoch and its items, as without keepalive."""
    _same(_torch_run(stream=True), _torch_run(tmp_path / "run", stream=True))


def test_control_a_probe_that_draws_is_seen(tmp_path):
    """The audit can fail: one draw from the global generator inside the training shows up."""
    drawn = []
    without = _torch_run()
    got = _torch_run(probe_hook=lambda: drawn or drawn.append(torch.rand(())))
    assert first_difference(without[0].events, got[0].events) is not None


# ------------------------------------------------------------------------------------ HF Trainer
class _HFNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = _net()

    def forward(self, x, labels=None):
        out = self.net(x)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


def _hf_run(tmp_path, name, with_keepalive):
    transformers = pytest.importorskip("transformers")
    _seed()
    probe = Probe()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / f"out-{name}"), per_device_train_batch_size=4, num_train_epochs=2,
        learning_rate=0.05, save_strategy="no", report_to=[], use_cpu=True, seed=0, logging_steps=100,
        disable_tqdm=True, remove_unused_columns=False, dataloader_num_workers=0)
    callbacks = []
    if with_keepalive:
        from keepalive.callbacks.transformers import DriveCheckpoint

        callbacks.append(DriveCheckpoint(tmp_path / name, every=3, quiet=True))
    model = _HFNet()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Counted(probe, dict_items=True),
                                   data_collator=probe.collate(default_collate), callbacks=callbacks)
    trainer.train()
    return probe, _weights(model)


def test_hf_trainer(tmp_path):
    _same(_hf_run(tmp_path, "plain", False), _hf_run(tmp_path, "run", True))


# ------------------------------------------------------------------------------------- Lightning
def _lightning_run(tmp_path, name, with_keepalive):
    pl = pytest.importorskip("lightning.pytorch")
    _seed()
    probe = Probe()

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _net()

        def training_step(self, batch, batch_idx):
            probe.note("step")
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return DataLoader(Counted(probe), batch_size=4, shuffle=True,
                              collate_fn=probe.collate(default_collate))

    callbacks = []
    if with_keepalive:
        from keepalive.callbacks.lightning import DriveCheckpoint

        callbacks.append(DriveCheckpoint(tmp_path / name, every=3, quiet=True))
    module = Module()
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                         default_root_dir=str(tmp_path / f"root-{name}"))
    trainer.fit(module)
    return probe, _weights(module)


def test_lightning(tmp_path):
    _same(_lightning_run(tmp_path, "plain", False), _lightning_run(tmp_path, "run", True))


# ---------------------------------------------------------------------------------------- fastai
def _fastai_run(tmp_path, name, with_keepalive, plain_items):
    pytest.importorskip("fastai")
    import fastai.callback.schedule  # noqa: F401 - Learner.fit_one_cycle
    from fastai_setup import NoisyImages, PlainNoisyImages, make_learner  # tests/scripts/fastai_setup.py

    probe = Probe()
    base = PlainNoisyImages if plain_items else NoisyImages

    class CountedImages(base):  # type: ignore[misc, valid-type]
        def __len__(self):
            probe.note("__len__")
            return super().__len__()

        def __getitem__(self, i):
            probe.note("__getitem__")
            return super().__getitem__(i)

    cbs = []
    if with_keepalive:
        from keepalive.callbacks.fastai import DriveCheckpoint

        cbs.append(DriveCheckpoint(tmp_path / name, every=2, quiet=True))
    learn = make_learner(n_train=48, n_valid=16, bs=16, dataset=CountedImages)
    learn.logger = lambda *a, **k: None
    learn.fit_one_cycle(2, 1e-2, cbs=cbs)
    return probe, _weights(learn.model)


@pytest.mark.parametrize("plain_items", [False, True], ids=["n_inp", "layout-looked-up"])
def test_fastai(tmp_path, plain_items):
    _same(_fastai_run(tmp_path, "plain", False, plain_items), _fastai_run(tmp_path, "run", True, plain_items))


# ----------------------------------------------------------------------------------------- Keras
KERAS_CHILD = os.path.join(HERE, "scripts", "probe_audit_keras.py")


@pytest.mark.parametrize("backend", ["jax", "torch", "tensorflow"])
def test_keras(tmp_path, backend):
    pytest.importorskip("keras")
    pytest.importorskip(backend)
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3", KEEPALIVE_PROGRESS="0",
               JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, KERAS_CHILD, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["weights_equal"], got
    for shape, result in got["shapes"].items():
        # documented: one look at a PyDataset batch (the generators put back) to build the model and its
        # compiled metrics before a checkpoint loads into them, and one len() when the fit starts
        assert result["difference"] is None or result["peek"], (shape, result)
        assert result["extra_len"] <= 1, (shape, result)
