"""The Hugging Face ``Trainer`` on several processes (gloo, CPU), checkpointed by keepalive inside epochs:
``torchrun --nproc_per_node=2 hf_ddp.py RUN_DIR OUT_DIR``. Used by tests/test_transformers_ddp.py.

The training (tests/scripts/hf_setup.py): a tiny BERT built from a config (random weights, dropout), synthetic
token rows, ``DataCollatorForLanguageModeling`` (random masking while batches are made), gradient accumulation
2; the Trainer creates the process group itself (``ddp_backend="gloo"``) and shards the shuffled batches
across the ranks through accelerate. 88 rows, batch 4: 22 batches, 11 per rank, 6 optimizer steps per epoch.

Each rank writes ``OUT_DIR/pid.<attempt>.<rank>`` at start (the test kills ranks by these PIDs) and, at the
end, ``OUT_DIR/final.<rank>.pt``: its trainable weights, optimizer state and log history (without timings).
Rank 0 prints ``ATTEMPT a`` when training starts, ``STEP n`` after each optimizer step, ``WRITING n`` as a
checkpoint's files are being written, ``COMMITTED n`` after each commit.

Environment (test knobs): HFDDP_ATTEMPT (this job's number, for the PID files), HFDDP_MODE (``keepalive``,
``plain``: the same training without keepalive, ``broken``: negative control, from the second attempt on
rank 1 reads rank 0's shard of the batches), HFDDP_EVERY (2 steps), HFDDP_EPOCHS (3), HFDDP_SLOW_WRITE
(seconds each checkpoint file write takes: kills land inside saves), HFDDP_STEP_SLEEP (seconds per step),
HFDDP_WORKERS (the loader's worker processes, 0: batches made in the main process).
"""
import json
import os
import sys
import time

import torch

# The registry's torchvision is a CUDA build: next to this CPU torch its import fails unless the op
# schemas exist first (DESIGN.md; transformers imports it when installed). Tests only.
for _name in ("torchvision::nms", "torchvision::qnms"):
    try:
        torch.library.define(_name, "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    except Exception:  # noqa: BLE001 - already defined
        pass
import hf_setup  # noqa: E402
from childio import emit, exit_after_group  # noqa: E402
from transformers import DataCollatorForLanguageModeling, Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from transformers import logging as hf_logging  # noqa: E402

ROWS = 88


class Steps(TrainerCallback):
    """``STEP n`` (rank 0) after each optimizer step; a pause per step when asked (kills land between steps)."""

    def __init__(self, rank: int, pause: float):
        self.rank, self.pause = rank, pause

    def on_train_begin(self, args, state, control, **kwargs):
        if self.rank == 0:
            emit(f"ATTEMPT {os.environ.get('HFDDP_ATTEMPT', '0')}")

    def on_step_end(self, args, state, control, **kwargs):
        if self.rank == 0:
            emit(f"STEP {state.global_step}")
        if self.pause:
            time.sleep(self.pause)


class RankZerosShard(TrainerCallback):
    """Negative control: after a restart, rank 1 reads rank 0's shard of every epoch's batches."""

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        from keepalive.callbacks import _hf_data

        sampler = _hf_data.base_loader(train_dataloader).batch_sampler
        sampler.shard["process_index"] = 0


def slow_writes(seconds: float) -> None:
    from keepalive.store import CheckpointStore

    original = CheckpointStore._write_one
    told = set()

    def slow_write(self, path, chunks, hasher=None, progress=None):
        folder = os.path.basename(os.path.dirname(path))
        if folder not in told:
            told.add(folder)
            emit(f"WRITING {folder}")
        time.sleep(seconds)
        return original(self, path, chunks, hasher, progress)

    CheckpointStore._write_one = slow_write


def main(run_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("HFDDP_ATTEMPT", "0"))
    mode = os.environ.get("HFDDP_MODE", "keepalive")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"pid.{attempt}.{rank}"), "w") as f:
        f.write(str(os.getpid()))
    if float(os.environ.get("HFDDP_SLOW_WRITE", "0")):
        slow_writes(float(os.environ["HFDDP_SLOW_WRITE"]))
    callbacks: list = []
    if mode != "plain":
        from keepalive.callbacks.transformers import DriveCheckpoint

        ckpt = DriveCheckpoint(run_dir, every=int(os.environ.get("HFDDP_EVERY", "2")), keep=None)
        if rank == 0:
            ckpt.core.on_commit.append(lambda r: emit(f"COMMITTED {r.info.step}"))
        callbacks.append(ckpt)
        if mode == "broken" and attempt > 0 and rank == 1:
            callbacks.append(RankZerosShard())
    # after keepalive's: ATTEMPT comes after the line saying where the attempt resumes
    callbacks.append(Steps(rank, float(os.environ.get("HFDDP_STEP_SLEEP", "0"))))
    args = TrainingArguments(
        output_dir=os.path.join(out_dir, "hf"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=5e-3, lr_scheduler_type="linear", warmup_steps=2, logging_steps=1, report_to=[],
        disable_tqdm=True, use_cpu=True, ddp_backend="gloo", seed=42, save_strategy="no",
        dataloader_num_workers=int(os.environ.get("HFDDP_WORKERS", "0")),
        num_train_epochs=int(os.environ.get("HFDDP_EPOCHS", "3")))
    collator = DataCollatorForLanguageModeling(hf_setup.tokenizer(), mlm_probability=0.3)
    trainer = Trainer(model=hf_setup.model(), args=args, train_dataset=hf_setup.Rows(ROWS), data_collator=collator,
                      callbacks=callbacks)
    trainer.train()
    logs = [{k: v for k, v in e.items() if not k.endswith(("_runtime", "_per_second"))}
            for e in trainer.state.log_history if "train_runtime" not in e]
    torch.save({"weights": {k: v.detach().clone() for k, v in trainer.model.named_parameters()},
                "optimizer": trainer.optimizer.state_dict()["state"], "logs": json.dumps(logs, sort_keys=True),
                "step": trainer.state.global_step},
               os.path.join(out_dir, f"final.{rank}.pt"))
    emit(f"DONE rank {rank} step {trainer.state.global_step}")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # both ranks are done with gloo before either tears it down
        torch.distributed.destroy_process_group()
        exit_after_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
