"""Torn folders at a destination: checkpoint folders without a manifest, removed by the writer that
holds the run's lease once no other writer may still be writing them.

A write cut short leaves one: an upload that hit a full destination (one per checkpoint it tried),
a direct commit that failed, a session whose lease was taken over while it wrote. None of them is a
checkpoint (readers skip them), but ``keepalive verify`` names each as bad, and on a full destination
they hold the space the next upload needs. The store removes the ones it finds when a run is opened
(:meth:`keepalive.store.CheckpointStore.open_for_writing`); :class:`TornFolders` removes those that
appear while a writer holds the lease, after each of its successful writes.

The rules, once:

* a folder with a manifest is never removed here, not even a damaged one (``keepalive verify`` shows
  it, retention removes it in its turn);
* only the holder of the run's lease removes anything, and only between its own writes (the caller's
  job: the uploader under its destination lock, a direct commit right after it returned);
* a folder this writer began itself (:meth:`TornFolders.began`) goes at once;
* any other one goes only while no other live writer may be writing it: when this writer took the
  lease over from a session whose lease was still live, that session may go on writing its current
  folder until it checks the lease before its manifest, so its folders stay for as long as its lease
  record would still count as live (its last heartbeat plus the lease's ttl; on this machine, until
  its process has ended).
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Iterable, List, Optional, Set

from ..store import CKPT_PREFIX, CheckpointStore

log = logging.getLogger("keepalive.spool")

__all__ = ["TornFolders"]


class TornFolders:
    """The torn checkpoint folders of one destination run ``store`` that its lease holder removes."""

    def __init__(self, store: CheckpointStore):
        self.store = store
        #: folder names this writer began at the destination (its uploads' checkpoint names)
        self.ours: Set[str] = set()
        #: the live lease this writer took over (its session may still be writing), else None
        self.taken_from: Optional[Dict[str, Any]] = None

    def opening(self) -> None:
        """Call right before the store takes its writer lease: remember a live lease of another
        session that the open takes over (``takeover=True``)."""
        lease = self.store.lease
        try:
            current = lease.read()
        except Exception:  # noqa: BLE001 - the open that follows says what is wrong
            return
        if current and current.get("owner") != lease.owner and lease.is_live(current):
            self.taken_from = current

    def began(self, name: str) -> None:
        """This writer starts writing the folder ``name`` at the destination."""
        self.ours.add(name)

    def others_may_write(self) -> bool:
        """Whether a session whose live lease this writer took over may still be writing."""
        if self.taken_from is None:
            return False
        if self.store.lease.is_live(self.taken_from):
            return True
        self.taken_from = None  # its heartbeat is older than the ttl, or its process ended
        return False

    def remove(self, committed: Iterable[str] = ()) -> List[str]:
        """Remove the torn folders no other live writer may be writing (never a committed one);
        the names removed. ``committed``: folders known to hold a manifest (a listing just taken),
        whose manifests are not read again. Never raises: what cannot be removed now is tried after
        the next write."""
        if not self.store.lease.held:
            return []
        guarded = self.others_may_write()
        known = set(committed)
        removed: List[str] = []
        try:
            names = [e.name for e in self.store.backend.listdir(self.store.path)
                     if e.is_dir and e.name.startswith(CKPT_PREFIX) and e.name not in known]
            listed = [self.store.load_info(name) for name in names
                      if not guarded or name in self.ours]
        except Exception as exc:  # noqa: BLE001 - the next write tries again
            log.info("could not list %s for torn folders: %s", self.store.url, exc)
            return removed
        for info in listed:
            if info.manifest is not None:
                continue
            try:
                self.store.backend.remove_tree(info.path)
                removed.append(info.name)
            except FileNotFoundError:
                pass
            except Exception as exc:  # noqa: BLE001
                log.info("could not remove the torn folder %s (tried again after the next write): %s",
                         info.url, exc)
        self.ours.difference_update(removed)
        if removed:
            log.info("removed %d torn checkpoint folder(s) in %s: %s", len(removed), self.store.url,
                     ", ".join(removed))
        return removed
