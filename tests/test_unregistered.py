"""Objects the training changes but nobody registered (timm's EMA, an AveragedModel, a second model) are
named once, at the first save after they change, with the line that fixes it; objects that never
change (a frozen teacher, a class-weighted loss) or that belong to registered ones are never named.
The watch reads version counters only: every global random generator is left as it was.

The kill test: a timm-style loop (tests/scripts/objects_train.py) with its EMA registered, SIGKILLed
mid-training and run again: bit-exact; the EMA left unregistered: the resumed EMA differs.
"""
from __future__ import annotations

import copy
import random
import sys

import numpy as np
import torch

from crashkit import assert_differs, assert_same
from keepalive.callbacks._torch_unregistered import UnregisteredWatch
from keepalive.callbacks.torch import DriveCheckpoint
from objectskit import forks_fixture, run_script


class ModelEmaV3(torch.nn.Module):
    """timm.utils.ModelEmaV3's shape (timm is not installed here)."""

    def __init__(self, model: torch.nn.Module, decay: float = 0.9):
        super().__init__()
        self.module = copy.deepcopy(model).eval()
        self.decay = decay

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        for e, m in zip(self.module.parameters(), model.parameters()):
            e.lerp_(m, 1.0 - self.decay)


def watched(ckpt: DriveCheckpoint, namespace: dict) -> None:
    """What DriveCheckpoint's loop start and captures do with the watch, by hand where they do not."""
    if hasattr(ckpt, "_unregistered"):
        return
    watch = UnregisteredWatch(ckpt.core, ckpt.objects)
    states = ckpt._objects.states
    ckpt._objects.states = lambda: (watch.check(), states())[1]
    watch.start([namespace, globals()])  # the loop's frame: its locals and its module's globals


def loader(steps_per_epoch: int = 4) -> torch.utils.data.DataLoader:
    n = 8 * steps_per_epoch
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(n, 6), torch.randint(0, 3, (n,))),
                                       batch_size=8)


def step(model, opt, x, y) -> None:
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def warnings_about(text: str, name: str) -> list:
    return [line for line in text.splitlines() if f"`{name}` (" in line]


def test_an_unregistered_ema_is_named_at_the_first_save_once_and_still_things_never(tmp_path, capsys):
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model_ema = ModelEmaV3(model)
    teacher = torch.nn.Linear(6, 3).requires_grad_(False)  # used in no step here: a frozen one never changes
    criterion = torch.nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 0.5]))
    body = model[0]  # a submodule of the registered model: changes, but is saved with it
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, every=2, quiet=True)
    data = loader()
    watched(ckpt, locals())
    said, err = [], []

    def each_step(n):
        model_ema.update(model)
        with torch.no_grad():
            criterion(teacher(torch.randn(2, 6)), torch.tensor([0, 1]))
        err.append(capsys.readouterr().err)
        said.append(len(warnings_about(err[-1], "model_ema")))

    for epoch in ckpt.epochs(3):  # the loop runs where the objects are (its frame is the one looked at)
        for x, y in ckpt.batches(data):
            step(model, opt, x, y)
            each_step(ckpt.step)
    text = "".join(err) + capsys.readouterr().err
    # named by the first capture after it changed (by the first save, at step 2), and never again
    assert sum(said) == 1 and said.index(1) <= 1, said
    assert warnings_about(text, "model_ema") == [
        "keepalive: warning: `model_ema` (ModelEmaV3) changed during the training and is not in the "
        "checkpoint: a resume would start it again from its state before the loop. Register it with "
        "`ckpt.register('model_ema', model_ema)` before the loop."]
    for quiet in ("teacher", "criterion", "body", "model", "opt"):
        assert not warnings_about(text, quiet), text
    assert body is model[0]


def test_the_named_line_is_the_fix(tmp_path, capsys):
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = ModelEmaV3(model)
    run = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, quiet=True)
    data = loader()
    watched(run, locals())
    for epoch in run.epochs(2):
        for x, y in run.batches(data):
            step(model, opt, x, y)
            ema.update(model)
    lines = warnings_about(capsys.readouterr().err, "ema")
    assert lines == ["keepalive: warning: `ema` (ModelEmaV3) changed during the training and is not in the "
                     "checkpoint: a resume would start it again from its state before the loop. Register it "
                     "with `run.register('ema', ema)` before the loop."]


def test_a_registered_ema_or_a_ddp_like_wrapper_of_the_model_is_not_named(tmp_path, capsys):
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = ModelEmaV3(model)

    class Wrapper(torch.nn.Module):  # holds only registered tensors (DDP, torch.compile, a task wrapper)
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

    wrapped = Wrapper(model)
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, ema=ema, quiet=True)
    data = loader()
    watched(ckpt, locals())
    for epoch in ckpt.epochs(2):
        for x, y in ckpt.batches(data):
            step(model, opt, x, y)
            ema.update(model)
    err = capsys.readouterr().err
    assert "changed during the training" not in err, err
    assert wrapped.inner is model


def test_an_averaged_model_is_named_once_it_starts_changing_and_a_second_model_too(tmp_path, capsys):
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    swa_model = torch.optim.swa_utils.AveragedModel(model)
    critic = torch.nn.Linear(3, 1)
    critic_opt = torch.optim.Adam(critic.parameters(), lr=1e-3)
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, every=2, quiet=True)
    data = loader()
    watched(ckpt, locals())
    named_at = {}

    def each_step(n):
        if n > 6:  # swa_start
            swa_model.update_parameters(model)
        if n == 5:
            critic_opt.zero_grad()
            critic(torch.randn(2, 3)).sum().backward()
            critic_opt.step()
        err = capsys.readouterr().err
        for name in ("swa_model", "critic", "critic_opt"):
            if warnings_about(err, name):
                named_at[name] = named_at.get(name, []) + [n]

    for epoch in ckpt.epochs(3):
        for x, y in ckpt.batches(data):
            step(model, opt, x, y)
            each_step(ckpt.step)
    # named at the first save after each began to change (saves every 2 steps), once
    assert named_at == {"critic": [6], "critic_opt": [6], "swa_model": [8]}, named_at


def test_the_watch_touches_no_random_generator_and_skips_what_has_no_state(tmp_path):
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = ModelEmaV3(model)
    relu = torch.nn.ReLU()  # a module without tensors: nothing to save
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, quiet=True)
    watch = UnregisteredWatch(ckpt.core, ckpt.objects)
    watch.start([locals(), sys.modules[__name__].__dict__])
    assert sorted(name for name, *_ in watch.watched.values()) == ["ema"]
    ema.update(model)
    before = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    watch.check()
    after = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    assert before[0] == after[0] and torch.equal(before[2], after[2])
    assert all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b for a, b in zip(before[1], after[1]))
    assert not watch.watched and relu is not None


class Cursor:
    """A plain position-carrying object of the loop's own code (build-nanogpt's DataLoaderLite shape)."""

    def __init__(self):
        self.current_shard, self.current_position, self.B = 0, 0, 8

    def next_batch(self) -> None:
        self.current_position += self.B


class Settings:
    """A plain object of the loop's code that never changes (a config): never named."""

    def __init__(self):
        self.lr, self.name = 0.1, "run"


def test_a_plain_object_of_the_loops_code_that_moves_is_named_with_its_attributes(tmp_path, capsys):
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_loader, config = Cursor(), Settings()
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, every=2, quiet=True)
    data = loader()
    watched(ckpt, locals())
    for epoch in ckpt.epochs(2):
        for x, y in ckpt.batches(data):
            train_loader.next_batch()
            step(model, opt, x, y)
    err = capsys.readouterr().err
    assert warnings_about(err, "train_loader") == [
        "keepalive: warning: `train_loader` (Cursor) changed during the training (its current_position) and is "
        "not in the checkpoint: a resume would start it again from its state before the loop. Register it with "
        "`ckpt.register('train_loader', train_loader)` before the loop."]
    assert not warnings_about(err, "config") and config.lr == 0.1


# ---------------------------------------------------------------------------------- SIGKILL
forks = forks_fixture(quick_exit=True)


def test_a_registered_ema_resumes_exact_after_sigkill_and_an_unregistered_one_does_not(tmp_path, forks):
    ref = tmp_path / "ref.pt"
    out = run_script(forks, "--scenario", "ema", "--run", str(tmp_path / "ref"), "--out", str(ref))
    assert "changed during the training" not in out  # registered: the teacher and the loss are never named
    reference = torch.load(ref, weights_only=False)
    for unregistered, run in ((False, "kept"), (True, "lost")):
        flag = ["--unregistered"] if unregistered else []
        common = ["--scenario", "ema", "--run", str(tmp_path / run), "--out", str(tmp_path / f"{run}.pt"), *flag]
        assert "KILL" in run_script(forks, *common, "--kill-at", "7")  # mid-epoch 1 (6 steps an epoch)
        out = run_script(forks, *common)
        resumed = torch.load(tmp_path / f"{run}.pt", weights_only=False)
        assert_same(reference["model"], resumed["model"])  # the EMA feeds nothing back: the model is exact
        if unregistered:
            assert len(warnings_about(out, "model_ema")) == 1, out
            assert_differs(reference["ema"], resumed["ema"])
            delta = max((reference["ema"][k] - resumed["ema"][k]).abs().max().item() for k in reference["ema"])
            print(f"unregistered EMA after a resume: max |delta| {delta:.3g}")
        else:
            assert "changed during the training" not in out, out
            assert_same(reference, resumed)
