"""The benchmark workloads (keepalive/workloads) and ``keepalive bench``.

* every workload trains a tiny synthetic run (the Keras ones in this process through the Python API,
  the fastai one in the crash test's subprocesses) and writes its per-epoch results;
* ``mnist_mlp`` and ``dogs_cats_resnet`` (tiny synthetic runs of ``tests/scripts/bench_run.py``, which
  prints the ``STEP`` / ``COMMITTED`` lines from ``workloads.run``'s ``on_step`` / ``on_commit`` hooks)
  are SIGKILLed in the middle of their training, re-run until they complete, and their final
  checkpoint (weights and optimizer state) compared bit for bit with an uninterrupted run;
* the CLI (list / run / report, ``--help``), the results files, and the data helpers.

No dataset or weights are downloaded: synthetic data, ``pretrained=False``. The fastai child gets the
torchvision import shim through ``tests/shims`` on its PYTHONPATH (test machine only).
"""
import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest

import crashkit
from crashkit import run_to_completion
from forkserver import ForkingSubprocess, ServerPool
from keepalive import workloads
from keepalive.cli import main
from keepalive.workloads import common

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SHIMS = os.path.join(HERE, "shims")
BENCH_RUN = os.path.join(HERE, "scripts", "bench_run.py")
KERAS = [n for n in workloads.names() if workloads.describe(n)["framework"] == "keras"]
ENV = dict(os.environ, KEEPALIVE_PROGRESS="0", TF_CPP_MIN_LOG_LEVEL="3", TF_ENABLE_ONEDNN_OPTS="0",
           KERAS_BACKEND="tensorflow",
           PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))

# the table in DESIGN.md: epochs x batch (fastai: fine_tune's unfrozen epochs after 1 frozen)
TABLE = {"mnist_mlp": (20, 128), "mnist_cnn": (12, 128), "cifar10_cnn": (20, 32), "imdb_fasttext": (5, 32),
         "imdb_bidirectional_lstm": (4, 32), "lstm_text_generation": (10, 128),
         "fashion_mnist_cnn": (5, 1024), "dogs_cats_resnet": (6, 64)}

# per-sample shape and dtype of (x, y) of the real data after the workload's preprocessing
REAL_SHAPES = {
    "mnist_mlp": ((784,), "float32", (10,), "float32"),
    "mnist_cnn": ((28, 28, 1), "float32", (10,), "float32"),
    "cifar10_cnn": ((32, 32, 3), "float32", (10,), "float32"),
    "imdb_fasttext": ((400,), "int32", (), "float32"),
    "imdb_bidirectional_lstm": ((100,), "int32", (), "float32"),
    "lstm_text_generation": ((40, 57), "bool", (57,), "bool"),
    "fashion_mnist_cnn": ((28, 28, 1), "float32", (), "int32"),
}


class Scripted(random.Random):
    """crashkit's rng, killing after chosen steps (clamped to what crashkit allows)."""

    def __init__(self, steps):
        super().__init__(0)
        self.steps = list(steps)

    def randint(self, a, b):
        return min(max(self.steps.pop(0), a), b)


# ------------------------------------------------------------------------------- light & CLI
def test_importing_registry_and_cli_imports_no_framework():
    code = ("import sys, keepalive, keepalive.cli, keepalive.workloads as w\n"
            "from keepalive.workloads import common\n"
            "rows = [w.describe(n) for n in w.names()]\n"
            "keepalive.cli.build_parser()\n"
            "heavy = [m for m in ('tensorflow', 'keras', 'torch', 'fastai', 'torchvision')\n"
            "         if m in sys.modules]\n"
            "print(len(rows), heavy)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "8 []"


def test_bench_list_matches_the_table(capsys):
    assert main(["bench", "list", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["name"] for r in rows] == list(TABLE)
    for r in rows:
        assert (r["epochs"], r["batch_size"]) == TABLE[r["name"]], r
        assert r["framework"] in ("keras", "fastai") and r["model"] and r["dataset"]
    by = {r["name"]: r for r in rows}
    assert by["fashion_mnist_cnn"]["steps_per_epoch"] == 100
    assert by["dogs_cats_resnet"]["freeze_epochs"] == 1 and by["dogs_cats_resnet"]["framework"] == "fastai"
    assert main(["bench", "list"]) == 0
    text = capsys.readouterr().out
    assert "dogs_cats_resnet" in text and "1+6 x 64" in text and "5 x 1024 (100 steps)" in text


@pytest.mark.parametrize("argv", [["bench"], ["bench", "list"], ["bench", "run"], ["bench", "report"]])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv + ["--help"])
    assert exc.value.code == 0
    assert "usage: keepalive bench" in capsys.readouterr().out


def test_bench_run_unknown_workload(capsys):
    assert main(["bench", "run", "nope", "--synthetic"]) == 2
    assert "unknown workload 'nope'" in capsys.readouterr().err


def test_download_errors_are_recognised():
    import urllib.error

    from keepalive.cli import _is_download_error

    assert _is_download_error(Exception("URL fetch failure on https://x/mnist.npz: None -- [Errno -2] ..."))
    try:
        try:
            raise urllib.error.URLError("Name or service not known")
        except urllib.error.URLError as inner:
            raise RuntimeError("untar_data failed") from inner
    except RuntimeError as outer:
        assert _is_download_error(outer)
    assert not _is_download_error(ValueError("bad shape"))


def test_bench_report_without_results(tmp_path, capsys):
    assert main(["bench", "report", str(tmp_path)]) == 2
    assert "no benchmark results" in capsys.readouterr().err


# ------------------------------------------------------------------------------- data helpers
def test_fasttext_bigram_augmentation():
    from keepalive.workloads.imdb_fasttext import add_bigram_features, add_ngram, create_ngram_set

    # the original example's doctests
    assert create_ngram_set([1, 4, 9, 4, 1, 4], ngram_value=2) == {(4, 9), (4, 1), (1, 4), (9, 4)}
    sequences = [[1, 3, 4, 5], [1, 3, 7, 9, 2]]
    token_indice = {(1, 3): 1337, (9, 2): 42, (4, 5): 2017}
    assert add_ngram(sequences, token_indice, ngram_range=2) == [[1, 3, 4, 5, 1337, 2017],
                                                                  [1, 3, 7, 9, 2, 1337, 42]]
    x_train, x_test, max_features = add_bigram_features([[1, 5, 6], [1, 6, 5]], [[1, 5, 6, 5, 7]], 10)
    # 4 bigrams (1,5) (1,6) (5,6) (6,5) after the 10 word indices: tokens 11..14, max_features 15
    assert max_features == 15
    assert x_train == [[1, 5, 6, 11, 13], [1, 6, 5, 12, 14]]
    assert x_test == [[1, 5, 6, 5, 7, 11, 13, 14]]  # (5, 7) was not seen in training


def test_repeated_view_and_text_vectors():
    from keepalive.workloads.fashion_mnist_cnn import Repeated
    from keepalive.workloads.lstm_text_generation import ALPHABET, synthetic_text, vectorize

    base = np.arange(5, dtype=np.uint8)[:, None] * np.ones((1, 3), np.uint8)
    rep = Repeated(base, 12)
    assert rep.shape == (12, 3) and len(rep) == 12
    got = rep[np.array([0, 4, 5, 11])]
    assert got.dtype == np.float32 and got[:, 0].tolist() == [0, 4, 0, 1]
    with pytest.raises(IndexError):
        rep[np.array([12])]
    text = synthetic_text(500)
    assert set(text) <= set(ALPHABET) and len(ALPHABET) == 57
    x, y = vectorize(text, list(ALPHABET))
    assert x.shape == (len(range(0, 500 - 40, 3)), 40, 57) and x.dtype == bool
    assert (x.sum(axis=2) == 1).all() and (y.sum(axis=1) == 1).all()
    assert y[0].argmax() == ALPHABET.index(text[40])


def test_recorder_resume_replaces_redone_epochs(tmp_path):
    run = str(tmp_path / "run")
    meta = {"workload": "w", "framework": "keras", "epochs": 3, "batch_size": 2}
    facts = {"platform": "local", "device": "CPU", "precision": "fp32", "framework": "keras",
             "versions": {"keras": "3", "backend": "tensorflow", "tensorflow": "2"}}
    r1 = common.RunRecorder(run, meta, facts)
    r1.printer = None
    for e in range(2):
        r1.epoch_begin(e)
        r1.step(2)
        r1.epoch_logs({"loss": 1.0 / (e + 1)})
    r1.finish_epoch()  # "killed" here: no finish(); epochs 1 and 2 recorded by session 1
    r2 = common.RunRecorder(run, meta, facts)  # resumed from the checkpoint of epoch 1
    r2.printer = None
    assert r2.session_no == 2
    r2.epoch_begin(1, start_batch=1)
    r2.step(2)
    r2.epoch_begin(2)
    r2.step(2)
    doc = r2.finish(completed=True)
    assert [(r["epoch"], r["session"]) for r in doc["records"]] == [(1, 1), (2, 2), (3, 2)]
    assert doc["records"][1]["start_batch"] == 1 and doc["epochs_done"] == 3
    assert doc["summary"]["sessions"] == 2 and doc["summary"]["epochs"] == 3
    rows = (tmp_path / "run" / "results.csv").read_text().splitlines()
    assert rows[0].startswith("workload,epoch,session") and len(rows) == 4 and "loss" in rows[0]
    # a torn results.json (killed mid-write) falls back to the backup written just before it
    (tmp_path / "run" / "results.json").write_text('{"format": 1, "recor')
    assert common.read_results(run)["records"] == doc["records"]
    text = common.format_report(common.read_results(run))
    assert "3/3 epochs, completed; 2 session(s)" in text and "resumed inside the epoch" in text


# --------------------------------------------------------------------------- tiny Keras runs
@pytest.fixture(scope="module")
def keras_backend():
    pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "tensorflow":
        pytest.skip("the Keras workloads are tested on the TensorFlow backend")
    return keras


@pytest.mark.parametrize("name", KERAS)
def test_synthetic_data_has_the_real_shapes(name, keras_backend):
    data = workloads.get(name).load_data(synthetic=True, size="tiny")
    xs, xd, ys, yd = REAL_SHAPES[name]
    x, y = data["x_train"], data["y_train"]
    assert tuple(x.shape[1:]) == xs and tuple(y.shape[1:]) == ys
    idx = np.arange(2)
    assert str(np.asarray(x[idx]).dtype) == xd and str(np.asarray(y[idx]).dtype) == yd
    assert len(y) == x.shape[0] > 0
    if data.get("x_test") is not None:
        assert tuple(data["x_test"].shape[1:]) == xs and str(data["x_test"].dtype) == xd


@pytest.mark.parametrize("name", KERAS)
def test_keras_workload_trains_tiny(name, tmp_path, keras_backend):
    from keepalive.store import CheckpointStore

    run_dir = str(tmp_path / name)
    doc = workloads.run(name, run_dir, synthetic=True, size="tiny", epochs=2, threads=1, quiet=True)
    assert doc["completed"] and doc["workload"] == name and doc["epochs"] == 2
    assert [r["epoch"] for r in doc["records"]] == [1, 2]
    for r in doc["records"]:
        assert r["seconds"] > 0 and r["samples"] > 0 and r["steps"] == doc["steps_per_epoch"]
        assert r["samples_per_s"] > 0 and r["checkpoint_seconds"] >= 0 and r["checkpoints"] == 1
        assert r["platform"] and r["device"] and r["metrics"]["loss"] > 0
    assert doc["summary"]["checkpoint_pct"] is not None
    on_disk = common.read_results(run_dir)
    assert on_disk["records"] == json.loads(json.dumps(doc["records"]))
    assert (tmp_path / name / "results.csv").read_text().count("\n") == 3
    ckpts = CheckpointStore(run_dir, keep=None).list()
    assert ckpts and ckpts[-1].epoch == 2 and ckpts[-1].step == 2 * doc["steps_per_epoch"]


def test_run_hooks_see_every_step_and_commit(tmp_path, keras_backend):
    """``workloads.run(on_step=..., on_commit=...)``: the public hooks the crash tests print from."""
    steps, commits = [], []
    doc = workloads.run("mnist_mlp", str(tmp_path / "mlp"), synthetic=True, size="tiny", epochs=2, threads=1,
                        quiet=True, on_step=steps.append, on_commit=commits.append)
    per_epoch = doc["steps_per_epoch"]
    assert steps == list(range(1, 2 * per_epoch + 1))
    assert sorted(commits) == [per_epoch, 2 * per_epoch]  # a checkpoint per epoch, all committed


def test_bench_run_through_the_cli(tmp_path, keras_backend, capsys):
    argv = ["bench", "run", "mnist_mlp", "--synthetic", "--size", "tiny", "--epochs", "1", "--threads", "1",
            "--dir", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "bench: mnist_mlp (synthetic data, size tiny)" in out and "1/1 epochs completed" in out
    assert common.read_results(str(tmp_path / "mnist_mlp-synthetic-tiny"))["completed"]
    with pytest.raises(SystemExit) as exc:  # the crash-test plumbing lives in tests/scripts now
        main(argv + ["--markers"])
    assert exc.value.code == 2


def test_bench_threads_setting(monkeypatch):
    monkeypatch.delenv("KEEPALIVE_BENCH_THREADS", raising=False)
    assert common.threads_from_env(None) is None and common.threads_from_env(3) == 3
    monkeypatch.setenv("KEEPALIVE_BENCH_THREADS", "2")
    assert common.threads_from_env(None) == 2 and common.threads_from_env(4) == 4
    monkeypatch.setenv("KEEPALIVE_BENCH_THREADS", "0")
    assert common.threads_from_env(None) is None


def test_completed_run_is_not_trained_again(tmp_path, keras_backend, capsys):
    run_dir = str(tmp_path / "mlp")
    first = workloads.run("mnist_mlp", run_dir, synthetic=True, size="tiny", epochs=1, threads=1, quiet=True)
    again = workloads.run("mnist_mlp", run_dir, synthetic=True, size="tiny", epochs=1, threads=1, quiet=True)
    assert "nothing to do" in capsys.readouterr().out
    assert again["completed"] and again["records"] == json.loads(json.dumps(first["records"]))
    assert len(again["sessions"]) == 1  # the session that trained nothing is not listed


# ----------------------------------------------------------------------------- crash tests
#: what each crash test's workload imports (keepalive.workloads loads its framework lazily): the 4
#: children of each fork from a server that has imported it (most of a child's CPU time)
PRELOAD = {"mnist_mlp": ["numpy", "tensorflow", "keras"],
           "dogs_cats_resnet": ["numpy", "PIL.Image", "torch", "torch._dynamo", "fastai.vision.all"]}


def _preload(argv, env):
    if argv[0] != BENCH_RUN or argv[1] not in PRELOAD:
        return None
    return argv[1], PRELOAD[argv[1]], ""


@pytest.fixture(scope="module", autouse=True)
def forked_children():
    pool = ServerPool(_preload, quick_exit=True)
    try:
        with ForkingSubprocess(pool).installed_in(crashkit):
            yield pool
    finally:
        pool.close()


def _bench_cmd(name, run_dir, *extra):
    return [sys.executable, BENCH_RUN, name, str(run_dir), "--threads", "1", *extra]


def _final_state(run_dir):
    """Every tensor of the newest checkpoint's model and optimizer state, by path."""
    from keepalive.resume import load_newest
    from keepalive.store import CheckpointStore

    info, tree, _ = load_newest(CheckpointStore(str(run_dir), keep=None))
    out = {}

    def walk(x, path):
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{path}/{k}")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, f"{path}/{i}")
        elif hasattr(x, "shape") or isinstance(x, (int, float)):
            out[path] = np.asarray(x)
    walk(tree["objects"], "")
    return info, out


def _assert_same(a, b):
    assert a.keys() == b.keys()
    differ = [k for k in a if not np.array_equal(a[k], b[k])]
    assert not differ, f"{len(differ)} of {len(a)} tensors differ, e.g. {differ[:3]}"


def _crash_and_compare(tmp_path, name, steps, kill_after, extra, env):
    run = f"{name}-synthetic-tiny"  # the folder `keepalive bench run NAME --synthetic --size tiny` uses
    ref = run_to_completion(_bench_cmd(name, tmp_path / "ref" / run, *extra), total_steps=steps, kills=0,
                            rng=random.Random(0), env=env, timeout=240)
    assert "DONE" in ref.final_output, ref.final_output[-3000:]
    report = run_to_completion(_bench_cmd(name, tmp_path / "crash" / run, *extra), total_steps=steps,
                               kills=len(kill_after), rng=Scripted(kill_after),
                               run_dir=str(tmp_path / "crash" / run), env=env, timeout=240)
    assert report.kills == len(kill_after) and "DONE" in report.final_output
    resumed = [t.resumed_step for t in report.trials[1:]]
    assert any(r for r in resumed), f"no restart resumed: {report.trials}"
    info_a, a = _final_state(tmp_path / "ref" / run)
    info_b, b = _final_state(tmp_path / "crash" / run)
    assert info_a.step == info_b.step == steps
    _assert_same(a, b)
    doc = common.read_results(str(tmp_path / "crash" / run))
    assert doc["completed"] and doc["epochs_done"] == doc["epochs"]
    assert [r["epoch"] for r in doc["records"]] == list(range(1, doc["epochs"] + 1))
    assert len(doc["sessions"]) >= 2 and any(s.get("resumed_from") for s in doc["sessions"])
    doc["_summary"] = (f"\n{name}: killed after steps {[t.killed_after_step for t in report.trials[:-1]]}, "
                       f"resumed at {resumed}; final weights and optimizer state ({len(a)} tensors) "
                       "bit-identical to the uninterrupted run")
    return doc


def test_keras_workload_sigkill_resume_is_bit_exact(tmp_path, keras_backend, capsys):
    """``mnist_mlp`` (4 epochs of 4 steps, checkpoints every epoch) killed twice."""
    # the second kill (after step 11) always resumes: the save at step 8 waited for step 4's write
    doc = _crash_and_compare(tmp_path, "mnist_mlp", 16, [6, 11], ["--epochs", "4", "--deterministic"], ENV)
    assert doc["records"][0]["framework"].startswith("keras 3")
    capsys.readouterr()
    assert main(["bench", "report", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert text.count("mnist_mlp (keras, synthetic data, size tiny)") == 2
    assert "4/4 epochs, completed" in text and "resumed at epoch" in text and "checkpoint overhead" in text
    assert main(["bench", "report", str(tmp_path / "crash"), "--json"]) == 0
    docs = json.loads(capsys.readouterr().out)
    assert len(docs) == 1 and docs[0]["workload"] == "mnist_mlp"
    assert main(["bench", "report", str(tmp_path), "--csv"]) == 0
    assert capsys.readouterr().out.count("\nmnist_mlp,") == 8
    with capsys.disabled():
        print(doc["_summary"])


def test_fastai_workload_sigkill_resume_is_bit_exact(tmp_path):
    """``dogs_cats_resnet``: fine_tune (1 frozen + 2 unfrozen epochs of 4 steps),
    checkpoints every 3 steps (inside epochs), killed in the unfrozen fit twice; TTA at the end."""
    pytest.importorskip("fastai")
    env = dict(ENV, PYTHONPATH=os.pathsep.join([SHIMS, ENV["PYTHONPATH"]]))
    # killed after step 6 (resumes at 4, the end of the frozen fit, saved synchronously), then after
    # step 11 (resumes inside the second unfrozen epoch: the save at step 10 waited for step 7's write)
    doc = _crash_and_compare(tmp_path, "dogs_cats_resnet", 12, [6, 11], ["--epochs", "2", "--every", "3"],
                             env)
    print(doc["_summary"])
    assert [r["phase"] for r in doc["records"]] == ["frozen", "unfrozen", "unfrozen"]
    assert 0.0 <= doc["final"]["tta_error_rate"] <= 1.0 and "error_rate" in doc["final"]
    assert doc["arch"] == "resnet18" and doc["pretrained"] is False and doc["epochs"] == 3
    import torch

    if not torch.cuda.is_available():
        assert all(s["precision"].startswith("fp32") for s in doc["sessions"])
