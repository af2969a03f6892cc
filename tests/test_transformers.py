"""Hugging Face ``Trainer`` + ``keepalive.callbacks.transformers.DriveCheckpoint``.

Crash tests: a child fine-tunes a tiny model built from a config (random weights, synthetic tokens, no
download) with gradient accumulation 2 and a linear warmup schedule, and is SIGKILLed at random steps
(inside steps and inside background writes too) and restarted until it finishes: the trainable weights,
the optimizer state and the log history must be bit-identical to an uninterrupted run's. The same kills
against the Trainer's own ``save_steps`` + ``resume_from_checkpoint=True`` show what that redoes and
where it differs. In-process tests: the deadline stop, what a checkpoint holds for LoRA, messages.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading

import pytest

torch = pytest.importorskip("torch")
for _name in ("torchvision::nms", "torchvision::qnms"):  # the CUDA torchvision here (DESIGN.md)
    try:
        torch.library.define(_name, "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    except Exception:  # noqa: BLE001 - already defined
        pass
pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

import crashkit  # noqa: E402
from crashkit import run_to_completion  # noqa: E402
from forkserver import script_children_fixture  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "scripts", "hf_train.py")
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(HERE, "scripts"), os.path.dirname(HERE)]),
           OMP_NUM_THREADS="1", KEEPALIVE_PROGRESS="0", TOKENIZERS_PARALLELISM="false")
TOTAL = 18  # 44 samples / batch 4 = 11 batches per epoch, accumulation 2: 6 optimizer steps, 3 epochs

try:
    import peft  # noqa: F401

    HAVE_PEFT = True
except ImportError:
    HAVE_PEFT = False


#: what hf_train.py imports before keepalive (its model classes and the Trainer too): the children fork
#: from a server that has imported it, some 4 s of CPU each of the 17 children here
PRELOAD = ["torch", "numpy", "safetensors.torch", "transformers", "transformers.trainer",
           "transformers.trainer_callback", "transformers.training_args",
           "transformers.models.gpt2.modeling_gpt2", "transformers.models.bert.modeling_bert"]
SETUP = """
import torch
for name in ("torchvision::nms", "torchvision::qnms"):
    torch.library.define(name, "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
"""


forked_children = script_children_fixture(SCRIPT, "hf", PRELOAD, crashkit, sys.modules[__name__], setup=SETUP)


def _cmd(run, out, *extra):
    return [sys.executable, SCRIPT, str(run), "--out", str(out), *extra]


def _result(out):
    with open(str(out) + ".json") as f:
        return load_file(str(out)), json.load(f)


def _reference(tmp_path, model, mode="keepalive"):
    d = tmp_path / f"ref-{model}-{mode}"
    out = d / "w.st"
    d.mkdir()
    subprocess.run(_cmd(d / "run", out, "--model", model, "--mode", mode), check=True, env=ENV,
                   capture_output=True, text=True, timeout=300)
    return _result(out)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Uninterrupted plain-Trainer runs, one per model, computed once: the gpt2 one is shared by its
    crash test and the side-by-side comparison with the Trainer's own resume."""
    cache = {}

    def get(model, mode="hf"):
        if (model, mode) not in cache:
            cache[model, mode] = _reference(tmp_path_factory.mktemp("ref"), model, mode)
        return cache[model, mode]

    return get


def _assert_same(ref, got):
    (rw, rj), (gw, gj) = ref, got
    assert sorted(rw) == sorted(gw)
    different = [k for k in rw if not torch.equal(rw[k], gw[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"
    assert gj["global_step"] == rj["global_step"] == TOTAL
    assert gj["log_history"] == rj["log_history"]  # losses, grad norms, learning rates, epochs: exact
    assert gj["lr"] == rj["lr"]


@pytest.mark.slow
@pytest.mark.parametrize("model,kills,seed", [
    ("gpt2", 3, 15),
    ("bert", 2, 16),
    pytest.param("lora", 2, 17, marks=pytest.mark.skipif(not HAVE_PEFT, reason="peft is not installed")),
])
def test_sigkill_resume_is_bit_exact(tmp_path, references, model, kills, seed):
    ref = references(model, mode="hf")  # a plain Trainer run: the callback changes nothing
    run, out = tmp_path / "run", tmp_path / "w.st"
    report = run_to_completion(_cmd(run, out, "--model", model, "--every", "3", "--sleep", "0.02"),
                               total_steps=TOTAL, kills=kills, rng=random.Random(seed), run_dir=str(run),
                               env=ENV, max_substep_delay=0.05, timeout=240)
    assert report.kills == kills
    assert "DONE" in report.final_output
    resumed = [t.resumed_step for t in report.trials[1:]]
    assert all(r is not None for r in resumed), report.trials
    print(f"\nkeepalive ({model}): kills {report.kills}, steps redone per kill {_redone(report)}")
    _assert_same(ref, _result(out))


def _redone(report):
    """Optimizer steps redone after each kill: the kill's step minus where the next start resumed."""
    out = []
    for killed, after in zip(report.trials, report.trials[1:]):
        if killed.killed_after_step is not None:
            out.append(killed.killed_after_step - (after.resumed_step or 0))
    return out


@pytest.mark.slow
def test_trainers_own_resume_side_by_side(tmp_path, references):
    """The same kills against ``save_steps=3`` + ``resume_from_checkpoint=True``: the figures of the
    README's comparison (printed with ``-s``). Its weights come out right here; its log history does not
    whenever a resume lands between two logging steps: the running loss sum is not in its checkpoint."""
    ref = references("gpt2", mode="hf")
    run, out = tmp_path / "hfrun", tmp_path / "w.st"
    report = run_to_completion(_cmd(run, out, "--mode", "hf", "--every", "3", "--sleep", "0.02"),
                               total_steps=TOTAL, kills=3, rng=random.Random(15), env=ENV,
                               max_substep_delay=0.05, timeout=240)
    gw, gj = _result(out)
    same_weights = all(torch.equal(ref[0][k], gw[k]) for k in ref[0])
    same_logs = gj["log_history"] == ref[1]["log_history"]
    print(f"\nTrainer's own resume: kills {report.kills}, steps redone per kill {_redone(report)}, "
          f"weights+optimizer identical {same_weights}, log history identical {same_logs}")
    assert report.kills == 3 and "DONE" in report.final_output
    assert gj["global_step"] == TOTAL


def test_trainers_own_resume_takes_a_torn_checkpoint(tmp_path):
    """What a kill during the Trainer's own save leaves (a checkpoint folder without its last file) is
    what ``resume_from_checkpoint=True`` picks: the newest folder by number, complete or not; and fails."""
    from transformers.trainer_utils import get_last_checkpoint

    t = _trainer(tmp_path, epochs=1, save_strategy="steps", save_steps=1)
    t.train()
    last = get_last_checkpoint(str(tmp_path / "hf"))
    os.remove(os.path.join(last, "trainer_state.json"))  # written last: a kill mid-save leaves this
    assert get_last_checkpoint(str(tmp_path / "hf")) == last
    t2 = _trainer(tmp_path, epochs=1, save_strategy="no")
    # the run cannot continue until someone deletes the torn folder by hand (keepalive: a checkpoint
    # without its manifest is not a checkpoint; the newest valid one is taken, see test_store_crash.py)
    with pytest.raises(FileNotFoundError, match="trainer_state.json"):
        t2.train(resume_from_checkpoint=True)


# ------------------------------------------------------------------------------ in-process tests
def _trainer(tmp_path, cb=None, epochs=2, model="gpt2", evaluate=False, **targs):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from transformers import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    net = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=8))
    if model == "lora":
        from peft import LoraConfig, get_peft_model

        net = get_peft_model(net, LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True))
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 50, (24, 8), generator=g)
    data = [{"input_ids": x, "labels": x} for x in ids]
    if evaluate:  # evaluation every 2 steps: its entries in the log history, its RNG draws
        targs = {"eval_strategy": "steps", "eval_steps": 2, **targs}
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, num_train_epochs=epochs, learning_rate=1e-2,
                             warmup_steps=2, logging_steps=1, report_to=[], disable_tqdm=True, use_cpu=True,
                             **{"save_strategy": "no", **targs})
    return Trainer(model=net, args=args, train_dataset=data, eval_dataset=data[:8] if evaluate else None,
                   callbacks=[cb] if cb else [])


def _trainable(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.named_parameters() if v.requires_grad}


def test_importing_keepalive_imports_no_transformers():
    code = "import keepalive, keepalive.config, keepalive.core, sys; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("evaluate", [False, True], ids=["train", "with-eval"])
def test_deadline_stops_cleanly_and_resumes_exactly(tmp_path, evaluate):
    from keepalive.callbacks.transformers import DriveCheckpoint

    ref = _trainer(tmp_path / "a", evaluate=evaluate)
    ref.train()
    left = {"s": 1000.0}
    calls = {"n": 0}

    def remaining():
        # boundaries only: keepalive's pause guard also asks, from its thread, when a step is slow
        if threading.current_thread() is threading.main_thread():
            calls["n"] += 1
        return left["s"] if calls["n"] < 4 else 1.0  # the session ends soon after the third step

    cb = DriveCheckpoint(tmp_path / "run", every=100, quiet=True, remaining_fn=remaining, deadline_margin="5s")
    t1 = _trainer(tmp_path / "b", cb, evaluate=evaluate)
    with pytest.raises(SystemExit) as stop:  # a script's stop exits 143 (EXIT_STOPPED) after its save
        t1.train()
    assert stop.value.code == 143 and cb.stopped and not cb.finished
    stopped_at = cb.step
    assert 0 < stopped_at < ref.state.global_step
    cb2 = DriveCheckpoint(tmp_path / "run", every=100, quiet=True)
    t2 = _trainer(tmp_path / "c", cb2, evaluate=evaluate)
    t2.train()
    assert cb2.finished and t2.state.global_step == ref.state.global_step
    a, b = _trainable(ref), _trainable(t2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    def strip(log):  # timings differ from run to run
        return [{k: v for k, v in e.items() if not k.endswith(("_runtime", "_per_second"))}
                for e in log if "train_runtime" not in e]

    assert strip(t2.state.log_history) == strip(ref.state.log_history)
    assert any("eval_loss" in e for e in ref.state.log_history) == evaluate


@pytest.mark.skipif(not HAVE_PEFT, reason="peft is not installed")
def test_lora_checkpoint_holds_only_the_adapters(tmp_path):
    from keepalive.callbacks.transformers import DriveCheckpoint

    cb = DriveCheckpoint(tmp_path / "run", quiet=True)
    t = _trainer(tmp_path, cb, epochs=1, model="lora")
    t.train()
    tree = cb.state_dict() if hasattr(cb, "state_dict") else cb.core.build_tree(cb.capture)
    keys = list(tree["objects"]["model"])
    assert keys and all("lora_" in k for k in keys if k.endswith("weight")), keys[:5]
    assert not any(k.endswith("wte.weight") for k in keys)


def test_finished_run_trains_nothing_and_restores_the_final_state(tmp_path, capsys):
    from keepalive.callbacks.transformers import DriveCheckpoint

    t1 = _trainer(tmp_path / "a", DriveCheckpoint(tmp_path / "run", quiet=True), epochs=1)
    t1.train()
    t2 = _trainer(tmp_path / "b", DriveCheckpoint(tmp_path / "run", quiet=True), epochs=1)
    t2.train()
    assert "already completed" in capsys.readouterr().out
    a, b = _trainable(t1), _trainable(t2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert t2.state.global_step == t1.state.global_step


@pytest.mark.skipif(not HAVE_PEFT, reason="peft is not installed")
def test_mismatched_model_is_refused_before_anything_loads(tmp_path):
    from keepalive.callbacks.transformers import DriveCheckpoint
    from keepalive.errors import StateMismatchError

    _trainer(tmp_path / "a", DriveCheckpoint(tmp_path / "run", quiet=True), epochs=1).train()
    with pytest.raises(StateMismatchError):
        _trainer(tmp_path / "b", DriveCheckpoint(tmp_path / "run", quiet=True), epochs=1, model="lora").train()


def test_an_iterable_dataset_without_state_is_checkpointed_at_steps_and_told(tmp_path, capsys):
    """A stream that ends (16 rows, 2 steps a pass) with max_steps: saves land at steps, passes end, and the
    first mid-epoch save says once that a resume reads the pass again (tests/test_transformers_data.py:
    endless streams, a datasets.IterableDataset, exactness)."""
    from torch.utils.data import IterableDataset

    from keepalive.callbacks.transformers import DriveCheckpoint

    class Stream(IterableDataset):
        def __iter__(self):
            g = torch.Generator().manual_seed(5)
            for _ in range(16):
                x = torch.randint(0, 50, (8,), generator=g)
                yield {"input_ids": x, "labels": x}

    cb = DriveCheckpoint(tmp_path / "run", every=1)
    steps = []
    cb.core.on_commit.append(lambda r: steps.append(r.info.step))
    t = _trainer(tmp_path, cb, max_steps=6)
    t.train_dataset = Stream()
    t.train()
    err = capsys.readouterr().err
    assert err.count("IterableDataset (Stream) without state_dict()") == 1
    assert cb.finished and cb.step == 6
    assert cb.epoch >= 2  # passes over the stream that ended before max_steps stopped the training
    assert 1 in steps and 6 in steps
