"""Where a ``Trainer.train()`` call continues: keepalive's checkpoint, the Trainer's own, or the start.

Beside ``train(resume_from_checkpoint=...)`` the newer checkpoint wins (:class:`TrainersResume` is where
the Trainer's own resume starts its epoch loop); the plan stored with a checkpoint is compared with the
one this code asks for (:func:`tell_plan`); a checkpoint inside an epoch fits only a training that splits
its epochs the same way (:func:`check_position_fits`). Each says, in one line, what happens.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Tuple

from transformers import TrainerState, TrainingArguments

from .. import plan as plans
from ..core import Checkpointer
from ..errors import StateMismatchError
from ..statetree import StateTree

#: a path that is never a Trainer checkpoint: the Trainer's resume branch runs, its file loads find nothing
NO_CHECKPOINT = os.path.join(os.sep, "nonexistent", "keepalive-positioned-resume")


class TrainersIsNewer(Exception):
    """Raised by the load check: the Trainer's own checkpoint is newer than keepalive's (nothing loaded)."""


class TrainersResume(NamedTuple):
    """Where the Trainer's own resume (``train(resume_from_checkpoint=...)``) starts its epoch loop."""

    path: str
    step: int     # its global step
    epoch: int    # epochs completed: the loop's first epoch
    batches: int  # batches of that epoch the Trainer skips

    @staticmethod
    def of(loop: Mapping[str, Any], state: TrainerState) -> Optional["TrainersResume"]:
        """From the training loop's local variables, when the Trainer loaded its own ``TrainerState``."""
        path = loop.get("resume_from_checkpoint")
        if not isinstance(path, str) or path == NO_CHECKPOINT or not state.global_step:
            return None
        return TrainersResume(path, int(state.global_step), int(loop.get("epochs_trained") or 0),
                              int(loop.get("steps_trained_in_current_epoch") or 0))


def saved_step(tree: StateTree) -> int:
    counters: Mapping[str, Any] = tree.get("counters") or {}
    return int(counters.get("step", 0))


def load_newest(core: Checkpointer, own: Optional[TrainersResume], check_fits: Callable[[StateTree], None]
                ) -> Tuple[Optional[StateTree], Optional[int]]:
    """keepalive's newest valid checkpoint, unless the Trainer's own (``own``) is newer: then none, and the
    step of keepalive's newest beside it (None: keepalive has none)."""
    newer: List[int] = []

    def check(tree: StateTree) -> None:
        step = saved_step(tree)
        if own is not None and own.step > step:
            newer.append(step)
            raise TrainersIsNewer()
        check_fits(tree)

    try:
        tree = core.load(describe=describe, check=check)  # may refuse: nothing changed
    except TrainersIsNewer:
        tree = None
    return tree, newer[0] if newer else None


def describe(tree: StateTree) -> str:
    """Where a checkpoint continues, for the core's resume line (empty at an epoch's end)."""
    data = tree.get("data") or {}
    if data.get("batch") and not (tree.get("hf") or {}).get("finished"):
        # the position itself is in the line already (keepalive.runs.position); this adds the length
        length = data.get("steps_in_epoch")
        return f"{length} batches per epoch" if length else "an unsized loader (its epochs have no known length)"
    return ""


# ------------------------------------------------------------------------------ the Trainer's own
def say_replaced(core: Checkpointer, own: TrainersResume, step: int) -> None:
    """keepalive's checkpoint (at ``step``) is as new as the Trainer's own, or newer, and replaced it."""
    core.say(f"the Trainer's own checkpoint {own.path} (step {own.step}) is not newer than keepalive's "
             f"(step {step}): keepalive's is restored (weights, optimizer, schedule, data position, "
             "random states) and the Trainer's is not used.")


def tell_continued(core: Checkpointer, own: TrainersResume, keepalives: Optional[int]) -> None:
    """The Trainer resumed from its own checkpoint; keepalive's newest (at step ``keepalives``) is older,
    or there is none."""
    if keepalives is None:
        core.say(f"continuing from the Trainer's own checkpoint {own.path} (epoch {own.epoch}, step "
                 f"{own.step}); keepalive checkpoints from there.")
        return
    core.warn(f"the Trainer's own checkpoint {own.path} (step {own.step}) is newer than keepalive's newest "
              f"(step {keepalives}): training continues from the Trainer's, as the Trainer resumes it (its "
              "checkpoint has no running loss sum: the first loss logged may differ from an uninterrupted "
              "run's), and keepalive checkpoints from there. For keepalive's exact resume, leave "
              "resume_from_checkpoint out.", key="hf-own-resume")


# ----------------------------------------------------------------------------------- the plan
def plan_of(args: TrainingArguments, state: TrainerState) -> Dict[str, Any]:
    """What the code asks for: the training's length and its learning-rate schedule."""
    return {"epochs": int(state.num_train_epochs or 0), "max_steps": int(state.max_steps or 0),
            "scheduler": str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)),
            "learning_rate": plans.plain(args.learning_rate), "warmup_steps": plans.plain(args.warmup_steps)}


#: the TrainingArguments that make another training of the same model (compared with a finished
#: unnamed run's: keepalive.runidentity); not its length (more epochs train a finished run on)
SETTINGS = ("learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "optim",
            "lr_scheduler_type", "warmup_ratio", "warmup_steps", "label_smoothing_factor", "seed", "data_seed")


def settings_of(args: TrainingArguments) -> Dict[str, Any]:
    """The training's settings as the code set them (``TrainingArguments.learning_rate``: 0.001, ...)."""
    out: Dict[str, Any] = {}
    for name in SETTINGS:
        value = getattr(args, name, None)
        value = getattr(value, "value", value)  # an enum (optim, lr_scheduler_type): its name in the arguments
        if value is None or isinstance(value, (int, float, bool, str)):
            out[f"TrainingArguments.{name}"] = value
    return out


def tell_plan(core: Checkpointer, state: TrainerState) -> None:
    """Say once what changed in the plan since the checkpoint (its epochs, steps, learning rate,
    schedule) and what happens."""
    found = plans.changes(core.saved_plan, core.plan)
    if not found:
        return
    done = int(core.counters["step"])
    length = [k for k, _, _ in found if k in ("epochs", "max_steps")]
    lines = [f"the training's plan changed since the checkpoint ({plans.describe(found)})."]
    if length:
        total = int(state.max_steps)
        if done >= total:
            lines.append(f"The checkpoint has trained {done} steps, not fewer than the {total} of this plan: "
                         "nothing more is trained and its state is restored.")
        else:
            lines.append(f"Training continues from step {done} to step {total} with the schedule this code "
                         f"builds ({core.plan.get('scheduler')} over {total} steps), so the learning rates "
                         "from there on are the new plan's.")
    if any(k not in ("epochs", "max_steps") for k, _, _ in found):
        lines.append("The checkpoint's optimizer and scheduler state wins for the learning rate, warmup and "
                     "scheduler settings (restored as saved); to train with the new ones, use another run "
                     "(path or run=).")
    core.warn(" ".join(lines), key="hf-plan")


def plan_extended(core: Checkpointer) -> bool:
    """The plan is longer than the saved one's (epochs or steps): a finished run continues."""
    return bool(plans.changes(core.saved_plan, core.plan, keys=("epochs", "max_steps")))


# ------------------------------------------------------------------------------- data position
def check_position_fits(data: Mapping[str, Any], *, where: str, world: int, now: Tuple[Any, ...],
                        positionable: bool, obstacle: Optional[str]) -> None:
    """A checkpoint inside an epoch fits a training with the same processes, batch size, gradient
    accumulation and batches per epoch (``now``), whose data can be positioned; else nothing is loaded."""
    if not data.get("batch"):
        return
    saved_world = int(data.get("processes") or 1)
    if saved_world != world:
        raise StateMismatchError(
            f"the checkpoint {where} is inside epoch {data['epoch']} of a training on {saved_world} "
            f"process(es), where each one's batches are its shard of the epoch; this one runs on {world}. "
            f"Nothing was loaded. Launch it on {saved_world} process(es) to continue the run, or start a "
            "new run (path or run=).")
    then = (data.get("batch_size"), data.get("gradient_accumulation_steps"), data.get("steps_in_epoch"))
    if now != then:
        raise StateMismatchError(
            f"the checkpoint {where} is inside epoch {data['epoch']} of a training with batch size, "
            f"gradient accumulation and batches per epoch {then}; this one has {now}. Nothing was "
            "loaded. Keep the settings to continue the run, or start a new run (path or run=).")
    if not positionable:
        raise StateMismatchError(
            f"the checkpoint {where} is inside epoch {data['epoch']}, but this training's data cannot "
            f"be positioned ({obstacle}). Nothing was loaded.")
