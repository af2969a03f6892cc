"""What the user reads when keepalive stops them or cannot go on: one clear line, not a traceback
through the framework and keepalive's internals; and the facts behind such lines found at once.

* In a real IPython kernel (jupyter_client), with and without ``%load_ext keepalive``: a
  ``RunLockedError`` (another session holds the run's writer lease) and the ``KeyboardInterrupt``
  keepalive re-raises after saving on "Interrupt kernel" are shown as their message plus one hint
  line; ``%tb`` still shows the full traceback; controls: ``%xmode Verbose`` and an error of the
  user's own code keep IPython's full traceback.
* ``gs://`` without any Google Cloud credentials says so in one line at once (not after the 15 s
  connect timeout); the real gcp-storage-emulator still works (control).
* ``KEEPALIVE_SESSION_START`` in the future is warned about and clamped; a budget already used up
  is named, with its clock, at ``%load_ext``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from keepalive import session
from keepalive.backends import missing_google_credentials
from keepalive.errors import StorageError
from keepalive.magics.tracebacks import HINT
from kernelkit import Kernel, kernel_env  # tests/kernelkit.py

pytest.importorskip("torch")
pytest.importorskip("ipykernel")

TRAIN = textwrap.dedent("""
    import time, torch
    from keepalive.callbacks.torch import DriveCheckpoint
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 4)), batch_size=8)
    ckpt = DriveCheckpoint({path!r}, model=model, optimizer=opt, every=2)
    for epoch in ckpt.epochs(3):
        for (x,) in ckpt.batches(data):
            opt.zero_grad(); model(x).pow(2).mean().backward(); opt.step()
            print("STEP", flush=True)
            time.sleep({sleep})
""")


def _error_lines(stderr: str) -> list:
    return [ln for ln in stderr.strip().splitlines() if ln.strip()]


def test_user_facing_errors_are_short_in_a_kernel(tmp_path):
    """RunLockedError without %load_ext (importing a callback is enough), then with it; the
    interrupt keepalive re-raises after its save; %tb; and the two controls."""
    from keepalive.store import CheckpointStore

    locked = tmp_path / "runs" / "locked"
    holder = CheckpointStore(str(locked))
    locked.mkdir(parents=True)
    holder.lease.acquire()  # this test process: another live session, for the kernel
    try:
        with Kernel(env=kernel_env(tmp_path / "default", tmp_path)) as k:
            res = k.run(TRAIN.format(path=str(locked), sleep=0))
            assert res.status == "error" and res.ename == "RunLockedError", res.text
            lines = _error_lines(res.stderr)
            assert len(lines) == 2, res.stderr
            assert "RunLockedError" in lines[0] and "being written by another session" in lines[0]
            assert lines[1] == HINT

            full = k.run("%tb")  # the whole traceback is one magic away
            assert "RunLockedError" in full.text and len(_error_lines(full.text)) > 15, full.text
            assert "keepalive/store.py" in full.text

            # control: an error of the user's own code keeps IPython's traceback
            own = k.run("def f():\n    return 1 / 0\nf()")
            assert own.ename == "ZeroDivisionError" and HINT not in own.stderr
            assert len(_error_lines(own.stderr)) > 4, own.stderr

            # control: %xmode Verbose shows keepalive's errors in full again
            k.run_ok("%xmode Verbose")
            verbose = k.run(TRAIN.format(path=str(locked), sleep=0))
            assert verbose.ename == "RunLockedError" and HINT not in verbose.stderr
            assert len(_error_lines(verbose.stderr)) > 15, verbose.stderr
            k.run_ok("%xmode Context")

            # %load_ext keeps the short form (one handler, not two), %unload_ext removes it
            k.run_ok("%load_ext keepalive")
            again = k.run(TRAIN.format(path=str(locked), sleep=0))
            assert _error_lines(again.stderr)[-1] == HINT and len(_error_lines(again.stderr)) == 2, again.stderr
            k.run_ok("%unload_ext keepalive")
            unloaded = k.run(TRAIN.format(path=str(locked), sleep=0))
            assert unloaded.ename == "RunLockedError" and HINT not in unloaded.stderr, unloaded.stderr
    finally:
        holder.lease.release()


def test_the_interrupt_after_the_save_is_short(tmp_path):
    """'Interrupt kernel' during training: keepalive saves at the end of the step, says so, and
    re-raises KeyboardInterrupt, shown as one line (its message says it saved)."""
    run = tmp_path / "runs" / "interrupted"
    with Kernel(env=kernel_env(tmp_path / "default", tmp_path)) as k:
        k.start(TRAIN.format(path=str(run), sleep=0.2))
        k.read_until(lambda r: "STEP" in r.stdout, timeout=120)
        k.km.interrupt_kernel()
        out = k.read_until(lambda r: r.ename is not None, timeout=120)
        assert out.ename == "KeyboardInterrupt", out.text
        assert "keepalive: SIGINT: saved" in out.stdout + out.stderr, out.text
        tail = _error_lines(out.stderr)[-2:]
        assert tail[1] == HINT and "keepalive saved (see the line above)" in tail[0], out.stderr
        assert "Traceback" not in out.stderr and "----> " not in out.stderr, out.stderr


# ------------------------------------------------------------------------------------------ gs://
def _no_google(tmp_path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GOOGLE_", "GCE_", "CLOUDSDK_", "FSSPEC_")) and k != "STORAGE_EMULATOR_HOST"}
    env.update(HOME=str(tmp_path / "home"), GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false", **extra)
    return env


def test_gs_without_credentials_says_so_at_once(tmp_path):
    env = _no_google(tmp_path)
    if missing_google_credentials(env=env) is None:
        pytest.skip("this machine is a Google Cloud VM (its metadata server may hold credentials)")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "keepalive", "ls", "gs://some-bucket/runs/x"], env=env,
                       capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - t0
    assert r.returncode == 1 and elapsed < 10, (elapsed, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "no Google Cloud credentials" in lines[0], r.stderr
    assert "GOOGLE_APPLICATION_CREDENTIALS" in lines[0] and "--storage-options" in lines[0]

    # the Python API: the checkpointer's store raises it when created, in well under a second
    code = ("import time; t = time.monotonic()\n"
            "from keepalive.store import CheckpointStore\n"
            "try:\n    CheckpointStore('gs://some-bucket/runs/x')\n"
            "except Exception as e:\n    print(type(e).__name__, round(time.monotonic() - t, 1), e)\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    name, seconds, message = r.stdout.split(" ", 2)
    assert name == "StorageError" and float(seconds) < 5, r.stdout + r.stderr
    assert "no Google Cloud credentials" in message and "authenticate_user()" in message


def test_what_counts_as_google_credentials(tmp_path):
    env = _no_google(tmp_path)
    if missing_google_credentials(env=env) is None:
        pytest.skip("this machine is a Google Cloud VM")
    adc = tmp_path / "gcloud" / "application_default_credentials.json"
    adc.parent.mkdir()
    adc.write_text("{}")
    for found in ({"token": "anon"}, {"endpoint_url": "http://127.0.0.1:1"}):
        assert missing_google_credentials(found, env=env) is None
    for extra in ({"GOOGLE_APPLICATION_CREDENTIALS": "/k.json"}, {"STORAGE_EMULATOR_HOST": "http://x"},
                  {"CLOUDSDK_CONFIG": str(adc.parent)}, {"GCE_METADATA_HOST": "169.254.169.254"}):
        assert missing_google_credentials(env=dict(env, **extra)) is None, extra


def test_gs_emulator_still_works(gcs_server, tmp_path):
    """Control: the real gcp-storage-emulator, reached through its endpoint env (the tests' way)
    and through explicit storage options (token anon, endpoint) with no env at all."""
    from keepalive.store import CheckpointStore

    url = gcs_server.url("messages", "run")
    store = CheckpointStore(url, keep=None, storage_options=gcs_server.storage_options)
    store.commit({"w.bin": b"x" * 10}, step=1, epoch=0, metadata={})
    r = subprocess.run([sys.executable, "-m", "keepalive", "ls", url, "--json"], capture_output=True,
                       text=True, timeout=120, env=dict(os.environ))
    assert r.returncode == 0 and json.loads(r.stdout.splitlines()[0])["step"] == 1, r.stderr
    r = subprocess.run([sys.executable, "-m", "keepalive", "ls", url, "--json", "--storage-options",
                        json.dumps(gcs_server.storage_options)], capture_output=True, text=True,
                       timeout=120, env=_no_google(tmp_path))
    assert r.returncode == 0 and json.loads(r.stdout.splitlines()[0])["step"] == 1, r.stderr
    with pytest.raises(StorageError, match="no Google Cloud credentials"):
        # negative control: the same URL, no options and no emulator env, is refused at once
        from keepalive.backends import backend_for

        old = os.environ.pop("STORAGE_EMULATOR_HOST")
        try:
            if missing_google_credentials() is None:
                pytest.skip("this machine is a Google Cloud VM")
            backend_for(url)
        finally:
            os.environ["STORAGE_EMULATOR_HOST"] = old


# ------------------------------------------------------------------------------- session clock
def test_a_session_start_in_the_future_is_warned_and_clamped(monkeypatch, capsys):
    from keepalive import status

    future = time.time() + 3 * 3600
    monkeypatch.setenv("KEEPALIVE_SESSION_START", str(int(future)))
    monkeypatch.setenv("KEEPALIVE_BUDGET", "4h")
    try:
        info = session.detect(refresh=True)
        err = capsys.readouterr().err
        assert "KEEPALIVE_SESSION_START" in err and "in the future" in err and "counted from now" in err
        assert abs(info.start_time - time.time()) < 60
        assert info.elapsed_seconds() >= 0
        assert 3.9 * 3600 < info.remaining_seconds() <= 4 * 3600
        report = status.status_report()
        assert report["elapsed_seconds"] >= 0
        assert any("in the future" in w for w in report["warnings"]), report["warnings"]
        from keepalive.magics import widget

        assert "in the future" in widget.warnings_html(report["warnings"])
        # control: a start in the past is taken as given, no warning
        monkeypatch.setenv("KEEPALIVE_SESSION_START", str(int(time.time() - 600)))
        info = session.detect(refresh=True)
        assert 590 < info.elapsed_seconds() < 700 and not info.warnings
    finally:
        monkeypatch.undo()
        session.detect(refresh=True)


def test_load_ext_says_the_budget_is_used_up_and_from_which_clock(tmp_path):
    """A budget shorter than the time since its clock's start (Colab: the VM's start) is named at
    %load_ext, with the clock; control: a budget with time left says nothing of the kind."""
    env = kernel_env(tmp_path / "default", tmp_path)
    env.update(KEEPALIVE_BUDGET="2min", KEEPALIVE_CLOCK="vm")
    with Kernel(env=env) as k:
        out = k.run_ok("%load_ext keepalive").stdout
    assert "budget of 2 min 00 s (KEEPALIVE_BUDGET=2min) is already used up" in out, out
    assert "start of the vm clock" in out and "KEEPALIVE_CLOCK=kernel" in out, out
    env.update(KEEPALIVE_BUDGET="5h", KEEPALIVE_CLOCK="kernel")
    with Kernel(env=env) as k:
        out = k.run_ok("%load_ext keepalive").stdout
    assert "used up" not in out, out
