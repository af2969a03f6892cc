"""The fastai adapter under SIGKILL: real ``fit_one_cycle`` and ``fine_tune`` subprocesses are killed at
random moments (mid-step, mid-write, between fine_tune's two fits), restarted until they finish, and
their final weights and Recorder history compared bit for bit with a run that was never interrupted.
A negative control shows the comparison fails when one piece of the state (the DataLoader RNG) is not
restored."""
import json
import os
import random
import sys

import pytest
import torch
from safetensors.torch import load_file

import crashkit
from crashkit import run_to_completion
from forkserver import ForkingSubprocess, ServerPool

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "fastai_train.py")
N_TRAIN, BS = 96, 16
N_ITER = -(-N_TRAIN // BS)


#: what fastai_train.py (and its fastai_setup) import before keepalive: its 16 children fork from a server
#: that has imported it
PRELOAD = ["numpy", "torch", "torch._dynamo", "safetensors.torch", "fastai.callback.core", "fastai.callback.tracker",
           "fastai.data.core", "fastai.learner", "fastai.losses", "fastai.metrics", "fastai.torch_core"]


@pytest.fixture(scope="module", autouse=True)
def forked_children():
    pool = ServerPool(lambda argv, env: ("fastai", PRELOAD, "") if argv[0] == SCRIPT else None, quick_exit=True)
    try:
        with ForkingSubprocess(pool).installed_in(crashkit):
            yield pool
    finally:
        pool.close()


def _cmd(run, out, *extra):
    return [sys.executable, SCRIPT, str(run), "--out", str(out), "--n-train", str(N_TRAIN), *extra]


def _assert_same(a, b):
    wa, wb = load_file(str(a)), load_file(str(b))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), f"{k} differs: max |diff| {(wa[k] - wb[k]).abs().max()}"
    ha, hb = (json.load(open(f"{p}.json")) for p in (a, b))
    assert ha == hb, "Recorder history differs"


def _check_resumes(report, every_steps=None):
    assert report.kills >= 1
    for prev, cur in zip(report.trials, report.trials[1:]):
        if prev.killed_after_step and prev.last_committed:
            assert cur.resumed_step is not None, "a restart did not resume"
            if every_steps:
                # lost at most one interval plus the one write still in flight at the kill
                assert prev.killed_after_step - cur.resumed_step <= 2 * every_steps + N_ITER, (prev, cur)


MODES = {
    # one-cycle, DataLoader workers (fastai's default), mid-epoch saves every 5 steps,
    # SaveModelCallback + EarlyStoppingCallback, bigger state so that kills land inside writes
    "one_cycle": (["--mode", "one_cycle", "--epochs", "4", "--workers", "2", "--every", "5",
                   "--trackers", "--hidden", "768"], 4 * N_ITER, 5),
    # fine_tune (a frozen fit, then an unfrozen one), the callback given to Learner(cbs=), saves
    # every 4 steps: kills land in both fits and between them
    "fine_tune": (["--mode", "fine_tune", "--epochs", "3", "--every", "4", "--in-learner",
                   "--hidden", "512"], 4 * N_ITER, 5),
}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Uninterrupted runs, one per mode (computed once, shared with the negative control)."""
    cache = {}

    def get(mode):
        if mode not in cache:
            d = tmp_path_factory.mktemp(f"ref-{mode}")
            args, total, _ = MODES[mode]
            ref = run_to_completion(_cmd(d / "run", d / "w.st", *args), total_steps=total, kills=0,
                                    rng=random.Random(0), timeout=180)
            assert "DONE" in ref.final_output
            cache[mode] = d / "w.st"
        return cache[mode]

    return get


@pytest.mark.parametrize("mode", list(MODES))
def test_sigkill_resume_is_bit_exact(tmp_path, references, mode):
    args, total, kills = MODES[mode]
    ref = references(mode)
    rng = random.Random(7000 + len(mode))
    report = run_to_completion(_cmd(tmp_path / "run", tmp_path / "w.st", *args),
                               total_steps=total, kills=kills, rng=rng,
                               run_dir=str(tmp_path / "run"), timeout=180)
    assert report.kills == kills
    assert "DONE" in report.final_output
    _assert_same(ref, tmp_path / "w.st")
    _check_resumes(report, int(args[args.index("--every") + 1]))
    print(f"\n{mode}: {report.kills} kills after steps {[t.killed_after_step for t in report.trials[:-1]]}, "
          f"resumed at steps {[t.resumed_step for t in report.trials[1:]]}, torn folders seen: "
          f"{sum(t.torn_folders_after_kill for t in report.trials)}")


class _KillLast(random.Random):
    """Makes crashkit kill right after the last step it is given."""

    def randint(self, a, b):
        return b


def test_detects_divergence(tmp_path, references):
    """Negative control: the fine_tune run, killed once inside the second fit, but the child does not
    restore the fastai DataLoader RNG (``--break dl_rng``): the final weights must differ."""
    args, total, _ = MODES["fine_tune"]
    ref = references("fine_tune")
    # killed after step 11, saved at step 10 (4 after the end of the frozen fit at 6): batch 4 of the
    # unfrozen fit's first epoch, whose order comes from the DataLoader RNG as the frozen fit left it
    report = run_to_completion(_cmd(tmp_path / "run", tmp_path / "w.st", *args, "--sleep", "0.05",
                                    "--break", "dl_rng"),
                               total_steps=N_ITER + 5, kills=1, rng=_KillLast(1), timeout=180,
                               kill_after_commit=10)
    assert report.trials[1].resumed_step == 10
    assert "DONE" in report.final_output
    with pytest.raises(AssertionError, match="differs"):
        _assert_same(ref, tmp_path / "w.st")
