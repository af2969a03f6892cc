"""The spool's checkpoints as the uploader's work: which to upload next, which to drop, which to keep.

:class:`Backlog` chooses and drops under one lock (:attr:`Backlog.lock`), shared by the uploader's
thread and a spooled store's size bound (:meth:`Backlog.enforce_bound`). The rules:

* a damaged spooled checkpoint is removed (with a warning);
* one that ``keep`` newer checkpoints supersede (spooled or at the destination, ``keep_every``
  sparing some) is dropped, not uploaded: the destination's retention would delete it at once;
* of the rest the newest goes first (the one a resume needs);
* the newest uploaded checkpoint stays in the spool as the local cache; older uploaded ones go, and
  so does one the destination no longer has (deleted there on purpose);
* the size bound drops the local cache first, then superseded checkpoints, oldest first, never the
  newest nor the one being uploaded.
"""
from __future__ import annotations

import logging
import threading
from typing import List, Optional, Sequence, Tuple

from .. import report
from ..store import CheckpointInfo, CheckpointStore
from .local import Spool

__all__ = ["Backlog", "upload_order"]

log = logging.getLogger("keepalive.spool")


def upload_order(info: CheckpointInfo) -> Tuple[int, float, str]:
    """Older first: by step, then creation time, then name."""
    return (info.step if info.step is not None else -1, info.created or 0.0, info.name)


class Backlog:
    """The checkpoints of one :class:`Spool` still to upload, and the local cache of uploaded ones.

    ``dropped`` counts the un-uploaded checkpoints dropped as superseded; ``in_flight`` names the one
    being uploaded; ``dest_known`` is the destination's list at the last look.
    """

    def __init__(self, spool: Spool, *, quiet: bool = False):
        self.spool = spool
        self.quiet = quiet
        self.lock = threading.Lock()  # choosing / dropping spooled checkpoints
        self.dropped = 0
        self.in_flight: Optional[str] = None
        self.dest_known: List[CheckpointInfo] = []   # the destination's checkpoints at the last listing

    def pending(self) -> List[CheckpointInfo]:
        try:
            return self.spool.pending()
        except OSError:
            return []

    def choose(self, dest: CheckpointStore) -> Tuple[Optional[CheckpointInfo], bool]:
        """The checkpoint to upload now (set as ``in_flight``; None when nothing is left), and whether
        a superseded one was dropped. Lists the destination. The caller holds :attr:`lock`."""
        pending = self.pending()
        for bad in [c for c in pending if c.error]:
            report.warn(f"spooled checkpoint {bad.name} is damaged ({bad.error}); removing it", quiet=self.quiet)
            self.drop(bad)
        pending = [c for c in pending if not c.error]
        self.dest_known = [c for c in dest.list() if c.error is None]
        self.trim_cache(self.dest_known)
        keep = []
        for c in pending:
            if self.superseded(c, pending, self.dest_known, dest):
                log.info("not uploading %s: %s newer checkpoint(s) supersede it (keep=%s)",
                         c.name, dest.keep, dest.keep)
                self.drop(c)
                self.dropped += 1
            else:
                keep.append(c)
        if not keep:
            return None, len(keep) != len(pending)
        chosen = max(keep, key=upload_order)  # newest first: the one a resume needs
        self.in_flight = chosen.name
        return chosen, len(keep) != len(pending)

    def needed(self, dest: CheckpointStore) -> List[CheckpointInfo]:
        """The pending checkpoints that will be uploaded, oldest first: not the damaged ones nor those
        that ``keep`` newer ones supersede (by the destination's list at the last look)."""
        pending = [c for c in self.pending() if not c.error]
        return [c for c in pending if not self.superseded(c, pending, self.dest_known, dest)]

    def uploaded(self, c: CheckpointInfo) -> None:
        """``c`` landed: mark it uploaded (the local cache now) and drop older cached copies."""
        with self.lock:
            try:
                self.spool.mark_uploaded(c)
            except FileNotFoundError:
                pass  # dropped meanwhile by the size bound: it is at the destination anyway
            self.trim_cache()

    def superseded(self, c: CheckpointInfo, spooled: Sequence[CheckpointInfo],
                   at_dest: Sequence[CheckpointInfo], dest: CheckpointStore) -> bool:
        """Whether retention would delete ``c`` at once: ``keep`` newer checkpoints exist (spooled or
        at the destination) and ``keep_every`` does not spare it."""
        keep = dest.keep
        if keep is None:
            return False
        every = dest.keep_every
        if every and c.seq and c.seq % every == 0:
            return False
        key = upload_order(c)
        newer = {x.name for x in (*spooled, *at_dest) if upload_order(x) > key}
        return len(newer) >= keep

    def enforce_bound(self, limit: int, dest: CheckpointStore) -> Tuple[int, List[CheckpointInfo]]:
        """Make the spool fit in ``limit`` bytes if that can be done safely: uploaded copies (the
        local cache) go first, then un-uploaded checkpoints that ``keep`` newer ones supersede,
        oldest first, never the newest. Returns ``(bytes still held, un-uploaded ones dropped)``."""
        dropped: List[CheckpointInfo] = []
        with self.lock:
            everything = self.spool.list()
            total = sum(c.size_bytes or 0 for c in everything)
            if total <= limit:
                return total, dropped
            for c in everything:  # uploaded copies (the local cache) go first: they are at the destination
                if total > limit and c.cached:
                    self.drop(c)
                    total -= c.size_bytes or 0
            pending = [c for c in everything if not c.cached]
            for c in pending[:-1]:  # oldest first, never the newest
                if total <= limit:
                    break
                if c.name == self.in_flight or not self.superseded(c, pending, self.dest_known, dest):
                    continue
                self.drop(c)
                self.dropped += 1
                dropped.append(c)
                total -= c.size_bytes or 0
        return total, dropped

    def trim_cache(self, at_dest: Optional[Sequence[CheckpointInfo]] = None) -> None:
        """Keep the newest uploaded checkpoint as the local cache, drop older uploaded ones (and one
        the destination no longer has: deleted there on purpose)."""
        cached = sorted(self.spool.cached(), key=upload_order)
        names = None if at_dest is None else {c.name for c in at_dest}
        for i, c in enumerate(cached):
            if i < len(cached) - 1 or (names is not None and c.name not in names):
                self.drop(c)

    def drop(self, c: CheckpointInfo) -> None:
        """Delete a spooled checkpoint (the caller holds :attr:`lock`)."""
        try:
            self.spool.remove(c)
        except OSError as exc:
            log.info("could not remove spooled %s: %s", c.path, exc)
