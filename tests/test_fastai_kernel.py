"""A fastai learner trained in two notebook cells, in real IPython kernels (jupyter_client).

The notebook story: a setup cell builds the learner with ``DriveCheckpoint``, cell A runs
``learn.fit_one_cycle(1)``, cell B ``learn.fit_one_cycle(2)``; the kernel is SIGKILLed inside cell B
(after a checkpoint of B has committed). A fresh kernel runs the setup cell and ``%resume_training``
only (cell A is not run again): cell B must be recognised as the run's second fit and continue it, so
that weights, optimizer state and Recorder history equal, bit for bit, those of a kernel never killed.
The negative control identifies fits by their number in the process and not by their plan (A and B
differ in epochs), as keepalive did before: cell B alone is then taken for the first fit, skipped, and
the comparison fails.
"""
from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("jupyter_client")
pytest.importorskip("ipykernel")
pytest.importorskip("fastai")
torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from kernelkit import Kernel, kernel_env  # noqa: E402  (tests/kernelkit.py)

pytestmark = pytest.mark.timeout(300)

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")
N_ITER = 6                   # 96 samples in batches of 16
SAVED, KILL_AFTER = 10, 11   # every=4: saves at 4, 6 (end of A), 10 (B's 4th batch), 14, ...

SETUP = """\
import sys, time
sys.path.insert(0, {scripts!r})
from childio import emit
from fastai.callback.core import Callback
from fastai_setup import make_learner
from keepalive.callbacks.fastai import DriveCheckpoint
if {broken!r}:  # negative control: fits numbered per process, not recognised by their cell or plan
    import keepalive.callbacks._fastai_state as fastai_state
    fastai_state.cell_identity = lambda: (None, None)
    fastai_state.FitLog._prefer_plan = lambda self, candidates, at, plan: at


class Steps(Callback):
    order = 200

    def after_batch(self):
        if self.learn.training:
            emit(f"STEP {{ckpt.counters['step'] + 1}}")
            time.sleep({sleep!r})


ckpt = DriveCheckpoint(run="two-cells", every=4)
ckpt.core.on_commit.append(lambda r: emit(f"COMMITTED {{r.info.step}}"))
learn = make_learner(cbs=[ckpt, Steps()])
if hasattr(learn, "progress"):
    learn.remove_cb(learn.progress)
learn.logger = lambda *a, **k: None
"""
CELL_A = "learn.fit_one_cycle(1, 5e-3)"
CELL_B = "learn.fit_one_cycle(2, 5e-3)"
DUMP = """\
import json, torch
from fastai_setup import history, weights
from safetensors.torch import save_file
save_file(weights(learn), {out!r} + ".st")
sd = learn.opt.state_dict()
torch.save({{"state": list(sd["state"]), "hypers": [dict(h) for h in sd["hypers"]]}}, {out!r} + ".opt")
with open({out!r} + ".json", "w") as f:
    json.dump(history(learn) if hasattr(learn.recorder, "values") else {{}}, f)  # never trained
print("DUMPED", flush=True)
"""


def setup(sleep=0.0, broken=False):
    return SETUP.format(scripts=SCRIPTS, sleep=sleep, broken=broken)


def assert_same(a, b):
    """Weights, optimizer state (per-parameter tensors and hyper-parameters), Recorder history."""
    wa, wb = safetensors_torch.load_file(f"{a}.st"), safetensors_torch.load_file(f"{b}.st")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), f"weight {k} differs: max |diff| {(wa[k] - wb[k]).abs().max()}"
    oa, ob = (torch.load(f"{p}.opt", weights_only=False) for p in (a, b))
    assert oa["hypers"] == ob["hypers"], "optimizer hyper-parameters differ"
    assert len(oa["state"]) == len(ob["state"])
    for i, (x, y) in enumerate(zip(oa["state"], ob["state"])):
        assert x.keys() == y.keys(), f"optimizer state of parameter {i} differs"
        for k in x:
            assert torch.equal(torch.as_tensor(x[k]), torch.as_tensor(y[k])), f"optimizer {k} of {i} differs"
    ha, hb = (json.load(open(f"{p}.json")) for p in (a, b))
    assert ha == hb, "Recorder history differs"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The three cells in one kernel, never interrupted."""
    tmp = tmp_path_factory.mktemp("reference")
    out = tmp / "ref"
    with Kernel(kernel_env(tmp / "ckpts", tmp), cwd=str(tmp)) as k:
        k.run_ok("%load_ext keepalive")
        k.run_ok(setup())
        assert f"STEP {N_ITER}\n" in k.run_ok(CELL_A).stdout
        assert f"STEP {3 * N_ITER}\n" in k.run_ok(CELL_B).stdout
        assert "DUMPED" in k.run_ok(DUMP.format(out=str(out))).stdout
    return out


def kill_in_cell_b_then_resume(tmp_path, broken=False):
    """Setup, A, B killed after its checkpoint at step SAVED; a new kernel: setup, %resume_training.
    Returns the resumed kernel's %resume_training output and where its state was dumped."""
    ckpts, out = tmp_path / "ckpts", tmp_path / "resumed"
    env = kernel_env(ckpts, tmp_path)
    with Kernel(env, cwd=str(tmp_path)) as k:
        k.run_ok("%load_ext keepalive")
        k.run_ok(setup(sleep=0.1, broken=broken))
        k.run_ok(CELL_A)
        k.start(CELL_B)
        k.read_until(lambda r: f"COMMITTED {SAVED}\n" in r.stdout and f"STEP {KILL_AFTER}\n" in r.stdout,
                     timeout=120)
        k.kill()
    with Kernel(env, cwd=str(tmp_path)) as k:
        res = k.run_ok("%load_ext keepalive")
        assert "unfinished run 'two-cells'" in res.stdout, res.text
        k.run_ok(setup(broken=broken))
        res = k.run_ok("%resume_training", timeout=240)
        assert "re-running training cell" in res.stdout and CELL_B in res.stdout, res.text
        assert "DUMPED" in k.run_ok(DUMP.format(out=str(out))).stdout
    return res, out


def test_two_cells_killed_in_the_second_resume_training_alone_is_bit_exact(tmp_path, reference):
    res, out = kill_in_cell_b_then_resume(tmp_path)
    assert "resuming run 'two-cells' from ckpt-" in res.stdout, res.text
    assert "fit 2 continues: 0 of 2 epochs done, " in res.stdout, res.text
    assert "skipped" not in res.stdout and "not recorded" not in res.text
    resumed_at = int(res.stdout.split("resuming run 'two-cells' from ckpt-")[1].split("-")[0])
    assert SAVED <= resumed_at <= KILL_AFTER + 1
    assert f"STEP {resumed_at + 1}\n" in res.stdout and f"STEP {resumed_at}\n" not in res.stdout
    assert_same(reference, out)
    print(f"\nkilled after step {KILL_AFTER} (in cell B), resumed at step {resumed_at}: bit-exact")


def test_negative_control_fits_counted_per_process(tmp_path, reference):
    res, out = kill_in_cell_b_then_resume(tmp_path, broken=True)
    assert "fit 1 had completed before the restart (the checkpoint is in fit 2): skipped" in res.stdout, res.text
    assert "STEP" not in res.stdout    # nothing trained: the model keeps its random initialisation
    with pytest.raises(AssertionError, match="differs"):
        assert_same(reference, out)
