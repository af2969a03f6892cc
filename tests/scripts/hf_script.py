"""What the Hugging Face crash tests' training scripts share (hf_sft_train.py, st_train.py, hf_data_train.py):
their common arguments, the ``STEP n`` and ``COMMITTED n`` lines the parent reads (tests/crashkit.py), and
what they write at the end for the parent to compare.

Import it before transformers: importing it defines the op schemas the registry's CUDA torchvision needs
next to the CPU torch here (DESIGN.md; transformers imports torchvision when it is installed). Tests only.
"""
import argparse
import json
import time

import torch

for _name in ("torchvision::nms", "torchvision::qnms"):
    try:
        torch.library.define(_name, "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    except Exception:  # noqa: BLE001 - already defined
        pass
from childio import emit
from transformers import TrainerCallback


def arguments() -> argparse.ArgumentParser:
    """``RUN --out OUT [--sleep S] [--plain]``; a script adds its own. ``--plain``: no keepalive (the
    reference run); ``--sleep``: seconds after each step (the parent's window for a kill)."""
    p = argparse.ArgumentParser()
    p.add_argument("run")
    p.add_argument("--out", required=True)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--plain", action="store_true")
    return p


class Steps(TrainerCallback):
    """Prints ``STEP n`` after each optimizer step, then sleeps ``sleep`` seconds."""

    def __init__(self, sleep: float = 0.0):
        self.sleep = sleep

    def on_step_end(self, a, state, control, **kw):
        emit(f"STEP {state.global_step}")
        if self.sleep:
            time.sleep(self.sleep)


def drive_checkpoint(run: str, every: int = 1):
    """keepalive's Trainer callback saving to ``run``, printing ``COMMITTED n`` after each commit."""
    from keepalive.callbacks.transformers import DriveCheckpoint

    ckpt = DriveCheckpoint(run, every=every)
    ckpt.core.on_commit.append(lambda r: emit(f"COMMITTED {r.info.step}"))
    return ckpt


def write_results(trainer, out: str, *, optimizer: bool = False, summary: bool = False) -> None:
    """The trained weights (and, with ``optimizer``, the optimizer's tensors) to ``out`` (safetensors); the
    log history without timings (the final summary's entry only with ``summary``) and the global step to
    ``out.json``; then ``DONE``."""
    from safetensors.torch import save_file

    weights = {k: v.detach().contiguous() for k, v in trainer.model.named_parameters()}
    if optimizer:
        for i, st in trainer.optimizer.state_dict()["state"].items():
            for k, v in st.items():
                if torch.is_tensor(v):
                    weights[f"opt.{i}.{k}"] = v.detach().contiguous().reshape(-1).clone()
    save_file(weights, out)
    logs = [{k: v for k, v in e.items() if not k.endswith(("_runtime", "_per_second"))}
            for e in trainer.state.log_history if summary or "train_runtime" not in e]
    with open(out + ".json", "w") as f:
        json.dump({"log_history": logs, "global_step": trainer.state.global_step}, f)
    print("DONE", flush=True)
