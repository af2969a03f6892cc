"""``%keepalive report [RUN]``: a run across its sessions, drawn inline (:mod:`keepalive.runsummary`).

Without RUN: the run of the newest checkpointer made in this kernel. The summary is printed, the
picture shown under it (a PNG, so that it stays in the saved notebook).
"""
from __future__ import annotations

from typing import Optional

__all__ = ["show_report"]


def _newest_run() -> Optional[str]:
    from ..core import active_checkpointers

    alive = active_checkpointers()
    return alive[-1].url if alive else None


def show_report(target: Optional[str]) -> None:
    """Print the summary of ``target`` (a run folder or URL) and show its picture."""
    from ..runlog import read_sessions
    from ..runsummary import record_dict, summarize

    run = target or _newest_run()
    if run is None:
        print("%keepalive report: name the run folder (%keepalive report PATH): no training ran in this kernel")
        return
    records = read_sessions(run)
    summary = summarize(run.rstrip("/"), [record_dict(r) for r in records])
    print("\n".join(summary.lines()))
    if not records:
        return
    from IPython.display import Image, display

    from ..runchart import draw

    display(Image(data=draw(summary), format="png"))
