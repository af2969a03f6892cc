"""How long does a checkpoint stall the training loop, and how long does a resume take?

Stall per save (``snapshot="lazy"`` vs ``snapshot="blocking"`` vs a plain memcpy of the same bytes):
a training state of ``--sizes`` MiB (two square linear layers plus their SGD momentum buffers,
half and half) is saved by hand between training steps of a synthetic loop: the forward and backward
of a matmul (a small parameter in the same optimizer; the large ones get no gradient, so the step
keeps them and its pre-hook is where a lazy copy is waited for) sized to take ~3x the memcpy
("step > copy") or ~0.3x ("step < copy"). Per save:

* ``stall`` = the time inside ``ckpt.save()`` + the excess of the step after it over a clean step
  (the lazy copy is waited for in that step's ``optimizer.step()``);
* ``wait`` = the part of that excess spent waiting in the pre-hook (``AsyncWriter.settle_seconds``);
* ``step x`` = the step after the save without that wait, over a clean step: how much the
  background copy slows the training (goal <= 1.05).

The write to disk is held back until that step is measured (then waited for, outside the timings):
this part measures the copy, not the write (``benchmarks/save_cost.py`` measures the whole cost).
The memcpy is ``np.copyto`` of the state's tensors into a preallocated, touched buffer.

Then, on a ~1 GB state as before:

* ``torch.save`` of the same model + optimizer state (the loop waits for the whole write) and
  keepalive's background write of it;
* resume: ``DriveCheckpoint.resume()`` (find newest, verify every byte's checksum, load into the
  objects) vs ``torch.load(mmap=True, weights_only=True)`` + ``load_state_dict`` (no verification).

    python benchmarks/save_stall.py [--sizes 256,1024] [--size-mb 1024] [--repeat 3] [--dir /tmp/x] [--quick]

Goals: lazy stall <= 0.1x the memcpy when the step is longer than the copy, never above the
blocking copy otherwise; step during the copy <= 1.05x; stall <= 0.15x torch.save;
resume <= 1.2x torch.load(mmap=True). ``--quick``: 256 MiB only, fewer repeats, a 256 MiB resume (< 60 s).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from keepalive.callbacks.torch import DriveCheckpoint  # noqa: E402
from keepalive.config import CheckpointConfig  # noqa: E402

SNAPSHOTS = ["lazy", "blocking"] if "snapshot" in CheckpointConfig.field_names() else []


def build(size_mb: int):
    # model params = half the state, momentum buffers the other half
    n = int(((size_mb / 2) * 2**20 / 4 / 2) ** 0.5)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(n, n, bias=False), torch.nn.Linear(n, n, bias=False))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    return model, opt


def state_bytes(model, opt) -> int:
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for s in opt.state_dict()["state"].values():
        total += sum(v.numel() * v.element_size() for v in s.values() if torch.is_tensor(v))
    return total



# ------------------------------------------------------------------------------- stall per save
def _tensors(model, opt) -> List[torch.Tensor]:
    out = list(model.state_dict().values())
    for s in opt.state_dict()["state"].values():
        out += [v for v in s.values() if torch.is_tensor(v) and v.numel() > 1]
    return out


def memcpy_seconds(tensors: List[torch.Tensor], repeat: int) -> float:
    """A plain copy of the same bytes into a preallocated buffer whose pages are already mapped."""
    total = sum(t.numel() * t.element_size() for t in tensors)
    dst = np.ones(total, dtype=np.uint8)
    times = []
    for _ in range(max(3, repeat)):
        t0 = time.perf_counter()
        at = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            np.copyto(dst[at:at + n], t.detach().reshape(-1).view(torch.uint8).numpy())
            at += n
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class SyntheticStep:
    """A training step whose length we choose: the forward and backward of ``x @ w`` (``w``: a small
    parameter in the same optimizer as the state's), then ``optimizer.step()``."""

    K = 1024

    def __init__(self, opt, seconds: float):
        self.w = torch.nn.Parameter(torch.randn(self.K, self.K) * 0.01)
        opt.add_param_group({"params": [self.w]})
        self.opt = opt
        self.rows = 256
        for _ in range(3):  # the time is not proportional to the rows for small ones: rescale twice
            self.x = torch.randn(self.rows, self.K)
            one = statistics.median(self._time() for _ in range(5))
            self.rows = max(8, int(self.rows * seconds / max(one, 1e-6)))
        self.x = torch.randn(self.rows, self.K)

    def __call__(self) -> float:
        return self._time()

    def _time(self) -> float:
        t0 = time.perf_counter()
        self.w.grad = None
        (self.x @ self.w).square().mean().backward()
        self.opt.step()
        return time.perf_counter() - t0


def measure_stall(model, opt, ratio: float, repeat: int, root: str, copy_s: float,
                  tensors: List[torch.Tensor]) -> Dict[str, Any]:
    """Saves of each snapshot kind, alternating (the load of a shared machine drifts; neighbours see
    the same): per save its stall, its pre-hook wait, the step during the copy; a memcpy next to each."""
    step = SyntheticStep(opt, ratio * copy_s)
    kinds = SNAPSHOTS or ["blocking"]
    ckpts, releases, folders = {}, {}, []
    for kind in kinds:
        folder = tempfile.mkdtemp(prefix=f"stall-{kind}-", dir=root)
        folders.append(folder)
        options = {"snapshot": kind} if SNAPSHOTS else {}
        ckpt = DriveCheckpoint(os.path.join(folder, "run"), model=model, optimizer=opt, keep=2, quiet=True,
                               **options)
        ckpt.resume()
        # hold the write back until the step after the save is measured: this measures the copy
        release = threading.Event()
        commit = ckpt.core.writer.store.commit

        def held_commit(*a: Any, _release: threading.Event = release, _commit: Any = commit, **k: Any) -> Any:
            _release.wait()
            return _commit(*a, **k)

        ckpt.core.writer.store.commit = held_commit  # type: ignore[method-assign]
        ckpts[kind], releases[kind] = ckpt, release
    out: Dict[str, Dict[str, List[float]]] = {k: {"save": [], "stall": [], "wait": [], "during": [],
                                                  "clean": [], "memcpy": []} for k in kinds}
    for i in range(repeat + 1):  # the first save of each maps its host buffer: left out
        order = kinds if i % 2 == 0 else kinds[::-1]
        for kind in order:
            ckpt, writer = ckpts[kind], ckpts[kind].core.writer
            copy = memcpy_seconds(tensors, 1) if i else 0.0
            clean = statistics.median(step() for _ in range(3))
            ckpt.core.counters["step"] = i + 1
            releases[kind].clear()
            writer.settle_seconds = 0.0
            t0 = time.perf_counter()
            ckpt.save()
            saved = time.perf_counter() - t0
            after = step()
            wait = writer.settle_seconds
            releases[kind].set()
            # (not ckpt.flush(): outside a loop it gives the run's lease back, and the next save would
            # take it again, with an fsync, inside the stall)
            writer.wait()
            if i:
                r = out[kind]
                r["save"].append(saved)
                r["stall"].append(saved + after - clean)
                r["wait"].append(wait)
                r["during"].append((after - wait) / clean)
                r["clean"].append(clean)
                r["memcpy"].append(copy)
    for ckpt in ckpts.values():
        ckpt.close()
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
    return out


def stall_table(sizes: List[int], repeat: int, root: str) -> None:
    med = statistics.median
    print(f"\nstall per save (median over {repeat} saves, range in brackets), load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    print(f"{'state':>7s} {'step':>7s} {'memcpy ms':>9s} {'snapshot':>9s} {'step ms':>7s} {'save() ms':>9s} "
          f"{'wait ms':>7s} {'stall ms':>16s} {'x memcpy':>17s} {'step x':>13s}")
    for size in sizes:
        model, opt = build(size)
        for p in model.parameters():
            p.grad = None  # the large parameters keep their values: only the step's own one trains
        tensors = _tensors(model, opt)
        copy_s = memcpy_seconds(tensors, repeat)
        for ratio in (3.0, 0.3):
            label = "> copy" if ratio > 1 else "< copy"
            for kind, r in measure_stall(model, opt, ratio, repeat, root, copy_s, tensors).items():
                st = r["stall"]
                x = [v / c for v, c in zip(st, r["memcpy"])]
                print(f"{size:5d}Mi {label:>7s} {1000 * med(r['memcpy']):9.1f} {kind:>9s} "
                      f"{1000 * med(r['clean']):7.0f} {1000 * med(r['save']):9.1f} {1000 * med(r['wait']):7.1f} "
                      f"{1000 * med(st):6.1f} ({1000 * min(st):4.0f}-{1000 * max(st):4.0f}) "
                      f"{med(x):5.2f} ({min(x):5.2f}-{max(x):5.2f}) "
                      f"{med(r['during']):5.2f} ({min(r['during']):.2f}-{max(r['during']):.2f})", flush=True)
        del model, opt, tensors
    print("stall = save() + (step after it - clean steps before it); wait = in that step's pre-hook; "
          "step x = that step without the wait / clean step; x memcpy: against a memcpy next to each save")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="folder to write to (default: a temp folder)")
    ap.add_argument("--sizes", default="256,1024", help="state sizes (MiB) of the stall per save")
    ap.add_argument("--no-stall", action="store_true", help="skip the stall per save")
    ap.add_argument("--no-resume", action="store_true", help="skip torch.save and the resume")
    ap.add_argument("--quick", action="store_true", help="256 MiB, 2 repeats: < 60 s")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads of the training step (default torch's: every core). Fewer than the "
                         "cores leaves one to the background copy, as a GPU training leaves the CPU")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.sizes, args.repeat, args.size_mb = "256", 4, 256
    root = args.dir or tempfile.mkdtemp(prefix="keepalive-bench-")
    os.makedirs(root, exist_ok=True)
    if not args.no_stall:
        stall_table([int(v) for v in args.sizes.split(",")], args.repeat, root)
    if args.no_resume:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
        return 0
    model, opt = build(args.size_mb)
    nbytes = state_bytes(model, opt)
    print(f"state: {nbytes / 2**30:.2f} GiB ({nbytes / 1e9:.2f} GB) in {root}")

    # -- torch.save: the loop waits for the whole write
    ts = []
    for i in range(args.repeat):
        path = os.path.join(root, f"torch-{i}.pt")
        t0 = time.perf_counter()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
        ts.append(time.perf_counter() - t0)
    torch_save = statistics.median(ts)

    # -- keepalive: the loop waits for the copy into the reused host buffer only
    # the blocking copy: with a lazy one the time inside save() is not the stall (the next step waits
    # for the rest; the table above measures both)
    blocking = {"snapshot": "blocking"} if SNAPSHOTS else {}
    ckpt = DriveCheckpoint(os.path.join(root, "run"), model=model, optimizer=opt, keep=2, quiet=True,
                           **blocking)
    ckpt.resume()
    # One training step's boundary prepares the first save's buffer in the background; a real loop
    # trains on (an epoch, N steps) before its first save. Here we wait for that preparation and
    # report how long it took, in the background.
    t0 = time.perf_counter()
    ckpt.core.path.reserve(ckpt.core.build_tree(ckpt.capture))
    reserving = ckpt.core.writer.snapshot._reserving
    if reserving is not None:
        reserving.join()
    reserve = time.perf_counter() - t0
    stalls, writes = [], []
    for i in range(args.repeat + 1):
        ckpt.core.counters["step"] = i + 1
        t0 = time.perf_counter()
        ckpt.save()
        stalls.append(time.perf_counter() - t0)
        ckpt.flush()
        writes.append(ckpt.core.writer.last_result.seconds)
    ckpt.close()
    first_stall, stall = stalls[0], statistics.median(stalls[1:])
    write = statistics.median(writes[1:])

    # -- resume: until the objects are loaded, and until the first optimizer step has run (which
    # is when torch.load(mmap=True) has actually read the optimizer state it mapped lazily)
    def ours():
        m2 = _like(model)
        o2 = torch.optim.SGD(m2.parameters(), lr=0.01, momentum=0.9)
        c2 = DriveCheckpoint(os.path.join(root, "run"), model=m2, optimizer=o2, quiet=True)
        c2.resume()
        return m2, o2, c2

    def baseline():
        m2 = _like(model)
        o2 = torch.optim.SGD(m2.parameters(), lr=0.01, momentum=0.9)
        sd = torch.load(os.path.join(root, "torch-0.pt"), mmap=True, weights_only=True)
        m2.load_state_dict(sd["model"])
        o2.load_state_dict(sd["opt"])
        return m2, o2, None

    def timed(fn, cold: bool):
        loaded, stepped = [], []
        for _ in range(args.repeat):
            if cold:
                _drop_caches()
            t0 = time.perf_counter()
            m2, o2, c2 = fn()
            loaded.append(time.perf_counter() - t0)
            for p in m2.parameters():
                p.grad = torch.zeros_like(p)
            t1 = time.perf_counter()
            o2.step()
            stepped.append(loaded[-1] + time.perf_counter() - t1)
            if c2 is not None:
                c2.close()
            del m2, o2, c2
        return statistics.median(loaded), statistics.median(stepped)

    ours_resume, ours_step = timed(ours, cold=False)
    torch_load, torch_step = timed(baseline, cold=False)
    cold = _drop_caches()
    if cold:
        ours_cold, _ = timed(ours, cold=True)
        torch_cold, _ = timed(baseline, cold=True)

    gb = nbytes / 1e9
    print(f"{'':38s} {'seconds':>8s} {'GB/s':>7s}")
    print(f"{'torch.save (loop blocked)':38s} {torch_save:8.3f} {gb / torch_save:7.2f}")
    print(f"{'keepalive: buffer prepared (background)':38s} {reserve:8.3f}")
    print(f"{'keepalive save: first stall':38s} {first_stall:8.3f}")
    print(f"{'keepalive stall (steady, blocking)':38s} {stall:8.3f} {gb / stall:7.2f}")
    print(f"{'keepalive background write (fsync)':38s} {write:8.3f} {gb / write:7.2f}")
    print(f"{'torch.load(mmap) + load_state_dict':38s} {torch_load:8.3f} {gb / torch_load:7.2f}")
    print(f"{'keepalive resume (verify + load)':38s} {ours_resume:8.3f} {gb / ours_resume:7.2f}")
    print(f"{'  ... until the first step has run':38s} {torch_step:8.3f}")
    print(f"{'  ... until the first step has run':38s} {ours_step:8.3f}")
    if cold:
        print(f"{'cold page cache: torch.load(mmap)':38s} {torch_cold:8.3f} {gb / torch_cold:7.2f}")
        print(f"{'cold page cache: keepalive resume':38s} {ours_cold:8.3f} {gb / ours_cold:7.2f}")
    print(f"ratio stall / torch.save  = {stall / torch_save:.3f}  "
          f"(goal <= 0.15; first save {first_stall / torch_save:.3f})")
    print(f"ratio resume / torch.load = {ours_resume / torch_load:.3f} loaded, "
          f"{ours_step / torch_step:.3f} to the first step"
          + (f", {ours_cold / torch_cold:.3f} from a cold cache" if cold else "") + "  (goal <= 1.2)")
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def _drop_caches() -> bool:
    """Empty the page cache (root only), so reads come from the disk as after a VM reset."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _like(model):
    n = model[0].weight.shape[0]
    return torch.nn.Sequential(torch.nn.Linear(n, n, bias=False), torch.nn.Linear(n, n, bias=False))


if __name__ == "__main__":
    sys.exit(main())
