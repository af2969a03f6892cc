"""sentence-transformers' ``SentenceTransformerTrainer`` (on the HF ``Trainer``) with its own batch samplers,
resumed inside its ONE epoch.

Its default ``BatchSamplers.BATCH_SAMPLER`` (``DefaultBatchSampler`` over accelerate's seedable sampler) and
``BatchSamplers.NO_DUPLICATES`` make each epoch's batches from their generators' states when the epoch
begins (``seed + epoch``); keepalive stands in for them (``keepalive.callbacks._hf_samplers``), keeps those
states and, on resume, runs the library's iteration again from them and drops the batches already trained as
indices. Before, such a run was checkpointed at epoch ends only: a one-epoch run had no protection.

``tests/scripts/st_train.py``: a tiny BERT saved to a folder with a WordPiece vocabulary the script writes,
``models.Transformer`` + mean ``models.Pooling``, ``MultipleNegativesRankingLoss`` on 50 in-memory (anchor,
positive) pairs with repeated anchors, batch 4, one epoch of 13 steps, dropout, saves every step.

* per sampler: SIGKILL mid-epoch, re-run until done: weights and log history bit-identical to an
  uninterrupted run without keepalive;
* control (default sampler): the same kill, with the resumed epoch run from its first batch again (not
  from the saved position): the weights and log history differ.
"""
from __future__ import annotations

import json
import os
import random
import sys

import pytest

torch = pytest.importorskip("torch")
for _name in ("torchvision::nms", "torchvision::qnms"):  # the CUDA torchvision here (DESIGN.md)
    try:
        torch.library.define(_name, "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    except Exception:  # noqa: BLE001 - already defined
        pass
pytest.importorskip("sentence_transformers")
pytest.importorskip("datasets")

import crashkit  # noqa: E402
from crashkit import assert_differs, assert_same, run_to_completion  # noqa: E402
from forkserver import ForkingSubprocess, ServerPool  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "scripts")
SCRIPT = os.path.join(SCRIPTS, "st_train.py")
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([SCRIPTS, os.path.dirname(HERE)]),
           OMP_NUM_THREADS="1", KEEPALIVE_PROGRESS="0", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
           HF_DATASETS_OFFLINE="1")
TOTAL = 13

PRELOAD = ["torch", "transformers.trainer", "datasets", "sentence_transformers.base.trainer"]
_SHIM = ("import torch\n"
         "for n in ('torchvision::nms', 'torchvision::qnms'):\n"
         "    try:\n"
         "        torch.library.define(n, '(Tensor dets, Tensor scores, float iou_threshold) -> Tensor')\n"
         "    except Exception:\n"
         "        pass\n")


@pytest.fixture(scope="module", autouse=True)
def forked_children():
    """The children fork from a server that has imported torch, transformers' Trainer and sentence-transformers (most of
    a child's CPU time)."""
    pool = ServerPool(lambda argv, env: ("hf", PRELOAD, _SHIM))
    try:
        with ForkingSubprocess(pool).installed_in(crashkit):
            yield pool
    finally:
        pool.close()


def _run(tmp_path, name, *extra, kills=0, seed=0):
    d = tmp_path / name
    d.mkdir()
    out = d / "w.st"
    cmd = [sys.executable, SCRIPT, str(d / "run"), "--out", str(out), *extra]
    if kills:
        report = run_to_completion(cmd + ["--sleep", "0.05"], total_steps=TOTAL, kills=kills,
                                   rng=random.Random(seed), run_dir=str(d / "run"), env=ENV,
                                   max_substep_delay=0.05, timeout=240, mid_epoch_of=TOTAL)
        assert report.kills == kills and "DONE" in report.final_output
        assert all(t.resumed_step is not None for t in report.trials[1:]), report.trials
        resumed = [t.resumed_step for t in report.trials[1:]]
    else:
        report = run_to_completion(cmd, total_steps=TOTAL, kills=0, rng=random.Random(0), env=ENV, timeout=240)
        assert "DONE" in report.final_output, report.final_output[-2000:]
        resumed = []
    from safetensors.torch import load_file

    with open(str(out) + ".json") as f:
        return {"weights": load_file(str(out)), **json.load(f)}, resumed


def _losses(result):
    return [e["loss"] for e in result["log_history"] if "loss" in e]


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["default", "no_duplicates"])
def test_one_epoch_run_killed_mid_epoch_resumes_bit_exactly(tmp_path, sampler):
    ref, _ = _run(tmp_path, "plain", "--sampler", sampler, "--plain")
    assert ref["global_step"] == TOTAL
    got, resumed = _run(tmp_path, "killed", "--sampler", sampler, kills=1, seed=5)
    assert resumed and 0 < resumed[0] < TOTAL, resumed  # inside the one epoch
    assert_same(ref, got)
    if sampler != "default":
        return  # one control is enough: the same position mechanism
    control, resumed = _run(tmp_path, "control", "--sampler", sampler, "--from-epoch-start", kills=1, seed=5)
    delta = max(abs(a - b) for a, b in zip(_losses(ref), _losses(control)))
    print(f"control (resumed from the epoch's first batch): max |delta| of the logged losses = {delta}")
    assert_differs(ref, control)
