"""A checkpoint writer for the crash test (tests/test_store_crash.py); the test SIGKILLs it.

    python tests/crash_writer.py RUN_FOLDER SEED [MAX_STEPS]

Takes the run's writer lease (the previous writer was killed: same host, dead pid), checks that the
newest valid checkpoint loads, then commits states of a few MB with changing content in a loop -
every other state is large (tens of MB) so that writes take tens of milliseconds and kills land
mid-write. Prints, flushing each line:

    READY <step>        lease taken, resuming at <step>
    BEGIN <step>        about to snapshot and commit <step>
    COMMITTED <step>    commit() of <step> returned
"""
from __future__ import annotations

import random
import sys
import zlib

import numpy as np

from keepalive.state import HostSnapshot, from_files
from keepalive.store import CheckpointStore

SMALL = 2 << 20
LARGE = 40 << 20


def make_state(step: int, base: np.ndarray) -> dict:
    size = LARGE if step % 2 else SMALL + (step % 5) * (256 << 10)
    data = base[:size] + np.uint8(step % 251)  # new content every step
    return {
        "step": step,
        "data": data,
        "crc": zlib.crc32(data),
        "weights": {"w": np.full((64, 64), step, dtype=np.float32), "n": np.int64(step)},
        "rng": random.getstate(),
    }


def check_state(state: dict, step: int) -> None:
    """Content check independent of the store's own checksums."""
    assert state["step"] == step, (state["step"], step)
    assert zlib.crc32(np.ascontiguousarray(state["data"])) == state["crc"], f"step {step}: data crc"
    assert float(state["weights"]["w"][0, 0]) == step and int(state["weights"]["n"]) == step


def main() -> None:
    run, seed = sys.argv[1], int(sys.argv[2])
    max_steps = int(sys.argv[3]) if len(sys.argv) > 3 else 10 ** 9
    random.seed(seed)
    base = np.frombuffer(np.random.default_rng(seed).bytes(LARGE), dtype=np.uint8)
    store = CheckpointStore(run, keep=3)
    store.open_for_writing()
    newest = store.newest_valid()
    step = 0
    if newest is not None:
        check_state(from_files(store.read_files(newest)), newest.step)
        step = newest.step + 1
    print(f"READY {step}", flush=True)
    snapshot = HostSnapshot()
    for _ in range(max_steps):
        state = make_state(step, base)
        print(f"BEGIN {step}", flush=True)
        store.commit(snapshot.take(state), step=step, epoch=step // 10)
        print(f"COMMITTED {step}", flush=True)
        step += 1
    store.close()


if __name__ == "__main__":
    main()
