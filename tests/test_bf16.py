"""bfloat16 and float8 in keepalive's own format: stored and read back bit for bit.

A numpy array of an ``ml_dtypes`` type (what ``np.asarray`` of a bf16 JAX array gives), a numpy scalar
of one, and torch's bf16 / float8 tensors go through a real :class:`~keepalive.core.Checkpointer` save
and a fresh one's load; the lazy snapshot's background copy (:class:`~keepalive.state.PendingCopy`) and
``frozen_copy`` keep them too. Values are compared as their raw bits: NaN payloads, -0.0, infinities and
subnormals. ``keepalive verify``'s code path checks the checkpoint's checksums, and finds a flipped bit.

Controls: a NaN payload or -0.0 passed through float32 (the usual way to "support" bf16) compares
equal by value but differs in its bits, which these comparisons catch.
"""
from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest
import torch

from keepalive import cli
from keepalive.core import Checkpointer
from keepalive.state import HostSnapshot, from_files, frozen_copy

#: bf16 bit patterns a cast would lose: NaNs with payloads (quiet and signalling, both signs), -0.0,
#: +-inf, the smallest subnormal, the largest finite value, ordinary numbers
BF16_BITS = np.array([0x7FC1, 0x7F81, 0xFFA5, 0x8000, 0x0000, 0x7F80, 0xFF80, 0x0001, 0x7F7F, 0x3FC0,
                      0xC049], dtype=np.uint16)
#: every byte: every float8 value (NaNs included)
F8_BITS = np.arange(256, dtype=np.uint8)


def bits(x) -> bytes:
    """The raw bytes of an array, tensor or numpy scalar (the comparison is bitwise, never by value)."""
    if isinstance(x, torch.Tensor):
        return x.contiguous().view(torch.uint8).numpy().tobytes()
    return np.ascontiguousarray(x).tobytes()


def numpy_tree():
    bf16 = BF16_BITS.view(ml_dtypes.bfloat16)
    return {"bf16": bf16.reshape(1, -1), "bf16_2d": np.tile(bf16, (3, 1)), "empty": bf16[:0],
            "scalar": bf16[0], "neg_zero": bf16[3],
            "e4m3": F8_BITS.view(ml_dtypes.float8_e4m3fn), "e5m2": F8_BITS.view(ml_dtypes.float8_e5m2),
            "f32": np.float32([1.5, -0.0])}


def torch_tree():
    bf16 = torch.from_numpy(BF16_BITS.view(np.int16).copy()).view(torch.bfloat16)
    f8 = torch.from_numpy(F8_BITS.copy())
    return {"bf16": bf16, "bf16_2d": bf16.repeat(3, 1), "strided": bf16.repeat(2, 1).t(),
            "e4m3": f8.view(torch.float8_e4m3fn), "e5m2": f8.view(torch.float8_e5m2),
            "dtype": torch.bfloat16}


def assert_bit_exact(saved: dict, loaded: dict) -> None:
    assert set(saved) == set(loaded)
    for key, value in saved.items():
        if isinstance(value, torch.dtype):
            assert loaded[key] is value
            continue
        back = loaded[key]
        assert type(back) is type(value), key  # an ml_dtypes array for a numpy one, a tensor for a tensor
        assert back.dtype == value.dtype and tuple(back.shape) == tuple(value.shape), key
        assert bits(back) == bits(value), f"{key}: bits differ"


def save_and_load(run: str, tree: dict) -> dict:
    ckpt = Checkpointer(run, quiet=True, keep=None)
    ckpt.load()
    ckpt.counters["step"] = 1
    ckpt.save(lambda: {"objects": tree}, reason="test")
    ckpt.writer.wait()
    ckpt.close()
    fresh = Checkpointer(run, quiet=True, keep=None)
    loaded = fresh.load()
    fresh.close()
    assert loaded is not None and loaded["counters"]["step"] == 1
    return loaded["objects"]


def test_numpy_and_torch_bf16_round_trip_bit_exact_and_verify(tmp_path, capsys):
    run = str(tmp_path / "run")
    tree = {"numpy": numpy_tree(), "torch": torch_tree()}
    loaded = save_and_load(run, tree)
    assert_bit_exact(tree["numpy"], loaded["numpy"])
    assert_bit_exact(tree["torch"], loaded["torch"])
    assert isinstance(loaded["numpy"]["scalar"], ml_dtypes.bfloat16)  # a scalar comes back a scalar

    # keepalive verify re-reads every byte against the manifest's checksums
    assert cli.main(["verify", run]) == 0
    assert "all 1 checkpoint(s) verified" in capsys.readouterr().out
    (folder,) = [d for d in os.listdir(run) if d.startswith("ckpt")]
    path = os.path.join(run, folder, "tensors.safetensors")
    with open(path, "r+b") as fh:  # one bit of the last tensor's bytes flipped
        fh.seek(-1, 2)
        last = fh.read(1)[0]
        fh.seek(-1, 2)
        fh.write(bytes([last ^ 0x01]))
    assert cli.main(["verify", run]) == 1
    assert "checksum" in capsys.readouterr().out


def test_lazy_copy_and_frozen_copy_keep_the_bits():
    tree = {"numpy": numpy_tree(), "torch": torch_tree()}
    snap = HostSnapshot()
    files = snap.take(tree, defer=lambda ref: True)  # every torch tensor copied by the background copy
    pending = snap.pending
    assert pending is not None and {t.key for t, _ in pending.items} >= {"torch.bf16", "torch.e4m3"}
    pending.run()
    assert pending.error is None and pending.changed() == []
    header, data = files["tensors.safetensors"]
    raw = bytearray(bytes(header) + bytes(data))
    loaded = from_files({"state.json": files["state.json"], "tensors.safetensors": raw}, copy=True)
    assert_bit_exact(tree["numpy"], loaded["numpy"])
    assert_bit_exact(tree["torch"], loaded["torch"])

    frozen = frozen_copy(tree)
    assert_bit_exact(tree["numpy"], frozen["numpy"])
    assert_bit_exact(tree["torch"], frozen["torch"])
    assert not np.shares_memory(frozen["numpy"]["bf16"], tree["numpy"]["bf16"])


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_control_a_float32_round_trip_is_value_equal_but_not_bit_exact(kind):
    """What a store that cast bf16 through float32 would give back: equal by value (NaN == NaN
    allowed), different in its bits (NaN payloads canonicalised); so the comparisons above are
    bitwise. -0.0 and 0.0 are equal by value too."""
    original = numpy_tree()["bf16"] if kind == "numpy" else torch_tree()["bf16"]
    if kind == "numpy":
        with np.errstate(invalid="ignore"):
            through = original.astype(np.float32).astype(ml_dtypes.bfloat16)
        value_equal = np.array_equal(original.astype(np.float32), through.astype(np.float32), equal_nan=True)
    else:
        through = original.float().bfloat16()
        value_equal = torch.equal(torch.nan_to_num(original.float()), torch.nan_to_num(through.float()))
    assert value_equal and bits(through) != bits(original)
    zero = np.zeros(1, ml_dtypes.bfloat16)
    assert (zero == -zero).all() and bits(zero) != bits(-zero)
