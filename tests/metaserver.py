"""A stand-in for the clouds' metadata services (GCE, AWS IMDSv2, Azure Scheduled Events) on 127.0.0.1.

The real services answer only on a cloud VM's own link (``metadata.google.internal``,
``169.254.169.254``) and cannot run here: this server speaks the parts of their protocols the
notice watcher (:mod:`keepalive.session.cloud`) uses, with the same paths and required headers, and
misbehaves on demand. Point keepalive at it with ``KEEPALIVE_METADATA_URL=srv.url`` (plus
``KEEPALIVE_CLOUD=gce|aws|azure`` where the machine is not detected as that cloud)::

    with MetadataServer(cloud="gce") as srv:
        env = {"KEEPALIVE_CLOUD": "gce", "KEEPALIVE_METADATA_URL": srv.url}
        srv.preempt()                    # a notice now (AWS / Azure: stopping in 30 s, or seconds=)
        srv.preempt(after_requests=5)    # ... visible from the server's 5th request on
        srv.maintenance()                # GCE TERMINATE_ON_HOST_MAINTENANCE; Azure a Redeploy event
        srv.rebalance()                  # AWS rebalance recommendation
        srv.clear()                      # no notice
        srv.misbehave("garbage")         # "ok" | "garbage" | "error" (HTTP 500) | "hang" (accept,
                                         # never answer) | "slow" (answer after srv.delay seconds)
        srv.count, srv.requests          # how many requests, and each one: Request(method, path, headers, body)
        srv.wait_for_requests(3, timeout=30)   # True once 3 have arrived (waits on an event, not a sleep)
        srv.acknowledged                 # Azure EventIds posted as StartRequests

The server runs in a daemon thread of the test process (``ThreadingHTTPServer``: a hanging or slow
request does not hold up the others); leaving the ``with`` block releases hanging requests and
closes the socket. Protocol details kept: GCE requires ``Metadata-Flavor: Google`` and long-polls
``?wait_for_change=true&last_etag=..&timeout_sec=N`` (answers when the value's ETag differs from
``last_etag`` or after N s); AWS requires a token from ``PUT /latest/api/token`` (with
``X-aws-ec2-metadata-token-ttl-seconds``) in ``X-aws-ec2-metadata-token``, answers 404 while there is
no notice; Azure requires ``Metadata: true`` and removes an event once it is acknowledged.
"""
from __future__ import annotations

import email.utils
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, Optional, Tuple

CLOUDS = ("gce", "aws", "azure")
MODES = ("ok", "garbage", "error", "hang", "slow")
GARBAGE = b"<html>\x00\xff not what a metadata service says {{"
AWS_TOKEN = "AQAEAtesttoken=="
#: answered in every mode, not counted: how many requests a server in a child process has seen
CONTROL_COUNT = "/_metaserver/count"


@dataclass
class Request:
    method: str
    path: str                                   # with the query
    headers: Dict[str, str] = field(default_factory=dict)
    body: bytes = b""


def iso_z(seconds: float) -> str:
    """AWS's time format: ``2017-09-18T08:22:00Z``."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


class MetadataServer:
    """One cloud's metadata service on 127.0.0.1 (see the module docstring)."""

    def __init__(self, cloud: str = "gce", *, mode: str = "ok", delay: float = 3.0):
        if cloud not in CLOUDS:
            raise ValueError(f"cloud must be one of {CLOUDS}")
        self.cloud = cloud
        self.mode = mode
        self.delay = delay
        self.requests: List[Request] = []
        self.acknowledged: List[str] = []
        self._changed = threading.Condition()
        self._release = threading.Event()  # set on close: hanging / slow requests end
        self._notice: Optional[Dict[str, Any]] = None
        self._after: int = 0
        self._server: Optional[ThreadingHTTPServer] = None
        self._thread: Optional[threading.Thread] = None

    # ----------------------------------------------------------------------------------- life
    def __enter__(self) -> "MetadataServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self) -> "MetadataServer":
        owner = self

        class Handler(_Handler):
            server_owner = owner

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True, name=f"metaserver-{self.cloud}")
        self._thread.start()
        return self

    def close(self) -> None:
        self._release.set()
        with self._changed:
            self._changed.notify_all()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    @property
    def url(self) -> str:
        assert self._server is not None, "start the server first"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    @property
    def count(self) -> int:
        return len(self.requests)

    def wait_for_requests(self, n: int, timeout: float = 30.0) -> bool:
        """Wait until ``n`` requests have arrived (True) or ``timeout`` passed (False)."""
        end = time.monotonic() + timeout
        with self._changed:
            while len(self.requests) < n:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
        return True

    # -------------------------------------------------------------------------------- switches
    def _set(self, notice: Optional[Dict[str, Any]], after_requests: int = 0) -> None:
        with self._changed:
            self._notice, self._after = notice, after_requests
            self._changed.notify_all()

    def preempt(self, seconds: float = 30.0, *, after_requests: int = 0, event_id: str = "EV-PREEMPT-1",
                not_before: bool = True) -> None:
        """A preemption notice: GCE ``preempted`` TRUE; AWS ``instance-action`` terminate at now +
        ``seconds``; Azure a ``Preempt`` event with ``NotBefore`` now + ``seconds`` (or none:
        ``not_before=False``). ``after_requests``: visible from the server's N-th request on."""
        self._set({"kind": "preemption", "stops_at": time.time() + seconds, "event_id": event_id,
                   "not_before": not_before}, after_requests)

    def maintenance(self, seconds: float = 600.0, *, after_requests: int = 0,
                    event_id: str = "EV-REDEPLOY-1", event_type: str = "Redeploy") -> None:
        """GCE ``maintenance-event`` TERMINATE_ON_HOST_MAINTENANCE; Azure a ``Redeploy`` (or
        ``event_type``) event NotBefore now + ``seconds``; AWS has none (a ``ValueError``)."""
        if self.cloud == "aws":
            raise ValueError("AWS announces no maintenance on this endpoint; use rebalance()")
        self._set({"kind": "maintenance", "stops_at": time.time() + seconds, "event_id": event_id,
                   "event_type": event_type, "not_before": True}, after_requests)

    def rebalance(self, *, after_requests: int = 0) -> None:
        """AWS's rebalance recommendation."""
        if self.cloud != "aws":
            raise ValueError("only AWS has rebalance recommendations")
        self._set({"kind": "rebalance", "stops_at": None, "noticed": time.time()}, after_requests)

    def clear(self) -> None:
        self._set(None)

    def misbehave(self, mode: str, delay: Optional[float] = None) -> None:
        """How the server answers from now on (one of :data:`MODES`); ``delay`` for ``slow``."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        self.mode = mode
        if delay is not None:
            self.delay = delay
        with self._changed:
            self._changed.notify_all()

    # ------------------------------------------------------------------------------ answering
    def _note(self, request: Request) -> int:
        with self._changed:
            self.requests.append(request)
            self._changed.notify_all()
            return len(self.requests)

    def visible_notice(self) -> Optional[Dict[str, Any]]:
        if self._notice is None or len(self.requests) < self._after:
            return None
        return self._notice

    def gce_value(self, name: str) -> str:
        notice = self.visible_notice()
        if name == "preempted":
            return "TRUE" if notice is not None and notice["kind"] == "preemption" else "FALSE"
        if name == "maintenance-event":
            return ("TERMINATE_ON_HOST_MAINTENANCE" if notice is not None and notice["kind"] == "maintenance"
                    else "NONE")
        raise KeyError(name)

    def answer(self, request: Request) -> Tuple[int, Dict[str, str], bytes]:
        """(status, headers, body) of one well-behaved answer."""
        parts = urllib.parse.urlsplit(request.path)
        query = dict(urllib.parse.parse_qsl(parts.query))
        return getattr(self, f"_{self.cloud}")(request, parts.path, query)

    def _gce(self, request: Request, path: str, query: Dict[str, str]) -> Tuple[int, Dict[str, str], bytes]:
        if request.headers.get("metadata-flavor") != "Google":
            return 403, {}, b"Missing Metadata-Flavor:Google header."
        prefix = "/computeMetadata/v1/instance/"
        name = path[len(prefix):] if path.startswith(prefix) else ""
        if name not in ("preempted", "maintenance-event") or request.method != "GET":
            return 404, {}, b"not found"

        def etag() -> str:
            return hashlib.md5(self.gce_value(name).encode()).hexdigest()[:16]

        if query.get("wait_for_change") == "true":
            end = time.monotonic() + float(query.get("timeout_sec", "60"))
            last = query.get("last_etag")
            with self._changed:
                while not self._release.is_set() and (last is None or last == etag()):
                    left = end - time.monotonic()
                    if left <= 0:
                        break
                    self._changed.wait(left)
                    if last is None:
                        last = etag()  # no ETag given: wait for a change from the current value
        return 200, {"ETag": etag(), "Content-Type": "application/text"}, self.gce_value(name).encode()

    def _aws(self, request: Request, path: str, query: Dict[str, str]) -> Tuple[int, Dict[str, str], bytes]:
        if path == "/latest/api/token":
            if request.method != "PUT":
                return 405, {}, b""
            if not request.headers.get("x-aws-ec2-metadata-token-ttl-seconds"):
                return 400, {}, b"missing ttl header"
            return 200, {}, AWS_TOKEN.encode()
        if request.headers.get("x-aws-ec2-metadata-token") != AWS_TOKEN:
            return 401, {}, b"Unauthorized"
        notice = self.visible_notice()
        if path == "/latest/meta-data/spot/instance-action":
            if notice is None or notice["kind"] != "preemption":
                return 404, {}, b"Not Found"
            body = {"action": "terminate", "time": iso_z(notice["stops_at"])}
            return 200, {"Content-Type": "text/plain"}, json.dumps(body).encode()
        if path == "/latest/meta-data/events/recommendations/rebalance":
            if notice is None or notice["kind"] != "rebalance":
                return 404, {}, b"Not Found"
            return 200, {}, json.dumps({"noticeTime": iso_z(notice["noticed"])}).encode()
        return 404, {}, b"Not Found"

    def _azure(self, request: Request, path: str, query: Dict[str, str]) -> Tuple[int, Dict[str, str], bytes]:
        if request.headers.get("metadata") != "true":
            return 400, {}, json.dumps({"error": "Bad request. Required metadata header not specified"}).encode()
        if path != "/metadata/scheduledevents" or not query.get("api-version"):
            return 404, {}, b"not found"
        if request.method == "POST":
            try:
                starts = json.loads(request.body or b"{}")["StartRequests"]
                ids = [str(s["EventId"]) for s in starts]
            except (ValueError, KeyError, TypeError):
                return 400, {}, b"bad StartRequests"
            with self._changed:
                self.acknowledged.extend(ids)
                if self._notice is not None and self._notice.get("event_id") in ids:
                    self._notice = None  # started: the event leaves the document
            return 200, {}, b""
        notice = self.visible_notice()
        events = []
        if notice is not None:
            event_type = "Preempt" if notice["kind"] == "preemption" else notice.get("event_type", "Redeploy")
            events.append({
                "EventId": notice["event_id"], "EventStatus": "Scheduled", "EventType": event_type,
                "ResourceType": "VirtualMachine", "Resources": ["testvm"],
                "NotBefore": (email.utils.formatdate(notice["stops_at"], usegmt=True)
                              if notice.get("not_before") else ""),
                "Description": "stand-in event", "EventSource": "Platform", "DurationInSeconds": -1,
            })
        body = {"DocumentIncarnation": len(self.acknowledged) + (1 if events else 0), "Events": events}
        return 200, {"Content-Type": "application/json"}, json.dumps(body).encode()


class _Handler(BaseHTTPRequestHandler):
    server_owner: MetadataServer
    protocol_version = "HTTP/1.0"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass  # quiet: the request log is MetadataServer.requests

    def _handle(self) -> None:
        owner = self.server_owner
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        request = Request(self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body)
        if request.path == CONTROL_COUNT:  # the request count, for a server in a child process
            self._send(200, {}, str(owner.count).encode())
            return
        owner._note(request)
        mode = owner.mode
        if mode == "hang":
            owner._release.wait()  # accepted, never answered (until the server closes)
            return
        if mode == "slow" and owner._release.wait(owner.delay):
            return
        if mode == "error":
            status, headers, payload = 500, {}, b"Internal Server Error"
        elif mode == "garbage":
            status, headers, payload = 200, {"ETag": "garbage"}, GARBAGE
        else:
            status, headers, payload = owner.answer(request)
        self._send(status, headers, payload)

    def _send(self, status: int, headers: Dict[str, str], payload: bytes) -> None:
        try:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        except OSError:
            pass  # the client gave up (its timeout): nothing to tell it

    do_GET = do_PUT = do_POST = _handle


class MetadataServerProcess:
    """The same server in a child process (``python tests/metaserver.py CLOUD MODE``), for
    measurements where the server's own Python work must not share the test process's GIL, as the
    real service does not. Only ``url``, ``count`` and the mode given at start::

        with MetadataServerProcess("aws", mode="hang") as srv: ...
    """

    def __init__(self, cloud: str = "gce", *, mode: str = "ok"):
        self.cloud, self.mode = cloud, mode
        self.proc: Optional[subprocess.Popen] = None
        self.url = ""

    def __enter__(self) -> "MetadataServerProcess":
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), self.cloud, self.mode],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.url = self.proc.stdout.readline().strip()  # the child prints its URL once it listens
        if not self.url.startswith("http://"):
            self.__exit__()
            raise RuntimeError(f"the metadata server did not start: {self.url!r}")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(30)
            self.proc = None

    @property
    def count(self) -> int:
        with urllib.request.urlopen(self.url + CONTROL_COUNT, timeout=30) as answer:
            return int(answer.read())


if __name__ == "__main__":
    with MetadataServer(sys.argv[1], mode=sys.argv[2] if len(sys.argv) > 2 else "ok") as _srv:
        print(_srv.url, flush=True)
        threading.Event().wait()  # until killed
