"""``keepalive sync``: upload what waits in this machine's spool, from any process.

After a kernel crash the spooled checkpoints stay on the VM's disk with their ``SPOOL.json``; this
uploads them with the same :class:`~keepalive.spool.uploader.Uploader` the training uses. When the
training process is still alive it owns the spool (its lease is live) and uploads them itself: sync
then only waits for it. A destination that fails with an error no retry fixes (full, read-only,
quota, permission) ends the sync at once, with that error, instead of retrying until the timeout.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List, Mapping, Optional

from ..store import CheckpointStore
from .local import Spool, list_spools
from .mount import describe_error
from .uploader import Uploader

log = logging.getLogger("keepalive.spool")

__all__ = ["sync", "sync_spool"]


def sync(path: Optional[str] = None, *, timeout: Optional[float] = None, root: Optional[str] = None,
         progress: Optional[Callable[[int], None]] = None,
         storage_options: Optional[dict] = None) -> Dict[str, Any]:
    """Upload what waits in the spool (for the destination run or folder of runs ``path``, or for
    every destination). Returns ``{"ok": bool, "destinations": [{destination, spool, pending_before,
    bytes_before, uploaded, pending, error}]}``; ``ok`` is False when something is still pending."""
    deadline = None if timeout is None else time.monotonic() + timeout
    results: List[Dict[str, Any]] = []
    for folder, record in list_spools(root, below=path):
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        results.append(sync_spool(folder, record, timeout=left, progress=progress,
                                  storage_options=storage_options))
    return {"ok": all(not r["pending"] for r in results), "destinations": results}


def sync_spool(folder: str, record: Mapping[str, Any], *, timeout: Optional[float] = None,
               progress: Optional[Callable[[int], None]] = None,
               storage_options: Optional[dict] = None) -> Dict[str, Any]:
    """Upload the pending checkpoints of the spool in ``folder`` (its ``SPOOL.json`` ``record``);
    one row of :func:`sync`'s result."""
    dest_url = record["destination"]
    spool = Spool.from_record(folder, record)
    before = spool.pending()
    row: Dict[str, Any] = {"destination": dest_url, "spool": folder, "pending_before": len(before),
                           "bytes_before": sum(c.size_bytes or 0 for c in before), "uploaded": 0,
                           "pending": len(before), "error": None}
    if not before:
        return row
    lease = spool.lease.read()
    if lease is not None and spool.lease.is_live(lease):
        # the training process is alive and uploads them itself: wait for it
        log.info("process %s on %s owns %s; waiting for its uploads", lease.get("pid"), lease.get("host"),
                 folder)
        end = None if timeout is None else time.monotonic() + timeout
        while spool.pending() and (end is None or time.monotonic() < end):
            time.sleep(0.5)
        row["pending"] = len(spool.pending())
        row["uploaded"] = max(0, len(before) - row["pending"])
        if row["pending"]:
            row["error"] = f"process {lease.get('pid')} still owns this spool and has not finished uploading"
        return row
    options = dict(record.get("storage_options") or {})
    options.update(storage_options or {})
    try:
        dest = CheckpointStore(dest_url, keep=record.get("keep"), keep_every=record.get("keep_every"),
                               storage_options=options or None)
        spool.open_for_writing()
    except Exception as exc:  # noqa: BLE001
        row["error"] = describe_error(exc)
        return row
    up = Uploader(spool, dest, bars=False, progress=progress)
    up.start()
    try:
        up.open_destination()
        # a full, read-only or forbidden destination stays so: report it instead of waiting for ever
        up.wait_settled(timeout, until_permanent=True)
    finally:
        up.stop(timeout=10.0)
        spool.close()
    row["pending"] = len(spool.pending())
    row["uploaded"] = up.uploaded
    row["dropped"] = up.dropped
    if row["pending"]:
        row["error"] = up.last_error or (str(up.fatal) if up.fatal else "timed out")
    return row
