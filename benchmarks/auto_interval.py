"""``every="auto"`` on the benchmark workloads: its checkpoint overhead, and the interval it chose next
to Young/Daly's optimum for the profile's interruption rate.

    python benchmarks/auto_interval.py [--only mnist_mlp,mnist_cnn] [--seconds 150] [--repeats 2] [--json]

Per workload (synthetic data, size "small"), runs of about ``--seconds`` of training alternate, each in
a fresh process, in three modes: without keepalive (``none``), with keepalive that saves only at the
end (``nosave``: ``every=`` a step count never reached; its per-step bookkeeping alone), and with
``DriveCheckpoint(every="auto")``; in the order A B C, C B A, ... so that no mode always runs first on
a machine whose load drifts. Per run: the training's wall time and process CPU time (all threads)
summed over its epochs, the checkpoints written, and the trigger's own figures at the end
(``SaveTrigger.auto_state()``), printed per run as they come (stderr).

Columns:

* ``interval``: the interval auto chose, and the rule that set it (Young/Daly, the 1 % budget, the
  one-minute minimum); ``C``: what it measured one save to cost (stall + background write's cost);
* ``YD 24h/3h/2h``: Young/Daly's optimum ``sqrt(2 * MTBF * C)`` for that C on a machine of one's own
  (24 h, this machine's profile), Colab's free tier (3 h), a Spot VM (2 h);
* ``loss % chosen/opt``: the expected share of time lost, ``C / t + t / (2 MTBF)`` (saving, plus the
  work redone after an interruption), at the chosen interval and at Young/Daly's optimum;
* ``block %``: the time spent inside keepalive's boundaries (bookkeeping plus the saves' stalls) as a
  share of the auto runs' training time;
* ``wall %`` / ``cpu %``: the auto runs' median training time over that of the runs ``all``: without
  keepalive, ``saves``: with keepalive but no save (what the saves every="auto" chose cost), minus
  one. Steady state: the first epoch (tracing, warm-up, and auto's measuring save) and the last one
  (every schedule writes the end of training synchronously) are left out. On a loaded 2-core VM the
  run-to-run noise of the wall time is several percent, far above the effect; the CPU time is
  steadier.

Goal: <= 1 % overhead. Not part of the test suite.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

HOURS = 3600.0


#: the modes each workload runs in: without keepalive, with keepalive but no save before the end (its
#: per-step bookkeeping alone), and with every="auto"
MODES = ("none", "nosave", "auto")
#: steps no run reaches: keepalive watches the loop but saves only at the end
NEVER = 10 ** 9


def child(name: str, run_dir: str, epochs: int, mode: str, out: str) -> None:
    """One training run in this process; its figures as JSON in ``out``."""
    from keepalive import trigger, workloads

    made: List[Any] = []
    original = trigger.SaveTrigger.__init__

    def remember(self, *args, **kwargs):  # the trigger the workload's DriveCheckpoint makes
        original(self, *args, **kwargs)
        made.append(self)

    trigger.SaveTrigger.__init__ = remember  # type: ignore[method-assign]
    doc = workloads.run(name, run_dir, epochs=epochs, synthetic=True, size="small",
                        every="auto" if mode == "auto" else NEVER, keep=2, checkpoint=mode != "none", quiet=True)
    records = sorted(doc["records"], key=lambda r: r["epoch"])
    state = made[0].auto_state() if made else None
    with open(out, "w") as f:
        json.dump({"records": records, "auto": state}, f)


def _env() -> Dict[str, str]:
    env = dict(os.environ, KEEPALIVE_PROGRESS="0", TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return env


def one_run(name: str, epochs: int, mode: str, workdir: str) -> Dict[str, Any]:
    run_dir = os.path.join(workdir, f"{name}-{mode}-{time.monotonic_ns()}")
    out = run_dir + ".json"
    subprocess.run([sys.executable, os.path.abspath(__file__), "--child", name, run_dir, str(epochs),
                    mode, out], check=True, env=_env(), stdout=subprocess.DEVNULL)
    with open(out) as f:
        doc = json.load(f)
    shutil.rmtree(run_dir, ignore_errors=True)
    recs = doc["records"]
    steady = recs[1:-1]
    return {"auto": doc["auto"], "epochs": len(recs),
            "wall": sum(r["seconds"] for r in steady), "cpu": sum(r["cpu_seconds"] for r in steady),
            "saves": sum(int(r.get("checkpoints") or 0) for r in recs),
            "steady_saves": sum(int(r.get("checkpoints") or 0) for r in steady),
            "blocking": sum(float(r.get("checkpoint_seconds") or 0.0) for r in steady)}


def epochs_for(name: str, seconds: float, workdir: str) -> int:
    """Epochs for about ``seconds`` of training, from a 3-epoch run without keepalive."""
    probe = one_run(name, 3, "none", workdir)
    per_epoch = probe["wall"]  # the one steady epoch of the three
    return max(4, int(math.ceil(seconds / max(per_epoch, 0.1))) + 2)


def expected_loss(interval: float, cost: float, mtbf: float) -> float:
    """The share of time lost: saving (C / t) plus the work redone after an interruption (t / 2M)."""
    return cost / interval + interval / (2.0 * mtbf)


def measure(name: str, seconds: float, repeats: int, workdir: str) -> Dict[str, Any]:
    from keepalive.autointerval import young_daly

    epochs = epochs_for(name, seconds, workdir)
    runs: Dict[str, List[Dict[str, Any]]] = {mode: [] for mode in MODES}
    for i in range(repeats):
        for mode in (MODES if i % 2 == 0 else MODES[::-1]):  # A B C, C B A, ...
            runs[mode].append(one_run(name, epochs, mode, workdir))
            r = runs[mode][-1]
            print(f"  {name} {mode} #{len(runs[mode])}: {r['wall']:.1f} s wall, {r['cpu']:.1f} s cpu, "
                  f"{r['saves']} saves ({r['steady_saves']} steady), {r['blocking']:.3f} s blocking; "
                  f"auto: {json.dumps(r['auto'])}", file=sys.stderr, flush=True)
    med = statistics.median
    auto_runs, none_runs, nosave_runs = runs["auto"], runs["none"], runs["nosave"]

    def over(key: str, base: List[Dict[str, Any]]) -> float:
        return 100.0 * (med(r[key] for r in auto_runs) / med(r[key] for r in base) - 1)

    state = auto_runs[-1]["auto"] or {}
    cost = float(state.get("cost_seconds") or 0.0)
    interval = float(state.get("interval_seconds") or 0.0)
    mtbf = float(state.get("mtbf_seconds") or 24 * HOURS)
    optimum = young_daly(mtbf, cost)
    loss_chosen = 100.0 * expected_loss(interval, cost, mtbf) if cost > 0 and interval > 0 else None
    loss_optimum = 100.0 * expected_loss(optimum, cost, mtbf) if cost > 0 else None
    return {
        "workload": name, "epochs": epochs, "repeats": repeats,
        "interval_s": interval, "limited_by": state.get("limited_by"), "cost_s": cost,
        "stall_s": state.get("stall_seconds"), "write_s": state.get("write_seconds"),
        "mtbf_s": mtbf, "mtbf_source": state.get("mtbf_source"),
        "yd_24h_s": young_daly(24 * HOURS, cost), "yd_3h_s": young_daly(3 * HOURS, cost),
        "yd_2h_s": young_daly(2 * HOURS, cost), "loss_chosen_pct": loss_chosen, "loss_optimum_pct": loss_optimum,
        "saves": [r["saves"] for r in auto_runs],
        "blocking_pct": med(100.0 * r["blocking"] / r["wall"] for r in auto_runs),
        **{f"{key}_{mode}_s": [round(r[key], 2) for r in runs[mode]] for key in ("wall", "cpu") for mode in MODES},
        "wall_pct": over("wall", none_runs), "cpu_pct": over("cpu", none_runs),
        "wall_saves_pct": over("wall", nosave_runs), "cpu_saves_pct": over("cpu", nosave_runs),
    }


def table(rows: List[Dict[str, Any]]) -> str:
    head = (f"{'workload':<12}{'ep':>4}{'interval':>9} {'rule':<11}{'C s':>7}{'YD 24h':>7}{'YD 3h':>6}"
            f"{'YD 2h':>6}{'loss %':>13}{'saves':>7}{'block %':>8}{'wall %':>14}{'cpu %':>14}")
    lines = [head, f"{'':<83}{'chosen/opt':>13}{'':>15}{'all/saves':>14}{'all/saves':>14}"]
    for r in rows:
        loss = ("n/a" if r["loss_chosen_pct"] is None
                else f"{r['loss_chosen_pct']:.3f}/{r['loss_optimum_pct']:.3f}")
        lines.append(f"{r['workload']:<12}{r['epochs']:>4}{r['interval_s']:>8.0f}s {str(r['limited_by']):<11}"
                     f"{r['cost_s']:>7.3f}{r['yd_24h_s']:>6.0f}s{r['yd_3h_s']:>5.0f}s{r['yd_2h_s']:>5.0f}s"
                     f"{loss:>13}{','.join(map(str, r['saves'])):>7}{r['blocking_pct']:>8.3f}"
                     f"{r['wall_pct']:>7.2f}/{r['wall_saves_pct']:<6.2f}{r['cpu_pct']:>7.2f}/{r['cpu_saves_pct']:<6.2f}")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        name, run_dir, epochs, mode, out = sys.argv[2:7]
        child(name, run_dir, int(epochs), mode, out)
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="mnist_mlp,mnist_cnn", help="workloads, comma-separated")
    p.add_argument("--seconds", type=float, default=150.0, help="training seconds per run (about)")
    p.add_argument("--repeats", type=int, default=2, help="runs per mode and workload")
    p.add_argument("--json", action="store_true", help="the figures as JSON too")
    args = p.parse_args()
    workdir = tempfile.mkdtemp(prefix="keepalive-auto-bench-")
    try:
        rows = [measure(name, args.seconds, args.repeats, workdir) for name in args.only.split(",")]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(table(rows))
    if rows:
        print(f"MTBF: {rows[0]['mtbf_s'] / HOURS:.0f} h ({rows[0]['mtbf_source']})")
    if args.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
