"""A cloud VM's preemption and maintenance notices, read from the VM's metadata service.

Spot / preemptible VMs (GCE Spot, AWS Spot, Azure Spot) are reclaimed with a short notice that the
cloud's metadata service announces before the shutdown. This module finds out whether this machine
is such a VM and, if it is, watches the notice in a daemon thread; the save trigger reads the newest
notice at every boundary (:func:`watcher` then :meth:`NoticeWatcher.notice`: two attribute reads).

* :func:`detect` -> ``"gce"`` | ``"aws"`` | ``"azure"`` | None, from the DMI files
  (``/sys/class/dmi/id``: ``sys_vendor``, ``product_name``, ``board_asset_tag``,
  ``chassis_asset_tag``) and ``/sys/hypervisor/uuid`` only: a machine that is not a cloud VM makes
  no network request at all. ``KEEPALIVE_CLOUD=gce|aws|azure|none`` forces the answer.
* :class:`NoticeWatcher` polls the provider's own endpoints, with the provider's headers:

  - GCE: ``/computeMetadata/v1/instance/preempted`` and ``instance/maintenance-event``
    (``Metadata-Flavor: Google``), each long-polled (``wait_for_change`` with the last ETag) in its
    own thread. ``preempted`` TRUE: a preemption, the VM stops in about 30 s;
    ``TERMINATE_ON_HOST_MAINTENANCE``: a maintenance, about 60 min ahead (GPU VMs are told an hour
    before; the endpoint gives no time).
  - AWS: an IMDSv2 token (``PUT /latest/api/token``), then ``/latest/meta-data/spot/instance-action``
    (404: none; JSON ``action`` + ``time``: the stop time) and
    ``/latest/meta-data/events/recommendations/rebalance`` (an advisory notice, no stop time) every 5 s.
  - Azure: Scheduled Events (``/metadata/scheduledevents?api-version=2020-07-01``, ``Metadata:
    true``) every 5 s: ``Preempt`` is a preemption (``NotBefore`` is the stop time),
    ``Terminate`` / ``Reboot`` / ``Redeploy`` a maintenance; :meth:`NoticeWatcher.acknowledge` posts
    ``StartRequests`` for the event once our save is durable, so the VM need not wait out the notice.

  ``KEEPALIVE_METADATA_URL`` replaces the scheme, host and port of the service (tests point it at a
  local server); the paths and headers stay each provider's own. Every request has a timeout (2 s;
  a long poll: the server's own timeout + 2 s). No answer, an HTTP error or an answer that does not
  parse doubles the pause before the next try up to 60 s, then keeps trying at that pace; it is
  recorded in :meth:`NoticeWatcher.status`, never raised. Requests go through :mod:`http.client`,
  not :mod:`urllib.request`: an ``http_proxy`` of the environment must not carry them (the metadata
  service answers only on the VM's own link).
* :func:`status` is what ``keepalive status`` shows from another process: the cloud and, for a cloud
  VM, the current answer of its notice endpoint (one quick try, 1 s at most per request).

A notice is sticky once seen (the VM goes away); a more urgent notice replaces a less urgent one
(preemption over maintenance over rebalance), and each new notice is passed once to the callbacks of
:meth:`NoticeWatcher.subscribe`. The thread never touches the training's state.
"""
from __future__ import annotations

import datetime as _dt
import email.utils
import http.client
import json
import logging
import os
import threading
import time
import urllib.parse
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from .. import report, settings
from ..units import format_duration

__all__ = ["CLOUDS", "Notice", "NoticeWatcher", "detect", "detect_from_files", "watcher", "status", "reset",
           "HYPERVISOR_UUID", "AZURE_ASSET_TAG", "DEFAULT_HOSTS"]

log = logging.getLogger("keepalive.cloud")

CLOUDS = ("gce", "aws", "azure")

#: Xen's hypervisor UUID: an older (Xen-based) EC2 instance's starts with "ec2" (tests monkeypatch it)
HYPERVISOR_UUID = "/sys/hypervisor/uuid"
#: Azure writes this fixed chassis asset tag into every VM's DMI; Hyper-V on a desk does not
AZURE_ASSET_TAG = "7783-7084-3265-9085-8269-3286-77"
#: each provider's metadata service (``KEEPALIVE_METADATA_URL`` replaces it)
DEFAULT_HOSTS = {"gce": "http://metadata.google.internal", "aws": "http://169.254.169.254",
                 "azure": "http://169.254.169.254"}

#: seconds between two polls of AWS / Azure (AWS's documented advice for the Spot notice)
POLL_SECONDS = 5.0
#: the longest pause between tries when the service does not answer
MAX_BACKOFF_SECONDS = 60.0
#: timeout of one request (a long poll adds the server's own wait)
REQUEST_TIMEOUT = 2.0
#: how long the GCE server holds a long poll before answering the unchanged value
LONG_POLL_SECONDS = 60
#: GCE's notice of a Spot VM's stop: about 30 s (more with a configured notice duration)
GCE_PREEMPT_SECONDS = 30.0
#: GCE tells GPU VMs of a terminating host maintenance about an hour ahead
GCE_MAINTENANCE_SECONDS = 3600.0
#: an Azure Preempt event without NotBefore (already started): about 30 s
AZURE_PREEMPT_SECONDS = 30.0
#: the most of an answer read (a garbage answer may be large)
MAX_ANSWER_BYTES = 64 * 1024

#: how urgent each kind is: a notice replaces the held one only when at least as urgent
URGENCY = {"rebalance": 0, "maintenance": 1, "preemption": 2}


# ----------------------------------------------------------------------------------------- notice
@dataclass(frozen=True)
class Notice:
    """One notice of the cloud: the VM stops (``preemption``, ``maintenance``) or is at risk
    (``rebalance``, no stop time)."""

    cloud: str                 # "gce" | "aws" | "azure"
    kind: str                  # "preemption" | "maintenance" | "rebalance"
    stops_at: Optional[float]  # time.time() when the VM is expected to stop; None: unknown
    detail: str                # one line for users
    event_id: Optional[str] = None  # Azure's EventId, to acknowledge

    def seconds_left(self, now: Optional[float] = None) -> Optional[float]:
        """Seconds until the expected stop (negative once passed); None when unknown."""
        if self.stops_at is None:
            return None
        return self.stops_at - (time.time() if now is None else now)

    def as_dict(self) -> Dict[str, Any]:
        """JSON-safe, with ``seconds_left`` at the time of asking."""
        out = asdict(self)
        out["seconds_left"] = self.seconds_left()
        return out


# -------------------------------------------------------------------------------------- detection
def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(256).strip()
    except OSError:
        return ""


def detect_from_files(dmi_dir: str, hypervisor_uuid: str) -> Optional[str]:
    """The cloud the DMI files under ``dmi_dir`` and the hypervisor UUID file name, or None."""
    def dmi(name: str) -> str:
        return _read(os.path.join(dmi_dir, name))

    vendor, product = dmi("sys_vendor"), dmi("product_name")
    if product == "Google Compute Engine" or vendor == "Google":
        return "gce"
    if (vendor == "Amazon EC2" or dmi("board_asset_tag").startswith("i-")
            or _read(hypervisor_uuid).lower().startswith("ec2")):
        return "aws"
    # "Microsoft Corporation" / "Virtual Machine" is any Hyper-V guest, a desktop's too: only Azure
    # writes its asset tag
    if (vendor == "Microsoft Corporation" and product == "Virtual Machine"
            and dmi("chassis_asset_tag") == AZURE_ASSET_TAG):
        return "azure"
    return None


def detect(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """``"gce"`` | ``"aws"`` | ``"azure"`` | None. ``KEEPALIVE_CLOUD`` forces it (``none``: None);
    else the DMI / hypervisor files decide. Never a network request."""
    forced = settings.get("KEEPALIVE_CLOUD", env)
    if forced == "none":
        return None
    if forced is not None:
        return str(forced)
    return detect_from_files(settings.get("KEEPALIVE_DMI_DIR", env), HYPERVISOR_UUID)


# -------------------------------------------------------------------------------------------- HTTP
class Unanswered(Exception):
    """A request got no usable answer: none in time, an HTTP error, or one that does not parse."""


@dataclass
class Answer:
    status: int
    text: str
    headers: Dict[str, str]


def _request(base: str, method: str, path: str, headers: Mapping[str, str], timeout: float,
             body: Optional[bytes] = None) -> Answer:
    """One request to ``base`` + ``path``; any failure to get an HTTP answer is :class:`Unanswered`."""
    parts = urllib.parse.urlsplit(base)
    conn_type = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = conn_type(parts.hostname or "", parts.port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=dict(headers))
        response = conn.getresponse()
        raw = response.read(MAX_ANSWER_BYTES)
        return Answer(response.status, raw.decode("utf-8", errors="replace").strip(),
                      {k.lower(): v for k, v in response.getheaders()})
    except (OSError, http.client.HTTPException, ValueError) as exc:  # timeouts are OSErrors
        raise Unanswered(f"no answer ({type(exc).__name__}: {exc})" if str(exc)
                         else f"no answer ({type(exc).__name__})") from None
    finally:
        conn.close()


def _short(text: str, limit: int = 80) -> str:
    one_line = " ".join(text.split())
    return one_line if len(one_line) <= limit else one_line[:limit - 3] + "..."


def _http_error(answer: Answer) -> Unanswered:
    return Unanswered(f"HTTP {answer.status}: {_short(answer.text) or '(empty)'}")


def _iso_seconds(text: str) -> float:
    """``2017-09-18T08:22:00Z`` -> unix seconds (ValueError when it is not such a time)."""
    value = _dt.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    if value.tzinfo is None:
        value = value.replace(tzinfo=_dt.timezone.utc)
    return value.timestamp()


def _in(seconds: Optional[float]) -> str:
    if seconds is None:
        return "at an unknown time"
    return f"in about {format_duration(max(0.0, seconds))}"


# ---------------------------------------------------------------------------------------- probes
class _Probe:
    """One endpoint the watcher asks, in its own thread. ``ask`` returns the notice the answer holds
    (None: none) and sets ``answer`` (a short text for status), or raises :class:`Unanswered`."""

    path = ""
    long_poll = False

    def __init__(self, cloud: str, timeout: float):
        self.cloud = cloud
        self.timeout = timeout
        self.answer = ""

    def ask(self, base: str, quick: bool = False) -> Optional[Notice]:
        raise NotImplementedError


class _GceValue(_Probe):
    """A GCE metadata value, long-polled: the first ask reads it and its ETag, the next ones wait for
    a change of that ETag (``wait_for_change``: the server answers when it changes or after
    ``timeout_sec``), so a change between two asks is never missed."""

    long_poll = True
    HEADERS = {"Metadata-Flavor": "Google"}

    def __init__(self, cloud: str, timeout: float, name: str, wait_seconds: int):
        super().__init__(cloud, timeout)
        self.name = name
        self.path = f"/computeMetadata/v1/instance/{name}"
        self.wait_seconds = wait_seconds
        self.etag: Optional[str] = None

    def ask(self, base: str, quick: bool = False) -> Optional[Notice]:
        path, timeout = self.path, self.timeout
        if self.etag is not None and not quick:
            query = urllib.parse.urlencode({"wait_for_change": "true", "last_etag": self.etag,
                                            "timeout_sec": str(self.wait_seconds)})
            path, timeout = f"{self.path}?{query}", self.wait_seconds + self.timeout
        answer = _request(base, "GET", path, self.HEADERS, timeout)
        if answer.status != 200:
            raise _http_error(answer)
        value = answer.text.strip()
        notice = self.read(value)  # raises on garbage: the ETag of garbage is not kept
        self.etag = answer.headers.get("etag")
        self.answer = value
        return notice

    def read(self, value: str) -> Optional[Notice]:
        if self.name == "preempted":
            if value == "FALSE":
                return None
            if value == "TRUE":
                return Notice("gce", "preemption", time.time() + GCE_PREEMPT_SECONDS,
                              f"GCE: instance/preempted is TRUE (the VM stops in about "
                              f"{GCE_PREEMPT_SECONDS:.0f} s)")
            raise Unanswered(f"not TRUE or FALSE: {_short(value)!r}")
        if value in ("NONE", "MIGRATE_ON_HOST_MAINTENANCE"):  # a live migration keeps the VM running
            return None
        if value == "TERMINATE_ON_HOST_MAINTENANCE":
            return Notice("gce", "maintenance", time.time() + GCE_MAINTENANCE_SECONDS,
                          "GCE: instance/maintenance-event is TERMINATE_ON_HOST_MAINTENANCE (the VM "
                          f"stops for host maintenance in about {format_duration(GCE_MAINTENANCE_SECONDS)})")
        raise Unanswered(f"not a maintenance event: {_short(value)!r}")


class _AwsSpot(_Probe):
    """AWS IMDSv2: a session token, then the Spot interruption notice and the rebalance
    recommendation (both 404 while there is none)."""

    path = "/latest/meta-data/spot/instance-action"
    REBALANCE = "/latest/meta-data/events/recommendations/rebalance"
    TOKEN_TTL = 21600

    def __init__(self, cloud: str, timeout: float):
        super().__init__(cloud, timeout)
        self.token: Optional[str] = None
        self.token_until = 0.0
        self.v1 = False  # the service answered the token request with an error: IMDSv1 only

    def _headers(self, base: str) -> Dict[str, str]:
        if not self.v1 and (self.token is None or time.monotonic() > self.token_until):
            answer = _request(base, "PUT", "/latest/api/token",
                              {"X-aws-ec2-metadata-token-ttl-seconds": str(self.TOKEN_TTL)}, self.timeout)
            if answer.status == 200:
                if not answer.text or not answer.text.isascii() or not answer.text.isprintable():
                    raise Unanswered(f"not a token: {_short(answer.text)!r}")  # it goes into a header
                self.token, self.token_until = answer.text, time.monotonic() + self.TOKEN_TTL - 60
            elif answer.status in (403, 404, 405):
                self.v1 = True  # IMDSv2 switched off: plain GETs work
            else:
                raise _http_error(answer)
        return {"X-aws-ec2-metadata-token": self.token} if self.token and not self.v1 else {}

    def _get(self, base: str, path: str) -> Optional[Dict[str, Any]]:
        answer = _request(base, "GET", path, self._headers(base), self.timeout)
        if answer.status == 401:
            self.token = None  # expired: a new one next time
            raise _http_error(answer)
        if answer.status == 404:
            return None
        if answer.status != 200:
            raise _http_error(answer)
        try:
            value = json.loads(answer.text)
        except ValueError:
            raise Unanswered(f"not JSON: {_short(answer.text)!r}") from None
        if not isinstance(value, dict):
            raise Unanswered(f"not a JSON object: {_short(answer.text)!r}")
        return value

    def ask(self, base: str, quick: bool = False) -> Optional[Notice]:
        action = self._get(base, self.path)
        if action is not None:
            try:
                stops_at = _iso_seconds(str(action["time"]))
                what = str(action["action"])
            except (KeyError, ValueError):
                raise Unanswered(f"no action / time: {_short(json.dumps(action))}") from None
            self.answer = json.dumps(action)
            return Notice("aws", "preemption", stops_at,
                          f"AWS: spot/instance-action says {what} at {action['time']} "
                          f"(the VM stops {_in(stops_at - time.time())})")
        self.answer = "404 (no interruption notice)"
        if quick:
            return None
        rebalance = self._get(base, self.REBALANCE)
        if rebalance is None:
            return None
        self.answer = f"rebalance {json.dumps(rebalance)}"
        return Notice("aws", "rebalance", None,
                      "AWS: a rebalance recommendation (the Spot VM is at elevated risk of interruption)")


class _AzureEvents(_Probe):
    """Azure Scheduled Events: the most urgent event that stops the VM."""

    path = "/metadata/scheduledevents?api-version=2020-07-01"
    HEADERS = {"Metadata": "true"}
    KINDS = {"Preempt": "preemption", "Terminate": "maintenance", "Reboot": "maintenance",
             "Redeploy": "maintenance"}  # Freeze pauses the VM a few seconds: nothing to save for

    def ask(self, base: str, quick: bool = False) -> Optional[Notice]:
        answer = _request(base, "GET", self.path, self.HEADERS, self.timeout)
        if answer.status != 200:
            raise _http_error(answer)
        try:
            document = json.loads(answer.text)
            events = document["Events"]
            if not isinstance(events, list):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            raise Unanswered(f"not a Scheduled Events document: {_short(answer.text)!r}") from None
        found: List[Notice] = []
        for event in events:
            if not isinstance(event, dict) or event.get("EventType") not in self.KINDS:
                continue
            found.append(self._notice(event))
        types = ", ".join(f"{e.get('EventType')} {e.get('EventId')}" for e in events
                          if isinstance(e, dict)) or "none"
        self.answer = f"{len(events)} event(s): {types}"
        if not found:
            return None
        return max(found, key=lambda n: URGENCY[n.kind])

    @classmethod
    def _notice(cls, event: Mapping[str, Any]) -> Notice:
        kind = cls.KINDS[str(event["EventType"])]
        not_before = str(event.get("NotBefore") or "").strip()
        stops_at: Optional[float] = None
        if not_before:
            try:
                stops_at = email.utils.parsedate_to_datetime(not_before).timestamp()
            except (TypeError, ValueError):
                raise Unanswered(f"NotBefore is not a time: {_short(not_before)!r}") from None
        elif kind == "preemption":
            stops_at = time.time() + AZURE_PREEMPT_SECONDS
        event_id = str(event["EventId"]) if event.get("EventId") is not None else None
        when = f"not before {not_before}" if not_before else "now"
        return Notice("azure", kind, stops_at,
                      f"Azure: scheduled event {event.get('EventType')} ({event_id}) {when} "
                      f"(the VM stops {_in(None if stops_at is None else stops_at - time.time())})",
                      event_id)


def _probes(cloud: str, timeout: float, long_poll: int) -> List[_Probe]:
    if cloud == "gce":
        return [_GceValue(cloud, timeout, "preempted", long_poll),
                _GceValue(cloud, timeout, "maintenance-event", long_poll)]
    if cloud == "aws":
        return [_AwsSpot(cloud, timeout)]
    if cloud == "azure":
        return [_AzureEvents(cloud, timeout)]
    raise ValueError(f"unknown cloud {cloud!r} (one of {', '.join(CLOUDS)})")


def _base_url(cloud: str, env: Optional[Mapping[str, str]] = None) -> str:
    return settings.get("KEEPALIVE_METADATA_URL", env) or DEFAULT_HOSTS[cloud]


# --------------------------------------------------------------------------------------- watcher
@dataclass
class _ProbeState:
    last_answer: Optional[str] = None
    last_checked: Optional[float] = None
    errors: int = 0
    backoff_seconds: float = 0.0  # the pause before the next try after an error (0: answering)


class NoticeWatcher:
    """Watches one cloud's notices in daemon threads (one per endpoint).

    ``base_url`` defaults to ``KEEPALIVE_METADATA_URL`` or the provider's service. The keyword
    arguments exist for tests: ``interval`` (seconds between polls, and the first pause after an
    error), ``long_poll`` (GCE's ``timeout_sec``), ``max_backoff``, ``timeout`` (one request),
    ``start`` (False: no thread; :meth:`check_once` asks once)."""

    def __init__(self, cloud: str, base_url: Optional[str] = None, *, interval: float = POLL_SECONDS,
                 long_poll: int = LONG_POLL_SECONDS, max_backoff: float = MAX_BACKOFF_SECONDS,
                 timeout: float = REQUEST_TIMEOUT, start: bool = True):
        self.cloud = cloud
        self.base_url = (base_url or _base_url(cloud)).rstrip("/")
        self.interval = interval
        self.max_backoff = max(max_backoff, interval)
        self.timeout = timeout
        self._probes = _probes(cloud, timeout, long_poll)
        self._states = {p.path: _ProbeState() for p in self._probes}
        self._notice: Optional[Notice] = None
        self._notice_key: Optional[Tuple[str, str]] = None  # endpoint and answer of the held notice
        self._callbacks: List[Callable[[Notice], None]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._acknowledged: List[str] = []
        self._threads: List[threading.Thread] = []
        if start:
            for probe in self._probes:
                thread = threading.Thread(target=self._run, args=(probe,), daemon=True,
                                          name=f"keepalive-cloud-{cloud}-{probe.path.rsplit('/', 1)[-1]}")
                self._threads.append(thread)
                thread.start()

    # ------------------------------------------------------------------------------- reading
    def notice(self) -> Optional[Notice]:
        """The newest (most urgent) notice seen; sticky once seen. An attribute read: never blocks."""
        return self._notice

    def subscribe(self, callback: Callable[[Notice], None]) -> None:
        """Call ``callback(notice)`` once per new notice, from the watcher's thread (a notice already
        seen is passed at once, from this thread). What it raises is logged, not passed on."""
        with self._lock:
            self._callbacks.append(callback)
            held = self._notice
        if held is not None:
            self._call(callback, held)

    @property
    def watched(self) -> bool:
        """Whether the threads run (False after :meth:`stop`, or for a watcher made with start=False)."""
        return any(t.is_alive() for t in self._threads) and not self._stop.is_set()

    def status(self) -> Dict[str, Any]:
        """JSON-safe: ``cloud``, ``watched``, ``endpoint``, ``last_answer``, ``last_checked`` (unix
        seconds), ``errors``, ``backoff_seconds``, ``notice`` (a dict or None), ``acknowledged``
        (Azure EventIds) and ``endpoints`` (the same per endpoint path)."""
        with self._lock:
            states = {path: _ProbeState(**asdict(s)) for path, s in self._states.items()}
            notice, acknowledged = self._notice, list(self._acknowledged)
        checked = [(s.last_checked, path, s) for path, s in states.items() if s.last_checked is not None]
        newest = max(checked, key=lambda c: c[0]) if checked else None
        return {
            "cloud": self.cloud,
            "watched": self.watched,
            "endpoint": self.base_url + self._probes[0].path,
            "last_answer": newest[2].last_answer if newest else None,
            "last_checked": newest[0] if newest else None,
            "errors": sum(s.errors for s in states.values()),
            "backoff_seconds": max(s.backoff_seconds for s in states.values()),
            "notice": notice.as_dict() if notice is not None else None,
            "acknowledged": acknowledged,
            "endpoints": {path: asdict(s) for path, s in states.items()},
        }

    # ------------------------------------------------------------------------------- acting
    def acknowledge(self, notice: Notice) -> None:
        """Azure: tell Scheduled Events to start ``notice``'s event now (after our save is durable,
        the VM need not wait out the notice). Others: nothing. Never raises; a short timeout."""
        if self.cloud != "azure" or not notice.event_id:
            return
        body = json.dumps({"StartRequests": [{"EventId": notice.event_id}]}).encode()
        try:
            answer = _request(self.base_url, "POST", _AzureEvents.path,
                              {**_AzureEvents.HEADERS, "Content-Type": "application/json"}, self.timeout, body)
            said = f"acknowledged {notice.event_id}: HTTP {answer.status}"
            if answer.status == 200:
                with self._lock:
                    self._acknowledged.append(notice.event_id)
        except Unanswered as exc:
            said = f"acknowledging {notice.event_id}: {exc}"
        except Exception as exc:  # noqa: BLE001 - acknowledging is a courtesy; it never fails a save
            said = f"acknowledging {notice.event_id}: {type(exc).__name__}: {exc}"
        log.info("%s", said)
        with self._lock:
            self._states[_AzureEvents.path].last_answer = said

    def stop(self, wait: float = 0.0) -> None:
        """End the threads (daemons: a request in flight ends with its timeout); ``wait``: up to so
        many seconds for them to end."""
        self._stop.set()
        end = time.monotonic() + wait
        for thread in self._threads:
            thread.join(max(0.0, end - time.monotonic()))

    def check_once(self, quick: bool = True) -> Optional[Notice]:
        """Ask in this thread (``keepalive status``). ``quick``: the preemption notice's endpoint
        once, no long poll (AWS: the token, then the interruption notice); else every endpoint
        once, stopping at the first that does not answer."""
        for probe in self._probes[:1] if quick else self._probes:
            if not self._ask(probe, quick):
                break
        return self._notice

    # ----------------------------------------------------------------------------- the threads
    def _ask(self, probe: _Probe, quick: bool) -> bool:
        """One ask of ``probe``, recorded; whether it answered."""
        try:
            found = probe.ask(self.base_url, quick)
        except Unanswered as exc:
            self._record(probe, str(exc), error=True)
            return False
        except Exception as exc:  # noqa: BLE001 - a bug here must not end the watching
            self._record(probe, f"{type(exc).__name__}: {exc}", error=True)
            log.debug("cloud notice probe %s failed", probe.path, exc_info=True)
            return False
        self._record(probe, probe.answer, error=False)
        if found is not None:
            self._offer(found, (probe.path, probe.answer))
        return True

    def _record(self, probe: _Probe, text: str, error: bool) -> None:
        with self._lock:
            state = self._states[probe.path]
            state.last_answer, state.last_checked = _short(text, 160), time.time()
            if error:
                state.errors += 1
                state.backoff_seconds = min(self.max_backoff, state.backoff_seconds * 2 or self.interval)
            else:
                state.backoff_seconds = 0.0

    def _offer(self, found: Notice, key: Tuple[str, str]) -> None:
        """Hold ``found`` unless it is the held notice asked again (the same answer of the same
        endpoint) or less urgent than the held one."""
        with self._lock:
            held = self._notice
            if held is not None and (key == self._notice_key or URGENCY[found.kind] < URGENCY[held.kind]):
                return
            self._notice, self._notice_key = found, key
            callbacks = list(self._callbacks)
        log.info("cloud notice: %s", found.detail)  # the core says it, once, at the next boundary
        for callback in callbacks:
            self._call(callback, found)

    @staticmethod
    def _call(callback: Callable[[Notice], None], notice: Notice) -> None:
        try:
            callback(notice)
        except Exception:  # noqa: BLE001 - a subscriber's bug must not end the watching
            log.exception("a cloud notice callback failed")

    def _run(self, probe: _Probe) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            answered = self._ask(probe, quick=False)
            if answered:
                # a long poll waited in the request already; one that came back at once (the value
                # changed, or a server that does not hold) must not spin
                pause = self.interval if not probe.long_poll else max(0.0, 1.0 - (time.monotonic() - started))
                pause = min(pause, self.interval)
            else:
                with self._lock:
                    pause = self._states[probe.path].backoff_seconds
            self._stop.wait(pause)


# ----------------------------------------------------------------------------------- the process
_LOCK = threading.Lock()
_DECIDED = False
_WATCHER: Optional[NoticeWatcher] = None


def watcher() -> Optional[NoticeWatcher]:
    """This process's watcher, started on the first call when :func:`detect` finds a cloud; None
    otherwise. Decided once per process (a VM does not change clouds): later calls are an
    attribute read, cheap at every boundary. :func:`reset` forgets the decision (tests)."""
    global _DECIDED, _WATCHER
    if _DECIDED:
        return _WATCHER
    with _LOCK:
        if not _DECIDED:
            cloud = detect()
            if cloud is not None:
                try:
                    _WATCHER = NoticeWatcher(cloud)
                except Exception as exc:  # noqa: BLE001 - no watching is better than no training
                    report.warn(f"could not start watching the {cloud} VM's preemption notices ({exc}); "
                                "a notice will not be seen, SIGTERM still is", key="cloud-watcher")
            _DECIDED = True
    return _WATCHER


def reset() -> None:
    """Stop this process's watcher and forget the decision: the next :func:`watcher` decides again."""
    global _DECIDED, _WATCHER
    with _LOCK:
        if _WATCHER is not None:
            _WATCHER.stop()
        _WATCHER, _DECIDED = None, False


def _forget_in_child() -> None:
    """A forked child has none of its parent's threads: it decides (and starts) again."""
    global _DECIDED, _WATCHER, _LOCK
    _LOCK = threading.Lock()
    _WATCHER, _DECIDED = None, False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def status(timeout: float = 1.0) -> Dict[str, Any]:
    """For ``keepalive status``: ``{"cloud": None, "watched": False}`` off a cloud VM (and no
    request). On one: this process's watcher's status when it runs one; else one quick ask of the
    notice endpoint (``timeout`` per request; AWS: the token, then the notice) and ``watched``
    True (a training's checkpointer on this VM watches the notices)."""
    if _WATCHER is not None:
        return _WATCHER.status()
    cloud = detect()
    if cloud is None:
        return {"cloud": None, "watched": False}
    probe_watcher = NoticeWatcher(cloud, timeout=timeout, start=False)
    probe_watcher.check_once(quick=True)
    report = probe_watcher.status()
    report["watched"] = True
    return report


def _stamp(seconds: Optional[float]) -> str:
    return "never" if seconds is None else time.strftime("%H:%M:%S UTC", time.gmtime(seconds))


def describe(report: Mapping[str, Any]) -> str:
    """One line for a status panel from :func:`status`'s dict."""
    if not report or not report.get("cloud"):
        return "not a cloud VM (no preemption notices to watch; KEEPALIVE_CLOUD=gce|aws|azure forces it)"
    notice = report.get("notice")
    watched = "watched" if report.get("watched") else "not watched"
    head = f"{report['cloud']}: notices {watched} at {report.get('endpoint')}"
    if notice:
        return f"{head}; NOTICE: {notice.get('detail')}"
    answer = report.get("last_answer")
    tail = f"last answer {answer!r} ({_stamp(report.get('last_checked'))})" if answer else "no answer yet"
    if report.get("errors"):
        tail += f", {report['errors']} failed {'try' if report['errors'] == 1 else 'tries'}"
    return f"{head}; {tail}"

