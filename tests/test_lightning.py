"""The PyTorch Lightning adapter: random SIGKILLs against real ``Trainer.fit`` subprocesses
(``LightningDataModule``, validation inside the epoch, ``EarlyStopping`` / ``ModelCheckpoint``,
Lightning's OneCycleLR recipe over ``trainer.estimated_stepping_batches`` stepped per step (its
``configure_optimizers`` builds the training loader before the loop state is restored), or manual
optimization with two optimizers) must end bit-identical to an
uninterrupted run: weights, optimizer states, the logged history, the final metrics. The same kills
against Lightning's own ``ModelCheckpoint(save_last=True, every_n_train_steps=...)`` +
``fit(ckpt_path="last")`` are measured side by side (work redone per kill, exactness). In-process
tests cover the deadline stop, a finished run, ``keepalive ls`` / ``verify``, a loader that cannot be
positioned, a checkpoint that does not fit, and the ``pytorch_lightning`` namespace."""
import contextlib
import importlib.util
import json
import os
import random
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SHIMS = os.path.join(HERE, "shims")
SCRIPT = os.path.join(HERE, "scripts", "lightning_train.py")


def _load_torchvision_shim():
    """The CUDA torchvision of this test machine needs its op schemas defined before it is imported
    (lightning imports it): the test-only shim of tests/shims, loaded under a private name."""
    spec = importlib.util.spec_from_file_location("_keepalive_tv_shim", os.path.join(SHIMS, "sitecustomize.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


torch = pytest.importorskip("torch")
_load_torchvision_shim()
pl = pytest.importorskip("lightning.pytorch")
from safetensors.torch import load_file  # noqa: E402
from torch.utils.data import DataLoader, IterableDataset, TensorDataset  # noqa: E402

import crashkit  # noqa: E402
from crashkit import assert_differs, run_to_completion  # noqa: E402
from fakeclock import deadline_after  # noqa: E402
from forkserver import ForkingSubprocess, ServerPool  # noqa: E402
from keepalive.callbacks.lightning import DriveCheckpoint  # noqa: E402
from keepalive.errors import StateMismatchError  # noqa: E402

ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([SHIMS, os.path.join(HERE, "scripts"), os.path.dirname(HERE)]),
           KEEPALIVE_PROGRESS="0", OMP_NUM_THREADS="1")

#: what lightning_train.py imports before keepalive: the crash children fork from a server that has
#: imported it (some 4 s of CPU each, 16 children here; the server's interpreter ran the shims' sitecustomize)
PRELOAD = ["torch", "torch._dynamo", "safetensors.torch", "lightning.pytorch"]


@pytest.fixture(scope="module", autouse=True)
def forked_children():
    pool = ServerPool(lambda argv, env: ("lightning", PRELOAD, "") if argv[0] == SCRIPT else None, quick_exit=True)
    try:
        with ForkingSubprocess(pool).installed_in(crashkit):  # not the pytorch_lightning child: fresh
            yield pool
    finally:
        pool.close()


KILL_AT = (17, 29, 41)  # inside epochs 2, 3 and 4 (12 steps each)
_KEEPALIVE_RUNS: dict = {}  # the crash test's keepalive run with these kills, for the side-by-side test

# mode -> (script arguments, total steps (= trainer.global_step at the end), kills)
MODES = {
    # automatic optimization, AdamW + OneCycleLR(total_steps=trainer.estimated_stepping_batches) stepped
    # per step, saves every 5 steps
    "auto": (["--mode", "auto", "--every", "5"], 48, 3),
    # manual optimization, two optimizers (global_step counts both: 2 per batch), StepLR by hand
    "manual": (["--mode", "manual", "--every", "6"], 96, 2),
}


def _cmd(run, out, *extra):
    return [sys.executable, SCRIPT, str(run), "--out", str(out), *extra]


def history(run):
    """The logged history as (step, key) -> value; a line written again after a restart (the same
    step redone) replaces the earlier one, a line torn by a kill is skipped."""
    out = {}
    path = os.path.join(str(run), "metrics.jsonl")
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            for k, v in rec["metrics"].items():
                out[f"{rec['step']}:{k}"] = v
    return out


def differences(ref_out, ref_run, out, run):
    """What differs between two finished runs (empty: bit-identical)."""
    found = []
    wa, wb = load_file(str(ref_out)), load_file(str(out))
    if wa.keys() != wb.keys():
        found.append(f"state keys {sorted(set(wa) ^ set(wb))[:4]}")
    for k in sorted(set(wa) & set(wb)):
        if not torch.equal(wa[k], wb[k]):
            found.append(f"{k} (max |diff| {(wa[k] - wb[k]).abs().max():.3g})")
    ja, jb = (json.load(open(f"{p}.json")) for p in (ref_out, out))
    if ja != jb:
        found.append(f"final metrics / step / lr: {ja} vs {jb}")
    ha, hb = history(ref_run), history(run)
    if ha != hb:
        keys = sorted(k for k in set(ha) | set(hb) if ha.get(k) != hb.get(k))
        found.append(f"logged history: {len(keys)} of {len(ha)} entries differ, e.g. {keys[:3]}")
    return found


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    cache = {}

    def get(mode, native=False):
        key = (mode, native)
        if key not in cache:
            d = tmp_path_factory.mktemp(f"ref-{mode}{'-native' if native else ''}")
            args, total, _ = MODES[mode]
            extra = ["--native"] if native else []
            ref = run_to_completion(_cmd(d / "run", d / "w.st", *args, *extra), total_steps=total, kills=0,
                                    rng=random.Random(0), env=ENV, timeout=240)
            assert "DONE" in ref.final_output
            cache[key] = (d / "w.st", d / "run")
        return cache[key]

    return get


class _Planned(random.Random):
    """Kills after the planned steps (or the first step after a resume, when that is later)."""

    def __init__(self, steps):
        super().__init__(0)
        self.steps = list(steps)

    def randint(self, a, b):
        return min(max(a, self.steps.pop(0)), b) if self.steps else b


def reached(run):
    """The last step each process of a run reached (from the run's own progress file)."""
    out = []
    with open(os.path.join(str(run), "steps.log")) as f:
        for line in f:
            line = line.strip()
            if line == "START":
                out.append(None)
            elif line.isdigit() and out:
                out[-1] = int(line)
    return out


def _kill_report(report):
    return [(t.killed_after_step, nxt.resumed_step) for t, nxt in zip(report.trials, report.trials[1:])]


@pytest.mark.parametrize("mode", list(MODES))
def test_sigkill_resume_is_bit_exact(tmp_path, references, mode):
    args, total, kills = MODES[mode]
    ref_out, ref_run = references(mode)
    rng = _Planned(KILL_AT) if mode == "auto" else random.Random(4200 + len(mode))
    report = run_to_completion(_cmd(tmp_path / "run", tmp_path / "w.st", *args), total_steps=total,
                               kills=len(KILL_AT) if mode == "auto" else kills, rng=rng,
                               run_dir=str(tmp_path / "run" / "ka"), env=ENV, timeout=240)
    assert report.kills == kills
    assert "DONE" in report.final_output
    assert differences(ref_out, ref_run, tmp_path / "w.st", tmp_path / "run") == []
    every = int(args[args.index("--every") + 1])
    for killed, resumed in _kill_report(report):
        if resumed is not None:  # lost at most two intervals (the write in flight) and a deferral
            assert killed - resumed <= 2 * every + 2, (killed, resumed)
    print(f"\n{mode}: kills (after step, resumed at step) {_kill_report(report)}")
    if mode == "auto":
        _KEEPALIVE_RUNS["auto"] = (report, tmp_path / "run", tmp_path / "w.st")


def test_sigkill_control_without_the_data_position_differs(tmp_path, references):
    """The control of the crash test: the same recipe (OneCycleLR over estimated_stepping_batches) killed
    once inside epoch 2, resumed with the saved data position not applied (the resumed epoch's order
    made afresh: what a loader built before the loop state is restored gave) must differ from the
    uninterrupted run, so the bit-exact comparison above does see the data order."""
    args, total, _ = MODES["auto"]
    ref_out, _ = references("auto")
    report = run_to_completion(_cmd(tmp_path / "run", tmp_path / "w.st", *args, "--control-drop-position"),
                               total_steps=total, kills=1, rng=_Planned(KILL_AT[:1]), env=ENV, timeout=240,
                               kill_after_commit=15)
    assert report.kills == 1 and "DONE" in report.final_output
    resumed = report.trials[1].resumed_step
    assert resumed is not None and resumed % 12, resumed  # resumed inside an epoch
    assert_differs(load_file(str(ref_out)), load_file(str(tmp_path / "w.st")))


def test_side_by_side_with_lightnings_own_resume(tmp_path, references):
    """The same kills (same steps) against keepalive and against Lightning's own last.ckpt every 5 steps
    + ``fit(ckpt_path="last")``: work redone per kill, and whether the result is the uninterrupted one.
    keepalive must be exact; Lightning's resume restarts the epoch's data from its beginning (its
    DataLoader is not resumable), restores no RNG and loses the epoch's logged accumulators, so a resume
    inside an epoch changes the result (reported, see README)."""
    args, total, _ = MODES["auto"]
    rows = {}
    for name, extra in (("keepalive", []), ("lightning", ["--native"])):
        ref_out, ref_run = references("auto", native=bool(extra))
        if name == "keepalive" and "auto" in _KEEPALIVE_RUNS:  # the crash test above ran these kills
            report, run_dir, out_file = _KEEPALIVE_RUNS["auto"]
        else:
            run_dir, out_file = tmp_path / name / "run", tmp_path / name / "w.st"
            report = run_to_completion(_cmd(run_dir, out_file, *args, *extra), total_steps=total,
                                       kills=len(KILL_AT), rng=_Planned(KILL_AT), env=ENV, timeout=240)
        assert "DONE" in report.final_output
        last = reached(run_dir)[:-1]  # where each killed process was when it died
        resumed = [t.resumed_step or 0 for t in report.trials[1:]]
        rows[name] = {"killed_at": last, "resumed_at": resumed,
                      "redone_steps": [k - r for k, r in zip(last, resumed)],
                      "differences": differences(ref_out, ref_run, out_file, run_dir)}
    print("\n" + json.dumps(rows, indent=1))
    out = os.environ.get("KEEPALIVE_LIGHTNING_COMPARE")
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)
    assert rows["keepalive"]["differences"] == []
    for row in rows.values():
        assert len(row["killed_at"]) == len(KILL_AT) and all(r >= 0 for r in row["redone_steps"]), row


# ------------------------------------------------------------------------------ in-process tests
class Data(pl.LightningDataModule):
    def __init__(self, n=48, iterable=False):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.x, self.y = torch.randn(n + 16, 4, generator=g), torch.randn(n + 16, 1, generator=g)
        self.n, self.iterable = n, iterable

    def train_dataloader(self):
        ds = TensorDataset(self.x[:self.n], self.y[:self.n])
        if self.iterable:
            ds = _Stream(ds)
            return DataLoader(ds, batch_size=8)
        return DataLoader(ds, batch_size=8, shuffle=True)

    def val_dataloader(self):
        return DataLoader(TensorDataset(self.x[self.n:], self.y[self.n:]), batch_size=8)


class _Stream(IterableDataset):
    def __init__(self, ds):
        self.ds = ds

    def __iter__(self):
        return iter(self.ds)


class Net(pl.LightningModule):
    def __init__(self, hidden=16):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Dropout(0.3), torch.nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.log("loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 3, 0.5),
                                                   "interval": "step"}}


def fit(path, epochs=3, hidden=16, iterable=False, stops=False, **options):
    """``stops``: the fit is stopped before its end, which exits a script with 143 (EXIT_STOPPED)."""
    pl.seed_everything(3, verbose=False)
    model, cb = Net(hidden), DriveCheckpoint(str(path), quiet=True, **options)
    trainer = pl.Trainer(max_epochs=epochs, callbacks=[cb], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                         num_sanity_val_steps=0)
    with pytest.raises(SystemExit, match="^143$") if stops else contextlib.nullcontext():
        trainer.fit(model, datamodule=Data(iterable=iterable))
    return model, cb, trainer


def _weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_deadline_stop_then_resume_in_process(tmp_path):
    ref, _, ref_trainer = fit(tmp_path / "ref")
    _, cb, trainer = fit(tmp_path / "run", every=4, remaining_fn=deadline_after(14), stops=True)
    assert cb.stopped and 12 < trainer.global_step < 18
    assert trainer.limit_val_batches == 1.0 and trainer.fit_loop.min_epochs == 0  # settings put back
    model, cb2, trainer2 = fit(tmp_path / "run", every=4)
    assert cb2.core.resumed_from is not None and cb2.finished
    assert trainer2.global_step == ref_trainer.global_step == 18
    for k, v in _weights(ref).items():
        assert torch.equal(v, model.state_dict()[k]), k
    # the last epoch resumed inside: its logged accumulators (loss_epoch) were restored too
    assert {k: float(v) for k, v in trainer2.callback_metrics.items()} == \
        {k: float(v) for k, v in ref_trainer.callback_metrics.items()}


def test_finished_run_trains_nothing_and_cli_sees_it(tmp_path, capsys):
    model, cb, trainer = fit(tmp_path / "run")
    assert cb.finished and trainer.current_epoch == 3
    before = _weights(model)
    model2, cb2, trainer2 = fit(tmp_path / "run")
    assert "already completed 3 epoch(s)" in capsys.readouterr().out
    for k, v in before.items():
        assert torch.equal(v, model2.state_dict()[k]), k
    from keepalive.cli import main

    assert main(["verify", str(tmp_path / "run")]) == 0
    assert main(["ls", str(tmp_path / "run"), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert rows and all(r["valid"] for r in rows) and max(r["step"] for r in rows) == 18


def test_iterable_data_saves_at_epoch_ends_only(tmp_path, capsys):
    _, cb, trainer = fit(tmp_path / "run", every=2, iterable=True)
    err = capsys.readouterr()
    assert "IterableDataset" in err.out + err.err
    steps = sorted(info.step for info in cb.core.store.list())
    assert steps and all(s % 6 == 0 for s in steps), steps  # 6 batches per epoch


def test_checkpoint_that_does_not_fit_changes_nothing(tmp_path):
    fit(tmp_path / "run", epochs=1)
    pl.seed_everything(3, verbose=False)
    model = Net(hidden=32)
    before = _weights(model)
    trainer = pl.Trainer(max_epochs=2, callbacks=[DriveCheckpoint(str(tmp_path / "run"), quiet=True)], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, accelerator="cpu")
    with pytest.raises(StateMismatchError, match="shape"):
        trainer.fit(model, datamodule=Data())
    for k, v in before.items():
        assert torch.equal(v, model.state_dict()[k]), k


def test_importing_keepalive_imports_no_lightning():
    code = ("import sys, keepalive, keepalive.callbacks; "
            "print(any(m.split('.')[0] in ('lightning', 'pytorch_lightning') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=ENV)
    assert out.stdout.strip() == "False", out.stderr


def test_pytorch_lightning_namespace(tmp_path):
    """A ``pytorch_lightning.Trainer`` takes the callback too (the same hooks, duck-typed)."""
    pytest.importorskip("pytorch_lightning")
    out = subprocess.run(_cmd(tmp_path / "run", tmp_path / "w.st", "--namespace", "pytorch_lightning", "--epochs", "1",
                              "--every", "4", "--n-train", "32"), capture_output=True, text=True, timeout=240,
                         env=ENV)
    assert "DONE" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    assert any(d.startswith("ckpt-") for d in os.listdir(tmp_path / "run" / "ka"))
