"""What every workload shares: sizes, per-epoch timing records, the results files, platform facts.

* Sizes: ``"tiny"`` (seconds on a laptop CPU, for tests), ``"small"`` (benchmarks: epochs of a few
  seconds on a CPU), ``"full"`` (the original sizes). Synthetic data defaults to ``"small"``, real
  data to ``"full"``; with real data a smaller size trains on the first samples only.
* :class:`RunRecorder`: one record per epoch - wall time (from the epoch's start to the next one's,
  so the checkpoint taken at its end is included), optimizer steps, samples, samples/s, the time the
  checkpoint held the training loop (measured around the checkpointer's step / epoch / end-of-fit
  boundaries), the background write time and bytes (from the writer's commit results), the logged
  metrics, platform and device. A resumed run (a new session) appends to the records of the earlier
  ones; epochs that are redone after a crash replace their old records.
* ``results.json`` (everything) and ``results.csv`` (one row per epoch) are written into the run
  folder, next to the ``ckpt-*`` folders, after every epoch (a local path or any fsspec URL).

Importing this module imports no framework.
"""
from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import platform as _platform
import statistics
import threading
import time
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence

from .. import report, settings
from .. import session as _session
from .._version import __version__
from ..errors import EXIT_STOPPED
from . import StepHook

SIZES = ("tiny", "small", "full")
RESULTS_JSON = "results.json"
RESULTS_BACKUP = "results.json.bak"  # the previous complete version: a kill mid-write never loses both
RESULTS_CSV = "results.csv"
RESULTS_FORMAT = 1

CSV_COLUMNS = ["workload", "epoch", "session", "start_batch", "seconds", "cpu_seconds", "steps", "samples",
               "samples_per_s", "checkpoint_seconds", "checkpoint_pct", "checkpoints", "write_seconds",
               "checkpoint_mb", "platform", "device", "precision", "framework"]


# ------------------------------------------------------------------------------------------ sizes
def resolve_size(synthetic: bool, size: Optional[str]) -> str:
    """The size to use: ``size`` when given, else ``"small"`` for synthetic data, ``"full"`` for real."""
    if size is None:
        return "small" if synthetic else "full"
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; use one of {', '.join(SIZES)}")
    return size


def pick(table: Mapping[str, Any], size: str) -> Any:
    """``table[size]`` with a clear error."""
    try:
        return table[size]
    except KeyError:
        raise ValueError(f"unknown size {size!r}; use one of {', '.join(table)}") from None


def subset(n_wanted: Optional[int], *arrays: Any) -> List[Any]:
    """The first ``n_wanted`` samples of each array (all of them for None)."""
    if n_wanted is None:
        return list(arrays)
    return [None if a is None else a[:n_wanted] for a in arrays]


# ------------------------------------------------------------------------------ synthetic data
def synthetic_images(n: int, shape: tuple, n_classes: int, seed: int, noise: float = 60.0):
    """``n`` uint8 images of ``shape`` in ``n_classes`` learnable classes (a smooth template per class
    plus noise), and their int labels; a function of ``seed`` only (never of the training seed)."""
    import numpy as np

    rs = np.random.RandomState(seed)
    templates: np.ndarray = rs.uniform(0, 255, size=(n_classes,) + tuple(shape)).astype(np.float32)
    # smooth the templates a little along the first two axes, so that convolutions have shapes to find
    for axis in (1, 2):
        if len(shape) >= axis:
            templates = (templates + np.roll(templates, 1, axis=axis) + np.roll(templates, -1, axis=axis)) / 3
    y = rs.randint(0, n_classes, size=n)
    x = np.empty((n,) + tuple(shape), dtype=np.uint8)
    chunk = 4096
    for i in range(0, n, chunk):
        part = templates[y[i:i + chunk]] + rs.normal(0, noise, size=(len(y[i:i + chunk]),) + tuple(shape))
        x[i:i + chunk] = np.clip(part, 0, 255).astype(np.uint8)
    return x, y.astype(np.uint8)


def synthetic_reviews(n: int, vocab: int, seed: int, mean_len: int = 230, min_len: int = 10,
                      max_len: int = 1000):
    """``n`` IMDb-like reviews: lists of word indices in ``[4, vocab)`` (0 padding, 1 start, 2 OOV,
    3 unused, as ``keras.datasets.imdb`` numbers them; each starts with 1), of varied lengths, and
    0/1 labels; positive reviews use some words more often (learnable)."""
    import numpy as np

    rs = np.random.RandomState(seed)
    y = rs.randint(0, 2, size=n)
    lengths = np.clip(rs.lognormal(np.log(mean_len), 0.6, size=n).astype(int), min_len, max_len)
    words = np.arange(4, vocab)
    # Zipf-like word frequencies, tilted per class
    base = 1.0 / np.arange(1, len(words) + 1) ** 1.05
    tilt = rs.uniform(0.5, 1.5, size=len(words))
    probs = [base / base.sum(), (base * tilt) / (base * tilt).sum()]
    x = [[1] + rs.choice(words, size=int(L) - 1, p=probs[int(c)]).tolist() for L, c in zip(lengths, y)]
    return x, y.astype(np.int64)


# ---------------------------------------------------------------------------------- environment
def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def facts(framework: str, device: str, precision: str = "fp32",
          versions: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """Platform and device facts of this session (for the results, one entry per session)."""
    info = _session.detect()
    try:
        hw = _session.hardware()
    except Exception as exc:  # noqa: BLE001 - facts are informative
        hw = {"gpu": "unknown", "error": str(exc)}
    cpu = hw.get("cpu_model") or _platform.processor() or "unknown CPU"
    if hw.get("cpu_usable"):
        cpu = f"{cpu} ({hw['cpu_usable']} usable cores)"
    v = {"python": _platform.python_version(), "keepalive": __version__}
    v.update(versions or {})
    return {"platform": info.platform, "profile": info.profile, "accelerator": info.accelerator,
            "device": device, "precision": precision, "gpu": hw.get("gpu"), "cpu": cpu,
            "ram": hw.get("ram_total"), "framework": framework, "versions": v,
            "hostname": _platform.node()}


def framework_label(framework: str, versions: Mapping[str, str]) -> str:
    if framework == "keras":
        return f"keras {versions.get('keras', '?')} ({versions.get('backend', '?')} " \
               f"{versions.get(versions.get('backend', ''), '')})".replace(" )", ")")
    return f"fastai {versions.get('fastai', '?')} / torch {versions.get('torch', '?')}"


def threads_from_env(threads: Optional[int]) -> Optional[int]:
    """``threads`` or ``KEEPALIVE_BENCH_THREADS`` (through :mod:`keepalive.settings`); None leaves the
    framework's default."""
    if threads is None:
        threads = settings.get("KEEPALIVE_BENCH_THREADS")
    return threads if threads and threads > 0 else None


def commit_hook(core: Any, on_commit: Optional[StepHook]) -> None:
    """Call ``on_commit(step)`` (from the writer thread) once each checkpoint of ``core`` is
    committed; nothing when either is None."""
    if on_commit is not None and core is not None:
        core.on_commit.append(lambda result: on_commit(int(result.info.step)))


# --------------------------------------------------------------------------------- results IO
def _backend(url: str):
    from ..backends import backend_for

    return backend_for(str(url))


def _join(url: str, name: str) -> str:
    return str(url).rstrip("/") + "/" + name


def write_results(run_dir: str, doc: Mapping[str, Any]) -> None:
    """``results.json`` (and its backup) and ``results.csv`` in ``run_dir`` (path or URL)."""
    backend, root = _backend(run_dir)
    backend.makedirs(root)
    data = json.dumps(doc, indent=1, default=_json_default).encode()
    # backup first, then the main file: a kill during either write leaves the other one complete
    backend.write_bytes(backend.join(root, RESULTS_BACKUP), data)
    backend.write_bytes(backend.join(root, RESULTS_JSON), data)
    backend.write_bytes(backend.join(root, RESULTS_CSV), results_csv([doc]).encode())


def _json_default(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    if hasattr(x, "tolist"):
        return x.tolist()
    return str(x)


def read_results(run_dir: str) -> Optional[Dict[str, Any]]:
    """The results document of a run folder (falling back to the backup when the main file is torn),
    or None when there is none."""
    backend, root = _backend(run_dir)
    problems = []
    for name in (RESULTS_JSON, RESULTS_BACKUP):
        path = backend.join(root, name)
        try:
            if not backend.exists(path):
                continue
            doc = json.loads(backend.read_bytes(path).decode())
        except (OSError, ValueError) as exc:
            # a kill while writing tears one of the two files: the other one is complete
            report.debug(f"cannot read {path} ({exc}); trying the other results file")
            problems.append(f"{name}: {exc}")
            continue
        if isinstance(doc, dict) and "records" in doc:
            doc["run_dir"] = str(run_dir)  # where it is now (a run folder can be moved or copied)
            return doc
    if problems:
        report.warn(f"the results in {run_dir} cannot be read ({'; '.join(problems)}): they start afresh",
                    key=f"workloads-results-read:{run_dir}")
    return None


def find_results(root: str, max_depth: int = 3) -> List[str]:
    """Run folders at or below ``root`` that hold a results file (sorted)."""
    backend, path = _backend(root)
    found: List[str] = []

    def walk(p: str, depth: int) -> None:
        try:
            entries = backend.listdir(p)
        except (FileNotFoundError, NotADirectoryError, OSError):
            return
        names = {e.name for e in entries}
        if RESULTS_JSON in names or RESULTS_BACKUP in names:
            found.append(backend.url(p))
        if depth < max_depth:
            for e in sorted(entries, key=lambda e: e.name):
                if e.is_dir and not e.name.startswith((".", "ckpt-")):
                    walk(backend.join(p, e.name), depth + 1)

    walk(path, 0)
    return found


def _metric_columns(docs: Iterable[Mapping[str, Any]]) -> List[str]:
    cols: List[str] = []
    for doc in docs:
        for r in doc.get("records", []):
            for k in (r.get("metrics") or {}):
                if k not in cols:
                    cols.append(k)
    return cols


def results_csv(docs: Sequence[Mapping[str, Any]]) -> str:
    """One row per epoch record (the metrics as extra columns)."""
    metrics = _metric_columns(docs)
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(CSV_COLUMNS + metrics)
    for doc in docs:
        for r in doc.get("records", []):
            row = [doc.get("workload") if c == "workload" else r.get(c) for c in CSV_COLUMNS]
            row += [(r.get("metrics") or {}).get(m) for m in metrics]
            w.writerow(["" if v is None else (f"{v:.6g}" if isinstance(v, float) else v) for v in row])
    return out.getvalue()


# ------------------------------------------------------------------------------------ recorder
class RunRecorder:
    """Per-epoch timing records of one run (see the module docstring).

    The framework glue calls :meth:`epoch_begin` / :meth:`step` / :meth:`epoch_logs` /
    :meth:`finish_epoch`; :meth:`attach` hooks the checkpointer (``DriveCheckpoint(...).core``) to
    measure the time it holds the training loop and its background writes.
    """

    def __init__(self, run_dir: str, meta: Mapping[str, Any], session_facts: Mapping[str, Any],
                 write: bool = True):
        self.run_dir = str(run_dir)
        self.write_enabled = write
        old = read_results(self.run_dir) if write else None
        doc: Dict[str, Any] = {"format": RESULTS_FORMAT, "run_dir": self.run_dir, "sessions": [],
                               "records": [], "final": {}}
        if old is not None:
            if old.get("workload") not in (None, meta.get("workload")):
                raise ValueError(f"{self.run_dir} holds results of workload {old.get('workload')!r}, "
                                 f"not {meta.get('workload')!r}: use another folder")
            doc.update({k: old[k] for k in ("sessions", "records", "final") if k in old})
        doc.update(meta)
        self.doc = doc
        self.session_no = len(doc["sessions"]) + 1
        self.session = dict(session_facts, session=self.session_no, started=_iso(time.time()),
                            resumed_from=None, resume_seconds=None, pid=os.getpid())
        doc["sessions"].append(self.session)
        self._lock = threading.Lock()
        self._open: Optional[Dict[str, Any]] = None
        self._t0 = self._cpu0 = 0.0
        self._ckpt = 0.0            # time spent inside the checkpointer's boundaries, this epoch
        self._saves: Dict[int, int] = {}  # step of a save -> epoch (1-based) it belongs to
        self._writes: Dict[int, List[float]] = {}  # epoch -> [seconds, bytes, count]
        self.core: Any = None
        self.printer: Optional[Callable[[str], None]] = report.say  # None: no per-epoch line

    # ----------------------------------------------------------------------------- hooks
    def attach(self, core: Any) -> None:
        """Time the checkpointer's boundaries (what it costs the training loop) and its writes."""
        self.core = core
        for name in ("advance", "end_epoch", "end_stage"):
            setattr(core, name, self._timed(getattr(core, name)))
        load = core.load

        def timed_load(*a, **kw):
            t0 = time.perf_counter()
            try:
                return load(*a, **kw)
            finally:
                self.session["resume_seconds"] = round(time.perf_counter() - t0, 4)
                if core.resumed_from is not None:
                    self.session["resumed_from"] = {"checkpoint": core.resumed_from.name,
                                                    "epoch": core.counters.get("epoch"),
                                                    "step": core.counters.get("step"),
                                                    "batch": core.counters.get("batch")}

        core.load = timed_load
        save = core.save

        def noted_save(*a, **kw):
            epoch = self._open["epoch"] if self._open else None
            if epoch is not None:
                with self._lock:
                    self._saves[int(core.counters.get("step", 0))] = epoch
            return save(*a, **kw)

        core.save = noted_save
        core.on_commit.append(self._committed)

    def _timed(self, fn: Callable) -> Callable:
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self._ckpt += time.perf_counter() - t0
        return wrapper

    def _committed(self, result: Any) -> None:  # the writer thread
        with self._lock:
            epoch = self._saves.pop(int(result.info.step), None)
            if epoch is None:
                epoch = int(result.info.epoch or 0) or 1
            w = self._writes.setdefault(epoch, [0.0, 0.0, 0])
            w[0] += float(result.seconds)
            w[1] += float(result.bytes_written or 0)
            w[2] += 1

    # ------------------------------------------------------------------------------ epochs
    def epoch_begin(self, epoch0: int, start_batch: int = 0,
                    extra: Optional[Mapping[str, Any]] = None) -> None:
        """Epoch ``epoch0`` (0-based, over the whole run) starts; closes the previous one. ``extra``:
        more fields for its record (e.g. fastai's ``phase``: frozen / unfrozen)."""
        self.finish_epoch()
        epoch = int(epoch0) + 1
        # epochs from here on are (re)done in this session: drop what an earlier session recorded
        self.doc["records"] = [r for r in self.doc["records"] if r["epoch"] < epoch]
        self._open = {"epoch": epoch, "session": self.session_no, "start_batch": int(start_batch),
                      "steps": 0, "samples": 0, "metrics": {}}
        self._open.update(extra or {})
        self._ckpt = 0.0
        self._cpu0 = time.process_time()
        self._t0 = time.perf_counter()

    def step(self, samples: int) -> None:
        if self._open is not None:
            self._open["steps"] += 1
            self._open["samples"] += int(samples)

    def epoch_logs(self, logs: Optional[Mapping[str, Any]]) -> None:
        if self._open is not None and logs:
            for k, v in logs.items():
                try:
                    self._open["metrics"][str(k)] = round(float(v), 6)
                except (TypeError, ValueError):
                    pass

    def finish_epoch(self) -> Optional[Dict[str, Any]]:
        """Close the open epoch (its wall time ends now), write the results; the record or None."""
        rec, self._open = self._open, None
        if rec is None:
            return None
        seconds = time.perf_counter() - self._t0
        rec["seconds"] = round(seconds, 4)
        rec["cpu_seconds"] = round(time.process_time() - self._cpu0, 4)  # all threads of this process
        rec["samples_per_s"] = round(rec["samples"] / seconds, 2) if seconds > 0 else None
        rec["checkpoint_seconds"] = round(self._ckpt, 4) if self.core is not None else None
        timed = self.core is not None
        rec["checkpoint_pct"] = round(100.0 * self._ckpt / seconds, 3) if timed and seconds > 0 else None
        for k in ("platform", "device", "precision"):
            rec[k] = self.session.get(k)
        rec["framework"] = framework_label(self.session.get("framework", ""),
                                           self.session.get("versions", {}))
        if rec["start_batch"] == 0:
            del rec["start_batch"]
        self.doc["records"].append(rec)
        self.doc["records"].sort(key=lambda r: r["epoch"])
        self._ckpt = 0.0
        self.write()
        if self.printer is not None:
            self.printer(format_epoch(rec, self.doc.get("epochs")))
        return rec

    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        """Around the training call: a stop before its end (keepalive's ``SystemExit(EXIT_STOPPED)``
        after its save: the session's deadline, a notice) still records this session, not completed,
        before the exit goes on."""
        try:
            yield
        except SystemExit as stop:
            if stop.code == EXIT_STOPPED:
                self.finish(completed=False)
            raise

    def finish(self, final: Optional[Mapping[str, Any]] = None,
               completed: Optional[bool] = None) -> Dict[str, Any]:
        """The end of this session's training: close the epoch, add ``final`` facts, write."""
        self.finish_epoch()
        mine = [r for r in self.doc["records"] if r.get("session") == self.session_no]
        if not mine and self.session.get("resumed_from") and completed:
            # the run had completed before: this session trained nothing; keep the record clean
            self.doc["sessions"].remove(self.session)
        if final:
            self.doc.setdefault("final", {}).update(final)
        if completed is not None:
            self.doc["completed"] = bool(completed)
        self.session["ended"] = _iso(time.time())
        self.write()
        return self.doc

    # ------------------------------------------------------------------------------- write
    def _merge_writes(self) -> None:
        with self._lock:
            writes = {e: list(w) for e, w in self._writes.items()}
        for r in self.doc["records"]:
            w = writes.get(r["epoch"])
            if w is not None and r.get("session") == self.session_no:
                r["write_seconds"] = round(w[0], 4)
                r["checkpoint_mb"] = round(w[1] / 1e6, 3)
                r["checkpoints"] = int(w[2])
            elif r.get("session") == self.session_no and self.core is not None:
                r.setdefault("checkpoints", 0)

    def write(self) -> None:
        self._merge_writes()
        self.doc["summary"] = summarize(self.doc)
        self.doc["epochs_done"] = max((r["epoch"] for r in self.doc["records"]), default=0)
        if not self.write_enabled:
            return
        try:
            write_results(self.run_dir, self.doc)
        except Exception as exc:  # noqa: BLE001 - timings must never stop a training
            report.warn(f"could not write the results to {self.run_dir}: {exc}",
                        key=f"workloads-results-write:{self.run_dir}")


def summarize(doc: Mapping[str, Any]) -> Dict[str, Any]:
    """Totals over the epoch records: time, samples/s, checkpoint overhead."""
    recs = list(doc.get("records") or [])
    if not recs:
        return {}
    total = sum(r.get("seconds") or 0.0 for r in recs)
    samples = sum(r.get("samples") or 0 for r in recs)
    whole = [r["seconds"] for r in recs if not r.get("start_batch")]
    ckpt = [r.get("checkpoint_seconds") for r in recs if r.get("checkpoint_seconds") is not None]
    writes = [r.get("write_seconds") for r in recs if r.get("write_seconds") is not None]
    out = {"epochs": len(recs), "total_seconds": round(total, 3),
           "median_epoch_seconds": round(statistics.median(whole), 4) if whole else None,
           "samples_per_s": round(samples / total, 2) if total else None,
           "sessions": len({r.get("session") for r in recs})}
    if ckpt:
        out["checkpoint_seconds"] = round(sum(ckpt), 4)
        out["checkpoint_pct"] = round(100.0 * sum(ckpt) / total, 3) if total else None
    if writes:
        out["write_seconds"] = round(sum(writes), 4)
    return out


# ------------------------------------------------------------------------------------ printing
def format_epoch(rec: Mapping[str, Any], epochs: Optional[int] = None) -> str:
    of = f"/{epochs}" if epochs else ""
    part = f" (resumed at batch {rec['start_batch']})" if rec.get("start_batch") else ""
    ck = ""
    if rec.get("checkpoint_seconds") is not None:
        ck = f", checkpoint {rec['checkpoint_seconds']:.3f} s ({rec.get('checkpoint_pct') or 0:.2f} %)"
    metrics = " ".join(f"{k} {v:.4g}" for k, v in (rec.get("metrics") or {}).items())
    sps = rec.get("samples_per_s")
    return (f"epoch {rec['epoch']}{of}{part}: {rec['seconds']:.2f} s, "
            f"{sps if sps is not None else 'n/a'} samples/s{ck}" + (f"; {metrics}" if metrics else ""))


def _cell(v: Any, fmt: str = "{:.3f}") -> str:
    if v is None or v == "":
        return "-"
    if isinstance(v, float):
        return fmt.format(v)
    return str(v)


def format_report(doc: Mapping[str, Any]) -> str:
    """The table ``keepalive bench report`` prints for one run."""
    lines = []
    data = "synthetic" if doc.get("synthetic") else "real"
    lines.append(f"{doc.get('workload')} ({doc.get('framework')}, {data} data, size {doc.get('size')}) "
                 f"in {doc.get('run_dir')}")
    sessions = doc.get("sessions") or []
    done = doc.get("epochs_done") or 0
    state = "completed" if doc.get("completed") else "not completed"
    resumes = sum(1 for s in sessions if s.get("resumed_from"))
    lines.append(f"  {done}/{doc.get('epochs')} epochs, {state}; {len(sessions)} session(s), "
                 f"{resumes} resumed from a checkpoint; batch {doc.get('batch_size')}, "
                 f"{doc.get('train_samples')} training samples")
    for s in sessions:
        lines.append(f"  session {s.get('session')}: {s.get('started')} platform {s.get('platform')}, "
                     f"device {s.get('device')}, {s.get('precision')}, "
                     f"{framework_label(s.get('framework', ''), s.get('versions') or {})}"
                     + (f"; resumed at epoch {s['resumed_from'].get('epoch')}, step "
                        f"{s['resumed_from'].get('step')}" if s.get("resumed_from") else ""))
    metrics = _metric_columns([doc])[:4]
    head = (f"  {'epoch':>5} {'sess':>4} {'seconds':>9} {'samples/s':>10} {'ckpt s':>8} {'ckpt %':>7} "
            f"{'write s':>8} {'ckpt MB':>8}" + "".join(f" {m[:12]:>12}" for m in metrics))
    lines.append(head)
    for r in doc.get("records") or []:
        mark = "*" if r.get("start_batch") else " "
        lines.append(f"  {r['epoch']:>4}{mark} {r.get('session', ''):>4} {_cell(r.get('seconds')):>9} "
                     f"{_cell(r.get('samples_per_s'), '{:.1f}'):>10} {_cell(r.get('checkpoint_seconds')):>8} "
                     f"{_cell(r.get('checkpoint_pct'), '{:.2f}'):>7} {_cell(r.get('write_seconds')):>8} "
                     f"{_cell(r.get('checkpoint_mb'), '{:.1f}'):>8}"
                     + "".join(f" {_cell((r.get('metrics') or {}).get(m), '{:.4g}'):>12}" for m in metrics))
    if any(r.get("start_batch") for r in doc.get("records") or []):
        lines.append("  * resumed inside the epoch: the time covers the batches after the resume only")
    s = doc.get("summary") or {}
    if s:
        lines.append(f"  total {_cell(s.get('total_seconds'), '{:.1f}')} s, median epoch "
                     f"{_cell(s.get('median_epoch_seconds'))} s, {_cell(s.get('samples_per_s'), '{:.1f}')} "
                     f"samples/s; checkpoint overhead {_cell(s.get('checkpoint_pct'), '{:.2f}')} % of the "
                     f"epoch time ({_cell(s.get('checkpoint_seconds'))} s blocking, "
                     f"{_cell(s.get('write_seconds'))} s of background writes)")
    final = doc.get("final") or {}
    if final:
        lines.append("  final: " + ", ".join(f"{k} {_cell(v, '{:.4g}')}" for k, v in final.items()))
    return "\n".join(lines)


__all__ = ["SIZES", "resolve_size", "pick", "subset", "facts", "RunRecorder", "summarize",
           "write_results", "read_results", "find_results", "results_csv", "format_report",
           "format_epoch", "threads_from_env", "StepHook", "commit_hook"]
