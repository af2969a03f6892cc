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

import os

import pytest

import hfkit
from crashkit import assert_differs, assert_same

hfkit.importorskip("sentence_transformers", "datasets")

SCRIPT = os.path.join(hfkit.SCRIPTS, "st_train.py")
TOTAL = 13

#: the children fork from a server that has imported torch, transformers' Trainer and
#: sentence-transformers (most of a child's CPU time)
forked_children = hfkit.forked_children_fixture(["torch", "transformers.trainer", "datasets",
                                                 "sentence_transformers.base.trainer"])


def _run(tmp_path, name, *extra, kills=0, seed=0):
    """The script's result and the steps the runs after a kill resumed from."""
    result, report = hfkit.run_script(SCRIPT, tmp_path / name, *extra, total=TOTAL, kills=kills, seed=seed,
                                      mid_epoch_of=TOTAL)
    return result, [t.resumed_step for t in report.trials[1:]]


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
