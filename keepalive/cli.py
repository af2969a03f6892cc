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


def cmd_ls(args) -> int:
    from .runs import checkpoints_at
    from .units import format_bytes

    rows = checkpoints_at(args.path, verify=args.verify)
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
    from .runs import checkpoints_at

    try:
        rows = checkpoints_at(args.path, verify=True)
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
    p.add_argument("--settings", action="store_true",
                   help="list every KEEPALIVE_* setting: the value in force, set or default, meaning")
    p.set_defaults(func=cmd_status)


def cmd_status(args) -> int:
    from . import status

    if args.settings:
        from . import settings

        rows = settings.table()
        print(json.dumps(rows, indent=2, default=str) if args.json else status.format_settings(rows))
        return 0
    report = status.status_report(checkpoint_dir=args.dir)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(status.format_status(report))
    return 0


# ----------------------------------------------------------------------------------------- sync
def add_sync(sub) -> None:
    p = sub.add_parser("sync", help="upload checkpoints still waiting in the local spool",
                       description="Upload the checkpoints that wait in this machine's spool "
                                   "($KEEPALIVE_SPOOL, default /tmp/keepalive-spool) to their destination: "
                                   "for the run (or folder of runs) PATH, or for every destination. Use it "
                                   "after a kernel crash, or before ending a runtime. When the training "
                                   "process is still alive it uploads them itself: sync then waits for it. "
                                   "Exit 0 when nothing is left, 1 when something could not be uploaded.")
    p.add_argument("path", nargs="?", default=None,
                   help="destination run or folder of runs (path or URL); default: every destination")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="give up after S seconds (default: keep retrying until done)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--spool", default=None, help="spool root (default: $KEEPALIVE_SPOOL or /tmp/keepalive-spool)")
    p.set_defaults(func=cmd_sync)


def cmd_sync(args) -> int:
    from . import spool
    from .runs import spooled_runs
    from .units import format_bytes

    total = sum(c.size_bytes or 0 for run in spooled_runs(below=args.path, spool_root=args.spool)
                for c in run.pending_uploads())
    bar = None
    if total and not args.json:
        try:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="keepalive sync",
                       file=sys.stderr, mininterval=0.5)
        except ImportError:
            bar = None
    try:
        result = spool.sync(args.path, timeout=args.timeout, root=args.spool,
                            progress=bar.update if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()
    if args.json:
        print(json.dumps(result))
    else:
        rows = [r for r in result["destinations"] if r["pending_before"]]
        if not rows:
            print("nothing to upload: the spool is empty" + (f" for {args.path}" if args.path else ""))
        for r in rows:
            state = "done" if not r["pending"] else f"{r['pending']} still pending ({r['error']})"
            print(f"{r['destination']}: {r['uploaded']} uploaded of {r['pending_before']} "
                  f"({format_bytes(r['bytes_before'])}); {state}")
    return 0 if result["ok"] else 1


# ---------------------------------------------------------------------------------------- bench
def add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmark workloads (Keras / fastai) that survive resets",
                       description="The benchmark trainings users run on Colab / Kaggle (six Keras "
                                   "examples, the Colab Fashion-MNIST CNN, fastai's dogs-vs-cats ResNet), "
                                   "each checkpointed with DriveCheckpoint: re-running `bench run` after a "
                                   "crash or a new session resumes it. Per-epoch timings go to "
                                   "results.json / results.csv in the run folder.")
    bsub = p.add_subparsers(dest="bench_command", metavar="SUBCOMMAND")

    q = bsub.add_parser("list", help="the workloads: framework, model, epochs x batch, dataset",
                        description="List the workloads with their framework, model, epochs x batch "
                                    "size and dataset.")
    q.add_argument("--json", action="store_true", help="one JSON object per workload")
    q.set_defaults(func=cmd_bench_list)

    q = bsub.add_parser("run", help="train a workload (resumes a run that was interrupted)",
                        description="Train workload NAME with checkpoints in DIR/RUN (default RUN: NAME, "
                                    "or NAME-synthetic-SIZE with --synthetic). Run the same command again "
                                    "after a crash, a disconnect or in a new session: it resumes from the "
                                    "newest valid checkpoint. Exit 0 when the training completed, 3 when it "
                                    "stopped to save before the session's time limit.")
    q.add_argument("name", help="workload name (see `keepalive bench list`)")
    q.add_argument("--synthetic", action="store_true",
                   help="generated data of the same shapes and dtypes (no download)")
    q.add_argument("--size", choices=["tiny", "small", "full"], default=None,
                   help="data size (default: small with --synthetic, full otherwise; with real data a "
                        "smaller size trains on the first samples)")
    q.add_argument("--epochs", type=int, default=None, help="epochs (default: the workload's)")
    q.add_argument("--dir", default=None,
                   help="folder of benchmark runs, a path or fsspec URL (default: the default checkpoint "
                        "dir + /bench, see `keepalive status`)")
    q.add_argument("--run", default=None, help="run folder name inside --dir (default: see above)")
    q.add_argument("--every", default="epoch",
                   help="checkpoint schedule: epoch (default), a number of steps, or a duration (10min)")
    q.add_argument("--keep", type=int, default=3, help="checkpoints to keep (default 3)")
    q.add_argument("--no-checkpoint", action="store_true",
                   help="train without checkpoints (timings only; for overhead comparisons)")
    q.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    q.add_argument("--threads", type=int, default=None,
                   help="CPU threads for the framework (default: KEEPALIVE_BENCH_THREADS, else its own)")
    q.add_argument("--deterministic", action="store_true",
                   help="deterministic ops (TensorFlow op determinism / torch deterministic algorithms)")
    q.add_argument("--progress", action="store_true", help="the framework's own progress output too")
    q.add_argument("--quiet", action="store_true", help="no per-epoch lines")
    q.set_defaults(func=cmd_bench_run)

    q = bsub.add_parser("report", help="a table per run: epoch times, samples/s, checkpoint overhead",
                        description="Show the results of every benchmark run found at or below PATH (a run "
                                    "folder or a folder of runs; default: the default checkpoint dir + "
                                    "/bench): per epoch its time, samples/s, the checkpoint's blocking time "
                                    "and share, background write time and size, the metrics; platform and "
                                    "device per session.")
    q.add_argument("path", nargs="?", default=None, help="run folder or folder of runs (path or URL)")
    q.add_argument("--json", action="store_true", help="the results documents as one JSON list")
    q.add_argument("--csv", action="store_true", help="all epoch records as one CSV table")
    q.set_defaults(func=cmd_bench_report)
    p.set_defaults(func=lambda args: (p.print_help(), 0)[1])


def _bench_dir(path: Optional[str]) -> str:
    if path:
        return path
    from .session import default_checkpoint_dir

    return default_checkpoint_dir().rstrip("/") + "/bench"


def _is_download_error(exc: BaseException) -> bool:
    """A dataset / weights download that failed (keras.utils.get_file, fastai untar_data, urllib)."""
    import urllib.error

    seen = set()
    link: Optional[BaseException] = exc  # the exception, then its causes
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        names = {c.__name__ for c in type(link).__mro__}
        if isinstance(link, (urllib.error.URLError, ConnectionError, TimeoutError)) or \
                names & {"ConnectionError", "HTTPError", "URLError", "ProxyError", "SSLError"} or \
                "URL fetch failure" in str(link):
            return True
        link = link.__cause__ or link.__context__
    return False


def cmd_bench_list(args) -> int:
    from . import workloads

    rows = [workloads.describe(n) for n in workloads.names()]
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    print(f"{'name':<24} {'framework':<9} {'epochs x batch':<20} {'dataset':<31} model")
    for r in rows:
        if r["framework"] == "fastai" and r.get("freeze_epochs"):
            eb = f"{r['freeze_epochs']}+{r['epochs']} x {r['batch_size']}"
        else:
            eb = f"{r['epochs']} x {r['batch_size']}"
        if r.get("steps_per_epoch"):
            eb += f" ({r['steps_per_epoch']} steps)"
        print(f"{r['name']:<24} {r['framework']:<9} {eb:<20} {r['dataset']:<31} {r['model']}")
    return 0


def cmd_bench_run(args) -> int:
    from . import report, workloads

    if args.name not in workloads.REGISTRY:
        report.warn(f"bench run: unknown workload {args.name!r}; known: {', '.join(workloads.names())}")
        return 2
    from .workloads.common import resolve_size

    size = resolve_size(args.synthetic, args.size)
    run = args.run or (f"{args.name}-synthetic-{size}" if args.synthetic else
                       (args.name if size == "full" else f"{args.name}-{size}"))
    run_dir = _bench_dir(args.dir).rstrip("/") + "/" + run
    every = int(args.every) if str(args.every).isdigit() else args.every
    report.say(f"bench: {args.name} ({'synthetic' if args.synthetic else 'real'} data, size {size}) "
               f"in {run_dir}", quiet=args.quiet)
    try:
        doc = workloads.run(args.name, run_dir, epochs=args.epochs, synthetic=args.synthetic, size=size,
                            every=every, keep=args.keep, checkpoint=not args.no_checkpoint, seed=args.seed,
                            threads=args.threads, deterministic=args.deterministic,
                            verbose=1 if args.progress else 0, quiet=args.quiet)
    except Exception as exc:  # noqa: BLE001 - a failed download gets a one-line answer
        if args.synthetic or not _is_download_error(exc) or args.verbose:
            raise
        report.warn(f"bench run: could not download the {args.name} data ({exc}); check the network, or "
                    "train on generated data of the same shapes with --synthetic")
        return 1
    s = doc.get("summary") or {}
    pct = s.get("checkpoint_pct")
    report.say(f"bench: {doc.get('epochs_done')}/{doc.get('epochs')} epochs "
               f"{'completed' if doc.get('completed') else 'done, not completed'}; "
               f"{s.get('samples_per_s')} samples/s"
               + (f", checkpoint overhead {pct:.2f} %" if pct is not None else "")
               + f"; results in {run_dir}/results.json and results.csv", quiet=args.quiet)
    return 0 if doc.get("completed") else 3


def cmd_bench_report(args) -> int:
    from . import report
    from .workloads import common

    root = _bench_dir(args.path)
    docs = [d for d in (common.read_results(u) for u in common.find_results(root)) if d is not None]
    if args.json:
        print(json.dumps(docs, indent=1))
        return 0 if docs else 2
    if args.csv:
        sys.stdout.write(common.results_csv(docs))
        return 0 if docs else 2
    if not docs:
        report.warn(f"bench report: no benchmark results under {root}")
        return 2
    print("\n\n".join(common.format_report(d) for d in docs))
    return 0


# ------------------------------------------------------------------------------------------ main
# One builder per sub-command; `bench` (workloads) adds its own here.
_BUILDERS = [add_ls, add_verify, add_status, add_sync, add_bench]


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
    if args.verbose:  # the log's details; what a user must see is printed by keepalive.report anyway
        logging.basicConfig(level=logging.INFO if args.verbose == 1 else logging.DEBUG,
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
