"""Hugging Face ``Trainer`` beside its own checkpoints and its own plan.

* The notebook guard ``train(resume_from_checkpoint=get_last_checkpoint(out))`` with keepalive attached:
  the process SIGKILLs itself when the Trainer's checkpoint is newer in a later epoch, newer in the same
  epoch, then older than keepalive's, and is re-run until done: the newer checkpoint wins each time and the
  weights and log history are bit-identical to an uninterrupted run without keepalive. Control: keepalive
  unaware of the Trainer's resume does not get there.
* ``load_best_model_at_end`` with ``eval_on_start`` and a local ``output_dir`` that a VM reset wipes: killed
  after the best step, the folder removed, re-run: the final model is the best one and the log history has
  no second start evaluation. Controls: the best weights not kept (the run ends with the last model, said
  in one line), ``eval_on_start`` left on (an extra evaluation).
* ``num_train_epochs`` raised after the run finished ("one more epoch"): the run continues, as the
  Trainer continues its own end-of-training checkpoint, and says what changed. Control: a finished run
  that is not continued.

Tiny GPT-2 models built from configs, synthetic tokens, no download (``tests/scripts/hf_stages.py``).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
for _name in ("torchvision::nms", "torchvision::qnms"):  # the CUDA torchvision here (DESIGN.md)
    try:
        torch.library.define(_name, "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    except Exception:  # noqa: BLE001 - already defined
        pass
pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from crashkit import assert_differs, assert_same  # noqa: E402
from forkserver import ForkingSubprocess, ServerPool  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "scripts", "hf_stages.py")
#: what hf_stages.py imports before keepalive (the GPT-2 model and the Trainer too): its children fork
#: from a server that has imported it, some 4 s of CPU each of the 12 children here
PRELOAD = ["torch", "numpy", "safetensors.torch", "transformers", "transformers.trainer",
           "transformers.trainer_callback", "transformers.trainer_utils", "transformers.training_args",
           "transformers.models.gpt2.modeling_gpt2"]
SETUP = """
import torch
for name in ("torchvision::nms", "torchvision::qnms"):
    torch.library.define(name, "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
"""
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(HERE, "scripts"), os.path.dirname(HERE)]),
           OMP_NUM_THREADS="1", KEEPALIVE_PROGRESS="0", TOKENIZERS_PARALLELISM="false")
TOTAL = 18  # 44 samples / batch 4 = 11 batches an epoch, accumulation 2: 6 steps, 3 epochs


@pytest.fixture(scope="module", autouse=True)
def forked_children():
    pool = ServerPool(lambda argv, env: ("hf", PRELOAD, SETUP) if argv[0] == SCRIPT else None, quick_exit=True)
    try:
        with ForkingSubprocess(pool).installed_in(sys.modules[__name__]):
            yield pool
    finally:
        pool.close()


def _run(root, *extra, killed=False):
    out = subprocess.run([sys.executable, SCRIPT, str(root), "--out", str(root / "w.st"), *extra], env=ENV,
                         capture_output=True, text=True, timeout=300)
    if killed:
        assert out.returncode == -9, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def _result(root):
    with open(str(root / "w.st") + ".json") as f:
        return {"weights": load_file(str(root / "w.st")), **json.load(f)}


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """Uninterrupted runs without keepalive, by script options (each made once)."""
    made = {}

    def get(*extra):
        if extra not in made:
            made[extra] = _finish(tmp_path_factory.mktemp("plain"), "--mode", "plain", *extra)[0]
        return made[extra]

    return get


def _finish(root, *extra):
    out = _run(root, *extra)
    assert out.returncode == 0 and "DONE" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    return _result(root), out.stdout + out.stderr


# Kills after step 7 (keepalive saved 4, the Trainer 6: newer, in the next epoch), 11 (keepalive 10, the
# Trainer 9: older) and 16 (keepalive 14, the Trainer 15: newer, in the same epoch)
GUARD = ["--guard", "--save-steps", "3", "--every", "4"]
KILLS = (7, 11, 16)


@pytest.mark.slow
@pytest.mark.parametrize("control", [False, True], ids=["newer-wins", "control-ignore-trainer"])
def test_guarded_resume_beside_the_trainers_checkpoints_is_bit_exact(tmp_path, plain, control):
    ref = plain()
    root = tmp_path / "run"
    extra = ["--control-ignore-trainer"] if control else []
    said = []
    for step in KILLS[:1] if control else KILLS:  # the control: the Trainer's newer, in the next epoch
        out = _run(root, *GUARD, *extra, "--kill-at", str(step), killed=not control)
        said.append(out.stdout + out.stderr)
        if out.returncode != -9:
            return  # the control failed on its way: caught
    if control:
        out = _run(root, *GUARD, *extra)
        if out.returncode == 0:
            assert_differs(ref, _result(root))
        return
    hf = root / "hf"
    assert (f"keepalive: warning: the Trainer's own checkpoint {hf / 'checkpoint-6'} (step 6) is newer than "
            "keepalive's newest (step 4): training continues from the Trainer's, as the Trainer resumes it") in said[1]
    assert (f"the Trainer's own checkpoint {hf / 'checkpoint-9'} (step 9) is not newer than keepalive's (step 10): "
            "keepalive's is restored") in said[2]
    got, last = _finish(root, *GUARD)
    assert f"{hf / 'checkpoint-15'} (step 15) is newer than keepalive's newest (step 14)" in last
    assert_same(ref, got)


@pytest.mark.slow
@pytest.mark.parametrize("control", [False, True], ids=["exact", "control-no-best-eval-again"])
def test_best_model_survives_a_wiped_output_dir(tmp_path, plain, control):
    ref = plain("--best")
    assert ref["best"] < TOTAL  # the best model is not the last one
    root = tmp_path / "run"
    extra = ["--control-no-best", "--control-eval-again"] if control else []
    _run(root, "--best", "--every", "1", *extra, "--kill-at", "7", killed=True)
    shutil.rmtree(root / "hf")  # a local output_dir lost with the VM
    got, said = _finish(root, "--best", "--every", "1", *extra)
    lost = root / "hf" / f"checkpoint-{ref['best']}"
    if control:
        assert len(got["log_history"]) == len(ref["log_history"]) + 1  # the start evaluated again
        assert (f"keepalive: warning: the best model's folder {lost} no longer exists (a local output_dir is lost "
                "with the VM) and keepalive's checkpoint does not hold its weights: the training ends with the last "
                "model, not the best one.") in said
        assert_differs(ref["weights"], got["weights"])
        return
    assert f"keepalive: loaded the best model (step {ref['best']}, eval_loss " in said
    assert_same(ref, got)


def _trainer(tmp_path, cb=None, epochs=3, **targs):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from transformers import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    net = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=8))
    ids = torch.randint(0, 50, (24, 8), generator=torch.Generator().manual_seed(3))
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, num_train_epochs=epochs, learning_rate=1e-2,
                             warmup_steps=2, logging_steps=1, report_to=[], disable_tqdm=True, use_cpu=True,
                             **{"save_strategy": "no", **targs})
    return Trainer(model=net, args=args, train_dataset=[{"input_ids": x, "labels": x} for x in ids],
                   callbacks=[cb] if cb else [])


def _state(trainer):
    logs = [{k: v for k, v in e.items() if not k.endswith(("_runtime", "_per_second"))}
            for e in trainer.state.log_history if "train_runtime" not in e]
    return {"weights": {k: v.detach().clone() for k, v in trainer.model.named_parameters()}, "logs": logs,
            "step": trainer.state.global_step}


@pytest.mark.parametrize("control", [False, True], ids=["continues", "control-not-continued"])
def test_one_more_epoch_continues_a_finished_run(tmp_path, capsys, monkeypatch, control):
    from transformers.trainer_utils import get_last_checkpoint

    from keepalive.callbacks import transformers as kt

    # the Trainer's own way: its checkpoint at the end of epoch 3, resumed with num_train_epochs=4
    _trainer(tmp_path / "own", save_strategy="epoch").train()
    own = _trainer(tmp_path / "own", epochs=4, save_strategy="epoch")
    own.train(resume_from_checkpoint=get_last_checkpoint(str(tmp_path / "own" / "hf")))
    if control:  # the plan not compared: a finished run stays finished
        monkeypatch.setattr("keepalive.plan.changes", lambda *a, **k: [])
    _trainer(tmp_path / "a", kt.DriveCheckpoint(tmp_path / "run", quiet=True)).train()
    capsys.readouterr()
    longer = _trainer(tmp_path / "b", kt.DriveCheckpoint(tmp_path / "run"), epochs=4)
    longer.train()
    err = capsys.readouterr().err
    if control:
        assert_differs(_state(own), _state(longer))
        return
    assert ("keepalive: warning: the training's plan changed since the checkpoint (epochs 3 -> 4, max_steps 9 -> 12). "
            "Training continues from step 9 to step 12 with the schedule this code builds (linear over 12 steps), "
            "so the learning rates from there on are the new plan's.") in err
    assert_same(_state(own), _state(longer))
