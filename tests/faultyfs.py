"""Fault injection for the spool tests: a failing / slow filesystem, a failing local backend, and a
failing / slow HTTP proxy in front of the S3 and GCS protocol servers.

* ``faulty:///abs/path`` -- an fsspec filesystem (registered by importing this module) that is the
  local path ``/abs/path``, except while the JSON control file named by ``$KEEPALIVE_FAULTY_CONTROL``
  says otherwise. Every operation reads the control (cached by mtime), so a test can make the
  destination of a running training subprocess fail for a while and then recover.
* :func:`patch_local_backend` -- the same faults for :class:`keepalive.backends.LocalBackend` on paths
  under one root (a local / Drive-like destination; the spool, elsewhere, keeps working).
* :class:`FaultProxy` -- an HTTP proxy on 127.0.0.1 in front of moto / gcp-storage-emulator that
  answers 503 for a while or delays requests, forwarding everything else, so s3fs / gcsfs see real
  failing requests.

Control file fields (all optional)::

    {"fail_until": <unix time>, "fail_until_start": <n: until the n-th training child started>,
     "errno": "ENOTCONN" | "EIO" | "ENOSPC" | ...,
     "timeout": <s: hang this long, then raise TimeoutError(ETIMEDOUT)>,
     "fail_after_first_start": <s: the window opens this long after the first child started>,
     "fail_after_spooled": true,                       # ... once a checkpoint was spooled
     "ops": ["write", "read", "list", "meta"],        # which operations fail (default: all)
     "sleep_per_mb": <s>, "slow_until": <unix time>,  # slow writes (default: slow for ever)
     "corrupt_until": <unix time>}                    # flip a byte of every write chunk
"""
from __future__ import annotations

import errno as _errno
import http.client
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, Optional

import fsspec
from fsspec.implementations.local import LocalFileSystem

CONTROL_ENV = "KEEPALIVE_FAULTY_CONTROL"
STARTS_ENV = "KEEPALIVE_FAULTY_STARTS"
_cache: Dict[str, Any] = {"key": None, "value": {}}
_lock = threading.Lock()


# ------------------------------------------------------------------------------------- control
def write_control(path: str, **fields: Any) -> None:
    """Replace the control file (atomically: readers never see half of it)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(fields, f)
    os.replace(tmp, path)


def control() -> Dict[str, Any]:
    path = os.environ.get(CONTROL_ENV)
    if not path:
        return {}
    try:
        st = os.stat(path)
    except OSError:
        return {}
    key = (path, st.st_mtime_ns, st.st_size, st.st_ino)
    with _lock:
        if _cache["key"] != key:
            try:
                with open(path) as f:
                    _cache["value"] = json.load(f)
            except (OSError, ValueError):
                return _cache["value"]
            _cache["key"] = key
        return _cache["value"]


def note_start() -> None:
    """A training child announces its start (``$KEEPALIVE_FAULTY_STARTS``): a failure window can
    last until the N-th process started (``fail_until_start``), whatever the machine's speed."""
    path = os.environ.get(STARTS_ENV)
    if path:
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {time.time():.3f}\n")


def first_start(path: Optional[str] = None) -> Optional[float]:
    path = path or os.environ.get(STARTS_ENV)
    try:
        with open(path) as f:
            return float(f.readline().split()[1])
    except (OSError, TypeError, IndexError, ValueError):
        return None


_spooled_seen = False


def spooled(root: Optional[str] = None) -> bool:
    """Whether some checkpoint was committed to the spool (``$KEEPALIVE_SPOOL``) yet."""
    global _spooled_seen
    if not _spooled_seen:
        import glob

        root = root or os.environ.get("KEEPALIVE_SPOOL") or ""
        _spooled_seen = bool(root) and bool(glob.glob(os.path.join(root, "*", "*", "ckpt-*", "MANIFEST.json")))
    return _spooled_seen


def hits(control_path: str) -> int:
    """How many operations failed on purpose so far."""
    try:
        with open(control_path + ".hits") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def starts(path: Optional[str] = None) -> int:
    path = path or os.environ.get(STARTS_ENV)
    try:
        with open(path) as f:
            return sum(1 for _ in f)
    except (OSError, TypeError):
        return 0


def fault(op: str) -> None:
    """Raise the configured error for ``op`` while the failure window is open."""
    c = control()
    until, upto = c.get("fail_until"), c.get("fail_until_start")
    if until is None and upto is None:
        return
    if until is not None and time.time() >= until:
        return
    if upto is not None and starts() >= upto:
        return
    if c.get("fail_after_first_start") is not None:  # seconds after the first child started
        first = first_start()
        if first is None or time.time() < first + float(c["fail_after_first_start"]):
            return
    if c.get("fail_after_spooled") and not spooled():
        return
    ops = c.get("ops")
    if ops and op not in ops:
        return
    hits = os.environ.get(CONTROL_ENV, "") + ".hits"
    try:
        with open(hits, "a") as f:
            f.write(f"{op}\n")
    except OSError:
        pass
    if c.get("timeout"):
        time.sleep(float(c["timeout"]))
        raise TimeoutError(_errno.ETIMEDOUT, "operation timed out (injected)")
    name = c.get("errno", "EIO")
    code = getattr(_errno, name)
    raise OSError(code, f"{os.strerror(code)} (injected {name} on {op})")


def slow(nbytes: int) -> None:
    c = control()
    per_mb = c.get("sleep_per_mb")
    if per_mb and time.time() < c.get("slow_until", float("inf")):
        time.sleep(per_mb * nbytes / 1e6)


def corrupting() -> bool:
    c = control()
    return time.time() < c.get("corrupt_until", 0)


class _Writer:
    """Wraps a writable file: faults, slowness and corruption per write."""

    def __init__(self, f):
        self._f = f

    def write(self, data) -> int:
        fault("write")
        view = memoryview(data).cast("B")
        slow(len(view))
        if corrupting() and len(view):
            data = bytearray(view)
            data[0] ^= 0xFF
            view = memoryview(data)
        return self._f.write(view)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


class _Reader:
    def __init__(self, f):
        self._f = f

    def read(self, *args):
        fault("read")
        return self._f.read(*args)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


# ------------------------------------------------------------------------------- fsspec protocol
class FaultyFileSystem(LocalFileSystem):
    """``faulty:///abs/path``: the local path, with the control file's faults."""

    protocol = ("faulty",)
    root_marker = "/"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)

    def _open(self, path, mode="rb", block_size=None, **kwargs):
        if "r" in mode:
            fault("read")
            return _Reader(super()._open(path, mode, block_size, **kwargs))
        fault("write")
        return _Writer(super()._open(path, mode, block_size, **kwargs))

    def ls(self, path, detail=False, **kwargs):
        fault("list")
        return super().ls(path, detail=detail, **kwargs)

    def info(self, path, **kwargs):
        fault("list")
        return super().info(path, **kwargs)

    def exists(self, path, **kwargs):
        fault("list")
        return super().exists(path, **kwargs)

    def makedirs(self, path, exist_ok=False):
        fault("meta")
        return super().makedirs(path, exist_ok=exist_ok)

    def mkdir(self, path, create_parents=True, **kwargs):
        fault("meta")
        return super().mkdir(path, create_parents=create_parents, **kwargs)

    def rm(self, path, recursive=False, maxdepth=None):
        fault("meta")
        return super().rm(path, recursive=recursive, maxdepth=maxdepth)

    def rm_file(self, path):
        fault("meta")
        return super().rm_file(path)


fsspec.register_implementation("faulty", FaultyFileSystem, clobber=True)


# ------------------------------------------------------------------------ local backend faults
def patch_local_backend(root: str):
    """Make :class:`keepalive.backends.LocalBackend` obey the control file for paths under ``root``
    (in this process). Returns a function that undoes it."""
    from keepalive import backends

    cls = backends.LocalBackend
    root = os.path.abspath(root).rstrip("/") + "/"
    originals = {}

    def under(path) -> bool:
        return (os.path.abspath(path) + "/").startswith(root)

    def wrap(name, op, wrapper=None):
        orig = getattr(cls, name)
        originals[name] = orig

        def method(self, path, *args, **kwargs):
            if under(path):
                fault(op)
                result = orig(self, path, *args, **kwargs)
                return wrapper(result) if wrapper else result
            return orig(self, path, *args, **kwargs)

        method.__name__ = name
        setattr(cls, name, method)

    wrap("open_write", "write", _Writer)
    wrap("open_read", "read", _Reader)
    wrap("makedirs", "meta")
    wrap("listdir", "list")
    wrap("exists", "list")
    wrap("remove_tree", "meta")
    wrap("remove_file", "meta")
    wrap("mmap", "read")

    def undo():
        for name, orig in originals.items():
            setattr(cls, name, orig)

    return undo


# ------------------------------------------------------------------------------------ HTTP proxy
_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
        "transfer-encoding", "upgrade", "expect", "content-length"}


class FaultProxy:
    """An HTTP proxy on 127.0.0.1 in front of ``upstream_port`` that can fail or delay requests.

    ``fail(seconds, status=503)`` answers every request (or those whose method is in ``methods``)
    with ``status`` for that long; ``delay(seconds_per_request, for_seconds)`` sleeps before
    forwarding. ``flavor`` picks the error body: ``"s3"`` (XML SlowDown) or ``"gcs"`` (JSON).
    """

    def __init__(self, upstream_port: int, flavor: str = "s3", host: str = "127.0.0.1"):
        self.upstream = (host, upstream_port)
        self.flavor = flavor
        self.fail_until = 0.0
        self.status = 503
        self.methods: Optional[set] = None
        self.delay_seconds = 0.0
        self.delay_until = 0.0
        self.requests = 0
        self.failed = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _body(self) -> Optional[bytes]:
                if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
                    out = bytearray()
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return bytes(out)
                        out += self.rfile.read(size)
                        self.rfile.readline()
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else (b"" if self.command in ("PUT", "POST") else None)

            def _handle(self):
                body = self._body()
                proxy.requests += 1
                now = time.time()
                if now < proxy.delay_until and proxy.delay_seconds:
                    time.sleep(proxy.delay_seconds)
                if now < proxy.fail_until and (proxy.methods is None or self.command in proxy.methods):
                    proxy.failed += 1
                    if proxy.flavor == "gcs":
                        payload = json.dumps({"error": {"code": proxy.status, "message":
                                                        "Backend Error (injected)"}}).encode()
                        ctype = "application/json"
                    else:
                        payload = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
                                   b"<Message>Please reduce your request rate (injected)</Message></Error>")
                        ctype = "application/xml"
                    self.send_response(proxy.status)
                    self.send_header("Content-Type", ctype)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(payload)
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                if body is not None:
                    headers["Content-Length"] = str(len(body))
                try:
                    conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    conn.close()
                except OSError as exc:
                    payload = f"proxy: upstream failed: {exc}".encode()
                    self.send_response(502)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                self.send_response(resp.status, resp.reason)
                up = f"{proxy.upstream[0]}:{proxy.upstream[1]}"
                me = f"{proxy.upstream[0]}:{proxy.port}"
                length = None
                for k, v in resp.getheaders():
                    lk = k.lower()
                    if lk == "content-length":
                        length = v
                    if lk in _HOP or lk in ("server", "date"):
                        continue
                    if lk == "location":
                        v = v.replace(up, me)
                    self.send_header(k, v)
                if self.command == "HEAD":
                    self.send_header("Content-Length", length or "0")
                else:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD" and data:
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _handle

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address):  # a killed child resets its connections
                pass

        self.server = Server((host, 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread: Optional[threading.Thread] = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.upstream[0]}:{self.port}"

    def fail(self, seconds: float, status: int = 503, methods=None) -> None:
        self.status, self.methods = status, set(methods) if methods else None
        self.fail_until = time.time() + seconds

    def delay(self, per_request: float, seconds: float) -> None:
        self.delay_seconds = per_request
        self.delay_until = time.time() + seconds

    def start(self) -> "FaultProxy":
        self._thread = threading.Thread(target=self.server.serve_forever, name="fault-proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
