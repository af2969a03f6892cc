"""A masked-LM ``Trainer`` run for the HF adapter's data crash tests (``tests/scripts/hf_setup.py``: a tiny BERT,
``DataCollatorForLanguageModeling`` masking while batches are made, dropout, accumulation 2). Prints ``STEP n``
after each optimizer step and ``COMMITTED n`` after each keepalive commit; at the end writes the weights, the
optimizer state and the log history (without timings).

``--data map|stream|hfstream``, ``--workers N``; ``--plain``: no callback (the reference run).
"""
import argparse
import json
import os
import time

import torch

for _name in ("torchvision::nms", "torchvision::qnms"):  # the CUDA torchvision here (DESIGN.md); tests only
    try:
        torch.library.define(_name, "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    except Exception:  # noqa: BLE001 - already defined
        pass
import hf_setup
from childio import emit
from transformers import TrainerCallback

p = argparse.ArgumentParser()
p.add_argument("run")
p.add_argument("--out", required=True)
p.add_argument("--data", default="map", choices=["map", "stream", "hfstream"])
p.add_argument("--workers", type=int, default=0)
p.add_argument("--every", type=int, default=2)
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--plain", action="store_true")
args = p.parse_args()
torch.set_num_threads(1)


class Steps(TrainerCallback):
    def on_step_end(self, a, state, control, **kw):
        emit(f"STEP {state.global_step}")
        if args.sleep:
            time.sleep(args.sleep)


ckpt = None
if not args.plain:
    from keepalive.callbacks.transformers import DriveCheckpoint

    ckpt = DriveCheckpoint(args.run, every=args.every)
    ckpt.core.on_commit.append(lambda r: emit(f"COMMITTED {r.info.step}"))
trainer = hf_setup.trainer(os.path.join(os.path.dirname(args.out), "hf-unused"), ckpt, data=args.data,
                           workers=args.workers, extra_callbacks=[Steps()])
trainer.train()

from safetensors.torch import save_file  # noqa: E402

weights = {k: v.detach().contiguous() for k, v in trainer.model.named_parameters()}
for i, st in trainer.optimizer.state_dict()["state"].items():
    for k, v in st.items():
        if torch.is_tensor(v):
            weights[f"opt.{i}.{k}"] = v.detach().contiguous().reshape(-1).clone()
save_file(weights, args.out)
logs = [{k: v for k, v in e.items() if not k.endswith(("_runtime", "_per_second"))}
        for e in trainer.state.log_history if "train_runtime" not in e]
with open(args.out + ".json", "w") as f:
    json.dump({"log_history": logs, "global_step": trainer.state.global_step}, f)
print("DONE", flush=True)
