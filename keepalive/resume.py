"""Finding what to resume: the newest checkpoint that verifies, falling back to older ones.

Verification reads every byte once (the checksum pass) and the same buffers then become the state's
tensors, so a resume costs one pass over the checkpoint. Nothing from a checkpoint is executed: the
state is JSON plus raw tensor bytes (:mod:`keepalive.state`).
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Optional, Tuple

from .errors import CheckpointCorruptError
from .state import from_files
from .store import CheckpointInfo, CheckpointStore

log = logging.getLogger("keepalive.resume")


def load_newest(store: CheckpointStore) -> Optional[Tuple[CheckpointInfo, Dict[str, Any], Optional[dict]]]:
    """``(info, state tree, progress of the last writer)`` of the newest valid checkpoint, or None.

    Corrupt checkpoints (torn, truncated, bit-flipped) are skipped with a warning naming them.
    """
    previous = None
    try:
        lease = store.lease.read()
        previous = (lease or {}).get("progress")
    except OSError:
        pass
    for info in reversed(store.list()):
        try:
            if info.error:
                raise CheckpointCorruptError(info.url, info.error)
            files = store.read_files(info)
            tree = from_files(files, info.url)
        except CheckpointCorruptError as exc:
            info.valid, info.error = False, exc.reason
            log.warning("skipping corrupt checkpoint %s (%s); falling back to an older one", info.url, exc.reason)
            print(f"keepalive: checkpoint {info.name} is damaged ({exc.reason}); trying an older one",
                  flush=True)
            continue
        info.valid = True
        return info, tree, previous
    return None
