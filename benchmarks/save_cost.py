"""The whole cost of a save on a CPU-bound training loop, not only its stall.

On a CPU-only machine every core is busy training: a checkpoint's background write (its copies,
its checksum pass, its system calls) takes CPU time from the training, so the loop's wall time is
what counts. One training loop (4 x Linear(2048, 2048), Adam: 64 MiB of parameters, 64 MiB of
gradients, 128 MiB of moments = 256 MiB of training state; 192 MiB of it saved; ~0.35-0.4 s per
step on 2 cores) is run for ``--steps`` steps in a fresh process per run, and the variants alternate
(round robin, the order rotated every round) so that they share the machine's conditions:

* ``base``: no checkpoints at all;
* ``ka1000``: keepalive with ``every=1000`` (no save due inside the run; what remains is the per-step
  bookkeeping, the first boundary's buffer reservation and the end of training's save);
* ``ka5``: keepalive with ``every=5`` (``ka5-lazy`` / ``ka5-blocking`` when ``snapshot=`` exists);
* ``torchsave5``: ``torch.save`` of the model's and the optimizer's state dicts every 5 steps (in the
  loop, then ``fsync``: durable like keepalive's checkpoints), and at the end;
* ``dcp5``: ``torch.distributed.checkpoint.async_save`` every 5 steps (no process group), and at the
  end (its last write waited for).

Every keepalive run saves at the end of training too (synchronously, as every training's end does).
Per variant: loop wall time (from the first batch until the last checkpoint is durable), its
process CPU time, saves made; then ``per save`` = (loop - base) / saves, and its ratio to a memcpy of
the saved bytes (``np.copyto`` into a preallocated, touched buffer, measured in each run); the
writer's CPU time per save (``WriteResult.cpu_seconds`` when the store reports it, else the writer
thread's ``time.thread_time``); the median step time and the step after a save.

``--profile``: the keepalive runs also time keepalive's own functions (wall and CPU time, per step
and per save): where the time goes. ``--cprofile VARIANT``: one run of VARIANT under cProfile.

    python benchmarks/save_cost.py [--steps 40] [--rounds 3] [--batch 512] [--profile] [--quick]

Goal: per-save cost <= 2x the memcpy of the state. Not part of the test suite.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

WIDTH, LAYERS, EVERY = 2048, 4, 5


# ------------------------------------------------------------------------------------- the child
def _build(batch: int, steps: int):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(steps * batch, WIDTH)
    y = torch.randn(steps * batch, WIDTH)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)
    return model, opt, loader


def _saved_bytes(model, opt) -> int:
    import torch

    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for s in opt.state_dict()["state"].values():
        total += sum(v.numel() * v.element_size() for v in s.values() if torch.is_tensor(v))
    return total


def _memcpy_seconds(nbytes: int, repeat: int = 5) -> float:
    import numpy as np

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)  # touched: its pages are mapped before the timing
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class _Timers:
    """Wall and CPU (the calling thread's) time of wrapped functions, summed per name."""

    def __init__(self) -> None:
        self.wall: Dict[str, float] = defaultdict(float)
        self.cpu: Dict[str, float] = defaultdict(float)
        self.calls: Dict[str, int] = defaultdict(int)

    def wrap(self, owner: Any, attr: str, name: Optional[str] = None) -> None:
        original = getattr(owner, attr)
        label = name or attr
        timers = self

        @functools.wraps(original)
        def timed(*a: Any, **k: Any) -> Any:
            w, c = time.perf_counter(), time.thread_time()
            try:
                return original(*a, **k)
            finally:
                timers.wall[label] += time.perf_counter() - w
                timers.cpu[label] += time.thread_time() - c
                timers.calls[label] += 1

        setattr(owner, attr, timed)

    def as_json(self) -> Dict[str, Any]:
        return {k: {"wall": self.wall[k], "cpu": self.cpu[k], "calls": self.calls[k]} for k in self.wall}


def _instrument(timers: _Timers) -> None:
    """Time keepalive's boundary and save path, function by function (--profile)."""
    from keepalive import backends, core, pauses, rng, state, store, writer
    from keepalive.callbacks import torch as ka_torch
    from keepalive.lifecycle import between_steps, boundaries, saving

    C = core.Checkpointer
    for attr in ("advance", "check_storable", "build_tree", "end_epoch", "flush"):
        timers.wrap(C, attr, f"Checkpointer.{attr}")
    timers.wrap(saving.Saver, "save", "Saver.save")
    timers.wrap(between_steps.BetweenSteps, "remember", "BetweenSteps.remember")
    for attr in ("before_boundary", "agree", "carry_out"):
        timers.wrap(boundaries.BoundaryDriver, attr, f"BoundaryDriver.{attr}")
    timers.wrap(boundaries.BoundaryMachine, "feed", "BoundaryMachine.feed (boundary state machine)")
    timers.wrap(rng, "capture", "rng.capture")
    timers.wrap(pauses, "version_sum", "pauses.version_sum")
    timers.wrap(pauses, "tensors_of", "pauses.tensors_of")
    timers.wrap(state.HostSnapshot, "reserve", "HostSnapshot.reserve (starts the memset thread)")
    timers.wrap(state.HostSnapshot, "take", "HostSnapshot.take (the copy)")
    timers.wrap(state, "encode", "state.encode")
    timers.wrap(store.CheckpointStore, "commit", "CheckpointStore.commit (writer thread)")
    timers.wrap(store.CheckpointStore, "_write_one", "  _write_one (write + fsync + hash)")
    timers.wrap(store.CheckpointStore, "apply_retention", "  apply_retention")
    timers.wrap(store.CheckpointStore, "_manifest", "  _manifest")
    timers.wrap(store.Lease, "renew", "  Lease.renew")
    timers.wrap(backends.LocalBackend, "sync", "  fsync")
    timers.wrap(writer.AsyncWriter, "wait", "AsyncWriter.wait")
    if hasattr(writer.AsyncWriter, "settle"):  # a lazy snapshot: the step's pre-hook waits here
        timers.wrap(writer.AsyncWriter, "settle", "AsyncWriter.settle (pre-hook wait for the copy)")
        timers.wrap(state.PendingCopy, "run", "  PendingCopy.run (background copy, writer thread)")
    timers.wrap(ka_torch.DriveCheckpoint, "capture", "DriveCheckpoint.capture (state_dicts)")
    timers.wrap(ka_torch.DriveCheckpoint, "_fingerprint", "DriveCheckpoint._fingerprint")
    timers.wrap(ka_torch.DriveCheckpoint, "_boundary", "DriveCheckpoint._boundary")

    original_hasher = store.new_hasher

    class TimedHasher:  # xxhash's objects take no new attributes: a proxy times their update()
        def __init__(self, inner: Any) -> None:
            self.inner = inner
            self.name = getattr(inner, "name", "?")

        def update(self, b: Any) -> None:
            w, c = time.perf_counter(), time.thread_time()
            self.inner.update(b)
            timers.wall["  hash (checksum pass)"] += time.perf_counter() - w
            timers.cpu["  hash (checksum pass)"] += time.thread_time() - c
            timers.calls["  hash (checksum pass)"] += 1

        def __getattr__(self, attr: str) -> Any:  # reset(), digest(), ...: the hasher's own
            return getattr(self.inner, attr)

    store.new_hasher = lambda *a, **k: TimedHasher(original_hasher(*a, **k))  # type: ignore[assignment]

    # the first boundary's host buffer: the memset runs in its own thread; time that thread
    original_host_buffer = state._host_buffer

    def host_buffer(size: int) -> Any:
        w, c = time.perf_counter(), time.thread_time()
        try:
            return original_host_buffer(size)
        finally:
            timers.wall["_host_buffer (mmap)"] += time.perf_counter() - w
            timers.cpu["_host_buffer (mmap)"] += time.thread_time() - c
            timers.calls["_host_buffer (mmap)"] += 1

    state._host_buffer = host_buffer  # type: ignore[assignment]
    import ctypes

    original_memset = ctypes.memset

    def memset(*a: Any) -> Any:
        w, c = time.perf_counter(), time.thread_time()
        try:
            return original_memset(*a)
        finally:
            timers.wall["memset of the reserved buffer (thread)"] += time.perf_counter() - w
            timers.cpu["memset of the reserved buffer (thread)"] += time.thread_time() - c
            timers.calls["memset of the reserved buffer (thread)"] += 1

    ctypes.memset = memset  # type: ignore[assignment]


def _writer_cpu_probe() -> List[Dict[str, float]]:
    """Each commit's writer-thread CPU time and wall time (and the store's own figure, when it
    reports ``cpu_seconds``)."""
    from keepalive import writer

    found: List[Dict[str, float]] = []
    original = writer.AsyncWriter._run

    def run(self: Any, job: Any) -> None:
        w, c = time.perf_counter(), time.thread_time()
        try:
            original(self, job)
        finally:
            rec = {"thread_cpu": time.thread_time() - c, "wall": time.perf_counter() - w}
            result = self._result
            if result is not None and getattr(result, "cpu_seconds", None) is not None:
                rec["store_cpu"] = float(result.cpu_seconds)
            if result is not None:
                rec["bytes"] = float(result.bytes_written)
            found.append(rec)

    writer.AsyncWriter._run = run  # type: ignore[method-assign]
    return found


def child(variant: str, steps: int, batch: int, folder: str, profile: bool) -> Dict[str, Any]:
    import torch

    model, opt, loader = _build(batch, steps)
    nbytes = _saved_bytes_after_first_step(model, opt)
    memcpy = _memcpy_seconds(nbytes)
    timers = _Timers()
    writes: List[Dict[str, float]] = []
    step_times: List[float] = []
    saved_after: List[int] = []  # step indices (0-based) after which a save was made
    loss_fn = torch.nn.functional.mse_loss

    def train_step(x: Any, y: Any) -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    if variant.startswith("ka"):
        from keepalive.callbacks.torch import DriveCheckpoint
        from keepalive.config import CheckpointConfig

        writes = _writer_cpu_probe()
        if profile:
            _instrument(timers)
        every = 1000 if variant == "ka1000" else EVERY
        options: Dict[str, Any] = dict(every=every, keep=2, quiet=True)
        if "-" in variant:
            if "snapshot" not in CheckpointConfig.field_names():
                raise SystemExit(f"{variant}: this keepalive has no snapshot= option")
            options["snapshot"] = variant.split("-", 1)[1]
        cpu0, t0 = _cpu(), time.perf_counter()
        ckpt = DriveCheckpoint(os.path.join(folder, "run"), model=model, optimizer=opt, **options)
        at = [0]  # the batch whose boundary is running
        from keepalive import core as ka_core

        original_save = ka_core.Checkpointer.save

        def noted_save(self: Any, *a: Any, **k: Any) -> None:
            saved_after.append(at[0])
            original_save(self, *a, **k)

        ka_core.Checkpointer.save = noted_save  # type: ignore[method-assign]
        last = time.perf_counter()
        for _epoch in ckpt.epochs(1):
            for i, (x, y) in enumerate(ckpt.batches(loader)):
                train_step(x, y)
                now = time.perf_counter()
                if i:  # from the previous step's end: its boundary (and save), this batch, this step
                    step_times.append(now - last)
                last = now
                at[0] = i
        ckpt.flush()
        loop = time.perf_counter() - t0
        cpu = _cpu() - cpu0
        saves = len(saved_after)
        if ckpt.core.writer.last_error is not None:
            raise SystemExit(f"{variant}: a checkpoint write failed: {ckpt.core.writer.last_error!r}")
        ckpt.close()
    else:
        saves = 0
        cpu0, t0 = _cpu(), time.perf_counter()
        pending: Any = None
        last = t0
        for i, (x, y) in enumerate(loader):
            train_step(x, y)
            now = time.perf_counter()
            if i:
                step_times.append(now - last)
            last = now
            if variant != "base" and ((i + 1) % EVERY == 0 or i + 1 == steps):
                saves += 1
                saved_after.append(i)
                slot = os.path.join(folder, f"ckpt-{saves % 2}")
                if variant == "torchsave5":
                    w, c = time.perf_counter(), time.thread_time()
                    with open(slot + ".pt", "wb") as f:
                        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, f)
                        f.flush()
                        os.fsync(f.fileno())
                    writes.append({"thread_cpu": time.thread_time() - c, "wall": time.perf_counter() - w})
                elif variant == "dcp5":
                    import torch.distributed.checkpoint as dcp

                    if pending is not None:
                        pending.result()  # one save in flight, as DCP's own examples do
                    pending = dcp.async_save({"model": model.state_dict(), "opt": opt.state_dict()},
                                             checkpoint_id=slot)
        if pending is not None:
            pending.result()
        loop = time.perf_counter() - t0
        cpu = _cpu() - cpu0
    return {"variant": variant, "loop": loop, "cpu": cpu, "saves": saves, "memcpy": memcpy,
            "bytes": nbytes, "steps": steps, "step_times": step_times, "saved_after": saved_after,
            "writes": writes, "timers": timers.as_json(), "load": os.getloadavg()[0]}


def _saved_bytes_after_first_step(model: Any, opt: Any) -> int:
    """The bytes a checkpoint holds once Adam has its moments (64 MiB of parameters: 192 MiB)."""
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    return 3 * n


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


# ------------------------------------------------------------------------------------ the parent
def _run_child(variant: str, args: argparse.Namespace, root: str) -> Dict[str, Any]:
    folder = tempfile.mkdtemp(prefix=f"{variant}-", dir=root)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--steps", str(args.steps),
           "--batch", str(args.batch), "--dir", folder]
    if args.profile:
        cmd.append("--profile")
    env = dict(os.environ, KEEPALIVE_PROGRESS="0", PYTHONUNBUFFERED="1")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode:
        sys.stderr.write(out.stderr[-4000:])
        raise SystemExit(f"{variant}: the run failed (exit {out.returncode})")
    shutil.rmtree(folder, ignore_errors=True)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1]
    return json.loads(line)


def _variants(requested: Optional[str]) -> List[str]:
    if requested:
        return requested.split(",")
    from keepalive.config import CheckpointConfig

    ka5 = ["ka5-lazy", "ka5-blocking"] if "snapshot" in CheckpointConfig.field_names() else ["ka5"]
    return ["base", "ka1000", *ka5, "torchsave5", "dcp5"]


def _report(results: Dict[str, List[Dict[str, Any]]], rounds: int) -> None:
    med = statistics.median
    base = results["base"]
    r0 = next(iter(results.values()))[0]
    memcpy = med(r["memcpy"] for rs in results.values() for r in rs)
    print(f"\nsaved state {r0['bytes'] / 2**20:.0f} MiB (training state 256 MiB with the gradients), "
          f"{r0['steps']} steps, {rounds} round(s); memcpy of the saved bytes {1000 * memcpy:.1f} ms "
          f"(median over runs)")
    print(f"{'variant':14s} {'loop s (range)':>18s} {'cpu s':>7s} {'saves':>5s} {'per save ms':>20s} "
          f"{'x memcpy':>14s} {'writer cpu ms':>13s} {'write ms':>8s} {'step ms':>7s} {'after save':>10s}")
    for variant, rs in results.items():
        loops = [r["loop"] for r in rs]
        # per save: each run against the base run of the same round (they ran side by side)
        per = [(r["loop"] - b["loop"]) / r["saves"] for r, b in zip(rs, base) if r["saves"]]
        per_x = [p / r["memcpy"] for p, r in zip(per, rs)]
        wcpu = [w.get("store_cpu", w["thread_cpu"]) for r in rs for w in r["writes"]]
        wwall = [w["wall"] for r in rs for w in r["writes"]]
        steps = [t for r in rs for t in r["step_times"]]
        # the interval holding a save's stall and the next step (where a lazy copy's wait shows)
        after = [r["step_times"][i] for r in rs for i in r["saved_after"]
                 if 0 <= i < len(r["step_times"])]
        src = " (store)" if any("store_cpu" in w for r in rs for w in r["writes"]) else ""
        print(f"{variant:14s} {med(loops):6.2f} ({min(loops):5.2f}-{max(loops):5.2f}) "
              f"{med(r['cpu'] for r in rs):7.1f} {med(r['saves'] for r in rs):5.0f} "
              + (f"{1000 * med(per):7.0f} ({1000 * min(per):4.0f}-{1000 * max(per):4.0f}) "
                 f"{med(per_x):5.1f} ({min(per_x):4.1f}-{max(per_x):4.1f})" if per else f"{'-':>20s} {'-':>14s}")
              + f" {1000 * med(wcpu) if wcpu else float('nan'):13.0f}{src}"
              f" {1000 * med(wwall) if wwall else float('nan'):8.0f} {1000 * med(steps):7.0f}"
              f" {1000 * med(after) if after else float('nan'):10.0f}")
    print(f"load average (1 min) at the runs' ends: "
          f"{min(r['load'] for rs in results.values() for r in rs):.2f}-"
          f"{max(r['load'] for rs in results.values() for r in rs):.2f}")
    _report_timers(results)


def _report_timers(results: Dict[str, List[Dict[str, Any]]]) -> None:
    for variant, rs in results.items():
        if not any(r["timers"] for r in rs):
            continue
        steps = rs[0]["steps"]
        saves = statistics.median(r["saves"] for r in rs) or 1
        print(f"\nwhere the time goes, {variant} (median over {len(rs)} runs; wall / thread CPU; "
              f"per step = total / {steps}, per save = total / {saves:.0f}):")
        print(f"  {'function':52s} {'calls':>5s} {'total ms':>9s} {'cpu ms':>8s} {'/step ms':>8s} {'/save ms':>8s}")
        names = sorted({k for r in rs for k in r["timers"]}, key=lambda k: -statistics.median(
            r["timers"].get(k, {}).get("wall", 0.0) for r in rs))
        for k in names:
            wall = statistics.median(r["timers"].get(k, {}).get("wall", 0.0) for r in rs)
            cpu = statistics.median(r["timers"].get(k, {}).get("cpu", 0.0) for r in rs)
            calls = statistics.median(r["timers"].get(k, {}).get("calls", 0) for r in rs)
            print(f"  {k:52s} {calls:5.0f} {1000 * wall:9.1f} {1000 * cpu:8.1f} {1000 * wall / steps:8.2f} "
                  f"{1000 * wall / saves:8.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=512, help="batch size (~0.35-0.4 s steps on 2 cores)")
    ap.add_argument("--variants", default=None, help="comma-separated (default: all)")
    ap.add_argument("--profile", action="store_true", help="time keepalive's functions in its runs")
    ap.add_argument("--cprofile", default=None, metavar="VARIANT", help="one run of VARIANT under cProfile")
    ap.add_argument("--quick", action="store_true", help="15 steps, 1 round")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true", help="print every run's figures as JSON")
    args = ap.parse_args()
    if args.child:
        if args.cprofile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            res = prof.runcall(child, args.child, args.steps, args.batch, args.dir, args.profile)
            pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats("keepalive", 40)
        else:
            res = child(args.child, args.steps, args.batch, args.dir, args.profile)
        print(json.dumps(res))
        return 0
    if args.quick:
        args.steps, args.rounds = 15, 1
    root = args.dir or tempfile.mkdtemp(prefix="save-cost-")
    os.makedirs(root, exist_ok=True)
    if args.cprofile:
        folder = tempfile.mkdtemp(dir=root)
        subprocess.run([sys.executable, os.path.abspath(__file__), "--child", args.cprofile, "--steps",
                        str(args.steps), "--batch", str(args.batch), "--dir", folder, "--cprofile", "x"],
                       check=True, stdout=subprocess.DEVNULL)
        return 0
    variants = _variants(args.variants)
    if "base" not in variants:
        variants.insert(0, "base")
    results: Dict[str, List[Dict[str, Any]]] = {v: [] for v in variants}
    print(f"uptime: {os.getloadavg()}", flush=True)
    for rnd in range(args.rounds):
        order = variants[rnd % len(variants):] + variants[:rnd % len(variants)]
        for v in order:
            r = _run_child(v, args, root)
            results[v].append(r)
            print(f"  round {rnd + 1} {v:14s} loop {r['loop']:6.2f} s  cpu {r['cpu']:6.1f} s  saves {r['saves']}"
                  f"  load {r['load']:.2f}", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(results))
    _report(results, args.rounds)
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
