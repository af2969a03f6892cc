"""The fastai adapter in-process: resume positions (mid-epoch, epoch ends, fine_tune's two fits),
schedules, trackers, mixed precision, deadline stop, interrupts, mismatch errors, loaders that cannot
be positioned, lr_find / validate / export alongside. A "crash" here is an exception raised from a
callback at a chosen step; the "restarted session" builds a fresh learner with the same code (same
seed), like re-running a notebook after a reset. Crash tests with real SIGKILLed processes are in
test_fastai_crash.py."""
import contextlib
import os
import signal
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))

from fastai.callback.core import Callback  # noqa: E402
from fastai.callback.tracker import EarlyStoppingCallback, SaveModelCallback  # noqa: E402
from fastai_setup import history, make_learner, weights  # noqa: E402

from keepalive import notebook  # noqa: E402
from keepalive.callbacks.fastai import DriveCheckpoint  # noqa: E402
from keepalive.errors import StateMismatchError  # noqa: E402
from keepalive.state import from_files  # noqa: E402
from keepalive.store import CheckpointStore  # noqa: E402

N_ITER = 6  # 96 samples, batches of 16


class Crash(BaseException):
    """Stands for the process dying: not an Exception, so fastai does not catch or wrap it."""


class CrashAt(Callback):
    order = 200

    def __init__(self, step):
        self.step, self.n = step, 0

    def after_batch(self):
        if self.learn.training:
            self.n += 1
            if self.n == self.step:
                raise Crash()


class Watch(Callback):
    """Records what each training batch sees: fit's n_epoch, epoch, iter, pct_train, lr, freeze."""

    order = 201

    def __init__(self):
        self.seen = []

    def before_batch(self):
        if self.learn.training:
            body = next(iter(self.learn.model.body.parameters()))
            self.seen.append((self.learn.n_epoch, self.epoch, self.iter, self.learn.pct_train,
                              float(self.opt.hypers[-1]["lr"]), body.requires_grad))


def _quiet(learn, progress=False):
    if hasattr(learn, "progress") and not progress:
        learn.remove_cb(learn.progress)
    learn.logger = lambda *a, **k: None
    return learn


def session(path, mode="one_cycle", *, crash=None, every="epoch", epochs=3, learner=None,
            extra=(), lkw=None, ckw=None, progress=False, stops=False):
    """One 'session': build the learner, train with DriveCheckpoint; (learn, ckpt) or (None, ckpt).
    ``stops``: stopped before its end, which exits a script with 143 (EXIT_STOPPED): (None, ckpt)."""
    learn = learner or _quiet(make_learner(**(lkw or {})), progress)
    ckpt = DriveCheckpoint(str(path), every=every, **(ckw or {}))
    cbs = [ckpt, *extra] + ([CrashAt(crash)] if crash else [])
    try:
        if mode == "one_cycle":
            learn.fit_one_cycle(epochs, 5e-3, cbs=cbs)
        elif mode == "flat_cos":
            learn.fit_flat_cos(epochs, 5e-3, cbs=cbs)
        elif mode == "fit":
            learn.fit(epochs, 5e-3, cbs=cbs)
        else:
            learn.fine_tune(epochs, 5e-3, freeze_epochs=1, cbs=cbs)
    except Crash:
        return None, ckpt
    except SystemExit as stop:
        if not stops or stop.code != 143:
            raise
        return None, ckpt
    assert not stops, "the training was to stop (SystemExit 143)"
    return learn, ckpt


def assert_same(a, b):
    wa, wb = weights(a), weights(b)
    for k in wa:
        assert torch.equal(wa[k], wb[k]), f"{k} differs"
    assert history(a) == history(b)
    sa, sb = a.opt.state_dict()["state"], b.opt.state_dict()["state"]
    for x, y in zip(sa, sb):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(torch.as_tensor(x[k]), torch.as_tensor(y[k])), k


def steps_saved(path):
    return [i.step for i in CheckpointStore(str(path)).list()]


def finished(path):
    return bool(CheckpointStore(str(path)).list()[-1].manifest["metadata"]["finished"])


# ------------------------------------------------------------------------------------- positions
@pytest.mark.parametrize("mode,every,crashes,progress", [
    ("one_cycle", 3, [4, 10, 2], False),   # mid-epoch saves, crashes in epochs 0, 1 and 2
    ("one_cycle", "epoch", [8, 7], True),  # epoch ends only; fastai's progress bars on
    ("flat_cos", 4, [9, 6], True),
])
def test_resume_is_bit_exact(tmp_path, capsys, mode, every, crashes, progress):
    ref, _ = session(tmp_path / "ref", mode, every=every, progress=progress)
    for c in crashes:
        assert session(tmp_path / "run", mode, every=every, crash=c, progress=progress)[0] is None
    watch = Watch()
    got, ckpt = session(tmp_path / "run", mode, every=every, extra=[watch], progress=progress)
    assert_same(ref, got)
    assert "resuming run 'run'" in capsys.readouterr().out
    # the resumed session trained only the remaining batches, each at the right schedule position
    first_epoch, first_iter = watch.seen[0][1], watch.seen[0][2]
    assert 0 < first_epoch * N_ITER + first_iter < 3 * N_ITER
    for n_epoch, epoch, it, pct, _lr, _ in watch.seen:
        assert abs(pct - (epoch * N_ITER + it) / (n_epoch * N_ITER)) < 1e-9


def test_fine_tune_resumes_in_the_right_phase(tmp_path, capsys):
    ref, _ = session(tmp_path / "ref", "fine_tune", every=4, epochs=2)
    # crash in the frozen fit (mid-epoch, step 5 > save at 4): it resumes frozen
    w1 = Watch()
    assert session(tmp_path / "run", "fine_tune", every=4, epochs=2, crash=5, extra=[w1])[0] is None
    w2 = Watch()
    assert session(tmp_path / "run", "fine_tune", every=4, epochs=2, crash=7, extra=[w2])[0] is None
    out = capsys.readouterr().out
    assert "fit 1 (fine_tune's frozen fit) continues: 0 of 1 epochs done, 4 of 6 batches into the next" in out
    assert w2.seen[0][:3] == (1, 0, 4)
    assert [s[5] for s in w2.seen[:2]] == [False, False]   # frozen fit: body frozen
    assert [s[5] for s in w2.seen[2:]] == [True] * 5       # unfrozen fit
    # crashed in the unfrozen fit at its step 5 (saves: end of the frozen fit at 6, then 10): the
    # frozen fit is skipped whole
    w3 = Watch()
    got, _ = session(tmp_path / "run", "fine_tune", every=4, epochs=2, extra=[w3], progress=True)
    out = capsys.readouterr().out
    assert ("fit 1 (fine_tune's frozen fit) had completed before the restart (the checkpoint is in fit 2): "
            "skipped") in out
    assert "fit 2 (fine_tune's unfrozen fit) continues: 0 of 2 epochs done, 4 of 6 batches into the next" in out
    assert w3.seen[0][:3] == (2, 0, 4) and all(s[5] for s in w3.seen)
    assert len(w3.seen) == 2 * N_ITER - 4
    assert_same(ref, got)
    # run again: both fits had completed; the end state is restored, nothing trains
    w4 = Watch()
    again, _ = session(tmp_path / "run", "fine_tune", every=4, epochs=2, extra=[w4], progress=True)
    assert w4.seen == []
    out = capsys.readouterr().out
    assert "fit 2 (fine_tune's unfrozen fit, 2 epochs) had completed before the restart" in out
    assert_same(ref, again)


def test_crash_between_fine_tune_fits(tmp_path):
    """The newest checkpoint is the end of the frozen fit: the second fit starts from it after
    fine_tune's own unfreeze() (which clears the optimizer state, as it did the first time)."""
    ref, _ = session(tmp_path / "ref", "fine_tune", epochs=2)
    assert session(tmp_path / "run", "fine_tune", epochs=2, crash=N_ITER + 1)[0] is None
    assert steps_saved(tmp_path / "run") == [N_ITER]
    assert not finished(tmp_path / "run")   # the frozen fit's end is not the training's end
    got, _ = session(tmp_path / "run", "fine_tune", epochs=2)
    assert_same(ref, got)
    assert finished(tmp_path / "run")


def test_same_learner_rerun_after_interrupt(tmp_path):
    """Re-running the cell in the same kernel: the learner object has moved on past the checkpoint;
    everything is restored from the checkpoint, and the writer lease of the first run is free."""
    ref, _ = session(tmp_path / "ref", every=5)
    learn = _quiet(make_learner())
    assert session(tmp_path / "run", every=5, crash=12, learner=learn)[0] is None
    got, _ = session(tmp_path / "run", every=5, learner=learn)
    assert_same(ref, got)


def test_callback_on_the_learner_rerun_after_interrupt(tmp_path, capsys):
    """DriveCheckpoint given to Learner(cbs=): the same callback sees the re-run; fine_tune interrupted
    in its second fit, run again in the same process: it resumes from the checkpoint."""
    ref, _ = session(tmp_path / "ref", "fine_tune", every=4, epochs=2)
    ckpt = DriveCheckpoint(str(tmp_path / "run"), every=4)
    learn = _quiet(make_learner(cbs=ckpt))
    with pytest.raises(Crash):
        learn.fine_tune(2, 5e-3, freeze_epochs=1, cbs=CrashAt(N_ITER + 7))
    learn.fine_tune(2, 5e-3, freeze_epochs=1)
    out = capsys.readouterr().out
    # saved at 10
    assert "fit 2 (fine_tune's unfrozen fit) continues: 0 of 2 epochs done, 4 of 6 batches into the next" in out
    assert_same(ref, learn)
    learn.fit_one_cycle(1, 1e-3)   # a later cell: a new fit, numbered 3, trains
    assert steps_saved(tmp_path / "run")[-1] == 3 * N_ITER + N_ITER


def test_sigint_saves_at_the_step_and_interrupts(tmp_path):
    class Interrupt(Callback):
        order = 200

        def after_batch(self):
            if self.learn.training and self.learn.train_iter == 8:
                os.kill(os.getpid(), signal.SIGINT)

    ref, _ = session(tmp_path / "ref")
    with pytest.raises(KeyboardInterrupt):
        session(tmp_path / "run", extra=[Interrupt()])
    assert steps_saved(tmp_path / "run") == [N_ITER, 8]
    got, _ = session(tmp_path / "run")
    assert_same(ref, got)


# ------------------------------------------------------------------------------------- trackers
def test_tracker_callbacks_continue(tmp_path):
    """EarlyStopping's patience counter and best value and SaveModelCallback's best survive a restart:
    training stops at the same epoch and the same best weights are loaded at the end."""
    def trackers():
        return [SaveModelCallback(monitor="valid_loss", fname="best"),
                EarlyStoppingCallback(monitor="valid_loss", min_delta=0.01, patience=2)]

    ref_cbs = trackers()
    ref, _ = session(tmp_path / "ref", "fit", epochs=8, extra=ref_cbs, lkw={"path": str(tmp_path / "a")})
    stopped_after = len(ref.recorder.values)
    assert stopped_after < 8, "the scenario needs early stopping to trigger"
    lkw = {"path": str(tmp_path / "b")}
    for crash in (N_ITER * (stopped_after - 1) - 1, N_ITER * (stopped_after - 1) + 2):
        session(tmp_path / "run", "fit", epochs=8, extra=trackers(), crash=crash, lkw=lkw)
    cbs = trackers()
    got, _ = session(tmp_path / "run", "fit", epochs=8, extra=cbs, lkw=lkw)
    assert len(got.recorder.values) == stopped_after
    assert (cbs[0].best, cbs[1].best, cbs[1].wait) == (ref_cbs[0].best, ref_cbs[1].best, ref_cbs[1].wait)
    assert_same(ref, got)


# ---------------------------------------------------------------------------- mixed precision
def test_to_fp16_on_cpu(tmp_path):
    """fastai's MixedPrecision uses autocast('cuda') and GradScaler('cuda'): on a CPU both disable
    themselves (training runs in fp32). The callback checkpoints and resumes such a learner exactly."""
    def fp16():
        return _quiet(make_learner()).to_fp16()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref, _ = session(tmp_path / "ref", every=4, learner=fp16())
        session(tmp_path / "run", every=4, crash=7, learner=fp16())
        got, ckpt = session(tmp_path / "run", every=4, learner=fp16())
    assert_same(ref, got)
    newest = CheckpointStore(str(tmp_path / "run")).list()
    # a mid-fit checkpoint holds the GradScaler's state (empty: disabled on a CPU)
    mid = [i for i in newest if not i.manifest["metadata"]["finished"]][-1]
    tree = from_files(CheckpointStore(str(tmp_path / "run")).read_files(mid))
    assert tree["objects"]["scaler"] == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_to_fp16_on_gpu(tmp_path):
    """Real fp16 mixed precision: the GradScaler's scale and growth tracker are saved and restored."""
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False

    def fp16():
        learn = _quiet(make_learner())
        learn.dls.to(torch.device("cuda"))
        learn.model.cuda()
        return learn.to_fp16()

    ref, _ = session(tmp_path / "ref", every=4, learner=fp16())
    session(tmp_path / "run", every=4, crash=7, learner=fp16())
    got, ckpt = session(tmp_path / "run", every=4, learner=fp16())
    tree = ckpt.core.load()
    assert tree["objects"]["scaler"], "the GradScaler state is in the checkpoint"
    assert_same(ref, got)


# ------------------------------------------------------------------------------------ deadline
def test_deadline_saves_and_stops_then_resumes(tmp_path, monkeypatch, capsys):
    import keepalive.session as ks

    ref, _ = session(tmp_path / "ref", "fine_tune", epochs=2)
    budget = {"left": 1e6}

    class Clock(Callback):
        order = 200

        def after_batch(self):
            if self.learn.training and self.learn.train_iter == 3 and self.learn.n_epoch == 2:
                budget["left"] = 5.0  # the session is about to end

    monkeypatch.setattr(ks, "remaining_seconds", lambda: budget["left"])
    learn, ckpt = session(tmp_path / "run", "fine_tune", epochs=2, extra=[Clock()], stops=True)
    out = capsys.readouterr().out
    assert ckpt.stopped and "stopping before the session ends" in out
    assert "fit skipped: training stopped before the session's end" not in out  # stopped in fit 2
    assert steps_saved(tmp_path / "run")[-1] == N_ITER + 3  # the step at which the clock moved
    monkeypatch.setattr(ks, "remaining_seconds", lambda: None)
    got, _ = session(tmp_path / "run", "fine_tune", epochs=2)
    assert_same(ref, got)


def test_deadline_in_first_fit_skips_the_second(tmp_path, monkeypatch, capsys):
    import keepalive.session as ks

    monkeypatch.setattr(ks, "remaining_seconds", lambda: 1.0)
    learn, ckpt = session(tmp_path / "run", "fine_tune", epochs=2, stops=True)
    out = capsys.readouterr().out
    assert ckpt.stopped
    # the stop's exit ends fine_tune in its first fit: the second is not even called
    assert "fit skipped: training stopped before the session's end" not in out
    assert steps_saved(tmp_path / "run") == [1]


# ------------------------------------------------------------------------------------ mismatch
def test_resume_into_another_model_names_the_mismatch(tmp_path):
    session(tmp_path / "run", epochs=1)
    other = _quiet(make_learner(width=8))
    before = weights(other)
    with pytest.raises(StateMismatchError, match=r"body\.0\.weight.*\(8, 3, 3, 3\) in the checkpoint"
                                                 r"|body\.0\.weight.*shape"):
        session(tmp_path / "run", epochs=1, learner=other)
    assert all(torch.equal(before[k], v) for k, v in weights(other).items()), "nothing was loaded"


def test_resume_with_other_parameter_groups_is_refused(tmp_path):
    session(tmp_path / "run", epochs=1)
    learn = _quiet(make_learner(splitter=lambda m: [list(m.parameters())]))
    with pytest.raises(StateMismatchError, match="2 parameter group.*learner 1"):
        session(tmp_path / "run", epochs=1, learner=learn)


# ------------------------------------------------------------------------ fits in notebook cells
CELL_A = "learn.fit_one_cycle(1, 5e-3)"
CELL_B = "learn.fit_one_cycle(2, 5e-3)"


@contextlib.contextmanager
def cell(source):
    """A notebook cell execution, as IPython's pre_run_cell / post_run_cell events announce it."""
    info = SimpleNamespace(raw_cell=source, store_history=True, cell_id=None)
    notebook.pre_run_cell(info)
    try:
        yield notebook.current_cell_key()
    finally:
        notebook.post_run_cell(SimpleNamespace(info=info, execution_count=None, success=True))


def cells(path, sources, *, crash=None, every=4, resuming=None):
    """A kernel: a setup cell (learner + DriveCheckpoint), then each training cell; ``crash`` (cell
    number, step in it) raises in that cell as if the kernel died. (learn, keys of the cells run)."""
    ckpt = DriveCheckpoint(str(path), every=every)
    learn = _quiet(make_learner(cbs=ckpt))
    keys = []
    for i, source in enumerate(sources):
        cbs = [CrashAt(crash[1])] if crash and crash[0] == i else []
        with contextlib.ExitStack() as stack:
            if resuming is not None:  # %resume_training pins the recorded cell execution
                stack.enter_context(notebook.resuming({"cell_key": resuming, "cell": {"source": source}}))
            keys.append(stack.enter_context(cell(source)))
            try:
                learn.fit_one_cycle(int(source.split("(")[1].split(",")[0]), 5e-3, cbs=cbs)
            except Crash:
                return None, keys
    return learn, keys


def test_two_cells_killed_in_the_second_resume_from_that_cell_alone(tmp_path, capsys):
    """Cell A trains a fit, cell B another; the kernel dies in B. The new kernel runs the setup cell
    and cell B only: B is recognised as the run's fit 2 (its cell, not the process's count of fits)."""
    ref, _ = cells(tmp_path / "ref", [CELL_A, CELL_B])
    assert cells(tmp_path / "run", [CELL_A, CELL_B], crash=(1, 5))[0] is None
    assert steps_saved(tmp_path / "run")[-1] == N_ITER + 4
    capsys.readouterr()
    got, _ = cells(tmp_path / "run", [CELL_B])
    out = capsys.readouterr().out
    assert "fit 2: 0 of 2 epochs done, 4 of 6 batches into the next" in out   # the resume line
    assert "fit 2 continues: 0 of 2 epochs done, 4 of 6 batches into the next" in out
    assert "skipped" not in out
    assert_same(ref, got)
    # the whole notebook run again in another kernel: A is skipped, B's end state is restored
    again, _ = cells(tmp_path / "run", [CELL_A, CELL_B])
    out = capsys.readouterr().out
    assert "fit 1 had completed before the restart (the checkpoint is in fit 2): skipped" in out
    assert "fit 2 (2 epochs) had completed before the restart: skipped, its end state restored" in out
    assert_same(ref, again)


def test_killed_between_cells_the_next_cell_starts_from_the_first_ones_end(tmp_path, capsys):
    """Killed in B before B saved anything: the newest checkpoint is A's end. Cell B alone in a new
    kernel is a fit the run has not seen: it trains from there, as it did in the uninterrupted kernel."""
    ref, _ = cells(tmp_path / "ref", [CELL_A, CELL_B])
    assert cells(tmp_path / "run", [CELL_A, CELL_B], crash=(1, 1))[0] is None
    assert steps_saved(tmp_path / "run")[-1] == N_ITER
    capsys.readouterr()
    got, _ = cells(tmp_path / "run", [CELL_B])
    assert "fit 2 is new to run 'run': it trains from the end of fit 1" in capsys.readouterr().out
    assert_same(ref, got)


def test_same_cell_twice_and_resume_training_finds_the_killed_execution(tmp_path, capsys):
    """Cells A, B, B (B run twice to train longer), killed in the second B. %resume_training re-runs
    that very execution (its recorded key): fit 3, not the first B's fit 2."""
    ref, _ = cells(tmp_path / "ref", [CELL_A, CELL_B, CELL_B])
    _, keys = cells(tmp_path / "run", [CELL_A, CELL_B, CELL_B], crash=(2, 6))
    capsys.readouterr()
    store = CheckpointStore(str(tmp_path / "run"))
    fits = from_files(store.read_files(store.list()[-1]))["fastai"]["fits"]
    assert [(f["key"], f["index"]) for f in fits] == [(k, 1) for k in keys]
    killed_key = keys[-1]   # %resume_training pins the key recorded with the checkpoint
    got, _ = cells(tmp_path / "run", [CELL_B], resuming=killed_key)
    out = capsys.readouterr().out
    assert "fit 3 continues: 0 of 2 epochs done, 4 of 6 batches into the next" in out, out
    assert_same(ref, got)


def test_each_cell_with_its_own_callback(tmp_path):
    """``cbs=DriveCheckpoint(path)`` in each training cell, the same path: cell B's new callback sees
    the end of A in the run and trains its own fit from there (it is not taken for A's fit 1)."""
    ref, _ = cells(tmp_path / "ref", [CELL_A, CELL_B])
    learn = _quiet(make_learner())
    for source, n_epoch in ((CELL_A, 1), (CELL_B, 2)):
        with cell(source):
            learn.fit_one_cycle(n_epoch, 5e-3, cbs=DriveCheckpoint(str(tmp_path / "run"), every=4))
    assert steps_saved(tmp_path / "run")[-1] == 3 * N_ITER
    assert_same(ref, learn)


def test_negative_control_fits_counted_per_process(tmp_path, monkeypatch, capsys):
    """Negative control: with fits identified by their number in the process (no cell) and not by
    their plan (cells A and B differ in epochs), the story of the first test leaves the model
    untrained: cell B alone is taken for fit 1 and skipped."""
    import keepalive.callbacks._fastai_state as fastai_state

    monkeypatch.setattr(fastai_state, "cell_identity", lambda: (None, None))
    monkeypatch.setattr(fastai_state.FitLog, "_prefer_plan", lambda self, candidates, at, plan: at)
    ref, _ = cells(tmp_path / "ref", [CELL_A, CELL_B])
    assert cells(tmp_path / "run", [CELL_A, CELL_B], crash=(1, 5))[0] is None
    got, _ = cells(tmp_path / "run", [CELL_B])
    assert "fit 1 had completed before the restart (the checkpoint is in fit 2): skipped" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="differs"):
        assert_same(ref, got)


# ------------------------------------------------------------------------- loaders and context
def test_loader_that_cannot_be_positioned_saves_at_epoch_ends(tmp_path, capsys):
    """A torch DataLoader inside fastai DataLoaders: no mid-epoch checkpoints (a save that falls due
    inside an epoch is taken at its end; a warning says so), and resuming at epoch ends is exact."""
    from fastai.data.core import DataLoaders
    from fastai_setup import NoisyImages

    def learner():
        learn = _quiet(make_learner())
        train = torch.utils.data.DataLoader(NoisyImages(96, 1), batch_size=16, shuffle=True)
        valid = torch.utils.data.DataLoader(NoisyImages(32, 2), batch_size=16)
        learn.dls = DataLoaders(train, valid)
        return learn

    ref, _ = session(tmp_path / "ref", every=4, learner=learner())
    assert "not a fastai DataLoader: checkpoints at epoch ends only" in capsys.readouterr().err
    session(tmp_path / "run", every=4, crash=11, learner=learner())
    assert all(s % N_ITER == 0 for s in steps_saved(tmp_path / "run"))
    got, _ = session(tmp_path / "run", every=4, learner=learner())
    assert_same(ref, got)


def test_dataset_without_batch_layout(tmp_path):
    """A plain dataset without ``n_inp``: fastai fetches one (randomly augmented) item the first time it
    needs the batch layout; that draw must happen at the same point in a resumed run."""
    from fastai_setup import PlainNoisyImages

    lkw = {"dataset": PlainNoisyImages}
    ref, _ = session(tmp_path / "ref", every=3, lkw=lkw)
    session(tmp_path / "run", every=3, crash=10, lkw=lkw)
    got, _ = session(tmp_path / "run", every=3, lkw=lkw)
    assert_same(ref, got)


def test_options_are_those_of_checkpoint_config(tmp_path):
    from keepalive.config import CheckpointConfig

    cb = DriveCheckpoint(config=CheckpointConfig(str(tmp_path / "run"), keep=1), every=2)
    assert cb.url == str(tmp_path / "run") and (cb.core.config.keep, cb.core.config.every) == (1, 2)
    with pytest.raises(TypeError, match="unexpected keyword argument.*model"):
        DriveCheckpoint(str(tmp_path / "other"), model=None)


def test_lr_find_validate_get_preds_are_not_fits(tmp_path, capsys):
    ckpt = DriveCheckpoint(str(tmp_path / "run"))
    learn = _quiet(make_learner(cbs=ckpt, path=str(tmp_path)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        learn.lr_find(num_it=8, show_plot=False)
    learn.validate()
    learn.get_preds()
    assert steps_saved(tmp_path / "run") == []
    learn.fit_one_cycle(1, 5e-3)
    assert steps_saved(tmp_path / "run") == [N_ITER]
    assert ckpt._n_fits == 1


def test_learner_pickles_with_the_callback_attached(tmp_path):
    """learn.export() pickles the learner with its callbacks: the checkpointer (threads, locks) is left
    out and rebuilt on demand, the event hook comes along."""
    import cloudpickle

    learn = _quiet(make_learner(cbs=DriveCheckpoint(str(tmp_path / "run")), path=str(tmp_path)))
    learn.fit(1, 1e-3)
    loaded = cloudpickle.loads(cloudpickle.dumps(learn))
    cb = loaded.drive_checkpoint
    assert isinstance(cb, DriveCheckpoint) and cb.url == str(tmp_path / "run")
    assert loaded.__dict__["_with_events"].cb is cb and cb.learn is loaded
    loaded.remove_cb(cb)
    assert "_with_events" not in loaded.__dict__


def test_importing_keepalive_does_not_import_fastai():
    code = ("import sys, keepalive, keepalive.core; "
            "assert 'fastai' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)
