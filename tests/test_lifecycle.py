"""The core's lifecycle (counters, messages), the options object, the reporting gate and the generic
fit check: the pieces every adapter is built on, tested without a framework."""
from __future__ import annotations

import numpy as np
import pytest

from keepalive import report
from keepalive.adapter import CheckpointAdapter, check_fits
from keepalive.config import CheckpointConfig
from keepalive.core import Checkpointer, active_checkpointers
from keepalive.errors import StateMismatchError


class Toy(CheckpointAdapter):
    """The smallest adapter: a dict of arrays as its objects."""

    def __init__(self, path, **options):
        self.weights = {"w": np.zeros(3)}
        self.core = Checkpointer(config=CheckpointConfig.strict(path, None, options, "Toy"),
                                 framework="toy")

    def capture(self):
        return {"objects": {"weights": self.weights}}

    def restore(self, tree):
        self.weights = {k: np.array(v) for k, v in tree["objects"]["weights"].items()}

    def train(self, epochs, batches):
        core = self.core
        tree = core.load(check=lambda t: check_fits("weights", self.weights, t["objects"]["weights"],
                                                     where=core.resumed_from.name))
        if tree is not None:
            self.restore(tree)
        if core.counters["epoch"] >= epochs:
            core.already_complete(epochs)
            return
        while core.counters["epoch"] < epochs:
            core.start_epoch()
            for _ in range(core.counters["batch"], batches):
                self.weights["w"] = self.weights["w"] + 1
                core.advance(self.capture, samples=4)
            core.end_epoch(self.capture, last=core.counters["epoch"] + 1 >= epochs)


def test_counters_mean_the_same_for_every_adapter(tmp_path):
    toy = Toy(tmp_path / "run", quiet=True)
    toy.train(2, 3)
    assert toy.counters == {"epoch": 2, "step": 6, "batch": 0, "samples": 24}
    assert toy.finished and toy.epoch == 2 and toy.step == 6
    toy.close()


def test_resume_and_nothing_to_do_message(tmp_path, capsys):
    Toy(tmp_path / "run", quiet=True).train(2, 3)
    again = Toy(tmp_path / "run")
    again.train(2, 3)
    out = capsys.readouterr().out
    assert "resuming run 'run'" in out
    assert "already completed 2 epoch(s) of 2; nothing to do" in out
    np.testing.assert_array_equal(again.weights["w"], np.full(3, 6.0))
    again.close()


def test_new_fit_starts_the_counters_over(tmp_path):
    toy = Toy(tmp_path / "run", quiet=True)
    toy.train(1, 2)
    toy.core.new_fit()
    assert toy.counters == {"epoch": 0, "step": 0, "batch": 0, "samples": 0}
    assert not toy.finished and not toy.stopped
    toy.close()


def test_active_checkpointers_lists_live_ones(tmp_path):
    toy = Toy(tmp_path / "run", quiet=True)
    assert toy.core in active_checkpointers()
    toy.close()


def test_config_documents_every_option_once():
    doc = CheckpointConfig.__doc__ or ""
    for name in CheckpointConfig.field_names():
        assert f"{name}:" in doc, f"CheckpointConfig's docstring does not document {name}"


def test_config_rejects_unknown_option(tmp_path):
    with pytest.raises(TypeError, match="evry"):
        Checkpointer(tmp_path / "run", evry=5)


def test_config_object_and_keywords_combine(tmp_path):
    base = CheckpointConfig(keep=7, every=10)
    cfg, rest = CheckpointConfig.from_arguments(tmp_path, base, {"every": 3, "model": 1})
    assert (cfg.path, cfg.keep, cfg.every, rest) == (tmp_path, 7, 3, {"model": 1})


def test_check_fits_names_the_first_difference():
    live = {"a": np.zeros((2, 2)), "b": [np.zeros(3), np.zeros(4)]}
    check_fits("m", live, {"a": np.ones((2, 2)), "b": [np.ones(3), np.ones(4)]}, where="c")
    with pytest.raises(StateMismatchError, match=r"'b\.1' has shape \(5,\) in the checkpoint c but \(4,\)"):
        check_fits("m", live, {"a": np.zeros((2, 2)), "b": [np.zeros(3), np.zeros(5)]}, where="c")
    with pytest.raises(StateMismatchError, match="'a' is not in the checkpoint"):
        check_fits("m", live, {"b": [np.zeros(3), np.zeros(4)]}, where="c")
    with pytest.raises(StateMismatchError, match="has 'z' that the live m lacks"):
        check_fits("m", live, {**live, "z": np.zeros(1)}, where="c")
    with pytest.raises(StateMismatchError, match="has 1 entries at 'b'"):
        check_fits("m", live, {"a": np.zeros((2, 2)), "b": [np.zeros(3)]}, where="c")
    with pytest.raises(StateMismatchError, match=r"'dense/kernel' has shape"):
        check_fits("m", [np.zeros(2)], [np.zeros(3)], where="c", names=["dense/kernel"])


def test_quiet_silences_news_but_never_warnings(capsys, monkeypatch):
    monkeypatch.delenv("KEEPALIVE_VERBOSITY", raising=False)
    report.say("news", quiet=True)
    report.warn("a problem", quiet=True)
    captured = capsys.readouterr()
    assert "news" not in captured.out + captured.err
    assert "keepalive: warning: a problem" in captured.err


def test_warnings_show_once_per_key(capsys):
    report.reset_once("test-once")
    assert report.warn("shown", key="test-once")
    assert not report.warn("shown", key="test-once")
    assert capsys.readouterr().err.count("keepalive: warning: shown") == 1


def test_verbosity_quiet_and_debug(capsys, monkeypatch):
    monkeypatch.setenv("KEEPALIVE_VERBOSITY", "quiet")
    report.say("news")
    monkeypatch.setenv("KEEPALIVE_VERBOSITY", "debug")
    report.debug("details")
    captured = capsys.readouterr()
    assert "news" not in captured.out and "keepalive: details" in captured.err


def test_the_adapter_contract_is_capture_and_restore():
    """Every adapter implements the two methods of the contract; one that lacks one cannot be built.
    (The adapters' sources are read, not imported: some frameworks need test shims to import.)"""
    import ast
    import pathlib

    import pytest

    class Half(CheckpointAdapter):
        def capture(self):
            return {}

    with pytest.raises(TypeError, match="restore"):
        Half()
    folder = pathlib.Path(__file__).resolve().parent.parent / "keepalive" / "callbacks"
    for name in ("torch", "keras", "fastai", "transformers", "lightning"):
        module = ast.parse((folder / f"{name}.py").read_text())
        cls = next(n for n in module.body if isinstance(n, ast.ClassDef) and n.name == "DriveCheckpoint")
        methods = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
        assert {"capture", "restore"} <= methods, (name, sorted(methods))


def test_a_checkpointer_dropped_without_close_does_not_lock_its_own_process_out(tmp_path):
    """A checkpointer garbage-collected while it held the run (no close()) leaves a lease that names
    this process: the next checkpointer of the run in the same process takes it back."""
    import gc

    Toy(tmp_path / "run", quiet=True).train(1, 2)
    gc.collect()  # the first one is gone; its lease file (and heartbeat) are not
    again = Toy(tmp_path / "run", quiet=True)
    again.train(2, 2)
    assert again.counters["epoch"] == 2
    again.close()
