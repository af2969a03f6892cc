"""How long does a checkpoint stall the training loop, and how long does a resume take?

A ~1 GB training state (two 8192x8192 linear layers plus SGD momentum buffers), saved to a local
folder. Compared:

* stall per save: ``DriveCheckpoint.save()`` (copy to the reused host buffer, write in the background)
  vs ``torch.save`` of the same model + optimizer state (the loop waits for the whole write);
* resume: ``DriveCheckpoint.resume()`` (find newest, verify every byte's checksum, load into the
  objects) vs ``torch.load(mmap=True, weights_only=True)`` + ``load_state_dict`` (no verification).

    python benchmarks/save_stall.py [--size-mb 1024] [--repeat 3] [--dir /tmp/x]

Goals: stall <= 0.15x torch.save; resume <= 1.2x torch.load(mmap=True).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from keepalive.callbacks.torch import DriveCheckpoint  # noqa: E402


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="folder to write to (default: a temp folder)")
    args = ap.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="keepalive-bench-")
    os.makedirs(root, exist_ok=True)
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
    ckpt = DriveCheckpoint(os.path.join(root, "run"), model=model, optimizer=opt, keep=2, quiet=True)
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
    print(f"{'keepalive save: stall (steady)':38s} {stall:8.3f} {gb / stall:7.2f}")
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
