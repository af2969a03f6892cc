"""Several fits (stages) on one fastai run, as real processes killed with SIGKILL and run again.

The two-stage recipe (``freeze()``, ``fit_one_cycle`` -> ``unfreeze()`` -> ``fit_one_cycle(lr_max=
slice(...))``, tests/scripts/fastai_stages.py) with a new ``DriveCheckpoint(path)`` in each fit call or
one shared callback: never killed, it trains both stages; killed inside stage 1 or stage 2 and run
again, it ends bit-identical to the same script without keepalive (weights, Recorder history, the
``CSVLogger`` file). Killed in stage 2 and run again with the first fit commented out, the fit is
recognised by its plan and resumes. Each has a negative control (the old behaviour put back in the
child): the comparison fails. Also in-process: a fit's epochs changed between sessions, the
validation split of an unseeded ``RandomSplitter``, the CSV file after a resume (warnings asserted).
"""
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file

import crashkit
from crashkit import COMMITTED_RE, STEP_RE, run_to_completion
from forkserver import script_children_fixture

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "fastai_stages.py")
N_ITER = 6                   # 96 samples, batches of 16
TOTAL = 4 * N_ITER           # 2 epochs per stage
STAGE_2_AT = 2 * N_ITER + 4  # saves every 4 steps: batch 4 of stage 2's first epoch
STAGE_1_AT = 8               # batch 2 of stage 1's second epoch
#: the children fork from a server that has imported torch and fastai (tests/forkserver.py): most of a
#: child's CPU time
PRELOAD = ["numpy", "torch", "torch._dynamo", "safetensors.torch", "fastai.callback.core", "fastai.callback.progress",
           "fastai.callback.tracker", "fastai.data.core", "fastai.learner", "fastai.losses", "fastai.metrics",
           "fastai.torch_core"]


forked_children = script_children_fixture(SCRIPT, "fastai", PRELOAD, crashkit, sys.modules[__name__])


def _cmd(d, *extra):
    return [sys.executable, SCRIPT, str(d / "run"), "--out", str(d / "w.st"), *extra]


def _result(d):
    return load_file(str(d / "w.st")), json.load(open(d / "w.st.json"))


def _untimed(csv):
    """The CSV file without its time column (the one value an exact resume does not repeat)."""
    return [line.rsplit(",", 1)[0] for line in csv.splitlines()]


def _assert_same(ref, d):
    (wa, ha), (wb, hb) = _result(ref), _result(d)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), f"{k} differs: max |diff| {(wa[k] - wb[k]).abs().max()}"
    assert ha["history"] == hb["history"], "Recorder history differs"
    assert _untimed(ha["csv"]) == _untimed(hb["csv"]), f"CSVLogger file differs:\n{hb['csv']}"


def _differs(ref, d):
    with pytest.raises(AssertionError, match="differs"):
        _assert_same(ref, d)


def _run(d, *extra):
    """One uninterrupted child; its output."""
    res = run_to_completion(_cmd(d, *extra), total_steps=TOTAL, kills=0, rng=random.Random(0), timeout=240)
    assert "DONE" in res.final_output
    return res.final_output


def _kill_after_commit(d, commit, *extra):
    """A child SIGKILLed right after its checkpoint at step ``commit`` is committed, one step later."""
    proc = subprocess.Popen(_cmd(d, "--sleep", "0.05", *extra), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    committed = step = 0
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            m = COMMITTED_RE.match(line)
            committed = int(m.group(1)) if m else committed
            m = STEP_RE.match(line)
            step = int(m.group(1)) if m else step
            if committed >= commit and step > commit:
                proc.send_signal(signal.SIGKILL)
                break
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, "".join(lines[-40:])
    assert committed == commit, f"killed after commit {committed}, not {commit}"


def _copy(src, dst):
    shutil.copytree(src / "run", dst / "run")
    return dst


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """The two stages without keepalive."""
    d = tmp_path_factory.mktemp("without-keepalive")
    _run(d, "--cb", "none")
    return d


def _parallel(*jobs):
    """Independent scenarios side by side (each waits for its own child's lines, never for time)."""
    with ThreadPoolExecutor(len(jobs)) as pool:
        return [f.result() for f in [pool.submit(j) for j in jobs]]


def test_never_killed_trains_both_stages(tmp_path, ref):
    """A new callback per fit, never killed: the second one is the next stage (== without keepalive),
    said in one line. Control: a new callback that loads the run's end (the first fit's) into the
    learner instead loses the user's unfreeze() and the cleared optimizer state, and differs."""
    each, control = tmp_path / "each", tmp_path / "control"
    out, control_out = _parallel(lambda: _run(each, "--cb", "each"),
                                 lambda: _run(control, "--cb", "each", "--break", "stage"))
    assert ("keepalive: fit 2 of run 'run' is the next stage after fit 1, which this process trained: it trains "
            "from the learner as it is") in out
    assert "skipped" not in out and "resuming" not in out
    _assert_same(ref, each)
    assert "fit 2 is new to run 'run': it trains from the end of fit 1" in control_out
    _differs(ref, control)


def test_sigkill_in_stage_1_then_stage_2_is_bit_exact(tmp_path, ref):
    """Killed inside stage 1 (mid-epoch), run again with a new callback per fit and with one shared
    callback: stage 1 resumes, stage 2 trains after it in the same process (a new callback: as the
    next stage); both == without keepalive."""
    killed = tmp_path / "killed"
    _kill_after_commit(killed, STAGE_1_AT, "--cb", "each")
    runs = {cb: _copy(killed, tmp_path / cb) for cb in ("each", "shared")}
    outs = _parallel(*[lambda cb=cb: _run(runs[cb], "--cb", cb) for cb in runs])
    for out in outs:
        assert "fit 1 continues: 1 of 2 epochs done, 2 of 6 batches into the next" in out
    assert "fit 2 of run 'run' is the next stage after fit 1, which this process trained" in outs[0]
    for d in runs.values():
        _assert_same(ref, d)


def test_sigkill_in_stage_2_resumes_stage_2(tmp_path, ref):
    """Killed inside stage 2. Run again (the same folder, copied): with a new callback per fit, with
    one shared callback, and with the first fit commented out (recognised by its plan, not its
    place): each resumes stage 2 and ends == without keepalive. Controls: fits counted per callback
    object and matched by place only (the old behaviour) skip stage 2 as 'completed'; the first fit
    commented out and fits matched by place only: the same."""
    killed = tmp_path / "killed"
    _kill_after_commit(killed, STAGE_2_AT, "--cb", "each")
    runs = {name: _copy(killed, tmp_path / name) for name in
            ("each", "shared", "first-left-out", "control-place", "control-plan")}
    outs = _parallel(
        lambda: _run(runs["each"], "--cb", "each"),
        lambda: _run(runs["shared"], "--cb", "shared"),
        lambda: _run(runs["first-left-out"], "--cb", "each", "--first", "skip"))
    for out in outs:
        assert "fit 2 continues: 0 of 2 epochs done, 4 of 6 batches into the next" in out
    assert "fit 1 had completed before the restart (the checkpoint is in fit 2): skipped" in outs[0]
    assert "skipped" not in outs[2]
    for name in ("each", "shared", "first-left-out"):
        _assert_same(ref, runs[name])
    outs = _parallel(
        lambda: _run(runs["control-place"], "--cb", "each", "--break", "counter,plan"),
        lambda: _run(runs["control-plan"], "--cb", "each", "--first", "skip", "--break", "plan"))
    for out in outs:
        assert "fit 1 had completed before the restart (the checkpoint is in fit 2): skipped" in out
    for name in ("control-place", "control-plan"):
        _differs(ref, runs[name])


# ------------------------------------------------------------------------------- in-process sessions
# A "session" builds a new learner with the same code and trains with a new DriveCheckpoint, like a
# notebook run again after a restart; a crash is an exception raised from a callback at a chosen step.
class Crash(BaseException):
    """Stands for the process dying: not an Exception, so fastai does not catch or wrap it."""


def _crash_at(step):
    from fastai.callback.core import Callback

    class CrashAt(Callback):
        order = 200

        def __init__(self):
            self.n = 0

        def after_batch(self):
            if self.learn.training:
                self.n += 1
                if self.n == step:
                    raise Crash()

    return CrashAt()


class _Watch:
    """What each training batch sees: (n_epoch, epoch, iter, pct_train)."""

    def __new__(cls):
        from fastai.callback.core import Callback

        class Watch(Callback):
            order = 201

            def __init__(self):
                self.seen = []

            def before_batch(self):
                if self.learn.training:
                    self.seen.append((self.learn.n_epoch, self.epoch, self.iter, self.learn.pct_train))

        return Watch()


def _session(path, *, epochs=2, crash=None, csv_append=None, extra=()):
    """One session of a two-stage run (``epochs`` in stage 2), or one fit_one_cycle(epochs) without
    ``csv_append``; returns (learner or None after a crash, its CSV text)."""
    from fastai.callback.progress import CSVLogger
    from fastai_setup import make_learner

    from keepalive.callbacks.fastai import DriveCheckpoint

    cbs = [CSVLogger(append=csv_append)] if csv_append is not None else None
    learn = make_learner(path=str(path), cbs=cbs)
    learn.remove_cb(learn.progress)
    learn.logger = lambda *a, **k: None
    run = [DriveCheckpoint(str(path / "run"), every=4), *extra] + ([_crash_at(crash)] if crash else [])
    try:
        if csv_append is None:
            learn.fit_one_cycle(epochs, 5e-3, cbs=run)
        else:
            learn.freeze()
            learn.fit_one_cycle(1, 5e-3, cbs=run)
            learn.unfreeze()
            learn.fit_one_cycle(epochs, slice(1e-4, 1e-3), cbs=run)
    except Crash:
        return None, None
    log = path / "history.csv"
    return learn, log.read_text() if log.exists() else ""


@pytest.mark.parametrize("append", [False, True])
def test_csv_logger_file_after_resumes_is_the_uninterrupted_one(tmp_path, monkeypatch, append):
    """CSVLogger on the learner over two fits, killed in the second fit's second epoch and in its
    third, each time run again: the file holds every epoch exactly as the uninterrupted run's (with
    ``append=True`` both fits' headers and lines, no line twice). Control: the file not restored
    holds only the last session's epochs."""
    import keepalive.callbacks._fastai_state as fastai_state

    ref, ref_csv = _session(tmp_path / "ref", epochs=3, csv_append=append)
    assert ref_csv.count("epoch,") == (2 if append else 1)
    for crash in (N_ITER + 9, 7):  # saved at step 12 (batch 0 of epoch 2 of fit 2), then at 16
        assert _session(tmp_path / "run", epochs=3, crash=crash, csv_append=append)[0] is None
    got, csv = _session(tmp_path / "run", epochs=3, csv_append=append)
    assert _untimed(csv) == _untimed(ref_csv)
    monkeypatch.setattr(fastai_state, "restore_loggers", lambda learn, saved: None)
    monkeypatch.setattr(fastai_state, "write_loggers", lambda learn, saved: None)
    assert _session(tmp_path / "control", epochs=3, crash=N_ITER + 9, csv_append=append)[0] is None
    _, control_csv = _session(tmp_path / "control", epochs=3, csv_append=append)
    assert _untimed(control_csv) != _untimed(ref_csv)


def test_epochs_changed_between_sessions_the_code_wins_and_says_so(tmp_path, capsys):
    """A fit of 3 epochs killed in its second epoch; the next session's code asks 4: said once, with
    what wins and how to get the other; the fit trains to 4 epochs, its schedule placed on 4 epochs
    from the work done. The run's end, asked for 5 in a third session: the checkpoint wins (skipped).
    Control: the same plan again says nothing."""
    assert _session(tmp_path, epochs=3, crash=N_ITER + 3)[0] is None  # saved at step 8: batch 2 of epoch 1
    capsys.readouterr()
    watch = _Watch()
    learn, _ = _session(tmp_path, epochs=4, extra=[watch])
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert ("keepalive: warning: fit 1 was planned otherwise before the restart (epochs 3 -> 4): the code's "
            "plan wins, the fit goes on from 1 of 4 epochs done, 2 of 6 batches into the next with the code's "
            "schedule at that point. To finish the saved plan instead, run the fit as before the restart "
            "(3 epochs, the same learning rates); to train the new plan from the start, use another run "
            "(path or run=).") in out
    assert out.count("planned otherwise") == 1
    assert watch.seen[0][:3] == (4, 1, 2) and len(watch.seen) == 4 * N_ITER - 8
    for n_epoch, epoch, it, pct in watch.seen:
        assert abs(pct - (epoch * N_ITER + it) / (n_epoch * N_ITER)) < 1e-9
    _session(tmp_path, epochs=5)
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert ("keepalive: warning: fit 1 (4 epochs) had completed before the restart; the code now asks another "
            "plan (epochs 4 -> 5): the checkpoint wins, the fit is skipped and its end state restored. To train "
            "the new plan, use another run (path or run=).") in out
    _session(tmp_path, epochs=4)
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert "planned otherwise" not in out and "another plan" not in out
    assert "fit 1 (4 epochs) had completed before the restart: skipped, its end state restored" in out


def _tabular(path, seed):
    """The tabular tutorial's shape: TabularPandas split by RandomSplitter (``seed`` None: unseeded)."""
    import numpy as np
    import pandas as pd
    from fastai.tabular.all import Categorify, Normalize, RandomSplitter, TabularPandas, range_of, tabular_learner

    g = np.random.default_rng(0)
    df = pd.DataFrame({"a": g.normal(size=160), "b": g.integers(0, 3, 160), "y": g.integers(0, 2, 160)})
    to = TabularPandas(df, procs=[Categorify, Normalize], cat_names=["b"], cont_names=["a"], y_names="y",
                       splits=RandomSplitter(seed=seed)(range_of(df)), y_block=None)
    learn = tabular_learner(to.dataloaders(bs=16, path=str(path)), layers=[8])
    learn.remove_cb(learn.progress)
    learn.logger = lambda *a, **k: None
    return learn


@pytest.mark.parametrize("seed", [None, 42])
def test_unseeded_random_split_is_said_at_the_resume(tmp_path, capsys, seed):
    """RandomSplitter() without a seed splits again in a new process: said once at the resume, with
    what to change. Control: RandomSplitter(seed=42) splits the same way: nothing said."""
    from keepalive.callbacks.fastai import DriveCheckpoint

    learn = _tabular(tmp_path, seed)
    with contextlib.suppress(Crash):
        learn.fit_one_cycle(2, 1e-2, cbs=[DriveCheckpoint(str(tmp_path / "run"), every=3), _crash_at(4)])
    learn = _tabular(tmp_path, seed)  # the global RNG has moved on, as in another process
    learn.fit_one_cycle(2, 1e-2, cbs=DriveCheckpoint(str(tmp_path / "run"), every=3))
    captured = capsys.readouterr()
    out = captured.out + captured.err
    warning = ("keepalive: warning: the validation set differs from the one before the restart (a random split "
               "made again in this process, e.g. RandomSplitter() without a seed): training goes on, but on other "
               "training samples and with metrics on another validation set than the uninterrupted run's. Give the "
               "splitter a seed (RandomSplitter(seed=42), TabularPandas(splits=RandomSplitter(seed=42)(...))) "
               "so that every session splits the same way.")
    assert "fit 1 continues" in out
    assert out.count(warning) == (1 if seed is None else 0), out
