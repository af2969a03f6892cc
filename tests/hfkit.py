"""What the Hugging Face test files share: the libraries they need (torch made ready for the CUDA
torchvision here first), the training scripts' children forked from a server that has imported the
heavy modules, one script run to its end (killed and run again, or not), and in-process ``Trainer``
runs from ``tests/scripts/hf_setup.py`` stopped by the session's deadline and resumed.

Nothing here imports torch or transformers when the module is imported: a file calls
:func:`importorskip` first, so a machine without them skips the file instead of failing it.
"""
from __future__ import annotations

import json
import os
import random
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import pytest

import crashkit
from crashkit import CrashReport, run_to_completion
from forkserver import ForkingSubprocess, ServerPool

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "scripts")
sys.path.insert(0, SCRIPTS)  # hf_setup.py, for the in-process runs

#: the training scripts' environment: this checkout and tests/scripts importable, one thread, no
#: progress bars, no download attempted
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([SCRIPTS, os.path.dirname(HERE)]), OMP_NUM_THREADS="1",
           KEEPALIVE_PROGRESS="0", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")

#: The registry's torchvision is a CUDA build: next to the CPU torch here its import (which transformers
#: makes) fails unless these op schemas exist first (DESIGN.md). Run in this process and, as their setup,
#: in the fork servers; tests only.
TORCHVISION_OPS = """
import torch
for name in ("torchvision::nms", "torchvision::qnms"):
    try:
        torch.library.define(name, "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    except Exception:  # already defined
        pass
"""


def importorskip(*modules: str) -> Any:
    """torch (with the op schemas above defined) and each of ``modules``, or the calling file is
    skipped; returns torch."""
    torch = pytest.importorskip("torch")
    exec(TORCHVISION_OPS, {})
    for name in modules:
        pytest.importorskip(name)
    return torch


def forked_children_fixture(preload: Sequence[str], only: Optional[str] = None) -> Any:
    """A module fixture (autouse; assign it to ``forked_children``) that forks the training scripts'
    children (``only`` that script, when given) from a server which has imported ``preload``: most of
    a child's CPU time. Inside the module, :mod:`crashkit` starts its children through it."""

    @pytest.fixture(scope="module", autouse=True)
    def forked_children():
        pool = ServerPool(lambda argv, env: ("hf", list(preload), TORCHVISION_OPS)
                          if only is None or argv[0] == only else None, quick_exit=True)
        try:
            with ForkingSubprocess(pool).installed_in(crashkit):
                yield pool
        finally:
            pool.close()

    return forked_children


def run_script(script: str, folder: Path, *extra: str, total: int, kills: int = 0, seed: int = 0,
               sleep: float = 0.05, **kill_options: Any) -> Tuple[Dict[str, Any], CrashReport]:
    """Run ``script`` (``RUN --out OUT`` plus ``extra``) in ``folder`` to its end: without a kill, or
    SIGKILLed ``kills`` times (its steps slowed by ``sleep`` s; ``kill_options`` for
    :func:`crashkit.run_to_completion`) and run again until done, each run after a kill resumed. Returns
    the weights and the JSON the script wrote (``OUT``, ``OUT.json``) and the crash report."""
    folder.mkdir()
    out, run = folder / "w.st", str(folder / "run")
    cmd = [sys.executable, script, run, "--out", str(out), *extra]
    if kills:
        report = run_to_completion(cmd + ["--sleep", str(sleep)], total_steps=total, kills=kills,
                                   rng=random.Random(seed), run_dir=run, env=ENV, max_substep_delay=0.05,
                                   timeout=240, **kill_options)
        assert report.kills == kills and "DONE" in report.final_output
        assert all(t.resumed_step is not None for t in report.trials[1:]), report.trials
    else:
        report = run_to_completion(cmd, total_steps=total, kills=0, rng=random.Random(0), env=ENV, timeout=240)
        assert "DONE" in report.final_output, report.final_output[-2000:]
    from safetensors.torch import load_file

    with open(str(out) + ".json") as f:
        return {"weights": load_file(str(out)), **json.load(f)}, report


# ------------------------------------------------------------------------ in-process Trainer runs
def trainer_state(trainer: Any) -> Dict[str, Any]:
    """What a resumed run must equal bit for bit: the weights, the optimizer's state and the log
    history without timings (nor the final summary)."""
    weights = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    logs = [{k: v for k, v in e.items() if not k.endswith(("_runtime", "_per_second"))}
            for e in trainer.state.log_history if "train_runtime" not in e]
    return {"weights": weights, "optimizer": trainer.optimizer.state_dict()["state"], "logs": logs}


def train(out: Any, cb: Any = None, **kw: Any) -> Any:
    """``hf_setup.trainer(out, cb, **kw)``, trained; the trainer."""
    import hf_setup

    t = hf_setup.trainer(str(out), cb, **kw)
    t.train()
    return t


def stop_after(steps: int) -> Callable[[], float]:
    """A session clock whose deadline comes at the ``steps``-th boundary (the save-and-stop path)."""
    calls = {"n": 0}

    def remaining() -> float:
        # boundaries only: keepalive's pause guard also asks, from its thread, when a step is slow
        if threading.current_thread() is threading.main_thread():
            calls["n"] += 1
        return 1000.0 if calls["n"] < steps else 1.0

    return remaining


def stopped(root: Path, stop_at: int, **kw: Any) -> Any:
    """Train (run folder ``root/run``) until the deadline at the ``stop_at``-th boundary saves and
    stops; the callback."""
    from keepalive.callbacks.transformers import DriveCheckpoint

    cb = DriveCheckpoint(root / "run", every=100, quiet=True, remaining_fn=stop_after(stop_at),
                         deadline_margin="5s")
    with pytest.raises(SystemExit) as stop:  # a script's stop exits 143 (EXIT_STOPPED) after its save
        train(root / "a", cb, **kw)
    assert stop.value.code == 143 and cb.stopped
    return cb


def resumed(root: Path, total: int, **kw: Any) -> Dict[str, Any]:
    """The same training run again from ``root/run``'s checkpoint to its end (``total`` steps); its
    :func:`trainer_state`."""
    from keepalive.callbacks.transformers import DriveCheckpoint

    cb = DriveCheckpoint(root / "run", every=100, quiet=True)
    t = train(root / "b", cb, **kw)
    assert cb.finished and t.state.global_step == total
    return trainer_state(t)

