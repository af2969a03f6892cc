"""Write throughput of the checkpoint store against plain writes and torch.save, and checksum speed.

    python benchmarks/store_throughput.py [--size-mb 1024] [--repeat 5] [--dir /some/tmp]

Builds a training-like state of ``--size-mb`` MB (torch float32 / bfloat16 / int64 tensors of
several sizes), then times, on a local folder (a fresh temp dir unless ``--dir``):

* ``store commit``       CheckpointStore.commit of the HostSnapshot files, fsync on (as in production)
                         (its CPU time is the writing thread's, ``WriteResult.cpu_seconds``)
* ``store commit, page-aligned header``  the same with the safetensors header padded to 4 KiB, so the
                         snapshot buffer is page-aligned in the file and goes with O_DIRECT (shown
                         only while ``keepalive.state`` pads the header to less)
* ``snapshot+commit``    the same plus HostSnapshot.take (the copy to host memory that blocks training)
* ``write() + fsync``    the same bytes with plain ``write()`` in 64 MB pieces, then fsync
* ``write()``            the same without fsync (page cache only)
* ``torch.save + fsync`` torch.save of the same state, then fsync
* ``torch.save``         without fsync

and checksum throughput of xxh3_64, zlib.crc32 and sha256 over the same bytes. Each figure is the
best of ``--repeat`` rounds (the methods take turns within a round). Prints a table, the ratio
store / plain write (goal: >= 0.9x) and the writing thread's CPU seconds per GiB (what a background
write takes from a training whose cores are all busy), best and median round, side by side.
On a shared VM the figures vary a lot from run to run (page-cache allocation, other writers): the
methods take turns within each round, and both the best and the median round are shown.
Not part of the test suite.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import shutil
import statistics
import struct
import sys
import tempfile
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from keepalive.state import HostSnapshot  # noqa: E402
from keepalive.store import WRITE_CHUNK, CheckpointStore  # noqa: E402

MB = 1_000_000


def make_state(size_mb: int):
    """About ``size_mb`` MB of tensors shaped like a model + optimizer state."""
    import torch

    g = torch.Generator().manual_seed(0)
    total = size_mb * MB
    state = {"model": {}, "optimizer": {"state": {}, "param_groups": [{"lr": 1e-3, "params": []}]},
             "epoch": 3, "step": 12345}
    # 2/3 fp32 weights + moments, a little bf16 and int64; big and small tensors mixed
    sizes = [64 * MB, 16 * MB, 4 * MB, 1 * MB, 256_000]
    used, i = 0, 0
    while used < total:
        nbytes = min(sizes[i % len(sizes)], total - used)
        if i % 7 == 6:
            t = torch.randint(0, 1 << 40, (max(nbytes // 8, 1),), generator=g, dtype=torch.int64)
        elif i % 5 == 4:
            t = torch.randn(max(nbytes // 2, 1), generator=g).bfloat16()
        else:
            t = torch.randn(max(nbytes // 4, 1), generator=g)
        if i % 3 == 0:
            state["model"][f"layer{i}.weight"] = t
        else:
            state["optimizer"]["state"][i] = {"exp_avg": t, "step": torch.tensor(float(i))}
        used += t.numel() * t.element_size()
        i += 1
    return state


def flat_bytes(files) -> int:
    n = 0
    for content in files.values():
        parts = [content] if isinstance(content, (bytes, bytearray, memoryview)) else content
        n += sum(memoryview(p).nbytes for p in parts)
    return n


def page_aligned_header(files):
    """``files`` with the tensor file's safetensors header padded (JSON whitespace) to a whole page,
    or ``files`` itself when it is already: what lets the store write the snapshot buffer with
    O_DIRECT (its data must start page-aligned in the file as it does in memory)."""
    header, buffer = files["tensors.safetensors"]
    if len(header) % 4096 == 0:
        return files
    body = bytes(header[8:]).rstrip(b" ")
    body += b" " * (-(len(body) + 8) % 4096)
    return {**files, "tensors.safetensors": [struct.pack("<Q", len(body)) + body, buffer]}


def plain_write(path: str, files, fsync: bool) -> None:
    """The same bytes in the same files, written the simplest way: write() in 64 MB pieces."""
    os.makedirs(path, exist_ok=True)
    for name, content in files.items():
        parts = [content] if isinstance(content, (bytes, bytearray, memoryview)) else content
        with open(os.path.join(path, name), "wb", buffering=0) as f:
            for p in parts:
                view = memoryview(p).cast("B")
                for i in range(0, len(view), WRITE_CHUNK):
                    f.write(view[i:i + WRITE_CHUNK])
            if fsync:
                os.fsync(f.fileno())


def torch_save(path: str, state, fsync: bool) -> None:
    import torch

    with open(path, "wb") as f:
        torch.save(state, f)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def timed(fn, repeat: int, cleanup=None) -> float:
    best = float("inf")
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        if cleanup:
            cleanup()
    return best


def checksum_speeds(buf: memoryview, repeat: int):
    import xxhash

    chunk = 64 << 20

    def xxh():
        h = xxhash.xxh3_64()
        for i in range(0, len(buf), chunk):
            h.update(buf[i:i + chunk])
        return h.hexdigest()

    def crc():
        v = 0
        for i in range(0, len(buf), chunk):
            v = zlib.crc32(buf[i:i + chunk], v)
        return v

    def sha():
        h = hashlib.sha256()
        for i in range(0, len(buf), chunk):
            h.update(buf[i:i + chunk])
        return h.hexdigest()

    return {"xxh3_64": timed(xxh, repeat), "zlib.crc32": timed(crc, repeat), "sha256": timed(sha, repeat)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=1024, help="state size in MB (default 1024)")
    ap.add_argument("--repeat", type=int, default=5, help="rounds (each method once per round); best and median shown")
    ap.add_argument("--dir", default=None, help="folder to write in (default: a new temp dir)")
    ap.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every round's time")
    args = ap.parse_args(argv)

    import torch

    base = tempfile.mkdtemp(prefix="ka-bench-", dir=args.dir)
    try:
        t0 = time.perf_counter()
        state = make_state(args.size_mb)
        snap = HostSnapshot()
        t_snap = timed(lambda: snap.take(state), args.repeat)
        files = snap.take(state)
        nbytes = flat_bytes(files)
        print(f"state: {nbytes / MB:,.0f} MB in {sum(1 for _ in _tensors(state))} tensors "
              f"(built in {time.perf_counter() - t0:.1f} s); folder {base}; best of {args.repeat}; "
              f"torch {torch.__version__}, {os.cpu_count()} CPUs")

        counter = iter(range(10 ** 6))
        stores = []

        def new_store():
            s = CheckpointStore(os.path.join(base, f"store{next(counter)}", "run"), keep=3, fsync=True)
            s.open_for_writing()  # lease and run folder: once per session, not per checkpoint
            stores.append(s)
            return s

        def clean():
            for s in stores:
                s.close()
            stores.clear()
            for name in os.listdir(base):
                p = os.path.join(base, name)
                shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
            os.sync()  # settle deletes and writeback here, not inside the next measurement
            time.sleep(0.2)

        def store_commit():
            s = new_store()
            t = time.perf_counter()
            result = s.commit(files, step=1)
            return time.perf_counter() - t, result.cpu_seconds

        aligned_files = page_aligned_header(files)

        def store_commit_aligned():
            s = new_store()
            t = time.perf_counter()
            result = s.commit(aligned_files, step=1)
            return time.perf_counter() - t, result.cpu_seconds

        def snapshot_commit():
            s = new_store()
            t, cpu = time.perf_counter(), time.thread_time()
            s.commit(snap.take(state), step=1)
            return time.perf_counter() - t, time.thread_time() - cpu

        def clock(fn):
            def run():
                t, cpu = time.perf_counter(), time.thread_time()
                fn()
                return time.perf_counter() - t, time.thread_time() - cpu
            return run

        methods = {
            "store commit (fsync)": store_commit,
            "store, page-aligned header": store_commit_aligned,
            "snapshot + store commit": snapshot_commit,
            "write() + fsync": clock(lambda: plain_write(os.path.join(base, "plain"), files, True)),
            "write(), no fsync": clock(lambda: plain_write(os.path.join(base, "plain"), files, False)),
            "torch.save + fsync": clock(lambda: torch_save(os.path.join(base, "t.pt"), state, True)),
            "torch.save, no fsync": clock(lambda: torch_save(os.path.join(base, "t.pt"), state, False)),
        }
        if aligned_files is files:
            del methods["store, page-aligned header"]
        # warm-up: the first large write on a VM disk is often much slower than the next ones
        plain_write(os.path.join(base, "warmup"), files, True)
        clean()
        # rounds interleave the methods, so a slow phase of the machine hits them all alike
        times: dict = {name: [] for name in methods}
        cpus: dict = {name: [] for name in methods}
        names = list(methods)
        for r in range(args.repeat):
            for name in names[r % len(names):] + names[:r % len(names)]:  # rotate: no favoured slot
                gc.collect()
                wall, cpu = methods[name]()
                times[name].append(wall)
                cpus[name].append(cpu)
                clean()
        results = {name: min(t) for name, t in times.items()}
        results["HostSnapshot.take (copy)"] = min(t_snap, timed(lambda: snap.take(state), args.repeat))
        if args.verbose:
            for name, t in times.items():
                print(f"  {name:<26} " + " ".join(f"{x:.3f}" for x in t)
                      + "   cpu " + " ".join(f"{x:.3f}" for x in cpus[name]))

        sums = checksum_speeds(memoryview(files["tensors.safetensors"][1]), args.repeat)
        sum_bytes = memoryview(files["tensors.safetensors"][1]).nbytes

        gib = nbytes / (1 << 30)
        print()
        print(f"{'operation':<28} {'best s':>8} {'GB/s':>7} {'median s':>9} {'GB/s':>7}"
              f" {'CPU s/GiB best':>15} {'median':>7}")
        print("-" * 87)
        for name, sec in results.items():
            med = statistics.median(times[name]) if name in times else sec
            cpu_col = ""
            if name in cpus:
                cpu_col = f" {min(cpus[name]) / gib:>15.3f} {statistics.median(cpus[name]) / gib:>7.3f}"
            print(f"{name:<28} {sec:>8.3f} {nbytes / sec / 1e9:>7.2f} {med:>9.3f} {nbytes / med / 1e9:>7.2f}"
                  + cpu_col)
        for name, sec in sums.items():
            print(f"{'checksum ' + name:<28} {sec:>8.3f} {sum_bytes / sec / 1e9:>7.2f}")
        print()
        store_tp = nbytes / results["store commit (fsync)"]
        ratios = {
            "store / write()+fsync": store_tp / (nbytes / results["write() + fsync"]),
            "store / write() no fsync": store_tp / (nbytes / results["write(), no fsync"]),
            "store / torch.save+fsync": store_tp / (nbytes / results["torch.save + fsync"]),
            "snapshot+store / write()+fsync": results["write() + fsync"] / results["snapshot + store commit"],
            "xxh3 share of store commit": sums["xxh3_64"] / results["store commit (fsync)"],
        }
        for name, r in ratios.items():
            print(f"{name:<32} {r:>6.2f}{'x' if 'share' not in name else ''}")
        ratios["median: store / write()+fsync"] = (statistics.median(times["write() + fsync"])
                                                   / statistics.median(times["store commit (fsync)"]))
        if "store, page-aligned header" in times:
            ratios["aligned store / write()+fsync"] = results["write() + fsync"] / results["store, page-aligned header"]
            ratios["median: aligned store / write()+fsync"] = (
                statistics.median(times["write() + fsync"]) / statistics.median(times["store, page-aligned header"]))
            for name in ("aligned store / write()+fsync", "median: aligned store / write()+fsync"):
                print(f"{name:<32} {ratios[name]:>6.2f}x")
        print(f"{'median: store / write()+fsync':<32} {ratios['median: store / write()+fsync']:>6.2f}x")
        cpu_per_gib = {name: {"best": min(c) / gib, "median": statistics.median(c) / gib}
                       for name, c in cpus.items()}
        store_cpu, raw_cpu = cpu_per_gib["store commit (fsync)"], cpu_per_gib["write() + fsync"]
        goal = ratios["store / write()+fsync"]
        print(f"\nstore / write()+fsync (like with like, both fsync'ed; goal >= 0.9x): "
              f"best {goal:.2f}x, median {ratios['median: store / write()+fsync']:.2f}x "
              f"({'met' if goal >= 0.9 else 'NOT met'}); writer CPU s/GiB: store best "
              f"{store_cpu['best']:.3f} median {store_cpu['median']:.3f}, write()+fsync best "
              f"{raw_cpu['best']:.3f} median {raw_cpu['median']:.3f}")
        if "store, page-aligned header" in cpu_per_gib:
            aligned = cpu_per_gib["store, page-aligned header"]
            print(f"page-aligned header (O_DIRECT): store / write()+fsync best "
                  f"{ratios['aligned store / write()+fsync']:.2f}x, median "
                  f"{ratios['median: aligned store / write()+fsync']:.2f}x; writer CPU s/GiB best "
                  f"{aligned['best']:.3f} median {aligned['median']:.3f}")
        if args.json:
            print(json.dumps({"bytes": nbytes, "seconds": results, "rounds": times, "cpu_rounds": cpus,
                              "cpu_seconds_per_gib": cpu_per_gib, "checksum_seconds": sums,
                              "ratios": ratios}))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


def _tensors(tree):
    import torch

    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)


if __name__ == "__main__":
    sys.exit(main())
