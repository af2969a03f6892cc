"""The two-stage fastai recipe for crash tests: ``freeze()``, ``fit_one_cycle(2)``, ``unfreeze()``,
``fit_one_cycle(2, lr_max=slice(...))``, with a ``CSVLogger`` on the learner. ``--cb each``: a new
``DriveCheckpoint(path)`` in each fit call (as people copy the README's inline form), ``shared``: one
for both, ``none``: without keepalive (the reference). ``--first skip``: the first fit commented out
(a re-run of a script that died in its second fit). Prints `STEP n` after each optimizer step and
`COMMITTED n` after each commit; writes the final weights (safetensors), the Recorder history and
the CSVLogger's file (JSON) next to each other."""
import argparse
import json
import os
import sys
import time

import torch
from childio import emit
from fastai.callback.core import Callback
from fastai.callback.progress import CSVLogger
from fastai_setup import history, make_learner, weights
from safetensors.torch import save_file

import keepalive.callbacks._fastai_state as fastai_state
from keepalive.callbacks.fastai import DriveCheckpoint

p = argparse.ArgumentParser()
p.add_argument("run")
p.add_argument("--out", required=True)
p.add_argument("--cb", default="each", choices=["each", "shared", "none"])
p.add_argument("--first", default="run", choices=["run", "skip"])
p.add_argument("--every", default="4")
p.add_argument("--csv-append", action="store_true")
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--break", dest="breaks", default="",
               help="negative controls, comma-separated: stage = a new callback never takes the live learner "
               "as the next stage; counter = fits counted per callback object; plan = fits matched by place only; "
               "csv = the CSVLogger's file not restored")
args = p.parse_args()
torch.set_num_threads(1)

breaks = set(args.breaks.split(",")) - {""}
if "stage" in breaks:
    fastai_state.RunHere.live = property(lambda self: None, lambda self, value: None)  # type: ignore
if "counter" in breaks:
    _run_here = fastai_state.run_here
    fastai_state.run_here = lambda url, learn: fastai_state.RunHere(_run_here(url, learn).learner)
if "plan" in breaks:
    fastai_state.FitLog._prefer_plan = lambda self, candidates, at, plan: at
if "csv" in breaks:
    fastai_state.restore_loggers = lambda learn, saved: None
    fastai_state.write_loggers = lambda learn, saved: None

every = int(args.every) if args.every.isdigit() else args.every
current = {"cb": None, "steps": 0}


def checkpoint():
    cb = DriveCheckpoint(args.run, every=every)
    cb.core.on_commit.append(lambda r: emit(f"COMMITTED {r.info.step}"))
    current["cb"] = cb
    return cb


class PrintSteps(Callback):
    order = 200

    def after_batch(self):
        if self.learn.training:
            cb = current["cb"]
            current["steps"] += 1
            emit(f"STEP {cb.counters['step'] + 1 if cb is not None else current['steps']}")
            if args.sleep:
                time.sleep(args.sleep)


out_dir = os.path.dirname(os.path.abspath(args.out))
os.makedirs(out_dir, exist_ok=True)
learn = make_learner(seed=42, n_train=96, hidden=64, path=out_dir,
                     cbs=[PrintSteps(), CSVLogger(append=args.csv_append)])
learn.remove_cb(learn.progress)
shared = checkpoint() if args.cb == "shared" else None


def cbs():
    if args.cb == "none":
        return None
    return shared if shared is not None else checkpoint()


learn.freeze()
if args.first == "run":
    learn.fit_one_cycle(2, 3e-3, cbs=cbs())
learn.unfreeze()
learn.fit_one_cycle(2, lr_max=slice(1e-5, 1e-3), cbs=cbs())
if current["cb"] is not None and current["cb"].stopped:
    print("STOPPED", flush=True)
    sys.exit(3)
save_file(weights(learn), args.out)
with open(args.out + ".json", "w") as f:
    log = learn.path / "history.csv"
    csv = log.read_text() if log.exists() else ""
    trained = hasattr(learn.recorder, "values")  # a control that skips every fit trains nothing
    json.dump({"history": history(learn) if trained else None, "csv": csv}, f)
print("DONE", flush=True)
