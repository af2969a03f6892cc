"""An Optuna study whose objective trains a tiny torch model with an unnamed ``DriveCheckpoint()``.

``python optuna_sweep.py --db s.db --out DIR --trials 6 [--kill-trial 2 --kill-step 10] [--fixed-run NAME]``

The study lives in SQLite with a heartbeat and Optuna's retry callback, so a trial killed
mid-training is failed by the next process and retried (a new trial number, the same parameters).
Every trial writes ``DIR/trial<number>.pt`` (its value and final weights). ``--kill-trial``: that
trial prints ``KILLME`` once its checkpoint of step ``--kill-step`` - 2 is committed and waits for
the test's SIGKILL. ``--fixed-run``: every trial writes one named run (the old behaviour's shape,
the negative control). ``train(params, path)`` is the objective's training, alone.
"""
import argparse
import os
import sys
import time
import warnings

import torch

from keepalive.callbacks.torch import DriveCheckpoint

EPOCHS, BATCHES, BATCH = 3, 6, 8
#: a trial's parameters: lr and dropout sampled, the hidden size from a short list
HIDDEN = (8, 16)


def data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(BATCHES * BATCH, 5, generator=g)
    return torch.utils.data.TensorDataset(x, (x.sum(1, keepdim=True) > 0).float())


def train(params: dict, path=None, run=None, hook=None) -> tuple:
    """One training of ``params``: (value, final weights). ``hook(ckpt)`` is called after each step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, params["hidden"]), torch.nn.ReLU(),
                                torch.nn.Dropout(params["dropout"]), torch.nn.Linear(params["hidden"], 1))
    opt = torch.optim.SGD(model.parameters(), lr=params["lr"], momentum=0.9)
    loader = torch.utils.data.DataLoader(data(), batch_size=BATCH, shuffle=True)
    named = {"run": run} if run is not None else {}
    ckpt = DriveCheckpoint(path, model=model, optimizer=opt, every=2, **named)
    for _epoch in ckpt.epochs(EPOCHS):
        model.train()
        for x, y in ckpt.batches(loader):
            opt.zero_grad()
            torch.nn.functional.binary_cross_entropy_with_logits(model(x), y).backward()
            opt.step()
            if hook is not None:
                hook(ckpt)
    model.eval()
    with torch.no_grad():
        x, y = data().tensors
        value = float(torch.nn.functional.binary_cross_entropy_with_logits(model(x), y))
    ckpt.close()
    return value, {k: v.clone() for k, v in model.state_dict().items()}


def main() -> None:
    import optuna
    from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback

    p = argparse.ArgumentParser()
    p.add_argument("--db", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--trials", type=int, default=6)
    p.add_argument("--kill-trial", type=int, default=None)
    p.add_argument("--kill-step", type=int, default=None)
    p.add_argument("--fixed-run", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # Optuna's heartbeat and retry are "experimental"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = RDBStorage(f"sqlite:///{args.db}", heartbeat_interval=1, grace_period=2,
                         heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=3))
    study = optuna.create_study(study_name="sweep", storage=storage, load_if_exists=True)
    # seeded, and not the same seed again in a resumed study (that would sample the first trials' values again)
    study.sampler = optuna.samplers.RandomSampler(seed=3 + len(study.trials))

    def objective(trial: "optuna.trial.Trial") -> float:
        params = {"lr": trial.suggest_float("lr", 0.01, 0.3, log=True),
                  "dropout": trial.suggest_float("dropout", 0.0, 0.5),
                  "hidden": trial.suggest_categorical("hidden", HIDDEN)}

        def hook(ckpt) -> None:
            if trial.number == args.kill_trial and ckpt.step == args.kill_step:
                ckpt.flush()  # the checkpoint of the step before is committed: the kill lands after it
                print("KILLME", trial.number, ckpt.step, flush=True)
                time.sleep(600)

        value, weights = train(params, run=args.fixed_run, hook=hook)
        torch.save({"value": value, "params": params, "weights": weights, "run": trial.number},
                   os.path.join(args.out, f"trial{trial.number}.pt"))
        return value

    while sum(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials) < args.trials:
        study.optimize(objective, n_trials=1)
    for t in study.trials:
        print("TRIAL", t.number, t.state.name, t.system_attrs.get("failed_trial"), flush=True)


if __name__ == "__main__":
    sys.exit(main())
