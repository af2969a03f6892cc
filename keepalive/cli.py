"""The ``keepalive`` command (also ``python -m keepalive``).

Each sub-command lives in its own ``cmd_*`` function and its own ``add_*`` parser builder; the
shells (this CLI and the IPython magics) only call the Python API, so nothing here is out of reach
from Python.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import List, Optional

from ._version import __version__


# ------------------------------------------------------------------------------------------- ls
def add_ls(sub) -> None:
    p = sub.add_parser("ls", help="list the checkpoints of a run (or of every run below PATH)",
                       description="List checkpoints under PATH: a run folder, a folder of runs, or one "
                                   "checkpoint folder. Local paths and fsspec URLs (gs://, s3://, ...).")
    p.add_argument("path", help="run folder, folder of runs, or checkpoint folder (path or URL)")
    p.add_argument("--json", action="store_true", help="one JSON object per checkpoint, one per line")
    p.add_argument("--verify", action="store_true", help="re-read every file to fill in `valid`")
    p.set_defaults(func=cmd_ls)


def _checkpoints_under(path: str, verify: bool):
    from .store import CheckpointStore, open_location

    kind, what, info = open_location(path)
    if kind == "checkpoint":
        store = what
        yield (store.verify(info) if verify else info)
        return
    stores = [what] if kind == "run" else [CheckpointStore(u, keep=None) for u in what]
    for store in stores:
        for c in store.list(include_uncommitted=True):
            yield (store.verify(c) if verify and c.committed and c.error is None else c)


def cmd_ls(args) -> int:
    from .units import format_bytes

    rows = list(_checkpoints_under(args.path, args.verify))
    if args.json:
        for c in rows:
            print(json.dumps(c.to_json()))
        return 0
    if not rows:
        print(f"no checkpoints under {args.path}")
        return 0
    print(f"{'run':<20} {'checkpoint':<28} {'step':>9} {'epoch':>6} {'size':>11}  created (UTC)        status")
    for c in rows:
        j = c.to_json()
        status = "ok" if j["valid"] and c.valid else ("unverified" if j["valid"] else f"INVALID: {c.error}")
        print(f"{c.run:<20} {c.name:<28} {str(c.step):>9} {str(c.epoch):>6} "
              f"{format_bytes(c.size_bytes):>11}  {j['created'] or '-':<20} {status}")
    return 0


# --------------------------------------------------------------------------------------- verify
def add_verify(sub) -> None:
    p = sub.add_parser("verify", help="re-read and check every checkpoint under PATH",
                       description="Re-read every file of every checkpoint under PATH (or of the one "
                                   "checkpoint PATH names) against its manifest. Exit 0 when all verify, "
                                   "1 naming each bad checkpoint otherwise, 2 when nothing is found.")
    p.add_argument("path", help="run folder, folder of runs, or checkpoint folder (path or URL)")
    p.add_argument("--json", action="store_true", help="one JSON object per checkpoint")
    p.set_defaults(func=cmd_verify)


def cmd_verify(args) -> int:
    from .errors import NoCheckpointError

    try:
        rows = list(_checkpoints_under(args.path, verify=True))
    except NoCheckpointError as exc:
        print(f"keepalive verify: {exc}", file=sys.stderr)
        return 2
    bad = [c for c in rows if not c.valid]
    for c in rows:
        if args.json:
            print(json.dumps(c.to_json()))
        else:
            print(f"{'OK ' if c.valid else 'BAD'} {c.run}/{c.name}" + ("" if c.valid else f": {c.error}"))
    if not rows:
        print(f"keepalive verify: no checkpoints under {args.path}", file=sys.stderr)
        return 2
    if bad:
        print(f"{len(bad)} of {len(rows)} checkpoint(s) failed: " + ", ".join(c.name for c in bad),
              file=sys.stderr)
        return 1
    if not args.json:
        print(f"all {len(rows)} checkpoint(s) verified")
    return 0


# --------------------------------------------------------------------------------------- status
def add_status(sub) -> None:
    p = sub.add_parser("status", help="platform, session time left, idle margin, hardware, runs",
                       description="Show where this session runs, how much session time and idle margin "
                                   "is left, and the hardware. Overrides: KEEPALIVE_BUDGET, KEEPALIVE_IDLE, "
                                   "KEEPALIVE_SESSION_START.")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--dir", default=None, help="checkpoint folder to report on (default: the default dir)")
    p.set_defaults(func=cmd_status)


def cmd_status(args) -> int:
    from . import session

    report = session.status_report(checkpoint_dir=args.dir)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(session.format_status(report))
    return 0


# ------------------------------------------------------------------------------------------ main
# One builder per sub-command; `bench` (workloads) and `sync` (spool) add theirs here.
_BUILDERS = [add_ls, add_verify, add_status]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="keepalive",
        description="Checkpoints that survive notebook resets (Colab, Kaggle, Jupyter), and the session "
                    "facts that decide when to save.")
    parser.add_argument("--version", action="version", version=f"keepalive {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv: debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for builder in _BUILDERS:
        builder(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=[logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)],
                        format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - a CLI prints a clear line, not a traceback
        from .errors import KeepaliveError

        if isinstance(exc, (KeepaliveError, OSError)) and args.verbose == 0:
            print(f"keepalive {args.command}: {exc}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
