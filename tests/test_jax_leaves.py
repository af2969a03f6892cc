"""JAX arrays as leaves of a saved state: held by reference, copied after the loop went on, bit-exact.

A ``capture()`` may hand the store ``jax.Array`` leaves (float32 with NaN payloads, bf16, int, a typed
key's ``key_data``, a 0-d array): a save through a real :class:`~keepalive.core.Checkpointer` holds them
and leaves their copy to the background (nothing is copied in the loop), a fresh checkpointer reads
them back as numpy arrays with the same bits. An array sharded over 8 host devices (a child process:
the device count is fixed when JAX starts) is gathered to one array.

Donation (``jax.jit(..., donate_argnums=0)`` deletes the step's input buffers), the writer's copy held
until the donating step has run: a save settled before that step is committed with the values of its
step, on CPU (the settle copies the arrays, the step donates them) and on the accelerator path (taken
on CPU: the settle holds the host values, the copy runs after the step, the buffers are donated again
once it let them go); ``frozen_copy`` of arrays survives their donation. The control, a buffer donated
before its copy ran (no settle), drops that save with one line, no JAX traceback, and the previous
checkpoint stays the newest. A deleted array at capture, a typed key and an array of
several processes are refused with one line each. ``import keepalive`` imports neither JAX nor
ml_dtypes.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from keepalive import state as state_mod
from keepalive.core import Checkpointer
from keepalive.errors import UnsupportedStateError
from keepalive.state import HostSnapshot, PendingCopy, encode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

F32_BITS = np.array([0x7FC00001, 0xFF800001, 0x80000000, 0x00000001, 0x3F800000], dtype=np.uint32)
BF16_BITS = np.array([0x7FC1, 0xFFA5, 0x8000, 0x0001, 0x3FC0, 0x7F80], dtype=np.uint16)


def jax_tree():
    key = jax.random.key(7)
    return {"f32": jnp.asarray(F32_BITS.view(np.float32)).reshape(1, 5),
            "bf16": jnp.asarray(BF16_BITS.view(ml_dtypes.bfloat16)),
            "int": jnp.arange(6, dtype=jnp.int32).reshape(2, 3),
            "key_data": jax.random.key_data(key),
            "scalar": jnp.asarray(3.25, jnp.bfloat16),
            "empty": jnp.zeros((0, 4), jnp.float32),
            "plain": np.float32([1.0, -0.0])}


def bits(x) -> bytes:
    return np.ascontiguousarray(np.asarray(x)).tobytes()


def expected(tree: dict) -> dict:
    """The host values of a tree, taken before anything can donate its buffers."""
    return {k: (np.asarray(v).dtype, np.shape(v), bits(v)) for k, v in tree.items()}


def assert_same(want: dict, loaded: dict) -> None:
    assert set(want) == set(loaded)
    for key, (dtype, shape, raw) in want.items():
        back = loaded[key]
        assert isinstance(back, np.ndarray), key  # JAX leaves come back as host arrays
        assert back.dtype == dtype and back.shape == shape and bits(back) == raw, key


def lazy_checkpointer(run: str) -> Checkpointer:
    """A checkpointer whose saves leave JAX leaves to the background copy, as the JAX adapter's do
    (a lazy source registered: the loop settles the copy before its next step)."""
    ckpt = Checkpointer(run, quiet=True, keep=None)
    ckpt.load()
    ckpt.lazy_sources.append(lambda: ())
    return ckpt


def save(ckpt: Checkpointer, step: int, tree: dict) -> None:
    ckpt.counters["step"] = step
    ckpt.save(lambda: {"objects": tree}, reason="test")


def newest(run: str) -> dict:
    fresh = Checkpointer(run, quiet=True, keep=None)
    loaded = fresh.load()
    fresh.close()
    assert loaded is not None
    return loaded


def donating_step():
    return jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)


def test_jax_leaves_are_copied_in_the_background_and_read_back_bit_exact(tmp_path):
    run = str(tmp_path / "run")
    tree = jax_tree()
    want = expected(tree)
    ckpt = lazy_checkpointer(run)
    save(ckpt, 1, tree)
    pending = ckpt.writer.snapshot.pending
    assert pending is not None  # every non-empty JAX leaf waits for the writer's thread
    assert {t.key for t, _ in pending.items} == {f"objects.{k}" for k in ("f32", "bf16", "int", "key_data",
                                                                           "scalar")}
    ckpt.settle_snapshot()
    ckpt.writer.wait()
    ckpt.close()
    loaded = newest(run)
    assert loaded["counters"]["step"] == 1
    assert_same(want, loaded["objects"])

    # without a lazy snapshot (a plain HostSnapshot) they are copied at once, the same bits
    snap = HostSnapshot()
    files = snap.take({"objects": tree})
    assert snap.pending is None
    header, data = files["tensors.safetensors"]
    back = state_mod.from_files({"state.json": files["state.json"],
                                 "tensors.safetensors": bytearray(bytes(header) + bytes(data))}, copy=True)
    assert_same(want, back["objects"])


def hold_copies(monkeypatch) -> threading.Event:
    """Make the writer's copy of the next saves wait until the returned event is set (until the loop
    has run its donating step)."""
    release = threading.Event()
    original = PendingCopy.run

    def held(self):
        assert release.wait(30)
        original(self)

    monkeypatch.setattr(PendingCopy, "run", held)
    return release


@pytest.mark.parametrize("where", ["cpu", "accelerator"])
def test_a_save_settled_before_the_donating_step_is_committed(tmp_path, monkeypatch, where):
    """The writer's copy is held until the donating step has run. On CPU the settle copies the arrays
    itself and the step donates their buffers; on an accelerator (the same path, its arrays taken as
    not in host memory) the settle holds their host values and the copy runs after the step. Both
    commit the values of the saved step."""
    if where == "accelerator":
        monkeypatch.setattr(state_mod, "_in_host_memory", lambda a: False)
    run = str(tmp_path / "run")
    tree = {k: v for k, v in jax_tree().items() if k != "plain"}
    want = expected(tree)
    ckpt = lazy_checkpointer(run)
    release = hold_copies(monkeypatch)
    save(ckpt, 1, tree)
    ckpt.settle_snapshot()          # the adapter's step boundary, before the next step runs
    step = donating_step()
    after = step(tree)
    # on CPU the buffers were copied and donated; a held host value (a view on this CPU stand-in)
    # keeps JAX from donating its buffer until the copy let it go
    assert tree["f32"].is_deleted() == (where == "cpu")
    release.set()
    ckpt.writer.wait()
    ckpt.close()
    assert_same(want, newest(run)["objects"])
    assert bits(after["int"]) != want["int"][2]
    frozen = state_mod.frozen_copy(after)  # a copy of its own: the next donation leaves it alone
    step(after)                     # nothing held any more: donated again
    assert after["f32"].is_deleted()
    stepped_once = np.frombuffer(want["int"][2], np.int32).reshape(2, 3) + 1
    assert not frozen["f32"].is_deleted() and bits(frozen["int"]) == bits(stepped_once)


def test_control_a_buffer_donated_before_its_copy_drops_the_save_in_one_line(tmp_path, monkeypatch, capsys):
    run = str(tmp_path / "run")
    tree = jax_tree()
    ckpt = lazy_checkpointer(run)
    save(ckpt, 1, tree)
    ckpt.settle_snapshot()
    ckpt.writer.wait()

    release = hold_copies(monkeypatch)
    save(ckpt, 2, tree)
    donating_step()({k: v for k, v in tree.items() if k != "plain"})  # no settle first: the misuse
    release.set()
    ckpt.writer.wait()  # the write failed; training would go on
    err = capsys.readouterr().err
    assert "was deleted before the checkpoint copied it" in err and "donate_argnums" in err
    assert "Traceback" not in err and len([line for line in err.splitlines() if "deleted" in line]) == 1
    assert newest(run)["counters"]["step"] == 1  # the previous checkpoint stays the newest

    with pytest.raises(UnsupportedStateError, match="objects.f32 was deleted"):  # met at capture
        save(ckpt, 3, tree)
    ckpt.close()


def test_keys_and_arrays_of_several_processes_are_refused_in_one_line(monkeypatch):
    with pytest.raises(UnsupportedStateError, match=r"typed PRNG key .*jax.random.key_data"):
        encode({"rng": jax.random.key(0)})

    class OtherProcesses:  # what a jax.distributed array sharded over several hosts answers
        dtype, shape, nbytes = np.dtype(np.float32), (8,), 32
        is_fully_addressable = False

        def is_deleted(self) -> bool:
            return False

    is_jax = state_mod._is_jax_array
    monkeypatch.setattr(state_mod, "_is_jax_array", lambda x: isinstance(x, OtherProcesses) or is_jax(x))
    with pytest.raises(UnsupportedStateError, match=r"w is sharded over several processes .*Orbax"):
        encode({"w": OtherProcesses()})


SHARDED = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, ml_dtypes, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from keepalive.core import Checkpointer
    assert jax.device_count() == 8, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    rows = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    tree = {"rows": jax.device_put(rows, NamedSharding(mesh, P("data"))),
            "bf16": jax.device_put(rows.astype(ml_dtypes.bfloat16), NamedSharding(mesh, P("data"))),
            "replicated": jax.device_put(rows[0], NamedSharding(mesh, P()))}
    assert len(tree["rows"].addressable_shards) == 8
    ckpt = Checkpointer(sys.argv[1], quiet=True, keep=None)
    ckpt.load()
    ckpt.lazy_sources.append(lambda: ())
    ckpt.counters["step"] = 4
    ckpt.save(lambda: {"objects": tree}, reason="test")
    ckpt.settle_snapshot()
    ckpt.writer.wait()
    ckpt.close()
    back = Checkpointer(sys.argv[1], quiet=True, keep=None).load()["objects"]
    for name, value in tree.items():
        host = np.asarray(value)
        assert back[name].shape == host.shape and back[name].dtype == host.dtype, name
        assert back[name].tobytes() == host.tobytes(), name
    print("sharded ok")
""")


def test_an_array_sharded_over_8_host_devices_is_gathered(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-c", SHARDED, str(tmp_path / "run")], env=env, cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "sharded ok" in done.stdout, done.stderr[-3000:]


def test_importing_keepalive_imports_neither_jax_nor_ml_dtypes():
    code = ("import sys, numpy as np, keepalive, keepalive.core, keepalive.state as s\n"
            "s.to_files({'w': np.ones(3, np.float32)})\n"
            "print(sorted(m for m in ('jax', 'jaxlib', 'ml_dtypes', 'flax', 'optax') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr[-2000:]
