"""The notebook face, in process: cell recording (with and without ``%load_ext``), the names a
training cell needs, replay rules, the status panel's text fallback, and the progress bars.

The real-kernel stories (SIGKILL and resume, the messages of ``%resume_training``) are in
``test_magics_kernel.py``. Here one IPython ``InteractiveShell`` is shared by the module and torn down
at its end, so no other test module sees an IPython shell.
"""
from __future__ import annotations

import json
import os
import sys
import time

import pytest

from keepalive import notebook as context
from keepalive import session
from keepalive.magics import cells

IPython = pytest.importorskip("IPython")


@pytest.fixture(scope="module")
def shell(tmp_path_factory):
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    saved_hooks = sys.displayhook, sys.excepthook
    old_dir = os.environ.get("IPYTHONDIR")
    os.environ["IPYTHONDIR"] = str(tmp_path_factory.mktemp("ipython"))
    cfg = Config()
    cfg.HistoryManager.hist_file = ":memory:"
    ip = InteractiveShell.instance(config=cfg)
    try:
        yield ip
    finally:
        try:
            ip.run_cell("%unload_ext keepalive")
        except Exception:  # noqa: BLE001
            pass
        context.unregister(None)
        InteractiveShell.clear_instance()
        sys.displayhook, sys.excepthook = saved_hooks
        if old_dir is None:
            os.environ.pop("IPYTHONDIR", None)
        else:
            os.environ["IPYTHONDIR"] = old_dir
        session.detect(refresh=True)


@pytest.fixture
def ka_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KEEPALIVE_DIR", str(tmp_path / "ckpts"))
    return tmp_path / "ckpts"


def run(ip, src):
    res = ip.run_cell(src, store_history=True)
    return res


SETUP = """\
import torch
from torch.utils.data import DataLoader, TensorDataset
from keepalive.callbacks.torch import DriveCheckpoint
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=8, shuffle=True)
"""


# ------------------------------------------------------------------------------ name analysis
def test_free_names_of_a_training_cell():
    cell = ("ckpt = DriveCheckpoint(run='x', model=model, optimizer=opt)\n"
            "import math\n"
            "for epoch in ckpt.epochs(EPOCHS):\n"
            "    for x, y in ckpt.batches(loader):\n"
            "        loss = F.cross_entropy(model(x), y) * math.pi\n"
            "        losses = [l for l in (loss,)]\n"
            "    print(len(losses), epoch)\n"
            "def helper(a, *rest, k=1, **kw):\n"
            "    return a + k + undefined_global\n"
            "%time print(ok)\n")
    assert cells.free_names(cell) == ["DriveCheckpoint", "model", "opt", "EPOCHS", "loader", "F",
                                         "undefined_global"]   # line magics' arguments are text
    assert cells.missing_names(cell, {"model": 1, "opt": 1, "DriveCheckpoint": 1, "EPOCHS": 1,
                                        "loader": 1, "F": 1}) == ["undefined_global"]
    # a name defined by an earlier statement of the same cell is not free; one read before it is
    assert cells.free_names("y = x\nx = 1\nz = x") == ["x"]
    assert cells.free_names("from m import *\nprint(a)") is None        # cannot tell
    assert cells.free_names("def broken(:") is None
    assert cells.free_names("%%time\nmodel.fit(data)\n") == ["model", "data"]
    assert cells.defined_names(SETUP) >= {"torch", "DataLoader", "TensorDataset", "DriveCheckpoint",
                                            "model", "opt", "loader"}


# ---------------------------------------------------------------------------------- recording
def test_capture_without_load_ext_reads_the_history(shell):
    assert not context.is_registered()
    run(shell, "a = 1")
    run(shell, "b = a + 1")
    res = run(shell, "from keepalive.notebook import capture_context\nctx = capture_context()")
    assert res.success
    ctx = shell.user_ns["ctx"]
    assert ctx["recorded_by"] == "history"
    assert ctx["cell"]["source"].startswith("from keepalive.notebook import capture_context")
    assert ctx["cell"]["execution_count"] == shell.execution_count - 1
    sources = [c["source"] for c in ctx["setup_cells"]]
    assert sources[-2:] == ["a = 1", "b = a + 1"]
    json.dumps(ctx)  # JSON-able
    assert context.capture_context(ip=None) is not None  # the shell is found by get_ipython()


def test_load_ext_records_cells_and_a_run_carries_them(shell, ka_dir, capsys):
    res = run(shell, "%load_ext keepalive")
    assert res.success
    assert context.is_registered() and session.tracker().registered
    assert "keepalive" in shell.magics_manager.magics["line"]
    assert run(shell, "raise ValueError('a failing cell')").success is False
    assert run(shell, SETUP).success
    train = ("ckpt = DriveCheckpoint(run='rec', model=model, optimizer=opt, every=2, quiet=True)\n"
             "for epoch in ckpt.epochs(2):\n"
             "    for x, y in ckpt.batches(loader):\n"
             "        opt.zero_grad(); torch.nn.functional.mse_loss(model(x), y).backward(); opt.step()\n")
    assert run(shell, train).success
    from keepalive import CheckpointStore

    meta = CheckpointStore(str(ka_dir / "rec")).list()[-1].manifest["metadata"]
    ctx = meta["context"]
    assert meta["finished"] is True
    assert ctx["recorded_by"] == "pre_run_cell" and ctx["kind"] == "ipython"
    assert ctx["cell"]["source"].rstrip() == train.rstrip()
    setup = {c["source"].rstrip(): c for c in ctx["setup_cells"]}
    assert setup[SETUP.rstrip()]["ok"] is True
    assert setup["raise ValueError('a failing cell')"]["ok"] is False
    assert ctx["cell"]["execution_count"] == setup[SETUP.rstrip()]["execution_count"] + 1


def test_split_cells_record_the_loop_cell(shell, ka_dir):
    """``ckpt = DriveCheckpoint(...)`` in one cell, the loop in the next: the loop's cell is the
    training cell, the creating cell a setup cell."""
    run(shell, "%load_ext keepalive")
    assert run(shell, SETUP).success
    make = "ckpt = DriveCheckpoint(run='split', model=model, optimizer=opt, every=2, quiet=True)"
    loop = ("for epoch in ckpt.epochs(1):\n"
            "    for x, y in ckpt.batches(loader):\n"
            "        opt.zero_grad(); torch.nn.functional.mse_loss(model(x), y).backward(); opt.step()")
    assert run(shell, make).success
    assert run(shell, loop).success
    from keepalive import CheckpointStore

    ctx = CheckpointStore(str(ka_dir / "split")).list()[-1].manifest["metadata"]["context"]
    assert ctx["cell"]["source"] == loop
    assert ctx["setup_cells"][-1]["source"] == make
    assert cells.missing_names(ctx["cell"]["source"], {}) == ["ckpt", "loader", "opt", "torch", "model"]


def test_replay_skips_what_must_not_run_again():
    from keepalive.magics import KeepaliveMagics

    skip = KeepaliveMagics._skip_reason
    train = "for e in ckpt.epochs(3):\n    pass"
    assert skip({"ok": True}, train + "\n", train) == "the training cell itself"
    assert skip({"ok": False}, "x = 1", train) == "it failed in the original session"
    assert skip({"ok": True}, "%resume_training --replay", train) == "%resume_training"
    assert skip({"ok": True}, "%load_ext keepalive\n%keepalive status", train) == "keepalive display only"
    assert skip({"ok": True}, "%keepalive dir", train) == "keepalive display only"
    assert skip({"ok": True}, "%keepalive dir /content/drive/MyDrive/x", train) is None
    assert skip({"ok": None}, "import torch", train) is None


def test_magic_help_and_bad_arguments(shell, capsys):
    run(shell, "%load_ext keepalive")
    capsys.readouterr()
    for line in ("%keepalive --help", "%keepalive status --help", "%keepalive dir --help",
                 "%keepalive ls --help", "%resume_training --help"):
        assert run(shell, line).success
        out = capsys.readouterr().out
        assert "usage: %" in out, line
    res = run(shell, "%keepalive frobnicate")
    assert isinstance(res.error_in_exec, IPython.core.error.UsageError)
    assert "invalid choice" in str(res.error_in_exec)


def test_unload_removes_everything(shell):
    run(shell, "%load_ext keepalive")
    assert run(shell, "%unload_ext keepalive").success
    assert "keepalive" not in shell.magics_manager.magics["line"]
    assert "resume_training" not in shell.magics_manager.magics["line"]
    assert not context.is_registered()
    assert not session.tracker().registered
    assert context.pre_run_cell not in shell.events.callbacks["pre_run_cell"]
    assert run(shell, "%load_ext keepalive").success
    assert "resume_training" in shell.magics_manager.magics["line"]


# ---------------------------------------------------------------------------------- the panel
def test_status_panel_has_the_text_fallback(ka_dir):
    pytest.importorskip("ipywidgets")
    from keepalive.magics.widget import StatusPanel, time_lines

    panel = StatusPanel(interval=1, full_every=1)
    try:
        bundle = panel.mimebundle()
        assert bundle["text/plain"].startswith("keepalive status: platform")
        assert "application/vnd.jupyter.widget-view+json" in bundle
        assert "session left" == panel.session_bar.description
    finally:
        panel.stop()
    bars = time_lines({"budget_seconds": 3600.0, "remaining_seconds": 900.0, "idle_timeout_seconds": 600.0,
                       "idle_seconds": 60.0, "platform": "colab"})
    assert bars["session"] == (0.25, "15 min 00 s left of 1 h 00 min")
    assert bars["idle"][0] == pytest.approx(0.9)
    assert time_lines({"budget_seconds": None, "platform": "local"})["session"][0] is None
    from keepalive.magics.widget import hardware_html, runs_html

    gpu = session._gpu_entry(0, "NVIDIA H200", 150e9, 2e9, 7.0)
    html = hardware_html({"hardware": {"gpus": [gpu], "shm_total_bytes": 1 << 26, "shm_total": "64.00 MiB"}})
    assert "GPU 0" in html and "NVIDIA H200" in html and "utilisation 7 %" in html and "/dev/shm" in html
    html = runs_html({"checkpoint_dir": "/d", "runs": [{"run": "r<1>", "checkpoints": 2, "newest_step": 9,
                                                        "newest_epoch": 1, "newest_created": "t"}]})
    assert "r&lt;1&gt;" in html and "newest step 9" in html


# ------------------------------------------------------------------------------ progress bars
def _train(url, epochs=2, **kw):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from keepalive.callbacks.torch import DriveCheckpoint

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(16, 64), torch.randn(16, 64)), batch_size=8)
    ckpt = DriveCheckpoint(url, model=model, optimizer=opt, **kw)
    for _ in ckpt.epochs(epochs):
        for x, y in ckpt.batches(loader):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    ckpt.close()
    return ckpt


def test_upload_bar_for_large_saves(tmp_path, monkeypatch, capsys):
    pytest.importorskip("tqdm")
    monkeypatch.delenv("KEEPALIVE_PROGRESS", raising=False)   # automatic (other modules turn it off)
    monkeypatch.setenv("KEEPALIVE_PROGRESS_MIN_BYTES", "1000")   # the test's 16 KiB state is "large"
    long_name = "a-run-name-much-longer-than-any-label-should-be"
    _train(str(tmp_path / "runs" / long_name))
    captured = capsys.readouterr()
    err, out = captured.err, captured.out
    # the label is the run's name, shortened; the step is the postfix; never the URL in the label
    label = "saving a-run-name-...-should-be"
    assert label in err and "step 2" in err and "B/s" in err, err
    assert str(tmp_path) not in err, err
    # each complete write is confirmed once, in one line, with where it went
    wrote = [ln for ln in out.splitlines() if ln.startswith("keepalive: wrote step")]
    assert len(wrote) == 2, out
    assert wrote[-1].startswith(f"keepalive: wrote step 4 of '{long_name}' (") and "/s)" in wrote[-1]
    monkeypatch.setenv("KEEPALIVE_PROGRESS_MIN_BYTES", str(1 << 30))
    _train(str(tmp_path / "small"))
    captured = capsys.readouterr()
    assert "saving small" not in captured.err and "wrote step" not in captured.out
    monkeypatch.setenv("KEEPALIVE_PROGRESS_MIN_BYTES", "1000")
    monkeypatch.setenv("KEEPALIVE_PROGRESS", "0")
    _train(str(tmp_path / "off"))
    captured = capsys.readouterr()
    assert "saving off" not in captured.err and "wrote step" not in captured.out


def test_bar_labels_are_short():
    from keepalive import progress

    assert progress.label("pets") == "pets"
    shortened = progress.label("x" * 10 + "-middle-" + "y" * 30)
    assert len(shortened) == progress.LABEL_WIDTH and shortened.startswith("xxxxxxxxxx") and "..." in shortened
    assert progress.run_name("gs://bucket/runs/pets/") == "pets"
    assert progress.confirmation("wrote", 7, "pets", 2 << 20, 2.0, "gs://b/pets") == (
        "wrote step 7 of 'pets' (2.00 MiB in 2.0 s, 1.00 MiB/s) to gs://b/pets")


def test_epoch_bar_shows_session_time_left(tmp_path, monkeypatch, capsys):
    pytest.importorskip("tqdm")
    monkeypatch.delenv("KEEPALIVE_PROGRESS", raising=False)
    monkeypatch.setenv("KEEPALIVE_BUDGET", "2h")
    # the budget counts from a known start, not from this machine's (a host up for hours has none left)
    monkeypatch.setenv("KEEPALIVE_SESSION_START", str(int(time.time()) - 600))  # began 10 min ago
    session.detect(refresh=True)
    try:
        _train(str(tmp_path / "eta"), epochs=3)
        err = capsys.readouterr().err
        assert "session left 1 h" in err and "3/3" in err
        _train(str(tmp_path / "quiet"), epochs=3, quiet=True)
        assert "session left" not in capsys.readouterr().err
    finally:
        monkeypatch.delenv("KEEPALIVE_BUDGET")
        monkeypatch.delenv("KEEPALIVE_SESSION_START")
        session.detect(refresh=True)
    _train(str(tmp_path / "nobudget"), epochs=3)    # no session limit: no bar
    assert "session left" not in capsys.readouterr().err


# ------------------------------------------------------------------------ %resume_training edges
def _crashing_run(shell, name, crash_at=3):
    assert run(shell, SETUP).success
    train = (f"ckpt = DriveCheckpoint(run={name!r}, model=model, optimizer=opt, every=1, quiet=True)\n"
             "for epoch in ckpt.epochs(2):\n"
             "    for x, y in ckpt.batches(loader):\n"
             "        opt.zero_grad(); torch.nn.functional.mse_loss(model(x), y).backward(); opt.step()\n"
             f"        if CRASH and ckpt.step + 1 == {crash_at}: raise RuntimeError('crash')\n")
    assert run(shell, "CRASH = True").success
    assert run(shell, train).success is False
    run(shell, "ckpt.close()")
    assert run(shell, "CRASH = False").success


def test_resume_training_waits_for_a_live_writer_unless_takeover(shell, ka_dir, capsys):
    import time as _time

    run(shell, "%load_ext keepalive")
    _crashing_run(shell, "leased")
    lease = {"owner": "another-session", "host": __import__("socket").gethostname(), "pid": 1,
             "pid_start": None, "heartbeat": _time.time(), "ttl": 120.0, "released": False}
    (ka_dir / "leased" / "LEASE.json").write_text(json.dumps(lease))
    from keepalive.magics import unfinished_notice

    assert "is being trained right now by another session" in unfinished_notice(str(ka_dir))
    capsys.readouterr()
    res = run(shell, "%resume_training leased")
    assert isinstance(res.error_in_exec, IPython.core.error.UsageError)
    assert "being written by another live session" in str(res.error_in_exec)
    assert "--takeover" in str(res.error_in_exec)
    res = run(shell, "%resume_training leased --takeover")
    out = capsys.readouterr().out
    assert res.success, out
    assert "took run 'leased' over" in out and "re-running training cell" in out
    assert shell.user_ns["ckpt"].finished and shell.user_ns["ckpt"].core.resumed_from is not None


def test_resume_training_by_path_and_runs_without_a_cell(shell, ka_dir, tmp_path, capsys):
    from keepalive import CheckpointStore

    run(shell, "%load_ext keepalive")
    _crashing_run(shell, "bypath")
    capsys.readouterr()
    assert run(shell, f"%resume_training {ka_dir / 'bypath'}").success
    assert "re-running training cell" in capsys.readouterr().out
    assert shell.user_ns["ckpt"].core.resumed_from is not None
    assert run(shell, f"%resume_training {ka_dir / 'bypath'}").success
    assert "run 'bypath' has finished" in capsys.readouterr().out

    other = tmp_path / "elsewhere"
    script = CheckpointStore(str(other / "scripted"))
    script.commit({"a.bin": b"x"}, step=1, epoch=0, metadata={
        "finished": False, "context": {"kind": "script", "path": "/x/train.py", "argv": ["train.py"]}})
    script.close()
    res = run(shell, f"%resume_training {other / 'scripted'}")
    assert "started by the script /x/train.py" in str(res.error_in_exec)
    bare = CheckpointStore(str(other / "bare"))
    bare.commit({"a.bin": b"x"}, step=1, epoch=0, metadata={"finished": False})
    bare.close()
    res = run(shell, f"%resume_training --dir {other} bare")
    assert "has no recorded notebook cell" in str(res.error_in_exec)
    res = run(shell, f"%resume_training {tmp_path / 'nothing-here'}")
    assert "nothing to resume at" in str(res.error_in_exec)


def test_recording_can_be_limited(shell, monkeypatch):
    run(shell, "x = 1")
    monkeypatch.setenv("KEEPALIVE_RECORD_CELLS", "cell")
    ctx = context.capture_context(shell)
    assert ctx["cell"]["source"] and ctx["setup_cells"] == [] and ctx["setup_cells_left_out"] > 0
    monkeypatch.setenv("KEEPALIVE_RECORD_CELLS", "none")
    assert context.capture_context(shell) is None


def test_colab_shell_counts_as_a_notebook_front_end():
    """Colab's shell subclasses ipykernel's ZMQInteractiveShell under another name."""
    from keepalive.magics.widget import is_notebook_shell

    class ZMQInteractiveShell:  # stands in for ipykernel's class
        pass

    class Shell(ZMQInteractiveShell):  # google.colab._shell.Shell
        pass

    assert is_notebook_shell(Shell()) and is_notebook_shell(ZMQInteractiveShell())
    assert not is_notebook_shell(object())


def test_checkpoints_waiting_in_the_spool_count(shell, ka_dir, tmp_path, monkeypatch, capsys):
    """A kernel that died before its uploads finished leaves checkpoints in the local spool (Drive,
    buckets): the notice and %resume_training see them, as the DriveCheckpoint's own resume does."""
    import shutil

    from keepalive import CheckpointStore
    from keepalive.magics import scan_runs, unfinished_notice
    from keepalive.spool import Spool

    run(shell, "%load_ext keepalive")
    _crashing_run(shell, "spooled", crash_at=6)
    # move the run's checkpoints into the spool of another destination, which has none
    monkeypatch.setenv("KEEPALIVE_SPOOL", str(tmp_path / "spool"))
    dest_root = tmp_path / "drive"
    dest = CheckpointStore(str(dest_root / "spooled"), keep=None)
    spool = Spool.for_destination(dest)
    spool.write_record(dest, None)
    os.makedirs(spool.path, exist_ok=True)
    for folder in (ka_dir / "spooled").iterdir():
        if folder.name.startswith("ckpt-"):
            shutil.copytree(folder, os.path.join(spool.path, folder.name))
    assert not dest_root.exists()

    runs = scan_runs(str(dest_root))
    assert [r.run for r in runs] == ["spooled"] and runs[0].unfinished
    assert runs[0].in_spool(runs[0].newest)
    assert "not uploaded yet" in unfinished_notice(str(dest_root))

    monkeypatch.setenv("KEEPALIVE_DIR", str(dest_root))
    capsys.readouterr()
    res = run(shell, "%resume_training")
    out = capsys.readouterr().out
    assert res.success, out
    assert "in the local spool, not uploaded yet" in out and "re-running training cell" in out
    ckpt = shell.user_ns["ckpt"]
    assert ckpt.finished and ckpt.core.resumed_from is not None and ckpt.core.resumed_from.step == 5


# ------------------------------------------------------- runs elsewhere: the index of runs
def _crashing_path_run(shell, path, crash_at=3):
    """A run at an explicit path (as every README example writes one), its training crashed."""
    assert run(shell, SETUP).success
    train = (f"ckpt = DriveCheckpoint({str(path)!r}, model=model, optimizer=opt, every=1, quiet=True)\n"
             "for epoch in ckpt.epochs(2):\n"
             "    for x, y in ckpt.batches(loader):\n"
             "        opt.zero_grad(); torch.nn.functional.mse_loss(model(x), y).backward(); opt.step()\n"
             f"        if CRASH and ckpt.step + 1 == {crash_at}: raise RuntimeError('crash')\n")
    assert run(shell, "CRASH = True").success
    assert run(shell, train).success is False
    run(shell, "ckpt.close()")
    assert run(shell, "CRASH = False").success


def test_runs_at_explicit_paths_are_named_and_a_bare_resume_says_which_it_picks(shell, ka_dir, tmp_path,
                                                                                capsys):
    """Issue 14, items 8 and 9: runs outside the default dir are recorded in its RUNS.json; the
    notice names each unfinished one with its folder; a bare %resume_training with two unfinished
    runs says which it resumes and how to name the other, then the other is resumed in turn."""
    from keepalive.magics import unfinished_notice
    from keepalive.runs import RUN_INDEX, read_run_index

    drive = tmp_path / "drive" / "MyDrive" / "runs"
    run(shell, "%load_ext keepalive")
    _crashing_path_run(shell, drive / "alpha", crash_at=3)
    _crashing_path_run(shell, drive / "beta", crash_at=5)
    assert (ka_dir / RUN_INDEX).is_file()
    assert set(read_run_index(str(ka_dir))) == {str(drive / "alpha"), str(drive / "beta")}

    notice = unfinished_notice()
    assert f"unfinished run 'beta' in {drive / 'beta'}" in notice, notice
    assert "1 more unfinished run(s)" in notice
    assert f"'alpha' in {drive / 'alpha'}" in notice and f"%resume_training {drive / 'alpha'}" in notice

    capsys.readouterr()
    assert run(shell, "%keepalive ls").success
    out = capsys.readouterr().out
    assert f"runs elsewhere (recorded in {ka_dir}/{RUN_INDEX})" in out and f"in {drive / 'alpha'}" in out

    res = run(shell, "%resume_training")
    out = capsys.readouterr().out
    assert res.success, out
    assert "2 unfinished runs; resuming the newest: 'beta'" in out, out
    assert f"Also waiting: 'alpha' in {drive / 'alpha'}" in out
    assert f"to resume it: %resume_training {drive / 'alpha'}" in out
    assert shell.user_ns["ckpt"].url == str(drive / "beta") and shell.user_ns["ckpt"].finished

    res = run(shell, "%resume_training")             # one left: resumed without a word about others
    out = capsys.readouterr().out
    assert res.success, out
    assert "unfinished runs" not in out and "re-running training cell" in out
    assert shell.user_ns["ckpt"].url == str(drive / "alpha") and shell.user_ns["ckpt"].finished
    assert unfinished_notice() is None


def test_a_name_shared_by_two_unfinished_runs_asks_for_a_folder(shell, ka_dir, tmp_path, capsys):
    run(shell, "%load_ext keepalive")
    _crashing_path_run(shell, tmp_path / "one" / "same")
    _crashing_path_run(shell, tmp_path / "two" / "same")
    res = run(shell, "%resume_training same")
    err = str(res.error_in_exec)
    assert isinstance(res.error_in_exec, IPython.core.error.UsageError)
    assert "2 unfinished runs are named 'same'" in err and "name one by its folder" in err
    assert f"%resume_training {tmp_path / 'one' / 'same'}" in err
    assert f"%resume_training {tmp_path / 'two' / 'same'}" in err
    # a name that is not unique is never offered as the way to name a run
    from keepalive.magics import unfinished_notice

    notice = unfinished_notice()
    assert f"%resume_training {tmp_path / 'one' / 'same'}" in notice, notice


def test_ls_header_and_table_agree(shell, ka_dir, tmp_path, capsys):
    """%keepalive ls names the runs and lists their checkpoints from one listing: a run recorded
    elsewhere (the default dir itself holds nothing) is in both, never followed by "no checkpoints";
    with --verify a damaged newest checkpoint is INVALID in the table and not where the header says
    the run resumes (control: without --verify the header names it, unverified)."""
    from keepalive.store import CheckpointStore

    run(shell, "%load_ext keepalive")
    away = tmp_path / "drive" / "runs" / "gamma"
    _crashing_path_run(shell, away, crash_at=4)          # checkpoints at steps 1, 2, 3
    assert not ka_dir.exists() or not any(p.name.startswith("ckpt-") for p in ka_dir.rglob("*"))
    capsys.readouterr()
    assert run(shell, "%keepalive ls").success
    out = capsys.readouterr().out
    assert "runs elsewhere" in out and "gamma" in out and "no checkpoints" not in out, out
    table = [ln for ln in out.splitlines() if ln.startswith("gamma ")]
    assert len(table) == 3 and all(ln.rstrip().endswith("unverified") for ln in table), out

    store = CheckpointStore(str(away), keep=None)
    newest = store.list()[-1]
    data = next(p for p in (away / newest.name).iterdir() if p.name != "MANIFEST.json" and p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))

    assert run(shell, "%keepalive ls").success                      # control: not re-read
    out = capsys.readouterr().out
    assert f"UNFINISHED at step {newest.step}, {newest.epoch} epoch(s) done ({newest.name}" in out, out
    assert run(shell, "%keepalive ls --verify").success
    out = capsys.readouterr().out
    rows = {ln.split()[1]: ln for ln in out.splitlines() if ln.startswith("gamma ")}
    assert "INVALID" in rows[newest.name], out
    header = next(ln for ln in out.splitlines() if "UNFINISHED" in ln)
    assert f"({newest.name}" not in header.split("(the newer")[0], header
    assert f"the newer {newest.name} is INVALID" in header and "falls back past it" in header, header
    older = store.list()[-2]
    assert f"step {older.step}, {older.epoch} epoch(s) done ({older.name}" in header, header
    assert rows[older.name].rstrip().endswith("ok"), out


def test_status_panel_lists_runs_opened_with_a_path(shell, ka_dir, tmp_path):
    """The README's own form, DriveCheckpoint("/content/drive/MyDrive/runs/x"): the run lies outside
    the checkpoint dir; the panel (widget and text) lists it from the index of runs."""
    pytest.importorskip("ipywidgets")
    from keepalive import status
    from keepalive.magics.widget import StatusPanel, runs_html

    run(shell, "%load_ext keepalive")
    away = tmp_path / "MyDrive" / "runs" / "delta"
    _crashing_path_run(shell, away)
    panel = StatusPanel(interval=1, full_every=1)
    try:
        html = panel.runs.value
    finally:
        panel.stop()
    assert "delta" in html and str(away) in html and "UNFINISHED" in html, html
    assert "delta" in status.format_status(status.status_report()) and "UNFINISHED" in html
    # control: a report without runs elsewhere shows no such section
    assert "elsewhere" not in runs_html({"checkpoint_dir": "/d", "runs": [], "other_runs": []})


def test_epoch_bar_postfix_is_short_and_the_eta_is_said_once(capsys):
    """The epoch bar's postfix stays short (the rate must stay in view in JupyterLab); an ETA past
    the session's end is marked there and said once in full."""
    from types import SimpleNamespace

    from keepalive.progress import TrainingProgress

    core = SimpleNamespace(total_epochs=5, counters={"epoch": 1}, store=SimpleNamespace(run="pets"),
                           trigger=SimpleNamespace(remaining=lambda: 100.0, epoch_seconds=60.0))
    bar = TrainingProgress(core)
    assert bar.postfix() == "session left 1 min 40 s (ETA past it)"
    assert bar.postfix() == "session left 1 min 40 s (ETA past it)"
    err = capsys.readouterr().err
    assert err.count("keepalive: warning: run 'pets': the epochs left need about 4 min 00 s") == 1, err
    core.trigger.epoch_seconds = 10.0    # control: it fits
    assert TrainingProgress(core).postfix() == "session left 1 min 40 s"
    assert "warning" not in capsys.readouterr().err
