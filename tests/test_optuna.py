"""A real Optuna study with an unnamed ``DriveCheckpoint()`` in its objective: every trial is its own run.

The study (tests/scripts/optuna_sweep.py) lives in SQLite with a heartbeat and Optuna's retry
callback; its objective trains a tiny MLP whose lr and dropout are sampled and whose hidden size is
8 or 16. What is shown:

* every trial trains its own parameters: each trial's value and final weights equal those of the
  same parameters trained alone (nothing reused from another trial, no ``StateMismatchError`` for
  a trial with another hidden size);
* one trial SIGKILLed mid-training (the study process, a child) is failed by the heartbeat when the
  study is resumed, retried under a new number with the same parameters, and the retry resumes the
  killed trial's run from its newest checkpoint: its value and weights equal an uninterrupted
  training of those parameters;
* negative control: the trials sharing one run (the old behaviour, in which every unnamed
  checkpointer of a new process found the first one's run) reuse a finished trial's value, or fail
  on another model's shapes.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings

import pytest

optuna = pytest.importorskip("optuna")
torch = pytest.importorskip("torch")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "scripts"))

import optuna_sweep  # noqa: E402 - the objective's training, alone

SCRIPT = os.path.join(HERE, "scripts", "optuna_sweep.py")
KILL_TRIAL, KILL_STEP = 2, 11  # step 11 of 18: after the save of step 10, so step 11 is trained again


def _study(tmp_path, home, *extra: str, kill: bool = False):
    """Run the study script; with ``kill``: SIGKILL it once its trial ``KILL_TRIAL`` says so."""
    env = dict(os.environ, KEEPALIVE_DIR=str(home), OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, SCRIPT, "--db", str(tmp_path / "study.db"), "--out", str(tmp_path / "out"), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if kill and line.startswith("KILLME"):
            proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=300)
    return proc.returncode, "".join(lines)


def _alone(params: dict, tmp_path, name: str):
    torch.set_num_threads(1)
    return optuna_sweep.train(params, path=str(tmp_path / "alone" / name))


def test_each_trial_its_own_run_and_a_killed_trial_resumes(tmp_path):
    home = tmp_path / "home"
    (tmp_path / "out").mkdir()
    code, first = _study(tmp_path, home, "--kill-trial", str(KILL_TRIAL), "--kill-step", str(KILL_STEP), kill=True)
    assert code == -signal.SIGKILL, first
    assert f"KILLME {KILL_TRIAL}" in first
    killed_at = time.monotonic()
    time.sleep(max(0.0, 3.0 - (time.monotonic() - killed_at)))  # past the heartbeat's grace period (2 s)
    code, second = _study(tmp_path, home)
    assert code == 0, second

    trials = [line.split() for line in second.splitlines() if line.startswith("TRIAL ")]
    states = {int(t[1]): t[2] for t in trials}
    assert states[KILL_TRIAL] == "FAIL"  # the heartbeat failed it; the retry callback made a new trial
    retries = [int(t[1]) for t in trials if t[3] == str(KILL_TRIAL)]
    assert len(retries) == 1 and states[retries[0]] == "COMPLETE", trials
    retry = retries[0]
    # the retry resumed the killed trial's run (its newest checkpoint, step KILL_STEP - 2 or so)
    assert f"resuming run 'optuna-sweep-trial-{KILL_TRIAL}'" in second, second
    assert f"Optuna trial {retry} of study 'sweep'" in second and f"retries trial {KILL_TRIAL}" in second

    done = sorted(n for n, s in states.items() if s == "COMPLETE")
    assert len(done) == 6
    runs = sorted(os.listdir(home / "optuna-sweep-trial-0" / ".."))
    assert [r for r in runs if r.startswith("optuna-")] == sorted(
        f"optuna-sweep-trial-{KILL_TRIAL if n == retry else n}" for n in done)
    values = []
    for n in done:
        saved = torch.load(tmp_path / "out" / f"trial{n}.pt")
        value, weights = _alone(saved["params"], tmp_path, f"t{n}")
        assert saved["value"] == value, (n, saved["params"], saved["value"], value)
        for key, tensor in weights.items():
            assert torch.equal(saved["weights"][key], tensor), (n, key)
        values.append(value)
    assert len(set(values)) == len(values)  # no trial handed back another's value
    assert {torch.load(tmp_path / "out" / f"trial{n}.pt")["params"]["hidden"] for n in done} == {8, 16}


def test_control_trials_sharing_one_run_reuse_a_finished_one(tmp_path, monkeypatch):
    """The old behaviour's shape (every trial on the same run): the second trial, same model, hands
    back the first one's value without training; a third with another hidden size fails on shapes."""
    monkeypatch.setenv("KEEPALIVE_DIR", str(tmp_path / "home"))
    warnings.simplefilter("ignore")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for params in ({"lr": 0.05, "dropout": 0.1, "hidden": 8}, {"lr": 0.2, "dropout": 0.3, "hidden": 8},
                   {"lr": 0.1, "dropout": 0.0, "hidden": 16}):
        study.enqueue_trial(params)

    def objective(trial):
        params = {"lr": trial.suggest_float("lr", 0.01, 0.3, log=True),
                  "dropout": trial.suggest_float("dropout", 0.0, 0.5),
                  "hidden": trial.suggest_categorical("hidden", optuna_sweep.HIDDEN)}
        return optuna_sweep.train(params, run="shared")[0]

    study.optimize(objective, n_trials=3, catch=(Exception,))
    first, second, third = study.trials
    alone = _alone(second.params, tmp_path, "second")[0]
    assert second.value == first.value != alone  # reused: trial 1 trained nothing
    assert third.state == optuna.trial.TrialState.FAIL  # StateMismatchError: another hidden size
