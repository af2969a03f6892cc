"""The ``keepalive`` command (also ``python -m keepalive``).

Each sub-command lives in its own ``cmd_*`` function and its own ``add_*`` parser builder; the
shells (this CLI and the IPython magics) only call the Python API, so nothing here is out of reach
from Python.

Every failure is ONE line on stderr and a non-zero exit, never a traceback (``-v`` shows it): bad
input (exit 2), missing credentials, an unknown protocol, a store that does not answer within
``--connect-timeout`` seconds (exit 1; a remote store is probed first, in a background thread, so a
machine without network gets its answer in seconds, not after the storage library's minute of
retries). A closed pipe (``keepalive ls ... | head -1``) ends the command quietly.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
from typing import Any, Dict, List, Optional, Sequence

from ._version import __version__
from .errors import EXIT_STOPPED
from .supervise import add_run

#: seconds a remote store gets to answer its first request before the command gives up
CONNECT_TIMEOUT = 15.0


class CliError(Exception):
    """A failure the command answers with one line (its message) and ``exit_code``."""

    def __init__(self, message: str, exit_code: int = 1, hard_exit: bool = False):
        super().__init__(message)
        self.exit_code = exit_code
        #: leave at once (os._exit): a storage library's thread still waits on the network and
        #: would hold the interpreter's exit
        self.hard_exit = hard_exit


# ------------------------------------------------------------------------------ remote options
def add_storage_arguments(p: argparse.ArgumentParser) -> None:
    """``--storage-options JSON`` and ``--connect-timeout S`` (ls, verify, sync)."""
    p.add_argument("--storage-options", default=None, metavar="JSON",
                   help="fsspec storage options as a JSON object, e.g. '{\"token\": \"key.json\"}' (gs://) "
                        "or '{\"key\": \"...\", \"secret\": \"...\", \"client_kwargs\": "
                        "{\"endpoint_url\": \"http://...\"}}' (s3://)")
    p.add_argument("--connect-timeout", type=float, default=CONNECT_TIMEOUT, metavar="S",
                   help=f"give up when a remote store does not answer within S seconds ({CONNECT_TIMEOUT:g})")


def storage_options(args) -> Optional[Dict[str, Any]]:
    """The parsed ``--storage-options`` (None without); bad JSON is a :class:`CliError` (exit 2)."""
    text = getattr(args, "storage_options", None)
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise CliError(f"--storage-options is not valid JSON ({exc}): give an object, e.g. "
                       "'{\"token\": \"anon\"}'", exit_code=2) from None
    if not isinstance(value, dict):
        raise CliError(f"--storage-options must be a JSON object ({{...}}), not {type(value).__name__}",
                       exit_code=2)
    return value


def _is_remote(url: Optional[str]) -> bool:
    return bool(url) and "://" in str(url) and not str(url).startswith(("file://", "memory://"))


def check_reachable(url: Optional[str], options: Optional[dict], timeout: float) -> None:
    """For a remote URL: ask the store whether ``url`` exists, in a background thread, waiting at
    most ``timeout`` seconds. Its error (no credentials, unknown bucket) is raised here; no answer
    is a :class:`CliError`. Local paths are not probed."""
    if not _is_remote(url):
        return
    from .backends import backend_for

    outcome: Dict[str, Any] = {}

    def probe() -> None:
        try:
            backend, path = backend_for(str(url), options)
            backend.exists(path)
            outcome["ok"] = True
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            outcome["error"] = exc

    thread = threading.Thread(target=probe, name="keepalive-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    if "error" in outcome:
        raise outcome["error"]
    if not outcome:
        raise CliError(f"no answer from {url} within {timeout:g} s: is there a network, and are the "
                       "endpoint and credentials right? (--connect-timeout S waits longer)", hard_exit=True)


def _chain(exc: BaseException) -> List[BaseException]:
    out: List[BaseException] = []
    link: Optional[BaseException] = exc
    while link is not None and all(link is not x for x in out) and len(out) < 20:
        out.append(link)
        link = link.__cause__ or link.__context__
    return out


def describe_error(exc: BaseException, url: Optional[str] = None) -> str:
    """One line for an error of a command: what went wrong and, for the usual causes (no
    credentials, an unknown protocol, a missing storage package), what to do."""
    chain = _chain(exc)
    names = {c.__name__ for e in chain for c in type(e).__mro__}
    texts = " | ".join(str(e) for e in chain)
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    where = f" for {url}" if url else ""
    if "NoCredentialsError" in names or "Unable to locate credentials" in texts:
        return (f"no AWS credentials{where}: pass --storage-options '{{\"key\": \"...\", \"secret\": "
                "\"...\"}', or set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)")
    if names & {"DefaultCredentialsError", "RefreshError"} or "credentials were not found" in texts \
            or "no Google Cloud credentials" in texts:
        return (f"no Google Cloud credentials{where}: on Colab run google.colab.auth.authenticate_user(); "
                "elsewhere set GOOGLE_APPLICATION_CREDENTIALS or pass --storage-options "
                "'{\"token\": \"/path/key.json\"}' ('{\"token\": \"anon\"}' for a public bucket)")
    if "Protocol not known" in texts:
        return f"{first}: not a storage protocol (give a local path, or a URL such as gs://, s3://)"
    if isinstance(exc, ImportError):
        return f"{first} (a storage package is missing: pip install it)"
    if isinstance(exc, TypeError) and "__init__()" in first:
        return f"a storage option is not accepted: {first} (check --storage-options)"
    if names & {"ClientConnectorError", "EndpointConnectionError", "ConnectionError", "ConnectTimeoutError"}:
        return f"cannot reach the store{where}: {first}"
    if isinstance(exc, PermissionError) or "AccessDenied" in texts or "Forbidden" in texts:
        return f"access denied{where}: {first} (check the credentials)"
    from .errors import KeepaliveError

    if isinstance(exc, (KeepaliveError, OSError)):
        return first
    return f"{type(exc).__name__}: {first}"


# ------------------------------------------------------------------------------------------- ls
def add_ls(sub) -> None:
    p = sub.add_parser("ls", help="list the checkpoints of a run (or of every run below PATH)",
                       description="List checkpoints under PATH: a run folder, a folder of runs, or one "
                                   "checkpoint folder. Local paths and fsspec URLs (gs://, s3://, ...). "
                                   "Without PATH: the runs in the default checkpoint dir and those its "
                                   "index of runs (RUNS.json) records elsewhere.")
    p.add_argument("path", nargs="?", default=None,
                   help="run folder, folder of runs, or checkpoint folder (path or URL); default: the "
                        "default checkpoint dir and the runs recorded in its RUNS.json")
    p.add_argument("--json", action="store_true", help="one JSON object per checkpoint, one per line")
    p.add_argument("--verify", action="store_true", help="re-read every file to fill in `valid`")
    add_storage_arguments(p)
    p.set_defaults(func=cmd_ls)


def cmd_ls(args) -> int:
    from .runs import checkpoints_of, locate

    options = storage_options(args)
    run_urls: List[str] = []
    if args.path is None:
        rows, where = _known_checkpoints(args, options), "the default checkpoint dir or its index of runs"
    else:
        check_reachable(args.path, options, getattr(args, "connect_timeout", CONNECT_TIMEOUT))
        location = locate(args.path, options)
        rows, where = checkpoints_of(location, verify=args.verify), args.path
        run_urls = [run.url for run in location.runs]
    if args.json:
        for c in rows:
            print(json.dumps(c.to_json()))
        return 0
    if rows:
        print_checkpoint_table(rows)
    else:
        print(f"no checkpoints under {where}")
    print_run_states(rows, options, run_urls)
    return 0


def print_run_states(rows: list, options: Optional[dict], run_urls: Sequence[str] = ()) -> None:
    """Below ``keepalive ls``'s table: each listed run's state from its session records (RUNNING /
    STOPPED / DIED / FINISHED, step, heartbeat age); nothing for a run without records. ``run_urls``:
    runs found besides the rows' (one that died before its first checkpoint reached the destination)."""
    from .runlog import run_summary

    folders = list(dict.fromkeys([*(c.url.rsplit("/", 1)[0] for c in rows), *run_urls]))
    for folder in folders:
        try:
            summary = run_summary(folder, options)
        except Exception as exc:  # noqa: BLE001 - the table is shown; the state is a bonus
            print(f"run {folder}: state unknown ({describe_error(exc, folder)})")
            continue
        if summary["state"] != "NEW":
            print(f"run {folder}: {summary['state']} ({summary['state_detail']})")


def print_checkpoint_table(rows: list) -> None:
    """``keepalive ls``'s table (also ``%keepalive ls``'s): one checkpoint per line with its status
    (``ok`` when re-read, ``unverified`` without ``--verify``, ``INVALID: why``)."""
    from .units import format_bytes

    print(f"{'run':<20} {'checkpoint':<28} {'step':>9} {'epoch':>6} {'size':>11}  created (UTC)        status")
    for c in rows:
        j = c.to_json()
        status = "ok" if j["valid"] and c.valid else ("unverified" if j["valid"] else f"INVALID: {c.error}")
        ranks = f" ({c.processes})" if c.processes else ""  # written by several torch.distributed ranks
        print(f"{c.run:<20} {c.name:<28} {str(c.step):>9} {str(c.epoch):>6} "
              f"{format_bytes(c.size_bytes):>11}  {j['created'] or '-':<20} {status}{ranks}")


def _known_checkpoints(args, options: Optional[dict]) -> list:
    """``keepalive ls`` without PATH: the checkpoints of the runs in the default checkpoint dir, then
    of the runs its index of runs records elsewhere (each store gets ``--connect-timeout`` seconds;
    one that does not answer is named on stderr and skipped)."""
    from . import report
    from .errors import NoCheckpointError
    from .runs import answered_within, checkpoints_at, indexed_runs
    from .session import default_checkpoint_dir

    root = default_checkpoint_dir()
    rows: list = []
    try:
        rows.extend(checkpoints_at(root, verify=args.verify, storage_options=options))
    except NoCheckpointError:
        pass
    answered, silent = answered_within(indexed_runs(root, exclude_below=root),
                                       getattr(args, "connect_timeout", CONNECT_TIMEOUT))
    for run in silent:
        report.warn(f"run {run.url} (recorded in the index of runs) did not answer; skipped")
    for run in answered:
        try:
            rows.extend(reversed(run.checkpoints(verify=args.verify, include_uncommitted=True)))
        except Exception as exc:  # noqa: BLE001 - one unreadable run does not hide the others
            report.warn(f"cannot read {run.url}: {describe_error(exc, run.url)}")
    return rows


# --------------------------------------------------------------------------------------- verify
def add_verify(sub) -> None:
    p = sub.add_parser("verify", help="re-read and check every checkpoint under PATH",
                       description="Re-read every file of every checkpoint under PATH (or of the one "
                                   "checkpoint PATH names) against its manifest. Exit 0 when all verify, "
                                   "1 naming each bad checkpoint otherwise, 2 when nothing is found.")
    p.add_argument("path", help="run folder, folder of runs, or checkpoint folder (path or URL)")
    p.add_argument("--json", action="store_true", help="one JSON object per checkpoint")
    add_storage_arguments(p)
    p.set_defaults(func=cmd_verify)


def cmd_verify(args) -> int:
    from .errors import NoCheckpointError
    from .runs import checkpoints_at

    options = storage_options(args)
    check_reachable(args.path, options, args.connect_timeout)
    try:
        rows = checkpoints_at(args.path, verify=True, storage_options=options)
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
    p.add_argument("path", nargs="?", default=None,
                   help="a run folder or folder of runs (path or URL) whose runs to show with their state "
                        "(RUNNING / STOPPED / DIED / FINISHED); default: the default checkpoint dir")
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
    report = status.status_report(checkpoint_dir=args.path or args.dir)
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
    add_storage_arguments(p)
    p.set_defaults(func=cmd_sync)


def cmd_sync(args) -> int:
    from . import spool
    from .runs import spooled_runs
    from .units import format_bytes

    options = storage_options(args)
    check_reachable(args.path, options, args.connect_timeout)
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
                            progress=bar.update if bar is not None else None, storage_options=options)
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
                                    "newest valid checkpoint. Exit 0 when the training completed, 143 when it "
                                    "stopped to save before the session's time limit or a VM's reclaim.")
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
    return 0 if doc.get("completed") else EXIT_STOPPED  # (a stop itself exits 143 from the training)


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


# --------------------------------------------------------------------------------------- report
def add_report(sub) -> None:
    p = sub.add_parser("report", help="a run across its sessions: a picture, the redone work, the ETA",
                       description="Draw a run from the session records its heartbeat keeps (RUN/sessions/): "
                                   "the sessions along the step axis, interruptions and redone steps, the "
                                   "loss over all sessions, and the ETA in steps, time and sessions of this "
                                   "platform's budget. Writes a PNG (--png) and prints a summary.")
    p.add_argument("run", metavar="RUN", help="the run folder or URL (gs://, s3://, a Drive path)")
    p.add_argument("--png", default=None, metavar="FILE",
                   help="where to write the picture (default: keepalive-report-<run>.png here)")
    p.add_argument("--json", action="store_true", help="the summary as JSON on stdout, no picture")
    add_storage_arguments(p)
    p.set_defaults(func=cmd_report)


def cmd_report(args) -> int:
    from .runlog import read_sessions
    from .runsummary import record_dict, summarize

    options = storage_options(args)
    check_reachable(args.run, options, timeout=30.0)
    records = read_sessions(args.run, storage_options=options)
    summary = summarize(args.run.rstrip("/"), [record_dict(r) for r in records])
    if args.json:
        print(json.dumps(summary.to_json(), indent=2, default=str))
        return 0
    print("\n".join(summary.lines()))
    if not records:
        return 0
    from .runchart import draw

    name = os.path.basename(args.run.rstrip("/")) or "run"
    path = args.png or f"keepalive-report-{name}.png"
    draw(summary, path)
    print(f"picture: {path}")
    return 0


# ------------------------------------------------------------------------------------------ main
# One builder per sub-command; `bench` (workloads) adds its own here.
_BUILDERS = [add_ls, add_verify, add_status, add_sync, add_report, add_bench, add_run]


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


def _quiet_closed_pipe() -> int:
    """stdout's reader went away (``| head -1``): send what is still buffered to /dev/null so the
    interpreter's exit has nothing to complain about, and end like a tool killed by SIGPIPE."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass
    return 141


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verbose:  # the log's details; what a user must see is printed by keepalive.report anyway
        logging.basicConfig(level=logging.INFO if args.verbose == 1 else logging.DEBUG,
                            format="%(levelname)s %(name)s: %(message)s")
    elif not logging.getLogger().handlers:
        # storage libraries log their retries with tracebacks (gcsfs: "_request out of retries"):
        # without -v they stay out of the one-line answer
        logging.getLogger().addHandler(logging.NullHandler())
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows up here, inside the guard
        return code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return _quiet_closed_pipe()
    except Exception as exc:  # noqa: BLE001 - a CLI prints a clear line, not a traceback
        if args.verbose:
            raise
        from .errors import KeepaliveError

        # os._exit only as the real command (argv None), never inside a caller's process (tests)
        hard = isinstance(exc, CliError) and exc.hard_exit and argv is None
        message = str(exc) if isinstance(exc, CliError) else describe_error(exc, getattr(args, "path", None))
        ours = isinstance(exc, (CliError, KeepaliveError))
        try:
            print(f"keepalive {args.command}: {message}"
                  + ("" if ours else " (keepalive -v ... shows the details)"),
                  file=sys.stderr, flush=True)
        except BrokenPipeError:
            pass
        code = exc.exit_code if isinstance(exc, CliError) else 1
        if hard:
            try:
                sys.stdout.flush()
            except Exception:  # noqa: BLE001
                pass
            os._exit(code)
        return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
