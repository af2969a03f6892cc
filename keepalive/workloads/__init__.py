"""The benchmark trainings people run on Colab / Kaggle, ported to Keras 3 / fastai 2, each wrapped
in :class:`DriveCheckpoint` so that a run of many hours survives disconnects and session limits.

Six Keras workloads of the well-known CPU-vs-GPU benchmark set (the Keras examples ``mnist_mlp``,
``mnist_cnn``, ``cifar10_cnn``, ``imdb_fasttext``, ``imdb_bidirectional_lstm``,
``lstm_text_generation``), the Colab Fashion-MNIST CNN (``fashion_mnist_cnn``) and fastai's
dogs-vs-cats ResNet with mixed precision and test-time augmentation (``dogs_cats_resnet``).

>>> from keepalive import workloads
>>> workloads.names()[:2]
['mnist_mlp', 'mnist_cnn']
>>> results = workloads.run("mnist_mlp", "/content/drive/MyDrive/bench/mnist_mlp")  # doctest: +SKIP

Each module has ``EPOCHS``, ``BATCH_SIZE``, ``FRAMEWORK``, ``MODEL``, ``DATASET``, ``build_model()``,
``load_data(synthetic, size)`` and ``run(dir, epochs=None, synthetic=False, size=None, ...)``;
``run`` trains with checkpoints in ``dir`` (re-running it after a crash resumes) and writes the
per-epoch timings to ``dir/results.json`` and ``dir/results.csv``. ``synthetic=True`` trains on
generated data of the same shapes and dtypes (no download); ``size`` is ``"tiny"`` (seconds, for
tests), ``"small"`` (benchmarks) or ``"full"`` (the original sizes).

Importing this package (and listing the workloads) imports no framework: each module imports
TensorFlow / Keras or torch / fastai inside its functions.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional

#: the type of the ``on_step`` / ``on_commit`` hooks of :func:`run`: called with a step number
StepHook = Callable[[int], None]

#: name -> module (in the order of the benchmark table)
REGISTRY: Dict[str, str] = {
    "mnist_mlp": "keepalive.workloads.mnist_mlp",
    "mnist_cnn": "keepalive.workloads.mnist_cnn",
    "cifar10_cnn": "keepalive.workloads.cifar10_cnn",
    "imdb_fasttext": "keepalive.workloads.imdb_fasttext",
    "imdb_bidirectional_lstm": "keepalive.workloads.imdb_bidirectional_lstm",
    "lstm_text_generation": "keepalive.workloads.lstm_text_generation",
    "fashion_mnist_cnn": "keepalive.workloads.fashion_mnist_cnn",
    "dogs_cats_resnet": "keepalive.workloads.dogs_cats_resnet",
}


def names() -> List[str]:
    """The workload names, in table order."""
    return list(REGISTRY)


def get(name: str) -> ModuleType:
    """The module of workload ``name`` (cheap: no framework is imported)."""
    try:
        return importlib.import_module(REGISTRY[name])
    except KeyError:
        raise KeyError(f"unknown workload {name!r}; known: {', '.join(REGISTRY)}") from None


def describe(name: str) -> Dict[str, Any]:
    """What ``keepalive bench list`` shows for one workload (no framework imported)."""
    m = get(name)
    return {"name": name, "framework": m.FRAMEWORK, "model": m.MODEL, "dataset": m.DATASET,
            "epochs": m.EPOCHS, "batch_size": m.BATCH_SIZE,
            "steps_per_epoch": getattr(m, "STEPS_PER_EPOCH", None),
            "freeze_epochs": getattr(m, "FREEZE_EPOCHS", None),
            "optimizer": getattr(m, "OPTIMIZER", None), "notes": getattr(m, "NOTES", "")}


def run(name: str, dir: str, *, on_step: Optional[StepHook] = None,
        on_commit: Optional[StepHook] = None, **kwargs: Any) -> Dict[str, Any]:
    """Train workload ``name`` with checkpoints in ``dir`` (see the module's ``run`` for ``kwargs``);
    returns the results document also written to ``dir/results.json``.

    Two hooks follow the training from outside, for your own logging or monitoring (the crash tests
    use them to kill a run at a chosen step):

    * ``on_step(step)``: after every optimizer step, with the number of steps done so far (a resumed
      run counts on from its checkpoint), on the training thread: keep it quick;
    * ``on_commit(step)``: each time a checkpoint is durably committed, with its step, on the
      checkpoint writer's thread (a run without checkpoints never calls it).
    """
    return get(name).run(dir, on_step=on_step, on_commit=on_commit, **kwargs)


__all__ = ["REGISTRY", "names", "get", "describe", "run", "StepHook"]
