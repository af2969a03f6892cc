"""The memory budget of a save's host copy (keepalive/memory.py) and the saves that stream when a
full copy does not fit (keepalive/hoststream.py).

* The budget's arithmetic, from ``/proc/meminfo`` and cgroup (v2, v1) files given as fixtures: the
  tighter of the machine's and the container's room, minus the margin; ``memory_budget=`` and
  ``KEEPALIVE_MEMORY_BUDGET`` override it.
* A training whose saves stream (a budget too small for a copy; tests/scripts/budget_train.py),
  SIGKILLed after a streamed save and re-run: bit-identical to the same training without keepalive;
  the line that says saves stream, once. Control: the same stream written in the background while
  the loop goes on (no wait) resumes from another state.
* After the loop, the host buffers are given back (a weakref to the full copy's buffer dies); with
  room for a copy (the control) the copy exists while training, with a small budget it never does.
"""
from __future__ import annotations

import gc
import os
import signal
import weakref

import numpy as np
import pytest
import torch

from keepalive import memory
from keepalive.memory import MARGIN_MIN, PIECE_MAX, PIECE_MIN, MemoryBudget, Room
from keepalive.state import from_files
from keepalive.status import format_status
from keepalive.store import CheckpointStore
from keepalive.writer import AsyncWriter
from objectskit import forks_fixture

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "budget_train.py")
GIB = 1 << 30
STREAMED_LINE = "does not fit in the memory a save may use"

forks = forks_fixture()  # a fork server that has imported torch, for the module


# ------------------------------------------------------------------------------------ arithmetic
def _files(root, files):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(root)


def _meminfo(total_gib, available_gib):
    return f"MemTotal: {total_gib * GIB // 1024} kB\nMemFree: 1 kB\nMemAvailable: {available_gib * GIB // 1024} kB\n"


def test_budget_is_the_tighter_room_minus_a_margin(tmp_path, monkeypatch):
    monkeypatch.delenv("KEEPALIVE_MEMORY_BUDGET", raising=False)
    proc = _files(tmp_path / "proc", {"meminfo": _meminfo(16, 10)})
    # no container limit: the machine's available memory, minus a tenth of its RAM
    machine = memory.room(proc, _files(tmp_path / "none", {"memory.max": "max\n"}))
    assert (machine.available, machine.total) == (10 * GIB, 16 * GIB)
    assert machine.for_copies == 10 * GIB - int(1.6 * GIB)
    # cgroup v2: 8 GiB limit, 5 GiB used of which 1 GiB reclaimable page cache -> 4 GiB left
    v2 = _files(tmp_path / "v2", {"memory.max": f"{8 * GIB}\n", "memory.current": f"{5 * GIB}\n",
                                  "memory.stat": f"anon 1\ninactive_file {GIB}\n"})
    room = memory.room(proc, v2)
    assert (room.available, room.total) == (4 * GIB, 8 * GIB) and "cgroup v2" in room.source
    assert room.for_copies == 4 * GIB - int(0.8 * GIB)
    # cgroup v1: 6 GiB limit, 5.5 GiB used, no cache -> 0.5 GiB left: less than the margin
    v1 = _files(tmp_path / "v1", {"memory/memory.limit_in_bytes": f"{6 * GIB}\n",
                                  "memory/memory.usage_in_bytes": f"{11 * GIB // 2}\n",
                                  "memory/memory.stat": "total_inactive_file 0\n"})
    room = memory.room(proc, v1)
    assert (room.available, room.total, room.for_copies) == (GIB // 2, 6 * GIB, 0) and "cgroup v1" in room.source
    # the process's own cgroup (/proc/self/cgroup) when it is not the mount's root: a systemd slice
    nested = _files(tmp_path / "nested", {"job.slice/memory.max": f"{2 * GIB}\n",
                                          "job.slice/memory.current": f"{GIB}\n"})
    own = _files(tmp_path / "proc2", {"meminfo": _meminfo(16, 10), "self/cgroup": "0::/job.slice\n"})
    assert memory.room(own, nested).available == GIB and memory.room(proc, nested).available == 10 * GIB
    # a container limit looser than the machine's room changes nothing; no files: unknown, no limit
    loose = _files(tmp_path / "loose", {"memory.max": f"{64 * GIB}\n", "memory.current": "0\n"})
    assert memory.room(proc, loose).available == 10 * GIB
    unknown = memory.room(str(tmp_path / "nothing"), str(tmp_path / "nothing"))
    assert unknown.for_copies is None and MemoryBudget(room_fn=lambda: unknown).fits(1 << 50)
    assert memory.margin_for(None) == MARGIN_MIN


def test_budget_overrides_reuse_and_piece_size(monkeypatch):
    monkeypatch.delenv("KEEPALIVE_MEMORY_BUDGET", raising=False)
    tight = Room(3 * GIB, 8 * GIB, "fixture")  # 3 GiB available - 0.8 GiB margin
    auto = MemoryBudget(room_fn=lambda: tight)
    assert auto.fits(2 * GIB) and not auto.fits(3 * GIB)
    assert auto.fits(3 * GIB, held=GIB)  # a buffer held already is room: it is reused
    assert "minus a margin" in auto.source()
    monkeypatch.setenv("KEEPALIVE_MEMORY_BUDGET", "1GiB")
    assert auto.limit() == GIB and "KEEPALIVE_MEMORY_BUDGET" in auto.source()
    assert "save mem  a state up to 1.00 GiB" in format_status({"largest_async_save_bytes": MemoryBudget().limit()})
    given = MemoryBudget("512MiB", room_fn=lambda: tight)  # the argument wins over the variable
    assert given.limit(held=GIB) == 512 << 20 and given.source() == "set by memory_budget="
    with pytest.raises(ValueError, match="memory_budget="):
        MemoryBudget("lots")
    assert MemoryBudget.piece_bytes(GIB // 8) == PIECE_MIN
    assert MemoryBudget.piece_bytes(10 << 20) == 10 << 20 and MemoryBudget.piece_bytes(1) == 1 << 20
    assert MemoryBudget.piece_bytes(16 * GIB) == PIECE_MAX
    assert MemoryBudget.piece_bytes(GIB) == GIB // 4


def test_streamed_files_are_the_copied_ones_bit_for_bit(tmp_path):
    """Every kind of leaf a stream meets (own memory, bool and non-contiguous through the bounded
    buffer, numpy, empty) gives the same files as a full copy; a small piece size splits tensors."""
    tree = {"w": torch.randn(3000), "mask": torch.rand(70) > 0.5, "t": torch.randn(40, 30).t(),
            "h": torch.randn(9).to(torch.bfloat16), "np": np.arange(11.0), "none": torch.empty(0), "n": 3}
    streamed = AsyncWriter(CheckpointStore(str(tmp_path / "s")), memory_budget=1)
    copied = AsyncWriter(CheckpointStore(str(tmp_path / "c")))
    for writer in (streamed, copied):
        writer.submit(tree, step=1, epoch=0)
        writer.wait()
    assert streamed.streamed is not None and streamed.streamed.buffered and streamed.snapshot.capacity == 0
    assert copied.streamed is None and copied.snapshot.capacity > 0  # control: room for a copy, a copy
    read = [w.store.read_files(w.store.newest_valid()) for w in (streamed, copied)]
    assert {k: bytes(v) for k, v in read[0].items()} == {k: bytes(v) for k, v in read[1].items()}
    state = from_files(read[0])
    assert all(torch.equal(state[k], tree[k]) for k in ("w", "mask", "t", "h", "none"))
    assert np.array_equal(state["np"], tree["np"])


# --------------------------------------------------------------------- a training that streams
def _run(forks, root, name, *args, killed=False):
    child = forks.spawn([SCRIPT, "--run", str(root / name), "--out", str(root / f"{name}.pt"), *args],
                        dict(os.environ, PYTHONUNBUFFERED="1"))
    out = child.stdout.read()
    child.stdout.close()
    code = child.wait(timeout=120)
    if killed:
        assert code == -signal.SIGKILL and "KILL" in out, f"{name}: not killed ({code}):\n{out[-3000:]}"
    else:
        assert code == 0 and "DONE" in out, f"{name} failed ({code}):\n{out[-3000:]}"
    return out


def test_streamed_saves_resume_bit_exact_and_say_it_once(forks, tmp_path):
    _run(forks, tmp_path, "plain", "--plain")
    plain = torch.load(tmp_path / "plain.pt")
    first = _run(forks, tmp_path, "budget", "--budget", "1", "--kill-at", "5", killed=True)
    assert first.count(STREAMED_LINE) == 1 and "straight from the training's memory" in first  # 2 saves, 1 line
    rest = _run(forks, tmp_path, "budget", "--budget", "1")
    assert "resuming run 'budget'" in rest and "step 4" in rest and "STREAMED HELD 0" in rest
    resumed = torch.load(tmp_path / "budget.pt")
    assert all(torch.equal(plain[k], resumed[k]) for k in plain)
    # control: the same stream written while the loop goes on holds the next step's weights
    _run(forks, tmp_path, "control", "--budget", "1", "--kill-at", "5", "--control", killed=True)
    _run(forks, tmp_path, "control", "--budget", "1", "--control")
    control = torch.load(tmp_path / "control.pt")
    delta = max((plain[k] - control[k]).abs().max().item() for k in plain)
    print(f"control max |delta| = {delta:.3g}")
    assert delta > 0


# ------------------------------------------------------------------------------ buffers released
SEEN: dict = {}


def _train_in_process(run, budget):
    """Three epochs of a model with a 1 MiB state in this process; the host copy held during training
    (read at the last step) and a weakref to it."""
    from keepalive.callbacks.torch import DriveCheckpoint

    torch.manual_seed(0)
    model = torch.nn.Linear(512, 512)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ckpt = DriveCheckpoint(run, model=model, optimizer=opt, every=1, memory_budget=budget, quiet=True)
    held, refs = SEEN["held"], SEEN["refs"] = [], []  # (module-level: no loop variable to put back)
    for epoch in ckpt.epochs(3):
        writer = ckpt.core.writer
        if epoch:  # after the save at the previous epoch's end
            writer.wait()
            SEEN["held"].append(writer.snapshot.capacity)
            if writer.snapshot._buffer is not None:
                SEEN["refs"].append(weakref.ref(writer.snapshot._buffer))
        opt.zero_grad()
        model(torch.randn(4, 512)).sum().backward()
        opt.step()
    ckpt.close()
    return ckpt, held, refs


def test_buffers_are_given_back_after_the_loop(tmp_path):
    ckpt, held, refs = _train_in_process(str(tmp_path / "room"), None)
    size = 512 * 512 * 4 + 512 * 4
    assert held and all(h >= size for h in held) and refs  # control: with room, a full copy while training
    gc.collect()
    assert ckpt.core.writer.snapshot.capacity == 0 and ckpt.core.writer.stream.capacity == 0
    assert all(ref() is None for ref in refs), "the host copy outlived close()"
    ckpt, held, refs = _train_in_process(str(tmp_path / "tight"), "1MiB")
    assert held == [0, 0] and not refs and ckpt.core.writer.streamed is not None  # never a copy
