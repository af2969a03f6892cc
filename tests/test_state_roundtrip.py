"""The framework-neutral state format: HostSnapshot().take(tree) -> store.commit -> read_files ->
state.from_files gives back the same tree; tensors.safetensors is a real safetensors file; values
that would need pickle are refused at save time; loading a hostile checkpoint never runs code."""
from __future__ import annotations

import base64
import json
import math
import os
import pickle
import random

import numpy as np
import pytest
import torch

from keepalive import state as ka_state
from keepalive.errors import CheckpointCorruptError, UnsupportedStateError
from keepalive.state import STATE_FILE, TENSOR_FILE, HostSnapshot, from_files, to_files
from keepalive.store import CheckpointStore

# bytes built in tests are read-only; torch warns once when it views them (checkpoint reads are not)
pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")


def sample_tree():
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    lin = torch.nn.Linear(5, 3)
    opt = torch.optim.AdamW(lin.parameters(), lr=1e-3)
    lin(torch.randn(4, 5)).sum().backward()
    opt.step()
    return {
        "model": lin.state_dict(),
        "optimizer": opt.state_dict(),  # int keys (param ids), nested dicts, lists, floats, tensors
        "tensors": {
            "f32": torch.randn(3, 4),
            "f64": torch.randn(2, dtype=torch.float64),
            "f16": torch.randn(5).half(),
            "bf16": torch.randn(7, 3).bfloat16(),
            "i64": torch.arange(-5, 5, dtype=torch.int64),
            "i32": torch.tensor([1, -2, 3], dtype=torch.int32),
            "i8": torch.tensor([-128, 127], dtype=torch.int8),
            "u8": torch.tensor([0, 255], dtype=torch.uint8),
            "bool": torch.tensor([True, False, True]),
            "zero_dim": torch.tensor(3.5),
            "zero_dim_int": torch.tensor(42),
            "empty": torch.empty(0, 3),
            "empty_bf16": torch.empty(0, dtype=torch.bfloat16),
            "transposed": torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
            "with_grad": torch.ones(2, requires_grad=True),
            "rng_cpu": torch.get_rng_state(),
        },
        "arrays": {
            "f32": np.arange(6, dtype=np.float32).reshape(2, 3),
            "f16": np.array([1.5, -2.0], dtype=np.float16),
            "u16": np.array([1, 65535], dtype=np.uint16),
            "bool": np.array([[True], [False]]),
            "zero_dim": np.array(2.25),
            "empty": np.zeros((0, 4), dtype=np.int64),
            "strided": np.arange(20, dtype=np.int32)[::3],
            "c64": np.array([1 + 2j], dtype=np.complex64),
        },
        "np_scalars": [np.float32(1.25), np.float64(2.5), np.int64(-3), np.int32(7), np.bool_(True),
                       np.uint8(200), np.float16(0.5)],
        "python_random": random.getstate(),
        "numpy_random": np.random.get_state(),
        "numpy_generator": np.random.default_rng(3).bit_generator.state,
        "int_keys": {0: "a", 1: {"nested": (1, 2)}, -7: None},
        "mixed_keys": {1: "one", "1": "string one", (2, 3): "tuple key", 2.5: "float key"},
        "marker_like_key": {"__ka_tensor__": "not a reference"},
        "bytes": b"\x00\x01\xffbinary",
        "bytearray": bytearray(b"ba"),
        "nested_tuples": ((1, (2, (3, "x"))), ()),
        "set": {3, 1, 2},
        "floats": [0.1, -0.0, 1e308, float("inf"), float("-inf")],
        "nan": float("nan"),
        "strings": ["", "ünïcode ✓", "line\nbreak"],
        "none": None,
        "bools": [True, False],
        "big_int": 2 ** 62,
        "dtype": torch.float16,
        "list_of_tensors": [torch.zeros(2), torch.ones(2)],
    }


def assert_same(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, (where, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a.detach().cpu(), b), where
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        np.testing.assert_array_equal(a, b)
    elif isinstance(a, np.generic):
        assert type(a) is type(b) and a == b, (where, type(a), type(b))
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a.keys()) == list(b.keys()), (where, a.keys(), b.keys())
        for k in a:
            assert type(k) is type(next(kk for kk in b if kk == k)), (where, k)
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), (where, type(a), type(b))
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, (bytes, bytearray)):
        assert isinstance(b, bytes) and bytes(a) == b, where
    else:
        assert type(a) is type(b) and a == b, (where, a, b)
        if isinstance(a, float):
            assert math.copysign(1, a) == math.copysign(1, b), where


@pytest.fixture
def store(location):
    """A run on each storage kind (local, memory://, gs:// and s3:// servers; see conftest)."""
    s = location.store("run")
    yield s
    s.close()


@pytest.mark.parametrize("copy", [False, True])
def test_round_trip_through_store(store, copy):
    tree = sample_tree()
    snap = HostSnapshot()
    files = snap.take(tree)
    assert set(files) == {STATE_FILE, TENSOR_FILE}
    info = store.commit(files, step=1, epoch=0).info
    loaded = from_files(store.read_files(store.newest_valid()), where=info.url, copy=copy)
    assert_same(tree, loaded)
    # restored RNG states work
    random.setstate(loaded["python_random"])
    np.random.set_state(loaded["numpy_random"])
    torch.set_rng_state(loaded["tensors"]["rng_cpu"])
    gen = np.random.default_rng()
    gen.bit_generator.state = loaded["numpy_generator"]
    # restored model / optimizer state loads into live objects
    lin = torch.nn.Linear(5, 3)
    lin.load_state_dict(loaded["model"])
    opt = torch.optim.AdamW(lin.parameters(), lr=1e-3)
    opt.load_state_dict(loaded["optimizer"])
    assert opt.state_dict()["state"][0]["step"] == tree["optimizer"]["state"][0]["step"]


def test_snapshot_is_a_copy_and_buffer_is_reused(tmp_path):
    t = torch.arange(1000.0)
    snap = HostSnapshot()
    files = snap.take({"t": t})
    t.add_(1)  # training goes on after the snapshot: the snapshot keeps the old values
    store = CheckpointStore(tmp_path / "run")
    store.commit(files, step=1)
    assert torch.equal(from_files(store.read_files(store.newest_valid()))["t"], torch.arange(1000.0))
    cap = snap.capacity
    snap.take({"t": t[:10]})
    assert snap.capacity == cap  # smaller state: same buffer
    snap.take({"t": torch.zeros(5000)})
    assert snap.capacity >= 5000 * 4
    store.close()


def test_safetensors_library_reads_the_file(tmp_path):
    safetensors = pytest.importorskip("safetensors")
    from safetensors import safe_open
    from safetensors.numpy import load as np_load
    from safetensors.torch import load as torch_load

    tree = sample_tree()
    store = CheckpointStore(tmp_path / "run")
    info = store.commit(to_files(tree), step=1).info
    path = os.path.join(info.path, TENSOR_FILE)
    with open(path, "rb") as f:
        raw = f.read()
    loaded = torch_load(raw)
    ours = from_files(store.read_files(info))
    # every tensor and array of the state is in the file under its key
    refs = ka_state.encode(tree)[1]
    assert set(loaded) == {r.key for r in refs}
    assert len(refs) > 30
    for r in refs:
        expected = r.value if r.kind == "torch" else torch.from_numpy(r.value.copy())
        got = loaded[r.key]
        assert got.dtype == expected.dtype and tuple(got.shape) == tuple(expected.shape), r.key
        assert torch.equal(got, expected.detach()), r.key
    assert torch.equal(loaded["tensors.bf16"], ours["tensors"]["bf16"])
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
        assert "keepalive.kinds" in meta
        assert torch.equal(f.get_tensor("tensors.i64"), tree["tensors"]["i64"])
    # the numpy reader too, for the dtypes numpy has
    arrays = np_load(joined(to_files({"a": np.arange(4, dtype=np.int16)}))[TENSOR_FILE])
    np.testing.assert_array_equal(arrays["a"], np.arange(4, dtype=np.int16))
    assert safetensors.__version__
    store.close()


class Custom:
    pass


@pytest.mark.parametrize("value, where, what", [
    (lambda x: x, "['optimizer']['fn']", "function"),
    (Custom(), "['optimizer']['fn']", "Custom"),
    (np.array([object()], dtype=object), "optimizer.fn", "object"),
    (np.complex128(1j), "['optimizer']['fn']", "complex128"),
    (1 + 2j, "['optimizer']['fn']", "complex"),
    (torch.zeros(2, dtype=torch.complex128), "optimizer.fn", "complex128"),
])
def test_values_needing_pickle_are_refused(value, where, what):
    tree = {"model": {"w": torch.ones(2)}, "optimizer": {"lr": 0.1, "fn": value}}
    with pytest.raises(UnsupportedStateError) as exc:
        HostSnapshot().take(tree)
    msg = str(exc.value)
    assert where in msg and what in msg, msg
    assert isinstance(exc.value, TypeError)


def test_refusal_names_location_in_lists_and_tuples():
    with pytest.raises(UnsupportedStateError) as exc:
        to_files({"cbs": [1, (2, Custom())]})
    assert "state['cbs']['1']['1']" in str(exc.value)


class _Boom:
    """Pickles to "create a folder": proof of execution if anything ever unpickled it."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_hostile_checkpoint_cannot_run_code(tmp_path):
    marker = str(tmp_path / "PWNED")
    payload = pickle.dumps(_Boom(marker))
    store = CheckpointStore(tmp_path / "run")
    # a state.json whose values look like pickles, a pickle under a tensor-file name, a .pt file
    state_json = json.dumps({
        "opcode_text": payload.decode("latin-1"),
        "as_bytes": {"__ka_bytes__": base64.b64encode(payload).decode()},
        "reduce": {"__reduce__": ["os.mkdir", [marker]]},
        "py_object": {"py/object": "os.system", "__class__": "subprocess.Popen"},
    }).encode()
    store.commit({STATE_FILE: state_json, "model.pt": payload, "extra.pkl": payload}, step=1)
    files = store.read_files(store.newest_valid())
    loaded = from_files(files)
    assert loaded["as_bytes"] == payload  # just bytes
    assert loaded["reduce"] == {"__reduce__": ["os.mkdir", [marker]]}
    assert isinstance(loaded["opcode_text"], str)
    assert not os.path.exists(marker)

    # a pickle where the safetensors file should be: a clear error, nothing executed
    store.commit({STATE_FILE: b"{}", TENSOR_FILE: payload}, step=2)
    with pytest.raises(CheckpointCorruptError):
        from_files(store.read_files(store.newest_valid()))
    assert not os.path.exists(marker)
    store.close()


@pytest.mark.parametrize("state_json, tensor_file", [
    ({"x": {"__ka_torch_dtype__": "load"}}, None),            # not a dtype: never hand out torch.load
    ({"x": {"__ka_torch_dtype__": "__class__"}}, None),
    ({"x": {"__ka_tensor__": "nope"}}, None),                   # reference to a missing tensor
    ({"x": {"__ka_dict__": [[{"a": 1}, 2]]}}, None),            # unhashable key
    ({"x": {"__ka_dict__": [[1, 2, 3]]}}, None),                # malformed pair
    ({}, {"t": {"dtype": "PICKLE", "shape": [1], "data_offsets": [0, 1]}}),
    ({}, {"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 4]}}),   # shape does not fit
    ({}, {"t": {"dtype": "F32", "shape": [1]}}),                            # no offsets
    ({}, {"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 64]}}),   # outside the file
    ({}, {"t": "not a spec"}),
    ({}, {"t": {"dtype": "F32", "shape": [-1, -2], "data_offsets": [0, 8]}}),   # negative dims
    ({}, {"t": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 6]},       # bf16 "numpy" array
          "__metadata__": {"keepalive.kinds": '{"t": "numpy"}'}}),             # whose bytes do not fit
    ({}, {"__metadata__": {"keepalive.kinds": "not json"}}),
    ({}, ["a", "list"]),
])
def test_malformed_state_is_a_clear_error(state_json, tensor_file):
    files = {STATE_FILE: json.dumps(state_json).encode()}
    if tensor_file is not None:
        header = json.dumps(tensor_file).encode()
        files[TENSOR_FILE] = len(header).to_bytes(8, "little") + header + b"\0" * 8
    with pytest.raises(CheckpointCorruptError):
        from_files(files, where="hostile")


def joined(files):
    """The files of ``to_files`` as one buffer each, as a checkpoint read gives them."""
    return {k: v if isinstance(v, bytes) else b"".join(bytes(p) for p in v) for k, v in files.items()}


def test_in_memory_round_trip_without_a_store():
    tree = sample_tree()
    assert_same(tree, from_files(joined(to_files(tree))))


def test_torch_dtype_values_round_trip():
    for dt in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
        assert from_files(joined(to_files({"d": dt})))["d"] is dt


def test_missing_state_json_is_clear():
    with pytest.raises(CheckpointCorruptError, match="no state.json"):
        from_files({TENSOR_FILE: b""})
    with pytest.raises(CheckpointCorruptError, match="not valid JSON"):
        from_files({STATE_FILE: b"\x80\x04K\x01."})  # a pickle is not JSON
