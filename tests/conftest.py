"""Shared fixtures: the GCS and S3 protocol servers (tests/servers.py) and a ``location`` fixture
that runs a test once per storage kind (local folder, memory://, gs://, s3://)."""
from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import tempfile
import uuid

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import servers  # noqa: E402  (tests/servers.py)

# The test session gets its own spool and default checkpoint folders (children inherit them): no
# test reads or fills the user's /tmp/keepalive-spool or ./keepalive-checkpoints.
_SCRATCH = tempfile.mkdtemp(prefix="keepalive-tests-")
os.environ.setdefault("KEEPALIVE_SPOOL", os.path.join(_SCRATCH, "spool"))
os.environ.setdefault("KEEPALIVE_DIR", os.path.join(_SCRATCH, "checkpoints"))
atexit.register(shutil.rmtree, _SCRATCH, True)
# A test run on a cloud VM (a CI runner on GCE / AWS / Azure) never asks the real metadata service:
# the tests that watch notices set KEEPALIVE_CLOUD and KEEPALIVE_METADATA_URL themselves.
os.environ.setdefault("KEEPALIVE_CLOUD", "none")
# A developer's own notification URLs and Kaggle chaining never act on the suite's trainings: the
# tests that send or push set them themselves.
for _name in ("KEEPALIVE_NOTIFY", "KEEPALIVE_KAGGLE_CHAIN"):
    os.environ.pop(_name, None)

# gcsfs reads these when it is imported / builds a filesystem: set them before any test imports it.
_GCS_PORT = servers.free_port()
servers.configure_gcs_env(_GCS_PORT)


@pytest.fixture(scope="session")
def gcs_server():
    """A gcp-storage-emulator (in memory) on 127.0.0.1 with one bucket; stopped by PID at the end."""
    server = servers.GcsServer(port=_GCS_PORT)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_server():
    """A moto_server on 127.0.0.1 with one bucket; stopped by PID at the end."""
    server = servers.S3Server()
    server.start()
    try:
        yield server
    finally:
        server.stop()


class Location:
    """Where one test's run lives: ``url`` plus the fsspec ``storage_options`` it needs."""

    def __init__(self, kind: str, url: str, storage_options=None):
        self.kind = kind
        self.url = url
        self.storage_options = storage_options

    def store(self, name: str = "run", **kw):
        from keepalive.store import CheckpointStore

        kw.setdefault("storage_options", self.storage_options)
        return CheckpointStore(self.join(name), **kw)

    def join(self, *parts: str) -> str:
        return "/".join([self.url.rstrip("/"), *parts])

    def __repr__(self) -> str:
        return f"Location({self.kind}: {self.url})"


LOCATION_KINDS = ["local", "memory", "gs", "s3"]


def make_location(kind: str, request, tmp_path) -> Location:
    token = uuid.uuid4().hex[:10]
    if kind == "local":
        return Location(kind, str(tmp_path / "runs"))
    if kind == "memory":
        return Location(kind, f"memory://ka-tests/{token}")
    if kind == "gs":
        server = request.getfixturevalue("gcs_server")
        return Location(kind, server.url(token), server.storage_options)
    if kind == "s3":
        server = request.getfixturevalue("s3_server")
        return Location(kind, server.url(token), server.storage_options)
    raise ValueError(kind)


@pytest.fixture(params=LOCATION_KINDS)
def location(request, tmp_path):
    """A fresh, empty folder on each storage kind in turn."""
    loc = make_location(request.param, request, tmp_path)
    yield loc
    if loc.kind == "memory":
        import fsspec

        fs = fsspec.filesystem("memory")
        path = loc.url.split("://", 1)[1]
        if fs.exists("/" + path):
            fs.rm("/" + path, recursive=True)


# ---- The quick tier (``bash scripts/test.sh --quick``, i.e. ``-m quick``) ----
# A developer's few-minutes check that nothing is broken: the unit tests, the state machine
# (boundary + trigger), store / state / settings, the architecture and doctests, and ONE real
# crash-and-resume test per adapter (the fastest of its file: a SIGKILLed training subprocess
# restarted until it finishes, compared bit for bit with an uninterrupted run). Listed here rather
# than marked in each file, so that the tier can be read and changed in one place.
QUICK_FILES = frozenset(f"tests/{name}.py" for name in (
    "test_architecture", "test_auto_interval", "test_boundary", "test_break_detection", "test_compat",
    "test_crashkit",
    "test_doctests", "test_lifecycle", "test_optimizer_steps", "test_options", "test_pauses",
    "test_resume_memory", "test_run_index", "test_runs", "test_settings", "test_state_roundtrip",
    "test_store_backends", "test_store_local", "test_store_write_path", "test_trigger",
))
QUICK_TESTS = frozenset((
    "tests/test_torch_crash.py::test_sigkill_with_gradient_accumulation_and_time_based_saves",
    "tests/test_keras_crash.py::test_torch_backend_sigkill_resume_is_bit_exact",
    "tests/test_fastai_crash.py::test_sigkill_resume_is_bit_exact[fine_tune]",
    "tests/test_transformers.py::test_sigkill_resume_is_bit_exact[lora-2-17]",
    "tests/test_lightning.py::test_sigkill_resume_is_bit_exact[manual]",
))

# ---- The order of the files on xdist's workers ----
# With --dist loadfile each file runs whole on one worker, and xdist hands the files out in the
# collection order (by default reordered by number of tests, which sends the few long crash files
# last). On 2 workers the run ends when the longer worker ends, so the longest files go first and the
# short ones fill in at the end. The seconds are one full run's per-file sums (the table printed at
# the end of a run; ``--file-seconds-out=PATH`` writes them as JSON to refresh this file; only their
# ratios matter, that run was on a busy machine). A file not in it (a new one) counts as long, so
# that it starts early rather than last.
FILE_SECONDS_PATH = os.path.join(os.path.dirname(__file__), "file_seconds.json")
UNKNOWN_FILE_SECONDS = 120.0


def pytest_addoption(parser) -> None:
    parser.addoption("--file-seconds-out", default=None, metavar="PATH",
                     help="write each test file's summed duration (seconds) to PATH as JSON")


def pytest_configure(config) -> None:
    if hasattr(config.option, "loadscopereorder"):  # xdist is active: keep the order set below
        config.option.loadscopereorder = False


def _known_file_seconds() -> dict:
    try:
        with open(FILE_SECONDS_PATH, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if _file_of(item.nodeid) in QUICK_FILES or item.nodeid in QUICK_TESTS:
            item.add_marker(pytest.mark.quick)
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker sorts alike: xdist checks that
        known = _known_file_seconds()
        rank = {path: -known.get(path, UNKNOWN_FILE_SECONDS) for path in {_file_of(i.nodeid) for i in items}}
        items.sort(key=lambda item: (rank[_file_of(item.nodeid)], _file_of(item.nodeid)))


def pytest_ignore_collect(collection_path, config):
    """Under ``-m quick`` the files with no quick test are not even imported (the frameworks they
    load take most of a collection's time)."""
    if config.option.markexpr != "quick" or not collection_path.name.startswith("test_"):
        return None
    rel = os.path.relpath(str(collection_path), str(config.rootpath)).replace(os.sep, "/")
    if not rel.endswith(".py") or rel in QUICK_FILES or any(_file_of(t) == rel for t in QUICK_TESTS):
        return None
    return True


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


# ---- The slowest test files, printed at the end of a run ----
# A file runs whole on one xdist worker (--dist loadfile), so its summed time is what it adds to that
# worker's path; the reports reach the controller, which sums them here (with or without xdist).
_FILE_SECONDS: dict = {}
SLOWEST_FILES_SHOWN = 10


def pytest_runtest_logreport(report) -> None:
    path = _file_of(report.nodeid)
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + getattr(report, "duration", 0.0)


def pytest_terminal_summary(terminalreporter, config) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: the controller sums and prints
        return
    if config.getoption("file_seconds_out"):
        with open(config.getoption("file_seconds_out"), "w", encoding="utf-8") as f:
            json.dump({path: round(s, 1) for path, s in sorted(_FILE_SECONDS.items())}, f, indent=0)
    if len(_FILE_SECONDS) < 2:
        return
    slowest = sorted(_FILE_SECONDS.items(), key=lambda item: item[1], reverse=True)
    terminalreporter.section(f"{SLOWEST_FILES_SHOWN} slowest files (setup + call + teardown)")
    for path, seconds in slowest[:SLOWEST_FILES_SHOWN]:
        terminalreporter.write_line(f"{seconds:9.1f}s  {path}")
    total = sum(_FILE_SECONDS.values())
    terminalreporter.write_line(f"{total:9.1f}s  in all {len(_FILE_SECONDS)} files")
