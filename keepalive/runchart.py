"""The picture of a run across its sessions (matplotlib, imported only here, only when drawing).

Above: each session as a bar along the step axis, coloured by how it ended, the steps it did again
hatched, each interruption marked. Below: the logged loss (or the first metric logged) over all
sessions, each session in its colour. The title says the run's state and its ETA.

>>> from keepalive.runsummary import summarize
>>> s = summarize("runs/x", [{"session": "a", "started": 0, "updated": 10, "state": "finished",
...                           "first_step": 0, "step": 10, "metrics": [{"step": 5, "loss": 1.0}]}])
>>> draw(s)[:8] == b"\\x89PNG\\r\\n\\x1a\\n"
True
"""
from __future__ import annotations

import io
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .runsummary import RunSummary

__all__ = ["draw", "metric_name", "COLOURS"]

#: a session's colour by how it ended
COLOURS = {"finished": "#2e7d32", "stopped": "#1565c0", "closed": "#757575", "crashed": "#c62828",
           "died": "#c62828", "running": "#ef6c00"}
_SKIP = {"step", "epoch", "time", "session", "batch"}
_LINE_COLOURS = ("C0", "C1", "C4", "C5", "C6", "C7", "C8", "C9")


def metric_name(points: Sequence[Dict[str, Any]]) -> Optional[str]:
    """The metric the chart draws: ``loss`` when logged, else the first numeric one.

    >>> metric_name([{"step": 1, "acc": 0.5}, {"step": 2, "loss": 1.0}])
    'loss'
    """
    names: List[str] = []
    for point in points:
        for key, value in point.items():
            if key not in _SKIP and isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and key not in names:
                names.append(key)
    if not names:
        return None
    return "loss" if "loss" in names else names[0]


def _series(points: Sequence[Dict[str, Any]], name: str) -> Dict[int, Tuple[List[float], List[float]]]:
    by_session: Dict[int, Tuple[List[float], List[float]]] = {}
    for point in points:
        value, step = point.get(name), point.get("step")
        if isinstance(value, (int, float)) and isinstance(step, (int, float)):
            xs, ys = by_session.setdefault(int(point.get("session", 0)), ([], []))
            xs.append(float(step))
            ys.append(float(value))
    return by_session


def _draw_sessions(ax: Any, summary: RunSummary) -> None:
    for i, seg in enumerate(summary.segments):
        colour = COLOURS.get(seg.state, "#757575")
        ax.barh(i, max(seg.end_step - seg.start_step, 0.5), left=seg.start_step, color=colour, height=0.6)
        if seg.redone:
            ax.barh(i, seg.redone, left=seg.start_step, color="none", edgecolor="black", hatch="///",
                    height=0.6, linewidth=0)
        if i < len(summary.segments) - 1:
            ax.axvline(seg.end_step, color=colour, linestyle=":", linewidth=1)
    ax.set_yticks(range(len(summary.segments)))
    ax.set_yticklabels([f"session {i + 1}: {seg.state}" for i, seg in enumerate(summary.segments)])
    ax.invert_yaxis()
    if summary.total_steps:
        ax.axvline(summary.total_steps, color="black", linewidth=1)
    ax.set_xlabel("step (hatched: done again after an interruption)")


def _draw_metric(ax: Any, summary: RunSummary) -> None:
    name = metric_name(summary.metrics)
    if name is None:
        ax.text(0.5, 0.5, "no metrics logged (ckpt.log(loss=...) in a torch loop)", ha="center",
                va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    for session, (xs, ys) in sorted(_series(summary.metrics, name).items()):
        # one colour per session (not per end state: two stopped sessions must be told apart), none of
        # the end states' red and green
        ax.plot(xs, ys, color=_LINE_COLOURS[session % len(_LINE_COLOURS)], marker=".", linewidth=1,
                label=f"session {session + 1}")
    ax.set_ylabel(name)
    ax.set_xlabel("step")
    if len(summary.segments) > 1:
        ax.legend(loc="best", fontsize="small")


def draw(summary: RunSummary, path: Optional[str] = None) -> bytes:
    """The run's picture as PNG bytes (also written to ``path`` when given)."""
    from matplotlib.figure import Figure  # no pyplot: no global figure, no GUI backend

    rows = max(1, len(summary.segments))
    fig = Figure(figsize=(9, 3.2 + 0.28 * rows), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[0.8 + 0.25 * rows, 2.4])
    _draw_sessions(top, summary)
    _draw_metric(bottom, summary)
    title = f"{summary.run}: {summary.state} at step {summary.step}"
    if summary.total_steps:
        title += f" of {summary.total_steps}"
    if summary.eta is not None:
        title += f"\nETA: {summary.eta.words()}"
    top.set_title(title, fontsize="medium")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    data = buffer.getvalue()
    if path is not None:
        with open(path, "wb") as f:
            f.write(data)
    return data
