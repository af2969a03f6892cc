"""Finding what to resume: the newest checkpoint that verifies, falling back to older ones.

Verification reads every byte once (the checksum pass) and the same buffers then become the state's
tensors, so a resume costs one pass over the checkpoint. Nothing from a checkpoint is executed: the
state is JSON plus raw tensor bytes (:mod:`keepalive.state`).
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Tuple

from .errors import CheckpointCorruptError
from .state import from_files
from .store import CheckpointInfo, CheckpointStore

log = logging.getLogger("keepalive.resume")


def load_newest(store: CheckpointStore, *more: CheckpointStore
                ) -> Optional[Tuple[CheckpointInfo, Dict[str, Any], Optional[dict]]]:
    """``(info, state tree, progress of the last writer)`` of the newest valid checkpoint, or None.

    Corrupt checkpoints (torn, truncated, bit-flipped) are skipped with a warning naming them.
    With several stores (the local spool and the destination, :mod:`keepalive.spool`) the newest
    valid checkpoint of all of them wins, by (step, created); a checkpoint held by two of them is
    read from the one named first and falls back to the other copy. A store that cannot be listed
    (the destination is down) is skipped with a warning as long as another one answers.
    """
    stores = [store, *more]
    previous = None
    candidates: List[Tuple[CheckpointInfo, CheckpointStore]] = []
    failed: List[BaseException] = []
    for s in stores:
        if len(stores) == 1:
            try:
                progress = (s.lease.read() or {}).get("progress")
                previous = progress or None
            except OSError:
                pass
        try:
            listed = s.list()
        except OSError as exc:
            if len(stores) == 1:
                raise
            failed.append(exc)
            log.warning("cannot list %s (%s); resuming from the other location(s)", s.url, exc)
            print(f"keepalive: cannot read {s.url} ({exc}); looking for the newest checkpoint in the "
                  "other location(s)", flush=True)
            continue
        candidates.extend((info, s) for info in listed)
        if len(stores) > 1:
            try:  # the writer's progress, from the store that answered (a failing one is not asked twice)
                progress = (s.lease.read() or {}).get("progress")
                if progress and (previous is None or (progress.get("step") or 0) > (previous.get("step") or 0)):
                    previous = progress
            except OSError:
                pass
    # A copy flagged ``cache`` (the spool's local copy of an uploaded checkpoint) counts only where
    # another store that answered holds it too, or where some store could not be read.
    held = {info.name for info, _ in candidates if not getattr(info, "cache", False)}
    candidates = [(info, s) for info, s in candidates
                  if failed or not getattr(info, "cache", False) or info.name in held]
    if failed and not candidates:
        # nothing to resume from where we could look, and the destination cannot say whether it
        # holds something: starting over could bury its checkpoints, so this is an error
        raise failed[0]
    if len(stores) > 1:
        # newest first by (step, created, name); for one checkpoint held twice, the earlier store first
        order = {id(s): r for r, s in enumerate(stores)}
        candidates.sort(key=lambda c: (-(c[0].step if c[0].step is not None else -1), -(c[0].created or 0.0),
                                       c[0].name, order[id(c[1])]))
    else:
        candidates.reverse()  # one store: exactly its own order (step, seq, created), newest first
    for info, s in candidates:
        try:
            if info.error:
                raise CheckpointCorruptError(info.url, info.error)
            files = s.read_files(info)
            tree = from_files(files, info.url)
        except CheckpointCorruptError as exc:
            info.valid, info.error = False, exc.reason
            log.warning("skipping corrupt checkpoint %s (%s); falling back to an older one", info.url, exc.reason)
            print(f"keepalive: checkpoint {info.name} is damaged ({exc.reason}); trying an older one",
                  flush=True)
            continue
        info.valid = True
        return info, tree, previous
    if failed:
        raise failed[0]  # all that could be read was damaged; the unreadable store may hold more
    return None
