"""Local protocol servers for tests: a GCS emulator and an S3 (moto) server on 127.0.0.1.

Each server is started as a child process on a free port, waited for until it answers HTTP, and
stopped by its PID. ``configure_gcs_env`` must run before ``gcsfs`` is imported (tests/conftest.py
calls it at import time), else gcsfs probes a gRPC endpoint for 60 s on every call.

    with GcsServer() as gcs:
        store = CheckpointStore(f"gs://{gcs.bucket}/run", storage_options=gcs.storage_options)
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from typing import List, Optional

BIN = os.path.dirname(sys.executable)
HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def configure_gcs_env(port: int) -> None:
    """Point gcsfs at the emulator; must happen before gcsfs is imported (and is read per call)."""
    os.environ["STORAGE_EMULATOR_HOST"] = f"http://{HOST}:{port}"
    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"


def _executable(name: str) -> str:
    path = os.path.join(BIN, name)
    return path if os.path.exists(path) else name


class _Server:
    name = "server"

    def __init__(self, port: Optional[int] = None):
        self.port = port or free_port()
        self.proc: Optional[subprocess.Popen] = None
        self._log = None

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    def command(self) -> List[str]:
        raise NotImplementedError

    def env(self) -> dict:
        return dict(os.environ)

    def start(self, timeout: float = 30.0) -> "_Server":
        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self.env(), start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {self.output()}")
            try:
                urllib.request.urlopen(self.endpoint + "/", timeout=1).close()
                return self
            except urllib.error.HTTPError:
                return self  # it answers (404 / 400 / ...): it is up
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{self.name} did not answer on {self.endpoint} within {timeout} s")

    def output(self) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-4000:]

    def stop(self) -> None:
        """Stop the server by its PID (SIGTERM, then SIGKILL), including any children it forked."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(proc.pid, sig)  # its own session: the group is the server and its children
                except ProcessLookupError:
                    break
                try:
                    proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class GcsServer(_Server):
    """``gcp-storage-emulator`` in memory, with one bucket created through gcsfs."""

    name = "gcp-storage-emulator"

    def __init__(self, port: Optional[int] = None, bucket: Optional[str] = None):
        super().__init__(port)
        self.bucket = bucket or f"ka-test-{uuid.uuid4().hex[:8]}"

    def command(self) -> List[str]:
        return [_executable("gcp-storage-emulator"), "start", f"--host={HOST}", f"--port={self.port}",
                "--in-memory"]

    @property
    def storage_options(self) -> dict:
        return {"token": "anon", "project": "test", "endpoint_url": self.endpoint}

    def start(self, timeout: float = 30.0) -> "GcsServer":
        configure_gcs_env(self.port)
        super().start(timeout)
        import gcsfs

        fs = gcsfs.GCSFileSystem(**self.storage_options, skip_instance_cache=True)
        fs.mkdir(self.bucket)
        return self

    def url(self, *parts: str) -> str:
        return "/".join([f"gs://{self.bucket}", *parts])


class S3Server(_Server):
    """``moto_server`` with one bucket."""

    name = "moto_server"

    def __init__(self, port: Optional[int] = None, bucket: Optional[str] = None):
        super().__init__(port)
        self.bucket = bucket or f"ka-test-{uuid.uuid4().hex[:8]}"

    def command(self) -> List[str]:
        return [_executable("moto_server"), "-H", HOST, "-p", str(self.port)]

    def env(self) -> dict:
        env = dict(os.environ)
        env.setdefault("AWS_ACCESS_KEY_ID", "testing")
        env.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
        return env

    @property
    def storage_options(self) -> dict:
        return {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": self.endpoint}}

    def start(self, timeout: float = 30.0) -> "S3Server":
        super().start(timeout)
        import s3fs

        fs = s3fs.S3FileSystem(**self.storage_options, skip_instance_cache=True)
        fs.mkdir(self.bucket)
        return self

    def url(self, *parts: str) -> str:
        return "/".join([f"s3://{self.bucket}", *parts])
