"""Which run an unnamed ``DriveCheckpoint()`` writes when one process runs several trainings
(keepalive/runidentity.py), and the line said at a run's first save.

* a K-fold loop: each fold its own run (``default``, ``default-2``, ...), each trained from its own
  start; control: one named run shared by the folds hands fold 0's weights to every later fold;
* an Optuna objective: each trial its own run ``optuna-<study>-trial-<n>`` (found in the caller's
  frames, also from a helper the objective calls), a second checkpointer in one trial ``...-2``, a
  retried trial its original's run, a new trial never a finished run (a study made again under its
  name starts ``.2``);
* the first save says ``protecting run 'x' → <folder>, every ...`` once; ``quiet=True`` silences it;
* the same model with other settings (a script run again with another lr, weight decay, betas or
  optimizer; a Trainer's TrainingArguments) after its run finished: a run of its own, trained from its
  start, said in one line; controls: the same settings find the run complete, a named run keeps its
  checkpoint, an unfinished run resumes (the checkpoint's values in force), a further stage of a model
  trained here is no other training.
"""
from __future__ import annotations

import os
import warnings

import pytest

torch = pytest.importorskip("torch")

import hfkit  # noqa: E402
from keepalive import runidentity  # noqa: E402
from keepalive.callbacks.torch import DriveCheckpoint  # noqa: E402
from keepalive.store import CheckpointStore  # noqa: E402


def _fold_training(fold: int, run=None, quiet=True):
    """One fold: a tiny model trained two epochs on its own split; (run folder, final weights)."""
    torch.manual_seed(fold)
    x = torch.randn(40, 3)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]])
    keep = [i for i in range(40) if i % 5 != fold]
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[keep], y[keep]), batch_size=8)
    ckpt = DriveCheckpoint(model=model, optimizer=opt, quiet=quiet, **({"run": run} if run else {}))
    for _epoch in ckpt.epochs(2):
        for xb, yb in ckpt.batches(loader):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(xb), yb).backward()
            opt.step()
    ckpt.close()
    return ckpt.core.url, model.weight.detach().clone()


def test_kfold_each_fold_its_own_run(tmp_path, monkeypatch):
    monkeypatch.setenv("KEEPALIVE_DIR", str(tmp_path / "home"))
    folds = [_fold_training(k) for k in range(5)]
    names = [url.rsplit("/", 1)[-1] for url, _ in folds]
    assert names == ["default", "default-2", "default-3", "default-4", "default-5"]
    weights = [w for _, w in folds]
    assert all(not torch.equal(weights[0], w) for w in weights[1:])  # each fold trained its own split

    monkeypatch.setenv("KEEPALIVE_DIR", str(tmp_path / "shared-home"))
    shared = [_fold_training(k, run="cv") for k in range(3)]  # control: one run for every fold
    assert all(torch.equal(shared[0][1], w) for _, w in shared[1:])  # folds 1, 2 got fold 0's weights


def test_first_save_line_once_and_quiet(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KEEPALIVE_DIR", str(tmp_path))
    _fold_training(0, run="loud", quiet=False)
    out = capsys.readouterr().out
    line = f"keepalive: protecting run 'loud' → {tmp_path}/loud, every epoch"
    assert out.count("protecting run") == 1 and line in out, out
    _fold_training(0, run="hushed", quiet=True)
    assert "protecting" not in capsys.readouterr().out


# ----------------------------------------------------------------------------------------- Optuna
optuna = pytest.importorskip("optuna")


@pytest.fixture
def study_home(tmp_path, monkeypatch):
    monkeypatch.setenv("KEEPALIVE_DIR", str(tmp_path))
    warnings.simplefilter("ignore")  # the retry callback is "experimental"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return tmp_path


def _made_in(objective, n_trials=1, study=None):
    """The run URLs of the checkpointers ``objective(trial) -> [DriveCheckpoint]`` makes, per trial."""
    study = study or optuna.create_study(study_name="s")
    made = {}

    def wrapped(trial):
        made[trial.number] = [c.core.url.rsplit("/", 1)[-1] for c in objective(trial)]
        return 0.0

    study.optimize(wrapped, n_trials=n_trials)
    return study, made


def test_no_trial_outside_a_study():
    assert runidentity.running_trial() is None


def test_each_trial_its_own_run_also_from_a_helper(study_home):
    def helper():  # the trial is no local of this frame: found in Optuna's own
        return DriveCheckpoint(quiet=True)

    _, made = _made_in(lambda trial: [helper(), DriveCheckpoint(quiet=True)], n_trials=2)
    assert made == {0: ["optuna-s-trial-0", "optuna-s-trial-0-2"], 1: ["optuna-s-trial-1", "optuna-s-trial-1-2"]}


def test_ask_and_tell(study_home):
    """The ask-and-tell interface: the trial asked for is a local of the loop's frame."""
    study = optuna.create_study(study_name="asked")
    names = []
    for _ in range(2):
        trial = study.ask()
        names.append(DriveCheckpoint(quiet=True).core.store.run)
        study.tell(trial, 0.0)
    after = DriveCheckpoint(quiet=True).core.store.run  # `trial` still names the told one: not its run
    assert names == ["optuna-asked-trial-0", "optuna-asked-trial-1"] and not after.startswith("optuna-"), after


def test_retried_trial_writes_its_original_run(study_home):
    study, made = _made_in(lambda trial: [DriveCheckpoint(quiet=True)], n_trials=2)
    CheckpointStore(f"{study_home}/optuna-s-trial-1", keep=None).commit({"a.bin": b"x"}, step=3, epoch=0)
    # what Optuna's heartbeat does to a trial whose process was killed: a WAITING copy that names it
    optuna.storages.RetryHeartbeatStaleTrialCallback()(study, study.trials[1])
    _, again = _made_in(lambda trial: [DriveCheckpoint(quiet=True)], study=study)
    assert again == {2: ["optuna-s-trial-1"]}
    assert optuna.storages.RetryHeartbeatStaleTrialCallback.retried_trial_number(study.trials[2]) == 1


def test_a_new_trial_never_takes_a_finished_run(study_home, capsys):
    CheckpointStore(f"{study_home}/optuna-s-trial-0", keep=None).commit({"a.bin": b"x"}, step=3, epoch=0)
    _, made = _made_in(lambda trial: [DriveCheckpoint()])  # a study made again under the same name
    assert made == {0: ["optuna-s-trial-0.2"]}
    out = capsys.readouterr().out
    assert "run 'optuna-s-trial-0.2'" in out and "run 'optuna-s-trial-0' is an earlier trial 0" in out, out


def test_study_names_become_folder_names():
    assert runidentity.slug("plain_name-1.0") == "plain_name-1.0"
    assert runidentity.slug("a/b") != runidentity.slug("a b") and "/" not in runidentity.slug("a/b")


# ------------------------------------------------------------ a finished run of another training
def _session(hidden: int, monkeypatch, **named):
    """A new process's first unnamed DriveCheckpoint() training an MLP of ``hidden`` units."""
    from keepalive import notebook

    monkeypatch.setattr(notebook, "_UNNAMED", {})  # a new process: its first unnamed checkpointer
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 3)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    ckpt = DriveCheckpoint(model=model, optimizer=opt, **named)
    trained = 0
    for _epoch in ckpt.epochs(2):
        for xb, yb in ckpt.batches(loader):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(xb), yb).backward()
            opt.step()
            trained += 1
    ckpt.close()
    return ckpt.core.store.run, trained, [p.detach().clone() for p in model.parameters()]


def test_a_finished_run_of_another_model_is_not_reused(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KEEPALIVE_DIR", str(tmp_path / "home"))
    assert _session(8, monkeypatch)[:2] == ("default", 8)
    run, trained, weights = _session(16, monkeypatch)  # another model: a run of its own, trained
    out = capsys.readouterr().out
    assert run.startswith("default-") and trained == 8, out
    assert f"run '{run}' (new: another model than run 'default', which finished (model: '0.weight'" in out, out
    monkeypatch.setenv("KEEPALIVE_DIR", str(tmp_path / "alone"))
    alone = _session(16, monkeypatch)[2]
    assert all(torch.equal(a, b) for a, b in zip(alone, weights))
    monkeypatch.setenv("KEEPALIVE_DIR", str(tmp_path / "home"))
    assert _session(16, monkeypatch)[:2] == (run, 0)  # the same training again finds its own run, complete
    assert _session(8, monkeypatch)[:2] == ("default", 0)  # and the first one its own
    runs = sorted(d for d in os.listdir(tmp_path / "home") if d.startswith("default"))
    assert runs == sorted(["default", run])


def test_control_a_named_run_of_another_model_is_refused(tmp_path, monkeypatch):
    """A run the user named is the user's choice: a misfit is refused as ever, nothing moves."""
    from keepalive.errors import StateMismatchError

    monkeypatch.setenv("KEEPALIVE_DIR", str(tmp_path))
    _session(8, monkeypatch, run="mine")
    with pytest.raises(StateMismatchError):
        _session(16, monkeypatch, run="mine")


# ------------------------------------------------- a finished run of the same model, other settings
def _data():
    torch.manual_seed(0)
    x = torch.randn(16, 3)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def _train(ckpt, model, opt, epochs=2, crash_after=None):
    """``ckpt.epochs(epochs)`` over 4 batches an epoch; the optimizer steps it ran (a crash after
    ``crash_after`` steps stands for a kill: the run is left unfinished)."""
    trained = 0
    for _epoch in ckpt.epochs(epochs):
        for xb, yb in ckpt.batches(_data()):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(xb), yb).backward()
            opt.step()
            trained += 1
            if trained == crash_after:
                raise KeyboardInterrupt
    return trained


def _rerun(monkeypatch, make_opt=lambda params: torch.optim.SGD(params, lr=0.1), model=None, **options):
    """A script run again (a new process's first unnamed DriveCheckpoint()): (run, steps trained, weights)."""
    from keepalive import notebook

    monkeypatch.setattr(notebook, "_UNNAMED", {})
    if model is None:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
    opt = make_opt(model.parameters())
    crash = options.pop("crash_after", None)
    ckpt = DriveCheckpoint(model=model, optimizer=opt, **options)
    try:
        trained = _train(ckpt, model, opt, crash_after=crash)
    finally:
        ckpt.close()
    return ckpt.core.store.run, trained, [p.detach().clone() for p in model.parameters()]


def _sgd(lr):
    return lambda params: torch.optim.SGD(params, lr=lr)


def test_a_finished_run_with_another_learning_rate_is_another_training(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KEEPALIVE_DIR", str(tmp_path / "home"))
    assert _rerun(monkeypatch, _sgd(0.1))[:2] == ("default", 8)
    assert _rerun(monkeypatch, _sgd(0.1))[:2] == ("default", 0)  # control: the same training is complete
    assert "run 'default' already completed 2 epoch(s)" in capsys.readouterr().out
    run, trained, weights = _rerun(monkeypatch, _sgd(0.03))
    out = capsys.readouterr().out
    assert run.startswith("default-") and trained == 8, out
    line = f"keepalive: run '{run}' (new: other settings than run 'default', which finished: optimizer lr 0.1 → 0.03;"
    assert out.count(line) == 1 and "already completed" not in out, out
    monkeypatch.setenv("KEEPALIVE_DIR", str(tmp_path / "alone"))
    assert all(torch.equal(a, b) for a, b in zip(_rerun(monkeypatch, _sgd(0.03))[2], weights))  # its own start
    monkeypatch.setenv("KEEPALIVE_DIR", str(tmp_path / "home"))
    assert _rerun(monkeypatch, _sgd(0.03))[:2] == (run, 0)  # run again: its own run, complete
    assert _rerun(monkeypatch, _sgd(0.1))[:2] == ("default", 0)
    assert sorted(os.listdir(tmp_path / "home")) == sorted(["default", run])


def test_other_weight_decay_betas_or_optimizer_are_other_settings(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KEEPALIVE_DIR", str(tmp_path))

    def adamw(**kw):
        return lambda params: torch.optim.AdamW(params, **{"lr": 1e-3, **kw})

    assert _rerun(monkeypatch, adamw(), quiet=True)[:2] == ("default", 8)
    assert _rerun(monkeypatch, adamw(fused=False), quiet=True)[:2] == ("default", 0)  # how a step runs: the same
    for kw, said in [({"weight_decay": 0.1}, "optimizer weight_decay 0.01 → 0.1"),
                     ({"betas": (0.9, 0.95)}, "optimizer betas [0.9, 0.999] → [0.9, 0.95]")]:
        run, trained, _ = _rerun(monkeypatch, adamw(**kw))
        out = capsys.readouterr().out
        assert run.startswith("default-") and trained == 8 and said in out, out
    run, trained, _ = _rerun(monkeypatch, lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9))
    out = capsys.readouterr().out  # another optimizer
    assert run.startswith("default-") and trained == 8 and "which finished: optimizer AdamW → SGD, " in out, out


def test_control_a_named_run_with_another_learning_rate_is_complete(tmp_path, monkeypatch, capsys):
    """A run the user named, or an unfinished one, goes on as before: the checkpoint's values are used."""
    monkeypatch.setenv("KEEPALIVE_DIR", str(tmp_path))
    _rerun(monkeypatch, _sgd(0.1), run="mine", quiet=True)
    assert _rerun(monkeypatch, _sgd(0.03), run="mine", quiet=True)[:2] == ("mine", 0)
    assert "other settings" not in capsys.readouterr().out


def test_an_unfinished_run_resumes_with_the_same_or_other_settings(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KEEPALIVE_DIR", str(tmp_path / "ref"))
    reference = _rerun(monkeypatch, _sgd(0.1), quiet=True)[2]
    for home, lr in (("same", 0.1), ("other", 0.03)):
        monkeypatch.setenv("KEEPALIVE_DIR", str(tmp_path / home))
        with pytest.raises(KeyboardInterrupt):  # killed after 6 of 8 steps, saved at step 4
            _rerun(monkeypatch, _sgd(0.1), every=2, quiet=True, crash_after=6)
        run, trained, weights = _rerun(monkeypatch, _sgd(lr), every=2, quiet=True)
        captured = capsys.readouterr()
        assert (run, trained) == ("default", 4), captured  # resumed, not moved
        assert all(torch.equal(a, b) for a, b in zip(weights, reference))  # the checkpoint's lr in force
        assert ("your code now sets lr 0.1 -> 0.03" in captured.err) == (lr != 0.1), captured.err


def test_a_stage_with_another_optimizer_is_a_stage(tmp_path, monkeypatch, capsys):
    """One checkpointer, a second ckpt.epochs() with another optimizer (under the same name): a stage of
    the run; the script run again finds both stages complete. A model trained to its loop's end in this
    process and given a new DriveCheckpoint with another learning rate (a cell run again with its model)
    goes on as before: the run is complete."""
    from keepalive import notebook

    monkeypatch.setenv("KEEPALIVE_DIR", str(tmp_path))

    def script():
        monkeypatch.setattr(notebook, "_UNNAMED", {})
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ckpt = DriveCheckpoint(model=model, optimizer=opt, quiet=True)
        first = _train(ckpt, model, opt, epochs=2)
        opt2 = torch.optim.Adam(model.parameters(), lr=1e-2)
        ckpt.register("optimizer", opt2)
        second = _train(ckpt, model, opt2, epochs=4)
        ckpt.close()
        return ckpt.core.store.run, first, second, model

    assert script()[:3] == ("default", 8, 8)
    run, first, second, model = script()
    assert (run, first, second) == ("default", 0, 0)
    assert _rerun(monkeypatch, _sgd(0.03), model=model, quiet=True)[:2] == ("default", 0)
    assert os.listdir(tmp_path) == ["default"] and "other settings" not in capsys.readouterr().out


def test_hf_trainer_with_another_learning_rate_is_another_training(tmp_path, monkeypatch, capsys):
    """The same for a Hugging Face Trainer: its TrainingArguments (learning_rate, weight_decay, seed...)."""
    hfkit.importorskip("transformers")  # with the op schemas the CUDA torchvision here needs (DESIGN.md)
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from transformers import logging as hf_logging

    from keepalive import notebook
    from keepalive.callbacks.transformers import DriveCheckpoint as HFCheckpoint

    hf_logging.set_verbosity_error()
    monkeypatch.setenv("KEEPALIVE_DIR", str(tmp_path / "home"))

    def script(lr, trainer=None):
        monkeypatch.setattr(notebook, "_UNNAMED", {})
        if trainer is None:
            torch.manual_seed(0)
            net = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=20, n_positions=4))
            ids = torch.randint(0, 20, (8, 4), generator=torch.Generator().manual_seed(3))
            args = TrainingArguments(output_dir=str(tmp_path / "hf"), per_device_train_batch_size=4,
                                     num_train_epochs=1, learning_rate=lr, report_to=[], disable_tqdm=True,
                                     use_cpu=True, save_strategy="no")
            trainer = Trainer(model=net, args=args, train_dataset=[{"input_ids": x, "labels": x} for x in ids])
        ckpt = HFCheckpoint()
        trainer.callback_handler.callbacks = [c for c in trainer.callback_handler.callbacks
                                              if not isinstance(c, HFCheckpoint)] + [ckpt]
        trainer.train()
        return ckpt.core.store.run, capsys.readouterr().out, trainer

    run, out, first = script(1e-2)
    assert run == "default" and "already completed" not in out, out
    assert "already completed" in script(1e-2)[1]  # control: the same training is complete
    run, out, _ = script(3e-3)
    assert run.startswith("default-") and "already completed" not in out, out
    assert "other settings than run 'default', which finished: TrainingArguments learning_rate 0.01 → 0.003" in out
    assert "already completed" in script(3e-3)[1]
    first.args.learning_rate = 3e-3  # a further train() of a model trained here: its run, not compared
    run, out, _ = script(None, trainer=first)
    assert run == "default" and "already completed" in out, out


def test_lightning_module_with_another_learning_rate_is_another_training(tmp_path, monkeypatch, capsys):
    """The same for Lightning: the module's hyper-parameters (``save_hyperparameters()``)."""
    hfkit.importorskip("lightning")
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from keepalive import notebook
    from keepalive.callbacks.lightning import DriveCheckpoint as LCheckpoint

    monkeypatch.setenv("KEEPALIVE_DIR", str(tmp_path / "home"))

    class Net(L.LightningModule):
        def __init__(self, lr: float, width: int = 4):
            super().__init__()
            self.save_hyperparameters()
            self.layer = torch.nn.Linear(width, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    data = TensorDataset(torch.randn(16, 4, generator=torch.Generator().manual_seed(1)), torch.randn(16, 1))

    def script(lr, module=None):
        monkeypatch.setattr(notebook, "_UNNAMED", {})
        torch.manual_seed(0)
        module = module or Net(lr)
        trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=[LCheckpoint()])
        trainer.fit(module, DataLoader(data, batch_size=8))
        ckpt = next(c for c in trainer.callbacks if isinstance(c, LCheckpoint))
        return ckpt.core.store.run, capsys.readouterr().out, module

    run, out, first = script(1e-2)
    assert run == "default" and "already completed" not in out, out
    assert "already completed" in script(1e-2)[1]  # control: the same training is complete
    run, out, _ = script(3e-3)
    assert run.startswith("default-") and "already completed" not in out, out
    assert "other settings than run 'default', which finished: hparams lr 0.01 → 0.003" in out
    assert "already completed" in script(3e-3)[1]
    assert "already completed" in script(None, module=first)[1]  # the module trained here, fit again: complete
