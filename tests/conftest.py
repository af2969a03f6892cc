"""Shared fixtures: the GCS and S3 protocol servers (tests/servers.py) and a ``location`` fixture
that runs a test once per storage kind (local folder, memory://, gs://, s3://)."""
from __future__ import annotations

import atexit
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
