"""keepalive.session: platform detection, budgets, clocks, idle tracking, hardware; keepalive.status:
`keepalive status` (and `--settings`).

Platforms are simulated by the environment variables each platform sets itself, in real
subprocesses running ``python -m keepalive status --json``. The one mock: a fake ``google.colab``
package on PYTHONPATH stands in for Colab's own module (it exists only on Colab). A fake
``nvidia-smi`` script stands in for the NVIDIA tool on this GPU-less machine (its CSV parsing is
what is tested; the real tool is used where one exists).
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from keepalive import session, status
from keepalive.session import platforms as session_platforms

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_STRIP_PREFIXES = ("COLAB_", "KAGGLE_", "PAPERSPACE_", "DATABRICKS_", "KEEPALIVE_", "TPU_", "JPY_")
_STRIP_NAMES = ("VSCODE_PID", "XRT_TPU_CONFIG", "PYCHARM_HOSTED", "JUPYTER_SERVER_ROOT")


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_STRIP_PREFIXES) and k not in _STRIP_NAMES}
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


def run_cli(env: dict, *args: str, cwd=None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "keepalive", *args], env=env, cwd=cwd or REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc


def status_json(tmp_path, *args: str, **env_extra: str) -> dict:
    env = clean_env(**env_extra)
    env.setdefault("KEEPALIVE_DIR", str(tmp_path / "ckpt"))
    env.setdefault("KEEPALIVE_SPOOL", str(tmp_path / "spool"))  # not the machine's real spool
    return json.loads(run_cli(env, "status", "--json", *args, cwd=str(tmp_path)).stdout)


@pytest.fixture
def fresh(monkeypatch):
    """In-process: a clean environment and no cached detection or configure() settings."""
    for k in list(os.environ):
        if k.startswith(_STRIP_PREFIXES) or k in _STRIP_NAMES:
            monkeypatch.delenv(k)
    session_platforms._OVERRIDES.clear()
    session_platforms._INFO = None
    yield
    session_platforms._OVERRIDES.clear()
    session_platforms._INFO = None


# ----------------------------------------------------------------------------- import and CLI
def test_import_is_cheap_and_framework_free():
    code = ("import sys, time; t = time.perf_counter(); import keepalive.session; "
            "print(time.perf_counter() - t); "
            "print(sorted(m for m in ('torch', 'tensorflow', 'keras', 'fastai', 'IPython', 'ipykernel', "
            "'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True,
                         text=True, timeout=60, check=True).stdout.splitlines()
    assert out[1] == "[]"
    assert float(out[0]) < 1.0


def test_status_help():
    out = run_cli(clean_env(), "status", "--help").stdout
    assert "--json" in out and "KEEPALIVE_BUDGET" in out


# ---------------------------------------------------------------------------- platform table
H = 3600.0


@pytest.mark.parametrize("env, platform, profile, budget, idle, source_has", [
    ({}, "local", "local", None, None, "local profile"),
    ({"COLAB_RELEASE_TAG": "release-colab_20250101-060000_RC00"}, "colab", "colab", 12 * H, 90 * 60.0,
     "research.google.com/colaboratory/faq"),
    ({"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}, "kaggle", "kaggle", 12 * H, 20 * 60.0,
     "kaggle.com/docs/notebooks"),
    ({"KAGGLE_KERNEL_RUN_TYPE": "Batch"}, "kaggle", "kaggle", 12 * H, None, "kaggle.com/docs/notebooks"),
    ({"KAGGLE_KERNEL_RUN_TYPE": "Interactive", "TPU_NAME": "local"}, "kaggle", "kaggle-tpu", 9 * H,
     20 * 60.0, "9 h per TPU"),
    ({"KAGGLE_KERNEL_RUN_TYPE": "Batch", "TPU_ACCELERATOR_TYPE": "v3-8"}, "kaggle", "kaggle-tpu", 9 * H,
     None, "9 h per TPU"),
    ({"PAPERSPACE_NOTEBOOK_REPO_ID": "abc123"}, "paperspace", "paperspace", None, None, "paperspace profile"),
    ({"DATABRICKS_RUNTIME_VERSION": "15.4"}, "databricks", "databricks", None, None, "databricks profile"),
    ({"KEEPALIVE_PLATFORM": "kaggle"}, "kaggle", "kaggle", 12 * H, 20 * 60.0, "kaggle.com"),
    ({"COLAB_RELEASE_TAG": "x", "KEEPALIVE_PROFILE": "colab-pro+"}, "colab", "colab-pro+", 24 * H,
     90 * 60.0, "colab.research.google.com/signup"),
])
def test_simulated_platforms(tmp_path, env, platform, profile, budget, idle, source_has):
    r = status_json(tmp_path, **env)
    assert r["platform"] == platform
    assert r["profile"] == profile
    assert r["budget_seconds"] == budget
    assert r["idle_timeout_seconds"] == idle
    assert source_has in r["budget_source"]
    assert r["idle_seconds"] == 0   # a subprocess outside a notebook is running code, not idle
    if budget is None:
        assert r["remaining_seconds"] is None
    else:
        assert r["remaining_seconds"] == pytest.approx(budget - r["elapsed_seconds"], abs=1.0)
    assert r["clock"] == {"colab": "vm", "paperspace": "vm"}.get(platform, "process")
    for key in ("elapsed_seconds", "session_start", "hardware", "warnings", "checkpoint_dir", "runs",
                "pending_uploads", "clock"):
        assert key in r
    assert r["pending_uploads"] is None
    if platform == "kaggle":
        assert r["run_type"] == env.get("KAGGLE_KERNEL_RUN_TYPE")


def test_colab_detected_from_its_module(tmp_path):
    # The only mock: Colab's own `google.colab` package, which exists only on Colab VMs. A namespace
    # portion (no google/__init__.py) so the real `google` packages stay importable.
    fake = tmp_path / "fake"
    (fake / "google" / "colab").mkdir(parents=True)
    (fake / "google" / "colab" / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    r = status_json(tmp_path, PYTHONPATH=f"{fake}{os.pathsep}{REPO}")
    assert r["platform"] == "colab" and r["evidence"] == "google.colab importable"
    assert r["budget_seconds"] == 12 * H and r["clock"] == "vm"


def test_kaggle_default_checkpoint_dir_and_storage_warning(tmp_path):
    env = clean_env(KAGGLE_KERNEL_RUN_TYPE="Interactive")
    r = json.loads(run_cli(env, "status", "--json", cwd=str(tmp_path)).stdout)
    assert r["checkpoint_dir"] == "/kaggle/working/keepalive"
    r = status_json(tmp_path, KAGGLE_KERNEL_RUN_TYPE="Interactive")   # KEEPALIVE_DIR under tmp_path
    assert any("outside /kaggle/working" in w for w in r["warnings"])
    r = json.loads(run_cli(clean_env(), "status", "--json", cwd=str(tmp_path)).stdout)
    assert r["checkpoint_dir"] == str(tmp_path / "keepalive-checkpoints")


# ---------------------------------------------------------------------------------- overrides
def test_budget_and_idle_overrides(tmp_path):
    r = status_json(tmp_path, COLAB_RELEASE_TAG="x", KEEPALIVE_BUDGET="3h", KEEPALIVE_IDLE="45min")
    assert r["platform"] == "colab"
    assert r["budget_seconds"] == 3 * H and r["budget_source"] == "KEEPALIVE_BUDGET=3h"
    assert r["idle_timeout_seconds"] == 45 * 60.0 and r["idle_source"] == "KEEPALIVE_IDLE=45min"
    r = status_json(tmp_path, COLAB_RELEASE_TAG="x", KEEPALIVE_BUDGET="none", KEEPALIVE_IDLE="0")
    assert r["budget_seconds"] is None and r["remaining_seconds"] is None
    assert r["idle_timeout_seconds"] is None
    r = status_json(tmp_path, KEEPALIVE_BUDGET="90min")          # a budget on a plain machine
    assert r["platform"] == "local" and r["budget_seconds"] == 5400.0


def test_bad_override_is_reported_not_fatal(tmp_path):
    r = status_json(tmp_path, KAGGLE_KERNEL_RUN_TYPE="Interactive", KEEPALIVE_BUDGET="soon",
                    KEEPALIVE_PLATFORM="mars")
    assert r["platform"] == "kaggle" and r["budget_seconds"] == 12 * H
    assert any("KEEPALIVE_BUDGET" in w for w in r["warnings"])
    assert any("KEEPALIVE_PLATFORM" in w for w in r["warnings"])


def test_session_start_override_counts_down(tmp_path):
    start = time.time() - 3600
    env = {"KEEPALIVE_BUDGET": "2h", "KEEPALIVE_SESSION_START": f"{start:.3f}"}
    r1 = status_json(tmp_path, **env)
    time.sleep(0.3)
    r2 = status_json(tmp_path, **env)
    assert r1["clock"] == "override" and r1["session_start_unix"] == pytest.approx(start, abs=1e-3)
    assert r1["remaining_seconds"] == pytest.approx(3600, abs=30)
    assert r1["elapsed_seconds"] == pytest.approx(3600, abs=30)
    assert r2["remaining_seconds"] < r1["remaining_seconds"]
    assert r1["remaining_seconds"] - r2["remaining_seconds"] == pytest.approx(
        r2["time_unix"] - r1["time_unix"], abs=0.01)


def test_session_start_iso(tmp_path):
    r = status_json(tmp_path, KEEPALIVE_SESSION_START="2025-01-31T08:00:00Z", KEEPALIVE_BUDGET="1h")
    assert r["session_start"] == "2025-01-31T08:00:00Z"
    assert r["deadline"] == "2025-01-31T09:00:00Z"
    assert r["remaining_seconds"] < 0
    assert any("used up" in w for w in r["warnings"])
    assert session.parse_start("2025-01-31T09:00:00+01:00") == session.parse_start("2025-01-31T08:00:00")


def test_configure_and_module_remaining(fresh):
    assert session.remaining_seconds() is None
    info = session.configure(budget="2h", start=time.time() - 3600)
    assert info.budget_source.startswith("configure(budget=")
    assert session.remaining_seconds() == pytest.approx(3600, abs=5)
    assert session.detect() is info                     # cached
    os.environ["KEEPALIVE_BUDGET"] = "10h"
    try:
        assert session.detect(refresh=True).budget_seconds == 2 * H   # configure() beats the env
        assert session.configure(reset=True).budget_seconds == 10 * H
    finally:
        del os.environ["KEEPALIVE_BUDGET"]
    assert session.configure(reset=True, platform="colab").platform == "colab"
    assert session.configure(platform=None).platform == "local"
    assert session.configure(start="2025-01-31T08:00:00Z").clock == "override"
    assert session.configure(start=None).clock == "process"


def test_remaining_seconds_is_cheap(fresh):
    session.configure(budget="1h")
    t = time.thread_time()  # this thread's CPU time: a loaded machine's waits are not the call's cost
    for _ in range(10000):
        session.remaining_seconds()
    assert (time.thread_time() - t) / 10000 < 20e-6


# -------------------------------------------------------------------------------- human output
_PAIR = re.compile(r"(\d+(?:\.\d+)?) (B|KiB|MiB|GiB|TiB) \((\d+(?:\.\d+)?) (B|kB|MB|GB|TB)\)")
_POW = {"B": 1, "KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30, "TiB": 2 ** 40,
        "kB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}


def test_human_output_states_units(tmp_path):
    # a spool of its own: the panel shows only this test's machine state, not another run's pending uploads
    env = clean_env(COLAB_RELEASE_TAG="x", KEEPALIVE_BUDGET="2h", KEEPALIVE_DIR=str(tmp_path),
                    KEEPALIVE_SESSION_START=str(time.time() - 1800), KEEPALIVE_SPOOL=str(tmp_path / "spool"))
    out = run_cli(env, "status", cwd=str(tmp_path)).stdout
    assert "platform colab" in out
    assert re.search(r"budget\s+2 h 00 min: 1 h (29|30) min left", out), out
    assert re.search(r"\[#+\.+\] 75 % of the session left", out), out
    assert "1 h 30 min timeout" in out
    pairs = _PAIR.findall(out)
    assert pairs, out
    for b, bu, d, du in pairs:       # each GiB figure sits next to the same size in GB
        assert float(b) * _POW[bu] == pytest.approx(float(d) * _POW[du], rel=0.01, abs=_POW[du] * 0.01)
    binary_tokens = re.findall(r"\b(KiB|MiB|GiB|TiB)\b", out)
    decimal_tokens = re.findall(r"\b(kB|MB|GB|TB)\b", out)
    assert len(binary_tokens) == len(pairs) == len(decimal_tokens)
    assert "RAM" in out and "/dev/shm" in out


def test_format_status_without_budget_and_with_gpu():
    report = {
        "platform": "local", "budget_seconds": None, "remaining_seconds": None, "elapsed_seconds": 5.0,
        "idle_timeout_seconds": None, "idle_seconds": 0.0, "budget_source": "x", "clock": "process",
        "session_start": "2025-01-01T00:00:00Z", "checkpoint_dir": "/x", "runs": [], "warnings": [],
        "hardware": {"gpus": [session._gpu_entry(0, "Tesla T4", 15360 * 2 ** 20, 1024 * 2 ** 20, 37.0)]},
    }
    text = status.format_status(report)
    assert "budget    none" in text
    assert "Tesla T4: 1.00 GiB (1.07 GB) used of 15.00 GiB (16.11 GB), utilisation 37 %" in text


def test_the_uploads_line_gives_the_pending_size_in_both_units():
    report = {"platform": "local", "checkpoint_dir": "/x", "runs": [], "warnings": [], "hardware": {},
              "pending_uploads": {"count": 2, "bytes": 1.2 * 2 ** 30, "oldest_age_seconds": 240.0,
                                  "destinations": [{"destination": "gs://b/run"}]}}
    [line] = [x for x in status.format_status(report).splitlines() if x.startswith("  uploads")]
    assert line == ("  uploads   2 checkpoint(s), 1.20 GiB (1.29 GB) pending, oldest 4 min 00 s old "
                    "(to gs://b/run; `keepalive sync` uploads them)"), line
    [(b, bu, d, du)] = _PAIR.findall(line)
    assert float(b) * _POW[bu] == pytest.approx(float(d) * _POW[du], rel=0.01)


# ----------------------------------------------------------------------------------- runs
def test_status_lists_runs_and_survives_bad_dirs(tmp_path):
    from keepalive.store import CheckpointStore

    store = CheckpointStore(str(tmp_path / "runs" / "pets"), keep=None)
    store.open_for_writing()
    store.commit({"a.bin": b"one"}, step=5, epoch=1)
    store.commit({"a.bin": b"two"}, step=10, epoch=2)
    store.close()
    r = status_json(tmp_path, "--dir", str(tmp_path / "runs"))
    assert r["checkpoint_dir"] == str(tmp_path / "runs")
    [run] = r["runs"]
    assert run["run"] == "pets" and run["checkpoints"] == 2
    assert run["newest_step"] == 10 and run["newest_epoch"] == 2
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", run["newest_created"])
    assert run["url"].endswith("pets")
    human = run_cli(clean_env(), "status", "--dir", str(tmp_path / "runs"), cwd=str(tmp_path)).stdout
    assert "pets: 2 checkpoint(s), newest step 10, 2 epoch(s) done" in human

    afile = tmp_path / "not-a-dir"
    afile.write_text("x")
    for bad in (str(afile), str(tmp_path / "missing"), "nosuchproto://x/y"):
        r = status_json(tmp_path, "--dir", bad)
        assert r["runs"] == []
    assert any("could not list runs" in w for w in r["warnings"])


# ------------------------------------------------------------------------------------ hardware
def test_hardware_facts(fresh, tmp_path):
    hw = session.hardware(str(tmp_path))
    assert hw["ram_total_bytes"] > 0 and hw["ram_available_bytes"] > 0
    assert hw["ram_total_gib"] == pytest.approx(hw["ram_total_bytes"] / 2 ** 30, abs=0.01)
    assert hw["ram_total_gb"] == pytest.approx(hw["ram_total_bytes"] / 1e9, abs=0.01)
    assert re.fullmatch(r"\d+\.\d\d GiB \(\d+\.\d\d GB\)", hw["ram_total"])
    assert hw["cpu_count"] >= 1 and 1 <= hw["cpu_usable"] <= hw["cpu_count"]
    assert [d["what"] for d in hw["disks"]] == ["checkpoint dir", "VM disk"]
    assert hw["disks"][0]["free_bytes"] > 0
    assert isinstance(hw["gpus"], list) and hw["gpu_source"]
    if not hw["gpus"]:
        assert hw["gpu"] == "none"
    json.dumps(hw)


def test_shm_warning_text():
    w = session.shm_warning(64 * 2 ** 20, "kaggle")
    assert "64.00 MiB (67.11 MB)" in w and "num_workers=0" in w and "bus error" in w and "64 MB" in w
    assert session.shm_warning(2 * 2 ** 30) is None
    assert "--shm-size" in session.shm_warning(512 * 2 ** 20, "local")


def test_gpus_from_nvidia_smi_output(tmp_path, monkeypatch):
    # Test double for the NVIDIA tool (this machine has no GPU); the parser is what is tested.
    fake = tmp_path / "bin"
    fake.mkdir()
    smi = fake / "nvidia-smi"
    smi.write_text(textwrap.dedent("""\
        #!/bin/sh
        echo "0, Tesla T4, 15360, 1024, 37"
        echo "1, NVIDIA A100-SXM4-40GB, 40960, 0, [N/A]"
        """))
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "pynvml" else _real_find_spec(name, *a))
    found, source = session.gpus()
    assert source == "nvidia-smi"
    assert found[0]["name"] == "Tesla T4" and found[0]["memory_total_mib"] == 15360.0
    assert found[0]["memory_total_gib"] == 15.0 and found[0]["utilization_percent"] == 37.0
    assert found[1]["name"] == "NVIDIA A100-SXM4-40GB" and found[1]["utilization_percent"] is None


_real_find_spec = importlib.util.find_spec


# --------------------------------------------------------------------------------- idle tracking
@pytest.fixture
def shell(tmp_path, monkeypatch):
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    cfg = Config()
    cfg.HistoryManager.hist_file = ":memory:"
    sh = InteractiveShell.instance(config=cfg)
    yield sh
    InteractiveShell.clear_instance()


def test_idle_tracker_with_real_ipython(fresh, shell):
    tracker = session.IdleTracker()
    tracker.register(shell, watch=False)
    shell.user_ns["tracker"] = tracker
    res = shell.run_cell("import time; time.sleep(0.05); during = (tracker.busy, tracker.idle_seconds())")
    assert res.success
    assert shell.user_ns["during"] == (True, 0.0)
    assert not tracker.busy
    time.sleep(0.25)
    assert tracker.idle_seconds() >= 0.25
    before_cell = time.monotonic()
    shell.run_cell("x = 1")
    assert tracker.idle_seconds() <= time.monotonic() - before_cell  # counted from that cell's end
    tracker.unregister(shell)
    assert not tracker.registered
    time.sleep(0.05)
    before = tracker.idle_seconds()
    shell.run_cell("y = 2")                  # no longer hooked: idle keeps growing
    assert tracker.idle_seconds() >= before


def test_idle_outside_ipython_and_note_activity(fresh):
    tracker = session.IdleTracker()
    assert tracker.idle_seconds() == 0.0     # nothing recorded: the process is running code
    tracker.note_activity()
    time.sleep(0.05)
    assert tracker.idle_seconds() >= 0.05
    before = time.monotonic()
    tracker.note_activity()
    assert tracker.idle_seconds() <= time.monotonic() - before  # counted from the activity, not before
    before = time.monotonic()
    session.note_activity()
    assert session.idle_seconds() <= time.monotonic() - before


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_idle_warning_fires_once_per_idle_period(fresh, caplog, capsys):
    info = session.configure(idle="100s")
    clock, events = FakeClock(), []
    tracker = session.IdleTracker(clock=clock, callbacks=[events.append])
    assert tracker.warn_margin(100) == 25.0
    tracker.post_run_cell()                       # a cell ended at t=1000
    capsys.readouterr()
    with caplog.at_level(logging.WARNING, logger="keepalive"):
        clock.t = 1050
        assert tracker.check_idle(info=info) is None      # 50 s of margin left
        clock.t = 1080
        event = tracker.check_idle(info=info)               # 20 s left < 25 s
        assert event and event["margin_seconds"] == pytest.approx(20)
        clock.t = 1090
        assert tracker.check_idle(info=info) is None       # once per idle period
        tracker.pre_run_cell()
        clock.t = 1200
        assert tracker.check_idle(info=info) is None       # a cell runs: not idle
        tracker.post_run_cell()
        clock.t = 1290
        assert tracker.check_idle(info=info) is not None    # a new idle period warns again
    assert len(events) == 2
    records = [r for r in caplog.records if r.name == "keepalive"]   # keepalive.report's logger
    assert len(records) == 2 and "idle timeout of 1 min 40 s" in records[0].getMessage()
    shown = capsys.readouterr().err                  # and printed: the user sees it, not only a log
    assert shown.count("keepalive: warning: idle for") == 2 and "idle timeout of 1 min 40 s" in shown
    assert session.check_idle_warning() is None               # the module tracker saw nothing
    assert session.configure(idle=None).idle_timeout_seconds is None
    assert tracker.check_idle() is None


def test_idle_watch_thread_warns_once(fresh, caplog):
    session.configure(idle="0.4s")                 # warning margin: a quarter = 0.1 s
    events = []
    tracker = session.IdleTracker(callbacks=[events.append])
    tracker.note_activity()
    with caplog.at_level(logging.WARNING, logger="keepalive"):
        tracker.start_watch(interval=0.02)
        try:
            time.sleep(0.6)
        finally:
            tracker.stop_watch()
    assert len(events) == 1
    assert events[0]["idle_seconds"] >= 0.3


# ------------------------------------------------------------------------------- a real kernel
def test_real_kernel_uses_kernel_clock(tmp_path):
    jupyter_client = pytest.importorskip("jupyter_client")
    env = clean_env(KEEPALIVE_DIR=str(tmp_path), IPYTHONDIR=str(tmp_path / "ipython"))
    km = jupyter_client.KernelManager(kernel_name="python3")
    km.start_kernel(env=env, cwd=str(tmp_path))
    try:
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=30)
        code = textwrap.dedent("""\
            import json, subprocess, sys
            from keepalive import session
            info = session.detect()
            out = subprocess.run(sys.executable + " -m keepalive status --json", shell=True,
                                 capture_output=True, text=True).stdout
            sub = json.loads(out)
            print("RESULT", json.dumps([info.platform, info.clock, info.in_kernel, info.frontend,
                                        sub["platform"], sub["clock"], sub["session_start_unix"],
                                        info.start_time]))
            """)
        chunks = []
        reply = kc.execute_interactive(
            code, timeout=60,
            output_hook=lambda m: (chunks.append(m["content"].get("text", ""))
                                   if m["msg_type"] == "stream" else None))
        assert reply["content"]["status"] == "ok", reply["content"]
        line = next(ln for ln in "".join(chunks).splitlines() if ln.startswith("RESULT"))
        platform, clock, in_kernel, frontend, sub_platform, sub_clock, sub_start, start = json.loads(line[7:])
        assert (platform, clock, in_kernel, frontend) == ("jupyter", "kernel", True, "jupyter")
        assert (sub_platform, sub_clock) == ("jupyter", "kernel")    # `!keepalive status` in a cell
        assert sub_start == pytest.approx(start, abs=0.05)            # the same kernel's start
        kc.stop_channels()
    finally:
        km.shutdown_kernel(now=True)


# --------------------------------------------------------------------- which clock a budget runs on
def test_status_says_which_clock_a_budget_runs_on_and_the_clock_can_be_chosen(tmp_path):
    """Colab's budget counts from the VM's start, which may be long before this kernel's: status
    says so (text and JSON) and ``KEEPALIVE_CLOCK`` picks another clock."""
    vm = status_json(tmp_path, COLAB_RELEASE_TAG="x", KEEPALIVE_BUDGET="1h")
    assert vm["clock"] == "vm" and "VM" in vm["clock_meaning"]
    assert vm["clock_reason"].startswith("colab profile") and "VM start" in vm["clock_reason"]
    starts = vm["clock_starts"]
    assert set(starts) == {"vm", "kernel", "process"}
    assert starts["vm"] == vm["session_start"] and starts["process"] is not None
    assert starts["vm"] <= starts["process"]            # the machine started before this process

    proc = status_json(tmp_path, COLAB_RELEASE_TAG="x", KEEPALIVE_BUDGET="1h", KEEPALIVE_CLOCK="process")
    assert proc["clock"] == "process" and proc["clock_meaning"] == "this process's start"
    assert "KEEPALIVE_CLOCK=process" in proc["clock_reason"] and "vm clock" in proc["clock_reason"]
    assert proc["session_start_unix"] >= vm["session_start_unix"]
    assert proc["remaining_seconds"] > 3600 - 60           # counts from now-ish, not from the VM start
    assert proc["remaining_seconds"] - vm["remaining_seconds"] == pytest.approx(
        proc["session_start_unix"] - vm["session_start_unix"], abs=30)

    # no kernel here: a kernel clock falls back to the process, and says so
    kern = status_json(tmp_path, COLAB_RELEASE_TAG="x", KEEPALIVE_CLOCK="kernel")
    assert kern["clock"] == "process" and "kernel clock cannot be read here" in kern["clock_reason"]

    env = clean_env(COLAB_RELEASE_TAG="x", KEEPALIVE_BUDGET="1h", KEEPALIVE_DIR=str(tmp_path / "c"),
                    KEEPALIVE_SPOOL=str(tmp_path / "s"))
    text = run_cli(env, "status", cwd=str(tmp_path)).stdout
    assert "the budget runs on the vm clock: it counts from the VM's (machine's) start" in text
    assert "why: colab profile" in text and "KEEPALIVE_CLOCK=vm|kernel|process" in text
    assert re.search(r"other clocks started: .*process 20\d\d-", text), text
    text = run_cli(dict(env, KEEPALIVE_CLOCK="process"), "status", cwd=str(tmp_path)).stdout
    assert "the budget runs on the process clock" in text and "KEEPALIVE_CLOCK=process" in text


def test_bad_clock_is_reported_and_configure_picks_one(fresh, tmp_path, monkeypatch):
    r = status_json(tmp_path, COLAB_RELEASE_TAG="x", KEEPALIVE_CLOCK="sundial")
    assert r["clock"] == "vm"                              # the profile's clock, not a crash
    env = clean_env(COLAB_RELEASE_TAG="x", KEEPALIVE_CLOCK="sundial", KEEPALIVE_DIR=str(tmp_path / "c"),
                    KEEPALIVE_SPOOL=str(tmp_path / "s"))
    err = run_cli(env, "status", "--json", cwd=str(tmp_path)).stderr
    assert "KEEPALIVE_CLOCK" in err and "sundial" in err

    monkeypatch.setenv("KEEPALIVE_PLATFORM", "colab")  # undone after the test: later modules see no Colab
    assert session.detect(refresh=True).clock == "vm"
    info = session.configure(clock="process")
    assert info.clock == "process" and info.clock_reason.startswith("configure(clock='process')")
    assert info.start_time > session.configure(clock=None).start_time - 1e-6   # back to the VM clock
    assert session.detect().clock == "vm"
    bad = session.configure(clock="sundial")             # a bad value is a warning, not a change
    assert bad.clock == "vm" and any("sundial" in w for w in bad.warnings)


def test_status_shows_the_runs_recorded_elsewhere(tmp_path):
    """Runs opened with an explicit path are in the index of runs of the default dir: status
    lists them (JSON ``other_runs``, text ``elsewhere``) next to the runs of the default dir."""
    from keepalive.runs import record_run
    from keepalive.store import CheckpointStore

    default = tmp_path / "ckpt"
    for path, finished in ((default / "here", True), (tmp_path / "drive" / "away", False)):
        store = CheckpointStore(str(path), keep=None)
        store.commit({"a.bin": b"x"}, step=7, epoch=1, metadata={"finished": finished})
        store.close()
    assert record_run(str(tmp_path / "drive" / "away"), str(default))
    r = status_json(tmp_path)
    assert [x["run"] for x in r["runs"]] == ["here"]
    (other,) = r["other_runs"]
    assert other["run"] == "away" and other["url"] == str(tmp_path / "drive" / "away")
    assert other["finished"] is False and other["newest_step"] == 7
    env = clean_env(KEEPALIVE_DIR=str(default), KEEPALIVE_SPOOL=str(tmp_path / "spool"))
    text = run_cli(env, "status", cwd=str(tmp_path)).stdout
    assert "elsewhere (runs recorded in the index of runs):" in text
    assert f"away: UNFINISHED, 1 checkpoint(s), newest step 7, 1 epoch(s) done in {tmp_path / 'drive' / 'away'}" in text
