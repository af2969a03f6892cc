"""``%keepalive status``: the session panel, live in a notebook front end, plain text elsewhere.

In a notebook kernel (``ZMQInteractiveShell``) with ipywidgets installed the panel is a widget: a bar
for the session time left, one for the idle margin, GPU / RAM / disk / ``/dev/shm`` and the newest
checkpoints, refreshed by a daemon thread (time bars every ``interval`` seconds from cached session
facts, the whole report every ``full_every`` seconds). The same display message carries the text
panel as its ``text/plain`` fallback, so front ends without widgets (nbconvert, jupyter_client,
GitHub's renderer) show the text. In a terminal IPython the text is printed.

Only the newest panel refreshes; an older one says so and freezes. ipywidgets is imported only
when a panel is built.
"""
from __future__ import annotations

import html
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from .. import report as _report
from .. import session, status
from ..session import is_notebook_shell
from ..units import format_duration

_PANELS: List["StatusPanel"] = []
_LOCK = threading.Lock()


def has_widget_frontend(ip: Any = None) -> bool:
    """Whether widgets can be shown: a notebook front end (:func:`keepalive.session.in_notebook`)
    and ipywidgets installed."""
    if not session.in_notebook(ip):
        return False
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


def _style(fraction: Optional[float]) -> str:
    if fraction is None:
        return "info"
    if fraction < 0.15:
        return "danger"
    if fraction < 0.4:
        return "warning"
    return "success"


def _esc(x: Any) -> str:
    return html.escape(str(x))


def time_lines(report: Dict[str, Any], info: Optional[session.SessionInfo] = None
               ) -> Dict[str, Any]:
    """Fractions and captions of the two time bars, from live session facts when ``info`` is given."""
    if info is not None:
        now = time.time()
        budget, remaining = info.budget_seconds, info.remaining_seconds(now)
        idle_to, idle = info.idle_timeout_seconds, session.idle_seconds()
    else:
        budget, remaining = report.get("budget_seconds"), report.get("remaining_seconds")
        idle_to, idle = report.get("idle_timeout_seconds"), report.get("idle_seconds") or 0.0
    out: Dict[str, Any] = {}
    if budget:
        frac = max(0.0, min(1.0, (remaining or 0.0) / budget))
        left = (f"{format_duration(remaining)} left" if remaining is not None and remaining >= 0
                else f"over by {format_duration(-(remaining or 0.0))}")
        out["session"] = (frac, f"{left} of {format_duration(budget)}")
    else:
        out["session"] = (None, f"no session limit ({report.get('platform')})")
    if idle_to:
        margin = idle_to - (idle or 0.0)
        out["idle"] = (max(0.0, min(1.0, margin / idle_to)),
                       f"margin {format_duration(max(0.0, margin))} (idle {format_duration(idle)} of "
                       f"a {format_duration(idle_to)} timeout)")
    else:
        out["idle"] = (None, f"idle {format_duration(idle)}; no idle timeout")
    return out


def hardware_html(report: Dict[str, Any]) -> str:
    hw = report.get("hardware") or {}
    rows: List[Tuple[str, Any]] = []
    gl = hw.get("gpus") or []
    for g in gl:
        util = g.get("utilization_percent")
        rows.append((f"GPU {g.get('index', '')}", f"{g.get('name')}: {g.get('memory')}"
                     + ("" if util is None else f", utilisation {util:.0f} %")))
    if not gl:
        rows.append(("GPU", hw.get("gpu_source") or "none"))
    if hw.get("ram_total_bytes") is not None:
        rows.append(("RAM", f"{hw.get('ram_available')} available of {hw.get('ram_total')}"))
    for d in hw.get("disks") or []:
        if d.get("free_bytes") is not None:
            rows.append(("disk", f"{d['what']} {d['path']}: {d['free']} free of {d['total']}"))
    if hw.get("shm_total_bytes") is not None:
        rows.append(("/dev/shm", hw.get("shm_total")))
    return "<table>" + "".join(
        f"<tr><td style='padding-right:1em'><b>{_esc(k)}</b></td><td>{_esc(v)}</td></tr>" for k, v in rows
    ) + "</table>"


def runs_html(report: Dict[str, Any]) -> str:
    """The runs under the checkpoint dir, then those the index of runs records elsewhere (runs
    opened with an explicit path, ``DriveCheckpoint("/content/drive/MyDrive/runs/x")``)."""
    return _dir_runs_html(report) + _other_runs_html(report)


def _other_runs_html(report: Dict[str, Any]) -> str:
    others = report.get("other_runs") or []
    if not others:
        return ""
    items = [f"<b>{_esc(run['run'])}</b>: {_esc(status.other_run_state(run))} in <code>{_esc(run['url'])}</code>"
             f"{_state_html(run)}"
             for run in others]
    return ("<b>elsewhere</b> (runs recorded in the index of runs)<ul style='margin:0'>"
            + "".join(f"<li>{i}</li>" for i in items) + "</ul>")


def _state_html(run: Dict[str, Any]) -> str:
    """The run's state line (:func:`keepalive.status.state_line`), its state word in bold."""
    line = status.state_line(run)
    return _esc(line).replace(str(run.get("state")), f"<b>{_esc(run.get('state'))}</b>", 1) if line else ""


def _dir_runs_html(report: Dict[str, Any]) -> str:
    runs = report.get("runs") or []
    head = f"<b>checkpoints</b> in <code>{_esc(report.get('checkpoint_dir'))}</code>"
    if not runs:
        return head + ": no runs yet<br>"
    items = []
    for run in runs:
        if run.get("error"):
            items.append(f"{_esc(run['run'])}: unreadable ({_esc(run['error'])})")
        elif run.get("checkpoints"):
            items.append(f"<b>{_esc(run['run'])}</b>: {run['checkpoints']} checkpoint(s), newest step "
                         f"{_esc(run.get('newest_step'))}, {_esc(run.get('newest_epoch'))} epoch(s) done "
                         f"({_esc(run.get('newest_created') or 'time unknown')}){_state_html(run)}")
        else:
            items.append(f"{_esc(run['run'])}: no committed checkpoint{_state_html(run)}")
    return head + "<ul style='margin:0'>" + "".join(f"<li>{i}</li>" for i in items) + "</ul>"


def warnings_html(warnings: List[str]) -> str:
    if not warnings:
        return ""
    return "".join(f"<div style='color:#b35900'>&#9888; {_esc(w)}</div>" for w in warnings)


class StatusPanel:
    """The live widget view of :func:`keepalive.status.status_report`."""

    def __init__(self, checkpoint_dir: Optional[str] = None, interval: float = 5.0,
                 full_every: float = 60.0):
        import ipywidgets as W

        self.checkpoint_dir = checkpoint_dir
        self.interval = max(0.5, float(interval))
        self.full_every = max(self.interval, float(full_every))
        self.report = status.status_report(checkpoint_dir=checkpoint_dir)
        self.extra_warnings: List[str] = []
        self.title = W.HTML()
        bar_layout = W.Layout(width="320px")
        self.session_bar = W.FloatProgress(min=0.0, max=1.0, description="session left",
                                           layout=bar_layout, style={"description_width": "90px"})
        self.session_text = W.Label()
        self.idle_bar = W.FloatProgress(min=0.0, max=1.0, description="idle margin",
                                        layout=bar_layout, style={"description_width": "90px"})
        self.idle_text = W.Label()
        self.hardware = W.HTML()
        self.runs = W.HTML()
        self.warnings = W.HTML()
        self.footer = W.HTML()
        self.box = W.VBox([self.title, W.HBox([self.session_bar, self.session_text]),
                           W.HBox([self.idle_bar, self.idle_text]), self.hardware, self.runs,
                           self.warnings, self.footer])
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._last_full = time.monotonic()
        self.render_full()

    # ------------------------------------------------------------------------------- rendering
    def render_time(self) -> None:
        try:
            info = session.detect()
        except Exception:  # noqa: BLE001
            info = None
        bars = time_lines(self.report, info)
        for (frac, text), bar, label in ((bars["session"], self.session_bar, self.session_text),
                                         (bars["idle"], self.idle_bar, self.idle_text)):
            bar.value = 1.0 if frac is None else frac
            bar.bar_style = _style(frac)
            label.value = text
        state = "live" if not self._stop.is_set() else "stopped"
        self.footer.value = (f"<small>updated {time.strftime('%H:%M:%S')}; {state}, time bars every "
                             f"{self.interval:g} s, the rest every {self.full_every:g} s</small>")

    def render_full(self) -> None:
        r = self.report
        extras = ", ".join(x for x in (r.get("profile") and f"profile {r['profile']}",
                                       r.get("accelerator") and f"accelerator {r['accelerator']}",
                                       r.get("frontend") and f"front end {r['frontend']}") if x)
        self.title.value = (f"<b>keepalive</b> &mdash; platform <b>{_esc(r.get('platform'))}</b>"
                            + (f" ({_esc(extras)})" if extras else "")
                            + f"; session started {_esc(r.get('session_start'))}, elapsed "
                            f"{_esc(format_duration(r.get('elapsed_seconds')))}")
        self.hardware.value = hardware_html(r)
        self.runs.value = runs_html(r)
        self.warnings.value = warnings_html(list(r.get("warnings") or []) + self.extra_warnings)
        self.render_time()

    def text(self) -> str:
        return status.format_status(self.report)

    def mimebundle(self) -> Dict[str, Any]:
        data = dict(self.box._repr_mimebundle_() or {})
        data["text/plain"] = self.text()
        return data

    # -------------------------------------------------------------------------------- refresh
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="keepalive-status", daemon=True)
        self._thread.start()

    def stop(self, why: str = "") -> None:
        self._stop.set()
        try:
            self.render_time()
            if why:
                self.footer.value += f"<small> ({_esc(why)})</small>"
        except Exception:  # noqa: BLE001
            pass

    def warn(self, event: Dict[str, Any]) -> None:
        self.extra_warnings = [event.get("message", "idle timeout near")]
        self.warnings.value = warnings_html(list(self.report.get("warnings") or []) + self.extra_warnings)

    def _closed(self) -> bool:
        return getattr(self.box, "comm", None) is None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            if self._closed():
                return
            try:
                if time.monotonic() - self._last_full >= self.full_every:
                    self._last_full = time.monotonic()
                    self.report = status.status_report(checkpoint_dir=self.checkpoint_dir)
                    self.extra_warnings = []
                    self.render_full()
                else:
                    self.render_time()
            except Exception as exc:  # noqa: BLE001 - a panel must never disturb the kernel
                _report.debug(f"status panel refresh failed: {exc!r}")


def _on_idle_warning(event: Dict[str, Any]) -> None:
    for panel in list(_PANELS):
        panel.warn(event)


def show_status(ip: Any = None, checkpoint_dir: Optional[str] = None, *, mode: str = "auto",
                interval: float = 5.0, full_every: float = 60.0, live: bool = True) -> Optional[StatusPanel]:
    """Show the session panel: a live widget (``mode="auto"`` in a notebook, or ``"widget"``) or
    text (``"text"``). Returns the panel when a widget was shown."""
    if mode == "widget" or (mode == "auto" and has_widget_frontend(ip)):
        try:
            panel = StatusPanel(checkpoint_dir, interval=interval, full_every=full_every)
            from IPython.display import display

            display(panel.mimebundle(), raw=True)
        except Exception as exc:  # noqa: BLE001 - fall back to text
            _report.debug(f"status widget failed, showing text: {exc!r}")
        else:
            with _LOCK:
                for old in _PANELS:
                    old.stop("a newer panel refreshes")
                _PANELS[:] = [panel]
                if _on_idle_warning not in session.idle_warning_callbacks:
                    session.idle_warning_callbacks.append(_on_idle_warning)
            if live:
                panel.start()
            else:
                panel.stop("not live")
            return panel
    print(status.format_status(status.status_report(checkpoint_dir=checkpoint_dir)))  # the panel itself
    return None


def stop_all() -> None:
    """Stop every panel's refresh thread and the idle-warning subscription (``%unload_ext``)."""
    with _LOCK:
        for panel in _PANELS:
            panel.stop("keepalive unloaded")
        _PANELS.clear()
        try:
            session.idle_warning_callbacks.remove(_on_idle_warning)
        except ValueError:
            pass


__all__ = ["show_status", "StatusPanel", "has_widget_frontend", "is_notebook_shell", "stop_all", "time_lines"]
