"""``dogs_cats_resnet``: fastai's dogs-vs-cats ResNet-34 with mixed precision and test-time augmentation.

``ImageDataLoaders.from_folder`` (train / valid folders, ``Resize(224)``, ``aug_transforms()``,
batch 64; built as its DataBlock with the files sorted, see :func:`load_data`),
``vision_learner(dls, resnet34, metrics=error_rate)``, ``to_fp16()`` where the device allows it
(CUDA; on a CPU the run is fp32 and the results say so), ``fine_tune(6, freeze_epochs=1)`` (one
epoch with the body frozen, then six unfrozen: seven epochs in all), then ``learn.tta()`` for the
final error rate. ``DriveCheckpoint`` follows both fits of ``fine_tune``: a resumed run skips what was
done and continues inside the right fit, epoch and batch.

Real data: ``untar_data(URLs.DOGS)`` (fastai's ``dogscats``: 23,000 training and 2,000 validation
images, 800 MB), ImageNet-pretrained weights (``pretrained=True``, downloaded by torchvision).
Synthetic: a folder of generated PNG images in ``cats`` / ``dogs`` class folders (a colour and texture
per class plus noise), created once in the temp dir, and ``pretrained=False`` (no download); the
tiny size uses 32 px images and ResNet-18 (ResNet-34's checkpoints are twice as large for the same
test), small and full use ResNet-34.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Any, Dict, Optional, Tuple

from . import common

NAME = "dogs_cats_resnet"
FRAMEWORK = "fastai"
MODEL = "vision_learner(resnet34), fine_tune, to_fp16 (CUDA), TTA"
OPTIMIZER = "Adam, one-cycle (fine_tune base_lr 2e-3)"
DATASET = "dogs-vs-cats 23k/2k, 224 px"
EPOCHS = 6             # fine_tune's unfrozen epochs
FREEZE_EPOCHS = 1      # ... after this many with the pretrained body frozen
BATCH_SIZE = 64
IMAGE_SIZE = 224
NOTES = "1 frozen + 6 unfrozen epochs"
# synthetic images per class (train, valid), image size, batch size, architecture
SIZES = {
    "tiny": {"train": 16, "valid": 8, "px": 32, "bs": 8, "arch": "resnet18"},
    "small": {"train": 128, "valid": 32, "px": 64, "bs": 32, "arch": "resnet34"},
    "full": {"train": 11500, "valid": 1000, "px": 224, "bs": 64, "arch": "resnet34"},
}
CLASSES = ("cats", "dogs")
DATA_VERSION = 1


# ------------------------------------------------------------------------------------------ data
def synthetic_folder(size: str = "tiny", root: Optional[str] = None) -> str:
    """A folder ``train/{cats,dogs}`` + ``valid/{cats,dogs}`` of generated PNGs (made once, then
    reused; a function of ``size`` only). Default root: ``$TMPDIR/keepalive-bench-data``."""
    import numpy as np
    from PIL import Image

    cfg = common.pick(SIZES, size)
    root = root or os.path.join(tempfile.gettempdir(), "keepalive-bench-data")
    final = os.path.join(root, f"dogs_cats-{size}-v{DATA_VERSION}")
    if os.path.exists(os.path.join(final, "DONE")):
        return final
    os.makedirs(root, exist_ok=True)
    work = tempfile.mkdtemp(prefix=f".dogs_cats-{size}-", dir=root)
    px = cfg["px"]
    rs = np.random.RandomState(12)
    yy, xx = np.mgrid[0:px, 0:px].astype(np.float32) / px
    for split in ("train", "valid"):
        for ci, cls in enumerate(CLASSES):
            folder = os.path.join(work, split, cls)
            os.makedirs(folder)
            for i in range(cfg[split]):
                if ci == 0:  # "cats": warm colours, stripes
                    base = np.array([190, 120, 70], np.float32)
                    f = rs.uniform(3, 6)
                    pattern = np.sin(2 * np.pi * f * yy + rs.uniform(0, 6.3))
                else:        # "dogs": cool colours, blobs
                    base = np.array([80, 120, 180], np.float32)
                    cy, cx = rs.uniform(0.2, 0.8, size=2)
                    pattern = 2 * np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / 0.04) - 0.5
                img = base + 40 * pattern[..., None] + rs.normal(0, 35, (px, px, 3))
                Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(
                    os.path.join(folder, f"{cls[:-1]}.{i}.png"))
    with open(os.path.join(work, "DONE"), "w") as done:
        done.write(f"synthetic dogs-vs-cats, size {size}, version {DATA_VERSION}\n")
    try:
        os.rename(work, final)
    except OSError:  # made meanwhile by another process: use that one
        shutil.rmtree(work, ignore_errors=True)
    return final


def load_data(synthetic: bool = False, size: Optional[str] = None, *, workers: Optional[int] = None,
              bs: Optional[int] = None) -> Any:
    """fastai ``DataLoaders`` of the image folders (call :func:`fastai.torch_core.set_seed` first for
    a reproducible shuffle).

    What ``ImageDataLoaders.from_folder(path, train="train", valid="valid", item_tfms=Resize(px),
    batch_tfms=aug_transforms(), bs=bs)`` builds, with the image files sorted: the order a folder
    lists its files in depends on the file system, and after a reset the data is extracted again on
    a new VM - a resumed run must number the images as the first session did.
    """
    from fastai.vision.all import (
        CategoryBlock,
        DataBlock,
        GrandparentSplitter,
        ImageBlock,
        L,
        Resize,
        URLs,
        aug_transforms,
        get_image_files,
        parent_label,
        untar_data,
    )

    size = common.resolve_size(synthetic, size)
    cfg = common.pick(SIZES, size)
    if synthetic:
        path, px, bs = synthetic_folder(size), cfg["px"], bs or cfg["bs"]
        workers = 0 if workers is None else workers  # tiny images: worker processes cost more than they save
    else:
        path, px, bs = untar_data(URLs.DOGS), IMAGE_SIZE, bs or BATCH_SIZE

    def get_items(p):
        return L(sorted(get_image_files(p, folders=["train", "valid"]), key=str))

    dblock = DataBlock(blocks=(ImageBlock, CategoryBlock), get_items=get_items,
                       splitter=GrandparentSplitter(train_name="train", valid_name="valid"),
                       get_y=parent_label, item_tfms=Resize(px), batch_tfms=aug_transforms())
    kw = {} if workers is None else {"num_workers": workers}
    return dblock.dataloaders(path, path=path, bs=bs, **kw)


def build_model(dls: Any = None, arch: str = "resnet34", pretrained: bool = True, cbs: Any = None):
    """The ``Learner``: ``vision_learner(dls, resnet34, pretrained=..., metrics=error_rate)``."""
    from fastai.vision import models
    from fastai.vision.all import error_rate, vision_learner

    return vision_learner(dls, getattr(models, arch), pretrained=pretrained, metrics=error_rate, cbs=cbs)


def device_facts() -> Dict[str, Any]:
    import fastai
    import torch

    versions = {"fastai": fastai.__version__, "torch": torch.__version__}
    try:
        import torchvision

        versions["torchvision"] = torchvision.__version__
    except Exception:  # noqa: BLE001
        pass
    if torch.cuda.is_available():
        return {"device": "GPU: " + torch.cuda.get_device_name(0), "versions": versions, "fp16": True}
    return {"device": "CPU", "versions": versions, "fp16": False}


# ------------------------------------------------------------------------------------------- run
def _timer(recorder: common.RunRecorder, on_step: Optional[common.StepHook], ckpt: Any):
    from fastai.callback.core import Callback
    from fastai.torch_core import find_bs

    class EpochTimer(Callback):
        """Feeds the recorder; after the Recorder (order 50) so the epoch's logged values exist."""

        order = 60

        def __init__(self):
            self.offset = 0  # epochs of earlier fits (without a checkpointer to count them)

        def before_epoch(self):
            if ckpt is not None:
                epoch, start = ckpt.counters["epoch"], ckpt.counters.get("batch", 0)
            else:
                epoch, start = self.offset + self.learn.epoch, 0
            phase = "frozen" if getattr(self.learn.opt, "frozen_idx", 0) else "unfrozen"
            recorder.epoch_begin(epoch, start_batch=start, extra={"phase": phase})

        def after_batch(self):
            if self.learn.training:
                yb = self.learn.yb
                recorder.step(find_bs(yb) if len(yb) else find_bs(self.learn.xb))
                if ckpt is not None and on_step is not None:
                    on_step(ckpt.counters["step"] + 1)

        def after_epoch(self):
            rec = self.learn.recorder
            names = [str(n) for n in rec.metric_names]
            values = list(getattr(rec, "log", []))
            recorder.epoch_logs({n: v for n, v in zip(names, values) if n not in ("epoch", "time")})

        def after_fit(self):
            self.offset += self.learn.n_epoch

    return EpochTimer()


def run(dir: str, epochs: Optional[int] = None, synthetic: bool = False, size: Optional[str] = None, *,
        every: Any = "epoch", checkpoint: bool = True, keep: int = 3, seed: int = 0,
        deterministic: bool = False, threads: Optional[int] = None,
        on_step: Optional[common.StepHook] = None, on_commit: Optional[common.StepHook] = None,
        verbose: int = 0, quiet: bool = False, write_results: bool = True,
        pretrained: Optional[bool] = None, freeze_epochs: int = FREEZE_EPOCHS, workers: Optional[int] = None,
        fp16: Optional[bool] = None, tta: bool = True) -> Dict[str, Any]:
    """Train with checkpoints in ``dir`` (re-run to resume); per-epoch timings in ``dir/results.*``.

    ``epochs``: fine_tune's unfrozen epochs (default 6; ``freeze_epochs`` frozen ones come first).
    ``pretrained``: default True for real data, False for synthetic data (no download). ``fp16``:
    default: where CUDA is available. ``verbose``: 1 shows fastai's progress bars. ``on_step(step)``:
    called after every optimizer step of a checkpointed run; ``on_commit(step)``: once each checkpoint
    is committed (from the writer thread).
    """
    import torch
    from fastai.torch_core import set_seed

    from ..callbacks.fastai import DriveCheckpoint

    size = common.resolve_size(synthetic, size)
    cfg = common.pick(SIZES, size)
    threads = common.threads_from_env(threads)
    if threads:
        torch.set_num_threads(threads)
    if deterministic:
        torch.use_deterministic_algorithms(True)
    epochs = int(EPOCHS if epochs is None else epochs)
    pretrained = (not synthetic) if pretrained is None else pretrained
    arch = cfg["arch"] if synthetic else "resnet34"
    dev = device_facts()
    fp16, precision = _precision(fp16, dev["fp16"])

    set_seed(seed, reproducible=deterministic)
    dls = load_data(synthetic, size, workers=workers)
    learn = build_model(dls, arch=arch, pretrained=pretrained)
    if not verbose:
        _silence(learn)
    if fp16:
        learn.to_fp16()
    meta = _meta(dls, learn, cfg, synthetic=synthetic, size=size, epochs=epochs, freeze_epochs=freeze_epochs,
                 arch=arch, pretrained=pretrained, seed=seed, every=every)
    facts = common.facts("fastai", dev["device"], precision, dev["versions"])
    recorder = common.RunRecorder(dir, meta, facts, write=write_results)
    if quiet:
        recorder.printer = None
    cbs = []
    ckpt = None
    if checkpoint:
        ckpt = DriveCheckpoint(dir, every=every, keep=keep, quiet=quiet)
        recorder.attach(ckpt.core)
        common.commit_hook(ckpt.core, on_commit)
        cbs.append(ckpt)
    cbs.append(_timer(recorder, on_step, ckpt))
    with recorder.training():
        learn.fine_tune(epochs, freeze_epochs=freeze_epochs, cbs=cbs)
    recorder.finish_epoch()  # the last epoch ends after the end-of-fit checkpoint
    completed = True if ckpt is None else (ckpt.finished and not ckpt.stopped)
    final = _tta_metrics(learn, recorder) if completed and tta else {}
    return recorder.finish(final=final, completed=completed)


def _precision(wanted: Optional[bool], possible: bool) -> Tuple[bool, str]:
    """Whether to train in mixed precision (default: where CUDA is), and the results' word for it."""
    fp16 = possible if wanted is None else (wanted and possible)
    return fp16, "fp16 (mixed, to_fp16)" if fp16 else \
        ("fp32 (no CUDA device: to_fp16 skipped)" if not possible else "fp32")


def _silence(learn: Any) -> None:
    """No progress bars and no per-epoch print of the recorder."""
    from fastcore.basics import noop

    if hasattr(learn, "progress"):
        learn.remove_cb(learn.progress)
    learn.logger = noop  # the recorder's per-epoch print: the timing line says it all


def _meta(dls: Any, learn: Any, cfg: Dict[str, Any], *, synthetic: bool, size: str, epochs: int,
          freeze_epochs: int, arch: str, pretrained: bool, seed: int, every: Any) -> Dict[str, Any]:
    """What the results file says about this run."""
    n_train = len(dls.train_ds)
    return {"workload": NAME, "framework": "fastai", "model": f"vision_learner({arch})", "dataset": DATASET,
            "synthetic": bool(synthetic), "size": size, "epochs": freeze_epochs + epochs,
            "freeze_epochs": freeze_epochs, "batch_size": dls.train.bs, "steps_per_epoch": len(dls.train),
            "train_samples": n_train, "valid_samples": len(dls.valid_ds),
            "image_size": cfg["px"] if synthetic else IMAGE_SIZE, "arch": arch, "pretrained": pretrained,
            "params": int(sum(p.numel() for p in learn.model.parameters())), "seed": seed,
            "every": str(every),
            "data_note": (f"synthetic PNG folders ({n_train} train / {len(dls.valid_ds)} valid, "
                          f"{cfg['px']} px)" if synthetic else "untar_data(URLs.DOGS)")
            + ("; tiny size: resnet18 instead of resnet34" if synthetic and arch != "resnet34" else "")}


def _tta_metrics(learn: Any, recorder: common.RunRecorder) -> Dict[str, Any]:
    """The error rate of the trained model, with and without test-time augmentation."""
    from fastai.metrics import error_rate

    final: Dict[str, Any] = {}
    t0 = time.perf_counter()
    preds, targs = learn.tta()
    final["tta_error_rate"] = round(float(error_rate(preds, targs)), 6)
    final["tta_seconds"] = round(time.perf_counter() - t0, 3)
    valid = learn.validate()
    final["error_rate"] = round(float(valid[1]), 6)
    if recorder.printer is not None:
        recorder.printer(f"error rate {final['error_rate']:.4f}, with TTA {final['tta_error_rate']:.4f} "
                         f"({final['tta_seconds']:.1f} s)")
    return final
