"""The framework-internals inventories (``keepalive/callbacks/_compat_*.py``) and their check.

For each framework: every listed internal exists in the installed version; an internal taken away
(a method deleted, a walked function replaced by one without the frame variable) makes creating the
callback fail at once with one line naming it, the version and the tested range; the inventory and the
adapters' sources agree both ways (every entry is used where it says, every private name an adapter
reaches for is listed); the extras in pyproject.toml accept exactly the tested ranges. No training.
"""
from __future__ import annotations

import ast
import importlib
import importlib.metadata
import importlib.util
import os
import re
import sys
from typing import Dict, List, Set

import pytest

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CALLBACKS = os.path.join(ROOT, "keepalive", "callbacks")


def _load_torchvision_shim() -> None:
    """The CUDA torchvision of this test machine needs its op schemas before it is imported
    (transformers and lightning import it): the test-only shim of tests/shims."""
    spec = importlib.util.spec_from_file_location("_keepalive_tv_shim", os.path.join(HERE, "shims", "sitecustomize.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_load_torchvision_shim()

from keepalive.callbacks._compat import Framework, Internal, Package  # noqa: E402
from keepalive.errors import IncompatibleFrameworkError  # noqa: E402

#: framework -> (its inventory module, its adapter's files)
FRAMEWORKS = {
    "keras": ("keepalive.callbacks._compat_keras", ("keras.py", "_keras_state.py", "_keras_data.py",
                                                    "_keras_stages.py", "_keras_input.py")),
    "fastai": ("keepalive.callbacks._compat_fastai", ("fastai.py", "_fastai_state.py", "_fastai_data.py",
                                                      "_fastai_fits.py", "_fastai_resume.py", "_fastai_capture.py")),
    "transformers": ("keepalive.callbacks._compat_transformers", ("transformers.py", "_hf_data.py", "_hf_state.py",
                                                                  "_hf_position.py", "_hf_resume.py",
                                                                  "_hf_messages.py", "_hf_best.py", "_hf_restore.py",
                                                                  "_hf_counters.py")),
    "lightning": ("keepalive.callbacks._compat_lightning", ("lightning.py", "_lightning_state.py",
                                                            "_lightning_data.py", "_lightning_attach.py",
                                                            "_lightning_fit.py", "_lightning_validation.py",
                                                            "_lightning_messages.py")),
    "jax": ("keepalive.callbacks._compat_jax", ("jax.py", "_jax_objects.py", "_jax_arrays.py", "_jax_data.py",
                                                "_jax_loop.py", "_jax_orbax.py")),
}
#: the framework module to import first (skip the framework's tests where it is not installed)
_NEEDS = {"keras": "keras", "fastai": "fastai", "transformers": "transformers", "lightning": "lightning.pytorch",
          "jax": "flax.nnx"}


def _compat(name: str) -> Framework:
    pytest.importorskip(_NEEDS[name])
    return importlib.import_module(FRAMEWORKS[name][0]).COMPAT


@pytest.fixture(autouse=True)
def fresh_verdicts():
    """Each test checks afresh (the verdict is otherwise kept for the process), and leaves none behind."""
    def reset() -> None:
        for module, _ in FRAMEWORKS.values():
            if module in sys.modules:
                sys.modules[module].COMPAT.reset()
    reset()
    yield
    reset()


def _source(file: str) -> str:
    with open(os.path.join(CALLBACKS, file), encoding="utf-8") as f:
        return f.read()


def _one_line_refusal(exc: IncompatibleFrameworkError, compat: Framework, needs: str) -> str:
    text = str(exc)
    pkg = next(iter(compat.packages.values()))
    assert "\n" not in text, text
    assert text.startswith(f"keepalive's {compat.name} adapter needs "), text
    assert needs in text, text
    assert f"{pkg.name} {compat.version(pkg.name)} lacks" in text, text
    assert f"tested with {pkg.name}{pkg.tested}" in text, text
    assert needs in exc.missing or any(needs in m for m in exc.missing), exc.missing
    return text


# ------------------------------------------------------------------------------ the installed versions
@pytest.mark.parametrize("name", list(FRAMEWORKS))
def test_every_listed_internal_exists_in_the_installed_version(name):
    compat = _compat(name)
    assert compat.internals, name
    missing = compat.missing(required_only=False)  # the optional ones too: they must be real names
    assert missing == [], [i.name for i in missing]
    compat.check()


@pytest.mark.parametrize("name", list(FRAMEWORKS))
def test_inventory_entries_are_well_formed(name):
    compat = _compat(name)
    names = [i.name for i in compat.internals]
    assert len(names) == len(set(names)), "duplicate names"
    for item in compat.internals:
        assert item.file in FRAMEWORKS[name][1], f"{item.name}: {item.where} is not one of the adapter's files"
        assert item.what and item.text
        assert compat.package_of(item).name in compat.packages


# ------------------------------------------------------------------------------ refusal at creation
def test_transformers_without_run_epoch_is_refused_at_callback_creation(tmp_path, monkeypatch):
    compat = _compat("transformers")
    from transformers import Trainer

    from keepalive.callbacks.transformers import DriveCheckpoint

    monkeypatch.delattr(Trainer, "_run_epoch")
    with pytest.raises(IncompatibleFrameworkError) as info:
        DriveCheckpoint(str(tmp_path / "run"))
    text = _one_line_refusal(info.value, compat, "Trainer._run_epoch")
    assert 'pip install "transformers>=5.3,<6"' in text
    assert not (tmp_path / "run").exists()  # refused before anything was made


def _rename_away(monkeypatch, cls, attr: str) -> List[str]:
    """Make ``cls`` look like a release that renamed the attribute ``attr``: every method of its MRO
    whose code reads or sets it is replaced (on ``cls``) by a stub."""
    from keepalive.callbacks._compat import code_names

    gone = []
    for klass in cls.__mro__:
        for n, f in vars(klass).items():
            if callable(f) and not isinstance(f, type) and attr in code_names(f) and n not in gone:
                monkeypatch.setattr(cls, n, lambda self, *a, **k: None)
                gone.append(n)
    assert gone, attr
    return gone


def test_transformers_private_attribute_gone_is_named(tmp_path, monkeypatch):
    compat = _compat("transformers")
    import transformers

    from keepalive.callbacks.transformers import DriveCheckpoint

    _rename_away(monkeypatch, transformers.Trainer, "_tr_loss")
    monkeypatch.setattr(transformers, "__version__", "6.0.1")
    with pytest.raises(IncompatibleFrameworkError) as info:
        DriveCheckpoint(str(tmp_path / "run"))
    text = _one_line_refusal(info.value, compat, "Trainer._tr_loss")
    assert "which transformers 6.0.1 lacks (tested with transformers>=5.3,<6)" in text


def test_keras_fit_without_the_walked_frame_variable_is_refused(tmp_path, monkeypatch):
    compat = _compat("keras")
    import keras

    from keepalive.callbacks.keras import DriveCheckpoint

    def fit(self, x=None, y=None, epochs=1, callbacks=None, initial_epoch=0):  # no epoch_iterator local
        return self._initial_epoch or initial_epoch

    monkeypatch.setattr(keras.Model, "fit", fit)
    with pytest.raises(IncompatibleFrameworkError) as info:
        DriveCheckpoint(str(tmp_path / "run"))
    text = _one_line_refusal(info.value, compat, "Model.fit local 'epoch_iterator'")
    assert "local 'callbacks'" not in text


def test_keras_private_callback_attribute_gone_is_refused(tmp_path, monkeypatch):
    compat = _compat("keras")
    import keras

    from keepalive.callbacks.keras import DriveCheckpoint

    _rename_away(monkeypatch, keras.callbacks.ModelCheckpoint, "_current_epoch")
    with pytest.raises(IncompatibleFrameworkError) as info:
        DriveCheckpoint(str(tmp_path / "run"))
    text = _one_line_refusal(info.value, compat, "ModelCheckpoint._current_epoch")
    assert "_last_batch_seen" not in text


def test_keras_optional_internal_gone_is_not_refused(tmp_path, monkeypatch):
    compat = _compat("keras")
    from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter

    from keepalive.callbacks.keras import DriveCheckpoint

    monkeypatch.delattr(PyDatasetAdapter, "_finite_generator")  # ResumableData falls back to epoch ends, said
    assert [i.name for i in compat.missing(required_only=False)] == ["PyDatasetAdapter._finite_generator"]
    DriveCheckpoint(str(tmp_path / "run")).close()


def test_fastai_without_with_events_is_refused(tmp_path, monkeypatch):
    compat = _compat("fastai")
    from fastai.learner import Learner

    from keepalive.callbacks.fastai import DriveCheckpoint

    monkeypatch.delattr(Learner, "_with_events")
    with pytest.raises(IncompatibleFrameworkError) as info:
        DriveCheckpoint(str(tmp_path / "run"))
    _one_line_refusal(info.value, compat, "Learner._with_events")


def test_fastai_fine_tune_without_its_frame_variable_is_refused(tmp_path, monkeypatch):
    compat = _compat("fastai")
    import functools

    from fastai.learner import Learner

    from keepalive.callbacks.fastai import DriveCheckpoint

    original = Learner.fine_tune

    def wrapper(*args, **kwargs):  # a decorator without functools.wraps: the frame walked has no `self`
        return original(*args, **kwargs)

    monkeypatch.setattr(Learner, "fine_tune", wrapper)
    with pytest.raises(IncompatibleFrameworkError) as info:
        DriveCheckpoint(str(tmp_path / "run"))
    _one_line_refusal(info.value, compat, "Learner.fine_tune local 'self'")
    # functools.wraps does not help: the adapter compares the frame's code with fine_tune's own
    monkeypatch.setattr(Learner, "fine_tune", functools.wraps(original)(wrapper))
    compat.reset()
    with pytest.raises(IncompatibleFrameworkError):
        DriveCheckpoint(str(tmp_path / "run"))


def test_lightning_without_a_patched_loop_method_is_refused(tmp_path, monkeypatch):
    compat = _compat("lightning")
    from keepalive.callbacks import _compat_lightning as lc
    from keepalive.callbacks.lightning import DriveCheckpoint

    epoch_loop = importlib.import_module(f"{lc.pl.__name__}.loops.training_epoch_loop")._TrainingEpochLoop
    monkeypatch.delattr(epoch_loop, "_should_accumulate")
    with pytest.raises(IncompatibleFrameworkError) as info:
        DriveCheckpoint(str(tmp_path / "run"))
    _one_line_refusal(info.value, compat, "_TrainingEpochLoop._should_accumulate")


def test_lightning_dump_checkpoint_signature_change_is_refused(tmp_path, monkeypatch):
    compat = _compat("lightning")
    from keepalive.callbacks import _compat_lightning as lc
    from keepalive.callbacks.lightning import DriveCheckpoint

    connector = importlib.import_module(
        f"{lc.pl.__name__}.trainer.connectors.checkpoint_connector")._CheckpointConnector
    monkeypatch.setattr(connector, "dump_checkpoint", lambda self, full=True: {})
    with pytest.raises(IncompatibleFrameworkError) as info:
        DriveCheckpoint(str(tmp_path / "run"))
    _one_line_refusal(info.value, compat, "_CheckpointConnector.dump_checkpoint(weights_only=)")


def test_the_verdict_is_kept_for_the_process(tmp_path, monkeypatch):
    compat = _compat("fastai")
    from fastai.learner import Learner

    compat.check()  # passes, and is remembered
    monkeypatch.delattr(Learner, "_with_events")
    compat.check()  # not looked at again: creating a callback costs nothing after the first
    compat.reset()
    with pytest.raises(IncompatibleFrameworkError):
        compat.check()
    with pytest.raises(IncompatibleFrameworkError):  # a refusal is remembered as well
        compat.check()


# ------------------------------------------------------------------------------ inventory <-> adapters
@pytest.mark.parametrize("name", list(FRAMEWORKS))
def test_every_entry_is_used_where_it_says(name):
    compat = _compat(name)
    unused = [f"{i.name}: {i.text!r} not in {i.file}" for i in compat.internals if i.text not in _source(i.file)]
    assert unused == []


def _own_names() -> Set[str]:
    """Private names keepalive itself defines: its functions and classes, the attributes its classes
    set on ``self`` / in their bodies."""
    own: Set[str] = set()
    for folder, _, files in os.walk(os.path.join(ROOT, "keepalive")):
        for file in files:
            if not file.endswith(".py"):
                continue
            with open(os.path.join(folder, file), encoding="utf-8") as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    own.add(node.name)
                if isinstance(node, ast.ClassDef):
                    for stmt in node.body:
                        targets = stmt.targets if isinstance(stmt, ast.Assign) else \
                            [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
                        own.update(t.id for t in targets if isinstance(t, ast.Name))
                        for t in targets:
                            if isinstance(t, ast.Tuple):
                                own.update(e.id for e in t.elts if isinstance(e, ast.Name))
                targets = node.targets if isinstance(node, ast.Assign) else \
                    [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
                for t in targets:
                    for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                        if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                            own.add(e.attr)
    return own


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _reached_for(file: str) -> Dict[str, int]:
    """The private names an adapter file reaches for on objects other than ``self``: attributes,
    ``getattr`` / ``hasattr`` / ``setattr`` / ``__dict__`` names, private imports. Name -> a line."""
    found: Dict[str, int] = {}
    for node in ast.walk(ast.parse(_source(file))):
        names: List[str] = []
        if isinstance(node, ast.Attribute) and _private(node.attr) and not (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            names.append(node.attr)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2 and \
                isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            names.append(node.args[1].value)
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and \
                node.value.attr == "__dict__" and isinstance(node.slice, ast.Constant) and \
                isinstance(node.slice.value, str) and not (isinstance(node.value.value, ast.Name)
                                                           and node.value.value.id == "self"):
            names.append(node.slice.value)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if any(_private(p) or p in ("src", "python") for p in parts[1:]):
                names.append(node.module)
            names += [a.name for a in node.names]
        for n in names:
            if _private(n) or "." in n:
                found.setdefault(n, getattr(node, "lineno", 0))
    return found


#: private names of the standard library / torch the adapters use (not a framework's internals)
#: not a framework's: Python's, and torch's own (a tensor's version counter and an LR scheduler's step
#: count, read by the saves during a pause where the framework runs on torch)
_NOT_FRAMEWORK = {"_getframe", "_C", "_version", "_step_count"}


@pytest.mark.parametrize("name", list(FRAMEWORKS))
def test_every_private_name_an_adapter_reaches_for_is_listed(name):
    """A new ``obj._internal`` in an adapter without an inventory entry fails here."""
    compat = _compat(name)
    listed = " ".join(f"{i.name} {i.text}" for i in compat.internals)
    own = _own_names()
    unlisted = []
    for file in FRAMEWORKS[name][1]:
        for n, line in _reached_for(file).items():
            if n in own or n in _NOT_FRAMEWORK:
                continue
            if not re.search(r"(?<!\w)" + re.escape(n) + r"(?!\w)", listed):
                unlisted.append(f"{file}:{line}: {n}")
    assert unlisted == [], "add these to the inventory (keepalive/callbacks/_compat_*.py): " + ", ".join(unlisted)


# ------------------------------------------------------------------------------ ranges and pins
def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


@pytest.mark.parametrize("name", list(FRAMEWORKS))
def test_extras_accept_exactly_the_tested_ranges(name):
    """pip installs what the check accepts: the extra of each framework names its tested range."""
    compat = _compat(name)
    extras = _pyproject()["project"]["optional-dependencies"]
    requirements = {re.split(r"[<>=!~ ;\[]", r, maxsplit=1)[0]: r.replace(" ", "") for r in extras[name]}
    for pkg in compat.packages.values():
        if pkg.name in requirements or pkg.name == name:
            assert requirements.get(pkg.name) == f"{pkg.name}{pkg.tested}", (name, pkg.name, requirements)


def test_the_test_environment_runs_the_pinned_versions():
    """constraints.txt pins the versions the suite is run with; each lies in its tested range."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    with open(os.path.join(ROOT, "constraints.txt"), encoding="utf-8") as f:
        pins = dict(line.split("#")[0].strip().split("==") for line in f if "==" in line.split("#")[0])
    for name in FRAMEWORKS:
        try:
            compat = _compat(name)
        except pytest.skip.Exception:
            continue
        for pkg in compat.packages.values():
            if pkg.name in pins:
                assert Version(pins[pkg.name]) in SpecifierSet(pkg.tested), (pkg.name, pins[pkg.name], pkg.tested)
    for pinned in ("transformers", "accelerate", "lightning", "peft"):
        assert pinned in pins, f"{pinned} is not pinned in constraints.txt"
        module = importlib.util.find_spec(pinned)
        if module is not None:
            assert importlib.metadata.version(pinned) == pins[pinned], pinned


def test_a_probe_that_cannot_look_counts_as_missing():
    def broken() -> bool:
        raise ImportError("gone")

    item = Internal("Thing._gone", "a test", "x.py: f", broken)
    compat = Framework("torch", [Package("torch", "torch", ">=2.1")], lambda: [item])
    assert compat.missing() == [item]
    with pytest.raises(IncompatibleFrameworkError) as info:
        compat.check()
    assert str(info.value).startswith("keepalive's torch adapter needs Thing._gone, which torch ")
    assert info.value.missing == ("Thing._gone",) and info.value.framework == "torch"


# ------------------------------------------------------------------ Accelerate's objects (torch adapter)
def test_accelerate_internals_exist_and_are_used_where_they_say():
    pytest.importorskip("accelerate")
    from keepalive.callbacks._compat import ACCELERATE

    ACCELERATE.reset()
    assert ACCELERATE.missing(required_only=False) == []
    unused = [f"{i.name}: {i.text!r} not in {i.file}" for i in ACCELERATE.internals if i.text not in _source(i.file)]
    assert unused == []
    pins = open(os.path.join(ROOT, "constraints.txt"), encoding="utf-8").read()
    from packaging.specifiers import SpecifierSet

    pinned = re.search(r"^accelerate==(\S+)", pins, re.M)
    assert pinned and pinned.group(1) in SpecifierSet(ACCELERATE.packages["accelerate"].tested)


def test_fabric_internals_exist_and_are_used_where_they_say():
    if importlib.util.find_spec("lightning") is None:
        pytest.skip("lightning is not installed")
    _load_torchvision_shim()
    from keepalive.callbacks._compat import FABRIC

    FABRIC.reset()
    assert FABRIC.missing(required_only=False) == []
    unused = [f"{i.name}: {i.text!r} not in {i.file}" for i in FABRIC.internals if i.text not in _source(i.file)]
    assert unused == []


def test_a_prepared_optimizer_of_an_accelerate_without_its_wrapped_optimizer_is_refused(tmp_path, monkeypatch):
    pytest.importorskip("accelerate")
    import accelerate.optimizer as ao
    import torch

    from keepalive.callbacks._compat import ACCELERATE
    from keepalive.callbacks.torch import DriveCheckpoint

    model = torch.nn.Linear(2, 1)
    prepared = object.__new__(ao.AcceleratedOptimizer)  # what accelerator.prepare returns
    prepared.__dict__["optimizer"] = torch.optim.SGD(model.parameters(), lr=0.1)

    class AcceleratedOptimizer(torch.optim.Optimizer):  # a release that keeps the optimizer elsewhere
        def __init__(self, optimizer):
            self.inner = optimizer

    monkeypatch.setattr(ao, "AcceleratedOptimizer", AcceleratedOptimizer)
    ACCELERATE.reset()
    try:
        with pytest.raises(IncompatibleFrameworkError) as info:
            DriveCheckpoint(str(tmp_path / "run"), model=model, optimizer=prepared)
    finally:
        ACCELERATE.reset()
    text = str(info.value)
    assert "\n" not in text and text.startswith(
        "keepalive's Accelerate adapter needs accelerate.optimizer.AcceleratedOptimizer.optimizer, which "
        "accelerate "), text
    assert "(tested with accelerate>=1.1,<2)" in text, text
