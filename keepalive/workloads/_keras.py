"""The Keras side shared by the Keras workloads: seeding, threads, data order, checkpoint, timing.

Imported by a workload's ``run()`` only (it imports Keras). A workload module provides the data
(``load_data``), the model (``build_model``) and its constants; :func:`run_keras` trains it:

* the training data goes through :class:`keepalive.callbacks.keras.ResumableData`: each epoch's order
  is a function of (seed, epoch), so a resumed run sees exactly the batches an uninterrupted one
  would, and a checkpoint every N steps / minutes can resume inside an epoch;
* ``DriveCheckpoint(run_dir, every=...)`` saves and resumes everything else (weights, optimizer,
  RNGs, counters, History);
* a timing callback writes one record per epoch to ``results.json`` / ``results.csv``.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional

# TensorFlow reads its own variable at import: quiet its C++ start-up lines unless the user chose
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from . import common  # noqa: E402


def configure(threads: Optional[int] = None, deterministic: bool = False) -> None:
    """Thread counts and op determinism (before the first op runs: call it first)."""
    threads = common.threads_from_env(threads)
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        if threads:
            try:
                tf.config.threading.set_intra_op_parallelism_threads(threads)
                tf.config.threading.set_inter_op_parallelism_threads(threads)
            except RuntimeError:  # TensorFlow already initialised in this process
                pass
        if deterministic:
            tf.config.experimental.enable_op_determinism()
    elif backend == "torch":
        import torch

        if threads:
            torch.set_num_threads(threads)
        if deterministic:
            torch.use_deterministic_algorithms(True)


def device_facts() -> Dict[str, Any]:
    """The device this Keras backend computes on, and the framework versions."""
    backend = keras.backend.backend()
    versions = {"keras": keras.__version__, "backend": backend}
    device = "CPU"
    if backend == "tensorflow":
        import tensorflow as tf

        versions["tensorflow"] = tf.__version__
        gpus = tf.config.list_physical_devices("GPU")
        tpus = tf.config.list_physical_devices("TPU")
        if gpus:
            names = []
            for g in gpus:
                try:
                    names.append(tf.config.experimental.get_device_details(g).get("device_name") or g.name)
                except Exception:  # noqa: BLE001
                    names.append(g.name)
            device = "GPU: " + ", ".join(names)
        elif tpus:
            device = f"TPU ({len(tpus)} cores)"
    elif backend == "torch":
        import torch

        versions["torch"] = torch.__version__
        if torch.cuda.is_available():
            device = "GPU: " + torch.cuda.get_device_name(0)
    elif backend == "jax":
        import jax

        versions["jax"] = jax.__version__
        d = jax.devices()[0]
        device = d.platform.upper() + ("" if d.platform == "cpu" else f": {d.device_kind}")
    return {"device": device, "versions": versions}


def make_timer(recorder: common.RunRecorder, data: Any, on_step: Optional[common.StepHook] = None,
               ckpt: Any = None) -> keras.callbacks.Callback:
    """The callback that feeds the recorder and calls ``on_step(step)`` after each optimizer step."""

    class EpochTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.step = 0

        def on_train_begin(self, logs=None):
            self.step = ckpt.step if ckpt is not None else 0

        def on_epoch_begin(self, epoch, logs=None):
            start = ckpt.core.counters.get("batch", 0) if ckpt is not None else 0
            recorder.epoch_begin(epoch, start_batch=start)

        def on_train_batch_end(self, batch, logs=None):
            recorder.step(data.samples_in(data.start + int(batch)))
            self.step = ckpt.step if ckpt is not None else self.step + 1
            if on_step is not None:
                on_step(self.step)

        def on_epoch_end(self, epoch, logs=None):
            recorder.epoch_logs(logs)

        def on_train_end(self, logs=None):
            recorder.finish_epoch()  # after every epoch end, the last checkpoint included

    return EpochTimer()


def run_keras(spec: Any, run_dir: str, *, epochs: Optional[int] = None, synthetic: bool = False,
              size: Optional[str] = None, every: Any = "epoch", checkpoint: bool = True, keep: int = 3,
              seed: int = 0, deterministic: bool = False, threads: Optional[int] = None,
              on_step: Optional[common.StepHook] = None, on_commit: Optional[common.StepHook] = None,
              verbose: int = 0, quiet: bool = False, write_results: bool = True) -> Dict[str, Any]:
    """Train the Keras workload ``spec`` (its module) in ``run_dir``; the results document.

    Args:
        epochs: default the workload's ``EPOCHS``; a resumed run trains up to this many in all.
        synthetic, size: generated data of the real shapes; ``"tiny"`` / ``"small"`` / ``"full"``.
        every, keep: ``DriveCheckpoint``'s schedule (``"epoch"``, steps, ``"10min"``) and retention.
        checkpoint: False trains without checkpoints (timings only).
        seed: Keras' global seed (weights, dropout, the data order of a new run).
        deterministic: TensorFlow op determinism (torch backend: deterministic algorithms).
        threads: framework CPU threads (default: ``$KEEPALIVE_BENCH_THREADS``, else its own).
        on_step: called with the optimizer step count after every training step (training thread).
        on_commit: called with the step of each checkpoint once it is committed (writer thread).
        verbose: ``model.fit``'s verbosity; quiet: no per-epoch line.
        write_results: write ``results.json`` / ``results.csv`` in ``run_dir``.
    """
    from ..callbacks.keras import DriveCheckpoint, ResumableData

    size = common.resolve_size(synthetic, size)
    configure(threads, deterministic)
    keras.utils.set_random_seed(seed)
    data = spec.load_data(synthetic=synthetic, size=size)
    cfg = dict(data.get("config") or {})
    batch_size = int(cfg.pop("batch_size", spec.BATCH_SIZE))
    epochs = int(epochs if epochs is not None else spec.EPOCHS)
    model = spec.build_model(**cfg)
    model.compile(**spec.compile_args())
    x, y = data["x_train"], data["y_train"]
    train = ResumableData(x, y, batch_size=batch_size, shuffle=True)
    val = (data["x_test"], data["y_test"]) if data.get("x_test") is not None else None

    dev = device_facts()
    meta = _meta(spec, data, model, train, synthetic=synthetic, size=size, epochs=epochs, batch_size=batch_size,
                 seed=seed, every=every)
    facts = common.facts("keras", dev["device"], "fp32", dev["versions"])
    recorder = common.RunRecorder(run_dir, meta, facts, write=write_results)
    if quiet:
        recorder.printer = None
    callbacks = []
    ckpt = None
    if checkpoint:
        ckpt = DriveCheckpoint(run_dir, every=every, keep=keep, quiet=quiet)
        recorder.attach(ckpt.core)
        common.commit_hook(ckpt.core, on_commit)
        callbacks.append(ckpt)
    callbacks.append(make_timer(recorder, train, on_step, ckpt))
    callbacks += list(spec.extra_callbacks(data)) if hasattr(spec, "extra_callbacks") else []
    with recorder.training():
        model.fit(train, epochs=epochs, validation_data=val, validation_batch_size=batch_size,
                  callbacks=callbacks, verbose=verbose)
    completed = ckpt.finished if ckpt is not None else True
    final: Dict[str, Any] = {}
    if completed and hasattr(spec, "after_training"):
        final.update(spec.after_training(model, data, synthetic=synthetic) or {})
    return recorder.finish(final=final, completed=completed)



def _meta(spec: Any, data: Dict[str, Any], model: Any, train: Any, *, synthetic: bool, size: str, epochs: int,
          batch_size: int, seed: int, every: Any) -> Dict[str, Any]:
    """What the results file says about this run."""
    return {"workload": spec.NAME, "framework": "keras", "model": spec.MODEL, "dataset": spec.DATASET,
            "synthetic": bool(synthetic), "size": size, "epochs": epochs, "batch_size": batch_size,
            "steps_per_epoch": train.batches_per_epoch,
            "train_samples": int(data.get("train_samples") or train.order.n),
            "params": int(model.count_params()), "seed": seed, "every": str(every),
            "data_note": data.get("note", "")}

def one_hot(y: np.ndarray, n: int) -> np.ndarray:
    return keras.utils.to_categorical(y, n).astype("float32")


def mnist_style(dataset: str, n_train: int, n_test: int, size: str, synthetic: bool,
                seeds=(1, 2), num_classes: int = 10):
    """28x28 grey images with integer labels, ``(x_train, y_train, x_test, y_test, note)``: synthetic
    ones of the same shapes, or ``keras.datasets.<dataset>`` (cut to the size unless ``full``)."""
    if synthetic:
        x_train, y_train = common.synthetic_images(n_train, (28, 28), num_classes, seed=seeds[0])
        x_test, y_test = common.synthetic_images(n_test, (28, 28), num_classes, seed=seeds[1])
        label = "Fashion-MNIST" if dataset == "fashion_mnist" else "MNIST"
        return x_train, y_train, x_test, y_test, f"synthetic {label}-shaped data ({n_train} / {n_test})"
    (x_train, y_train), (x_test, y_test) = getattr(keras.datasets, dataset).load_data()
    x_train, y_train = common.subset(None if size == "full" else n_train, x_train, y_train)
    x_test, y_test = common.subset(None if size == "full" else n_test, x_test, y_test)
    return x_train, y_train, x_test, y_test, f"keras.datasets.{dataset}"
