"""What the ``transformers`` adapter tells the user: what a resume cannot replay exactly, a save that
waits for the end of an evaluation, the best model's weights found or lost. Each is one line, said once
(by its key) through the core."""
from __future__ import annotations

from typing import Any, Optional, Tuple

from transformers import Trainer

from ..core import Checkpointer
from ..interrupts import signal_name
from . import _hf_data
from .replay import STATE_WAIT_S


def tell_inexact(core: Checkpointer, trainer: Trainer, stream: str, replay: Optional[_hf_data.Replay]) -> None:
    """At the first mid-epoch save: what a resume from it cannot replay exactly (once each)."""
    if stream == "reread":
        name = type(_hf_data.base_loader(trainer.callback_handler.train_dataloader).dataset).__name__
        core.warn(f"the training data is an IterableDataset ({name}) without state_dict(): a resume reads "
                  "its pass again from the start and drops the batches already trained (the Trainer's own "
                  "skip), which is exact only if the stream yields the same items in the same order on "
                  "every pass. Give it state_dict()/load_state_dict() (e.g. a datasets.IterableDataset) "
                  "to continue where it stopped", key="hf-stream")
    collator: Any = getattr(trainer.data_collator, "data_collator", trainer.data_collator)  # columns remover
    if getattr(collator, "seed", None) is not None:  # DataCollatorForLanguageModeling(seed=...)
        core.warn(f"the data collator {type(collator).__name__} draws from its own generator (seed="
                  f"{collator.seed}), which keepalive does not save: after a mid-epoch resume its draws "
                  "differ from the uninterrupted run's. Leave seed= unset (the Trainer's seed then "
                  "decides, and keepalive replays it)", key="hf-collator")
    if replay is not None and replay.deep_ahead:
        core.warn("the training loader fetched more than one batch ahead of a save: a resume replays the "
                  "random state of one, so random draws of the others (augmentation, masking) differ from "
                  "the uninterrupted run's", key="hf-ahead")
    if replay is not None and replay.workers_lost:
        core.warn("a loader worker had not started the next batch within "
                  f"{STATE_WAIT_S:g} s of a save, so its random state is not in the checkpoint: after a "
                  "resume from it, random draws in workers (augmentation, masking) differ from the "
                  "uninterrupted run's", key="hf-workers")


def watching(core: Checkpointer) -> Tuple[Any, Any]:
    """What :func:`tell_eval_for_step` compares with: the deadline and notice the trigger had seen."""
    return core.trigger.deadline_hit, core.trigger.notice_hit


def tell_eval_for_step(core: Checkpointer, before: Tuple[Any, Any], step: int) -> None:
    """Said when a signal, a notice or the deadline came (since :func:`watching` gave ``before``) during
    the evaluation the Trainer runs for a step."""
    signum = core.signals.peek()
    deadline, notice = before
    came = (signal_name(signum) if signum is not None else "a preemption notice"
            if core.trigger.notice_hit is not notice else "the deadline"
            if core.trigger.deadline_hit != deadline else None)
    if not came:
        return
    core.warn(f"{came} came during the evaluation the Trainer runs for step {step} "
              "(eval_strategy=\"steps\"), before keepalive's boundary of that step: the save waits for the "
              "evaluation's end. During an evaluation at an epoch's end (eval_strategy=\"epoch\") keepalive "
              "saves at once", key="hf-eval-steps")


def say_already_complete(core: Checkpointer, step: int) -> None:
    core.already_complete(message=f"run '{core.store.run}' already completed (global step {step}); its final "
                                  "state is restored and nothing is trained. To train again, use another run "
                                  "(path or run=).")


def say_best_loaded(core: Checkpointer, trainer: Trainer, path: str) -> None:
    state = trainer.state
    core.say(f"loaded the best model (step {state.best_global_step}, "
             f"{trainer.args.metric_for_best_model} {state.best_metric}) from keepalive's checkpoint: "
             f"the Trainer's folder {path} no longer exists.")


def tell_best_lost(core: Checkpointer, path: str) -> None:
    core.warn(f"the best model's folder {path} no longer exists (a local output_dir is lost with the VM) "
              "and keepalive's checkpoint does not hold its weights: the training ends with the last "
              "model, not the best one. Put output_dir on persistent storage (e.g. Drive) to keep it.",
              key="hf-best-lost")
