"""Checkpoint overhead per epoch of every benchmark workload (keepalive/workloads) at small scale.

    python benchmarks/workload_overhead.py [--epochs 14] [--period 3] [--size small] [--only a,b] [--json]

Each workload trains once, on synthetic data of its "small" size, through ``keepalive bench run`` (a
fresh process per workload), with ``DriveCheckpoint(every=PERIOD x steps per epoch)``: a checkpoint
at the end of every 3rd epoch, so that epochs with and without a checkpoint alternate within the same
run and share its conditions (the load of a shared machine drifts over minutes; neighbouring epochs
see the same). Each group of 3 epochs is: the epoch ending in a checkpoint, the next one (the
checkpoint's background write runs during it), a clean one. Left out: the first epoch (graph tracing,
warm-up), the last one (its checkpoint is written synchronously, as at the end of every training),
and fastai's frozen epoch and the one after it (the end of ``fine_tune``'s first fit is always saved
synchronously). Per workload:

* ``epoch s``: median time of a clean epoch;
* ``blocking``: the median time spent inside the checkpointer during an epoch that ends in a
  checkpoint: its per-step bookkeeping plus the save (the state copied to host memory; the write
  itself runs in the background); ``per-step``: the same in a clean epoch (bookkeeping only);
  ``share``: blocking as a share of that epoch's time - the overhead keepalive causes directly,
  free of noise;
* ``write s`` / ``MB``: background write time and size of one checkpoint;
* ``wall`` / ``cpu``: end to end, what one checkpoint adds to its epoch and to the next one (the
  background write competes for the CPU there), ``(t_ckpt + t_next - 2 t_clean) / t_clean``, in wall
  time and in process CPU time (all threads). Wall time carries the epoch-to-epoch noise of a shared
  machine (tens of percent on a loaded 2-core VM, far above the effect); CPU time is much steadier.

Goal: <= 1 % per epoch. Not part of the test suite. On a machine where ``import torchvision``
fails next to a CPU torch (this project's test machine), the fastai workload is run with the test
suite's import shim (tests/shims) on PYTHONPATH.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from keepalive import workloads  # noqa: E402
from keepalive.workloads import common  # noqa: E402


def _env(name: str) -> dict:
    env = dict(os.environ, KEEPALIVE_PROGRESS="0", TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    if workloads.describe(name)["framework"] == "fastai":
        probe = subprocess.run([sys.executable, "-c", "import torchvision"], capture_output=True, env=env)
        if probe.returncode != 0:
            print("  (torchvision does not import here: using the test suite's shim, tests/shims)",
                  file=sys.stderr)
            env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "tests", "shims"), env["PYTHONPATH"]])
    return env


def steps_per_epoch(name: str, size: str, workdir: str) -> int:
    """From a 1-epoch run without checkpoints (also creates the synthetic data caches)."""
    run_dir = os.path.join(workdir, f"{name}-probe")
    cmd = [sys.executable, "-m", "keepalive", "bench", "run", name, "--synthetic", "--size", size,
           "--epochs", "1", "--dir", workdir, "--run", f"{name}-probe", "--no-checkpoint", "--quiet"]
    subprocess.run(cmd, check=True, env=_env(name), stdout=subprocess.DEVNULL)
    doc = common.read_results(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    return int(doc["steps_per_epoch"])


def measure(name: str, size: str, epochs: int, workdir: str, threads: int = 0, period: int = 3) -> dict:
    fw = workloads.describe(name)["framework"]
    spe = steps_per_epoch(name, size, workdir)
    run = f"{name}-overhead"
    run_dir = os.path.join(workdir, run)
    cmd = [sys.executable, "-m", "keepalive", "bench", "run", name, "--synthetic", "--size", size,
           "--epochs", str(epochs), "--dir", workdir, "--run", run, "--every", str(period * spe), "--quiet"]
    if threads:
        cmd += ["--threads", str(threads)]
    t0 = time.time()
    subprocess.run(cmd, check=True, env=_env(name), stdout=subprocess.DEVNULL)
    wall = time.time() - t0
    doc = common.read_results(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    recs = {r["epoch"]: r for r in doc["records"]}
    last = max(recs)
    skip = {1, last}  # warm-up epoch; the last one (its checkpoint is written synchronously)
    if fw == "fastai":
        frozen = [e for e, r in recs.items() if r.get("phase") == "frozen"]
        skip |= set(frozen) | {max(frozen) + 1}  # synchronous end of the frozen fit; first after unfreeze
    # groups of `period` epochs: one ending in a checkpoint, the next one (its background write runs
    # then), the rest clean
    groups = []
    for e, r in sorted(recs.items()):
        if not r.get("checkpoints") or e in skip:
            continue
        members = [recs.get(e + k) for k in range(period)]
        if any(m is None or m["epoch"] in skip or (k and m.get("checkpoints"))
               for k, m in enumerate(members)):
            continue
        groups.append(members)
    if not groups:
        raise RuntimeError(f"{name}: no complete group of {period} epochs in {len(recs)} epochs "
                           f"({[recs[e].get('checkpoints') for e in sorted(recs)]}); use more --epochs")
    med = statistics.median

    def extra(key):  # what one checkpoint adds, as a share of a clean epoch
        clean = [med(r[key] for r in g[2:]) for g in groups]
        return med(100.0 * (g[0][key] + g[1][key] - 2 * c) / c for g, c in zip(groups, clean)), med(clean)

    wall_pct, clean_s = extra("seconds")
    cpu_pct, clean_cpu = extra("cpu_seconds")
    ck = [g[0] for g in groups]
    blocking = med(r["checkpoint_seconds"] for r in ck)
    return {"workload": name, "framework": fw, "params": doc.get("params"), "steps_per_epoch": spe,
            "batch_size": doc.get("batch_size"), "groups": len(groups), "epoch_s": clean_s,
            "epoch_cpu_s": clean_cpu, "wall_pct": wall_pct, "cpu_pct": cpu_pct,
            "blocking_s": blocking,
            "bookkeeping_s": med(r["checkpoint_seconds"] for g in groups for r in g[2:]),
            "blocking_pct": med(100.0 * r["checkpoint_seconds"] / r["seconds"] for r in ck),
            "write_s": med(r["write_seconds"] for r in ck if r.get("write_seconds") is not None),
            "checkpoint_mb": med(r["checkpoint_mb"] for r in ck if r.get("checkpoint_mb")),
            "device": ck[-1].get("device"), "wall_s": wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small", choices=["tiny", "small", "full"])
    p.add_argument("--epochs", type=int, default=14,
                   help="epochs per run (Keras; fastai: unfrozen epochs after the frozen one)")
    p.add_argument("--period", type=int, default=3, help="a checkpoint every PERIOD epochs (default 3)")
    p.add_argument("--only", default=None, help="comma-separated workload names (default: all)")
    p.add_argument("--threads", type=int, default=0, help="framework CPU threads (default: its own)")
    p.add_argument("--dir", default=None, help="where the runs go (default: a fresh temp dir)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = p.parse_args()
    names = args.only.split(",") if args.only else workloads.names()
    workdir = args.dir or tempfile.mkdtemp(prefix="workload-overhead-")
    rows = []
    for name in names:
        print(f"{name} ...", file=sys.stderr, flush=True)
        rows.append(measure(name, args.size, args.epochs, workdir, args.threads, args.period))
        r = rows[-1]
        print(f"  epoch {r['epoch_s']:.2f} s, blocking {1000 * r['blocking_s']:.1f} ms "
              f"({r['blocking_pct']:.2f} %), end to end {r['wall_pct']:+.1f} % wall, "
              f"{r['cpu_pct']:+.1f} % CPU "
              f"({r['groups']} groups), run {r['wall_s']:.0f} s", file=sys.stderr, flush=True)
    print(f"\ncheckpoint overhead per epoch, synthetic data size {args.size}, a checkpoint every "
          f"{args.period} epochs (device {rows[0]['device'] if rows else '?'}, {os.cpu_count()} CPUs"
          + (f", {args.threads} framework thread(s)" if args.threads else "") + ")")
    print(f"{'workload':<24} {'params':>10} {'MB':>6} {'epoch s':>8} {'blocking':>9} {'per-step':>9} "
          f"{'share':>7} {'write s':>8} {'wall':>8} {'cpu':>8}")
    for r in rows:
        print(f"{r['workload']:<24} {r['params']:>10,} {r['checkpoint_mb']:>6.1f} {r['epoch_s']:>8.3f} "
              f"{1000 * r['blocking_s']:>7.1f}ms {1000 * r['bookkeeping_s']:>7.1f}ms "
              f"{r['blocking_pct']:>6.2f}% "
              f"{r['write_s']:>8.3f} {r['wall_pct']:>+7.1f}% {r['cpu_pct']:>+7.1f}%")
    print("epoch s: median clean epoch; blocking: time inside the checkpointer in an epoch ending in a "
          "checkpoint (per-step: in a clean epoch); share: blocking / that epoch's time;\n"
          "wall / cpu: end to end, what a checkpoint adds to its epoch and the next one (the background "
          "write) in wall time / process CPU time, as a share of a clean epoch")
    if rows:
        print(f"blocking share: median {statistics.median(r['blocking_pct'] for r in rows):.2f} %, "
              f"max {max(r['blocking_pct'] for r in rows):.2f} % "
              f"({max(rows, key=lambda r: r['blocking_pct'])['workload']}); "
              f"end to end (CPU time): median {statistics.median(r['cpu_pct'] for r in rows):+.2f} %")
    if args.json:
        print(json.dumps(rows, indent=2))
    if not args.dir:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
