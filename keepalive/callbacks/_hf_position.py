"""The training data's position in one ``Trainer.train()`` call: how its epochs are cut into batches, the
positioned batch sampler or the stream that lets a resume start an epoch at any batch, and the random
states a mid-epoch resume replays (the mechanisms: :mod:`keepalive.callbacks._hf_data`).

The adapter (:mod:`keepalive.callbacks.transformers`) counts the epoch and batch; this part says where the
data can be put back, writes the checkpoint's ``data`` part and reads its order back.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

from transformers import TrainingArguments

from . import _hf_data, _hf_samplers

#: why a stream is checkpointed at epoch ends only with several processes
STREAM_ON_PROCESSES = ("a stream (IterableDataset) on several processes: keepalive checkpoints it at epoch ends "
                       "only; a map-style dataset is checkpointed inside epochs too")


class DataPosition:
    """What positions the training data of one ``train()`` call (a fresh one for each call)."""

    def __init__(self, steps_in_epoch: int = 0, batch_size: int = 0):
        self.steps_in_epoch = steps_in_epoch  # batches per epoch (0: a stream, whose epoch has no length)
        self.batch_size = batch_size
        self.sampler: Optional[_hf_data.PositionedBatchSampler] = None
        self.stream = ""               # an IterableDataset: "stateful" / "reread" (see _hf_data.stream_kind)
        self.replay: Optional[_hf_data.Replay] = None  # the random states a mid-epoch resume replays
        self.replay_resume: Optional[Dict[str, Any]] = None  # the resumed pass's, until its first fetch
        self.epoch_fix: Optional[Tuple[int, int]] = None  # (epoch, steps_in_epoch): state.epoch of a stream read on

    @property
    def positionable(self) -> bool:
        """An epoch can be continued at any batch: checkpoints inside epochs are exact."""
        return self.sampler is not None or bool(self.stream)

    def install(self, loader: Any, args: TrainingArguments) -> str:
        """Put the positioned batch sampler in the training loader (or take the stream as it is) and plan
        the replay of its random states; returns why an epoch cannot be continued inside ("" when it can)."""
        self.sampler, why = _hf_data.install(loader, int(args.data_seed if args.data_seed is not None
                                                         else args.seed))
        if why.startswith("custom batch sampler"):  # a library's own (sentence-transformers'): see _hf_samplers
            self.sampler, why = _hf_samplers.install_library(loader)
        if why == "iterable" and args.world_size > 1:
            # accelerate shards or dispatches a stream across the processes; neither is positioned
            why = STREAM_ON_PROCESSES
        elif why == "iterable":  # a stream: positioned by its state_dict() or read again (see _hf_data)
            self.stream, why = _hf_data.stream_kind(loader), ""
        if not why:
            self.replay = _hf_data.Replay(_hf_data.base_loader(loader), self.sampler,
                                          stateful_stream=self.stream == "stateful",
                                          accumulation=int(args.gradient_accumulation_steps))
        return why

    def shape(self, args: TrainingArguments) -> Tuple[int, int, int]:
        """Batch size, gradient accumulation and batches per epoch: a mid-epoch checkpoint needs the same."""
        return self.batch_size, int(args.gradient_accumulation_steps), self.steps_in_epoch

    def capture(self, args: TrainingArguments, epoch: int, batches: int, *, finishing: bool) -> Dict[str, Any]:
        """The checkpoint's ``data`` part: with ``replay`` when it is inside an epoch."""
        data: Dict[str, Any] = {
            "epoch": epoch, "batch": batches, "steps_in_epoch": self.steps_in_epoch, "batch_size": self.batch_size,
            "gradient_accumulation_steps": int(args.gradient_accumulation_steps),
            "processes": int(args.world_size),  # each rank's place is in its shard of the batches
            "order": None if self.sampler is None else [self.sampler.kind, self.sampler.seed],
            "stream": self.stream}
        if self.replay is not None and batches and not finishing:
            data["replay"] = self.replay.capture(batches)
        elif self.replay is not None and not finishing:  # an epoch's end: persistent workers go on
            carry = self.replay.capture_carry()
            if carry:
                data["worker_carry"] = carry
        library = _hf_samplers.library_state(self.sampler, bool(batches) and not finishing
                                             and batches < self.steps_in_epoch)
        if library is not None:
            data["library"] = library
        return data

    def restore_order(self, data: Mapping[str, Any]) -> None:
        """The saved run's epoch order (its sampler kind and seed) wins over this call's."""
        if data.get("order") and self.sampler is not None:
            self.sampler.kind, self.sampler.seed = data["order"][0], int(data["order"][1])
        _hf_samplers.restore_library(self.sampler, data.get("library"))
        if self.replay is not None and data.get("worker_carry") and not data.get("batch"):
            self.replay.resume_carry(data["worker_carry"])

    def end_pass(self) -> None:
        if self.replay is not None:
            self.replay.end_pass()

    def close(self) -> None:
        """``train()`` ended: the loader gets its dataset back, the workers' states folder goes."""
        if self.replay is not None:
            self.replay.end_pass()
            self.replay.close()
