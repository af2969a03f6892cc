"""Messages to a phone or a chat, through Apprise: one URL per service, sent from a background thread.

`Apprise <https://github.com/caronc/apprise>`_ knows about a hundred services, each named by a URL:
``ntfy://my-topic``, ``discord://id/token``, ``slack://...``, ``tgram://bot-token/chat-id``,
``mailto://user:password@gmail.com``, ``json://host:port/path`` (a JSON POST to any webhook). keepalive
writes no client of its own. :class:`Notifier` holds the URLs; :meth:`Notifier.send` queues a message
and returns at once: a thread sends it, each send bounded by a timeout, so that a dead receiver or a
slow network never slows the caller. A URL Apprise cannot use is said once, when the notifier is made;
a failing send once per notifier (its service named with the secrets masked); later failures only go
to the log. The training's notifications (:mod:`keepalive.lifecycle.notifications`) and the
supervisor of ``keepalive run`` both send through it.

>>> split_urls("json://localhost:8000/hook, ntfy://my-topic mailto://me:pw@example.com?to=a@x.org,b@y.org")
['json://localhost:8000/hook', 'ntfy://my-topic', 'mailto://me:pw@example.com?to=a@x.org,b@y.org']
>>> notifier_from([]) is None  # an explicit empty list: no notifications, whatever KEEPALIVE_NOTIFY says
True

Apprise is imported when a notifier is made, never by ``import keepalive`` (the ``notify`` extra
installs it: ``pip install "keepalive-nb[notify]"``).
"""
from __future__ import annotations

import atexit
import collections
import logging
import re
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Deque, List, Optional, Sequence, Union

from . import report, settings

log = logging.getLogger("keepalive")

__all__ = ["Notifier", "notifier_from", "split_urls", "KINDS", "SEND_TIMEOUT", "APPRISE_MISSING"]

#: what a message is, as Apprise's notification types (a service may colour or prioritise by it)
KINDS = ("info", "success", "warning", "failure")
#: seconds one message may take to send (every service together); a flush waits at most as long
SEND_TIMEOUT = 10.0
#: messages waiting beyond this many (a receiver that hangs): the oldest are dropped, not the newest
MAX_WAITING = 64

# a separator between two URLs: spaces, or a comma before the next URL's scheme (a comma inside a
# URL, e.g. mailto's ``to=a@x.org,b@y.org``, is not one)
_SEPARATOR = re.compile(r"\s+|\s*,\s*(?=[A-Za-z][A-Za-z0-9+.-]*://)")


def split_urls(urls: Union[str, Sequence[str], None]) -> List[str]:
    """The URLs in ``urls``: one string of URLs separated by spaces or commas, or a list of them."""
    if urls is None:
        return []
    items = [urls] if isinstance(urls, str) else list(urls)
    found: List[str] = []
    for item in items:
        found.extend(part.strip(" ,") for part in _SEPARATOR.split(str(item)) if part.strip(" ,"))
    return found


def masked(url: str) -> str:
    """A URL as it may be shown: its scheme only (a URL Apprise did not accept may hold a token)."""
    scheme, sep, _ = url.partition("://")
    return f"{scheme}://..." if sep else "(not a URL)"


@dataclass(frozen=True)
class _Message:
    title: str
    body: str
    kind: str


class Notifier:
    """Sends messages to every URL of ``urls`` (Apprise URLs, see the module docstring), in the
    background. ``timeout``: seconds one message may take (all services); ``warn``: how a problem is
    said (default :func:`keepalive.report.warn`, once per notifier and problem)."""

    def __init__(self, urls: Union[str, Sequence[str]], *, timeout: float = SEND_TIMEOUT,
                 warn: Optional[Callable[[str], object]] = None):
        import apprise  # lazily: `import keepalive` never imports it

        self.timeout = float(timeout)
        self._warn = warn or (lambda line: report.warn(line))
        self._apprise = apprise.Apprise()
        self.urls = split_urls(urls)
        rejected = [url for url in self.urls if not self._apprise.add(url)]
        if rejected:
            self._warn(f"notifications: Apprise cannot send to {', '.join(masked(u) for u in rejected)} "
                       f"(an unknown service, or a URL not in the form that service's page shows); "
                       f"{'no notification is sent' if not len(self._apprise) else 'the other URLs are used'}")
        #: the services messages go to (the URLs Apprise accepted)
        self.services = len(self._apprise)
        self._waiting: Deque[_Message] = collections.deque()
        self._cond = threading.Condition()
        self._unsent = 0  # queued or being sent
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self._failure_said = False
        self.sent = 0  #: messages every service took
        self.failed = 0  #: messages at least one service did not take
        self.dropped = 0  #: messages dropped unsent (too many waiting, or closed before their turn)
        #: the last message failed (a dead receiver): waiting for the next one is pointless
        self.failing = False
        _LIVE.add(self)

    def __repr__(self) -> str:
        return f"Notifier({self.services} service(s))"

    # ----------------------------------------------------------------------------------- sending
    def send(self, title: str, body: str, kind: str = "info") -> None:
        """Queue a message (``kind`` one of :data:`KINDS`) and return at once; a thread sends it."""
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r}: one of {KINDS}")
        if not self.services:
            return
        with self._cond:
            if len(self._waiting) >= MAX_WAITING:
                self._waiting.popleft()
                self._unsent -= 1
                self.dropped += 1
            self._waiting.append(_Message(title, body, kind))
            self._unsent += 1
            self._closed = False
            self._cond.notify_all()
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name="keepalive-notify", daemon=True)
        try:
            self._thread.start()
        except RuntimeError:  # the interpreter is exiting (no new thread then): sent here, bounded
            with self._cond:
                self._thread = None
            self._drain_here()

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every queued message was sent (or failed), at most ``timeout`` seconds (default:
        :attr:`timeout` plus a second). True when none is left."""
        limit = time.monotonic() + (self.timeout + 1.0 if timeout is None else timeout)
        with self._cond:
            while self._unsent:
                left = limit - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: Optional[float] = None) -> None:
        """Send what is queued (waiting at most ``timeout`` seconds), then drop what is left. A send
        after ``close`` starts again."""
        self.flush(timeout)
        with self._cond:
            self.dropped += len(self._waiting)
            self._unsent -= len(self._waiting)
            self._waiting.clear()
            self._closed = True
            self._cond.notify_all()

    # ------------------------------------------------------------------------------ the thread
    def _next(self) -> Optional[_Message]:
        with self._cond:
            while not self._waiting and not self._closed:
                self._cond.wait()
            if not self._waiting:
                self._thread = None  # closed: ends; a later send starts another
                return None
            return self._waiting.popleft()

    def _run(self) -> None:
        while True:
            message = self._next()
            if message is None:
                return
            self._deliver(message)

    def _drain_here(self) -> None:
        while True:
            with self._cond:
                if not self._waiting:
                    return
                message = self._waiting.popleft()
            self._deliver(message)

    def _deliver(self, message: _Message) -> None:
        try:
            result = self._apprise.notify(body=message.body, title=message.title, notify_type=message.kind,
                                          timeout=self.timeout)
            failures = [r for r in result if not r] if not result else []
            self.failing = not result
            if result:
                self.sent += 1
            else:
                self.failed += 1
                self._said_once(failures, result)
        except Exception as exc:  # noqa: BLE001 - a notifier never breaks its caller
            self.failed, self.failing = self.failed + 1, True
            self._said_once([], None, f"{type(exc).__name__}: {exc}")
        finally:
            with self._cond:
                self._unsent -= 1
                self._cond.notify_all()

    def _said_once(self, failures: List[Any], result: Any, error: str = "") -> None:
        where = ", ".join(_shown(r) for r in failures) or "its services"
        why = error or _why(failures) or (getattr(getattr(result, "status", None), "name", "") or "").lower()
        line = (f"notifications: could not send to {where}{' (' + why + ')' if why else ''}; the training "
                f"goes on; later failures of this notifier are only logged")
        if self._failure_said:
            log.info(line)
            return
        self._failure_said = True
        self._warn(line)


def _shown(result: Any) -> str:
    """A service of a failed send as it may be shown: Apprise's URL with its secrets masked, no options."""
    url = str(getattr(result, "url", "") or getattr(result, "name", "") or "a service")
    return url.split("?", 1)[0]


def _why(failures: Sequence[Any]) -> str:
    """The last warning a failed service logged (Apprise's words: a connection error, an HTTP status)."""
    for result in failures:
        try:
            entries = [e for e in result.logs() if str(getattr(e, "level", "")).upper() in _SERIOUS]
        except Exception:  # noqa: BLE001 - the reason is a nicety
            continue
        if entries:
            return str(getattr(entries[-1], "message", entries[-1])).strip().rstrip(".")[:200]
    return ""


_SERIOUS = ("WARNING", "ERROR", "CRITICAL")


#: said once when URLs are configured and Apprise is not installed
APPRISE_MISSING = ("notify= / KEEPALIVE_NOTIFY needs Apprise, which is not installed: pip install "
                   "'keepalive-nb[notify]' (or apprise); no notification is sent")


def notifier_from(urls: Union[str, Sequence[str], None] = None, **options: Any) -> Optional[Notifier]:
    """A :class:`Notifier` for ``urls`` (default: ``KEEPALIVE_NOTIFY``), or None when none is given
    (``""`` or ``[]`` turn notifications off whatever the environment says) or Apprise is not
    installed (said once). ``options`` go to :class:`Notifier`."""
    if urls is None:
        configured = settings.get("KEEPALIVE_NOTIFY")
        urls = getattr(configured, "text", configured)
    found = split_urls(urls)
    if not found:
        return None
    try:
        return Notifier(found, **options)
    except ImportError:
        report.warn(APPRISE_MISSING, key="notify-apprise")
        return None


_LIVE: "weakref.WeakSet[Notifier]" = weakref.WeakSet()


@atexit.register
def _send_before_exit() -> None:
    """What is still queued when the interpreter exits is sent (bounded; not waited for when the
    notifier's last message failed): the daemon thread would be stopped mid-way."""
    for notifier in list(_LIVE):
        try:
            if not notifier.failing:
                notifier.flush()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
