"""Transparent and exact data order for the torch adapter (keepalive.callbacks._torch_replay).

For each loader shape people use (tests/scripts/replay_shapes.py): the training with keepalive and no
kill is bit-identical to the same script without keepalive, and a SIGKILL in the middle of an epoch
(a save every 3 optimizer steps; killed in epoch 1's 4th step, the save of step 12 committed) resumes
bit-identical to the uninterrupted run. Negative controls: another seed changes the plain run (the
comparison can see a difference), and a resume whose loader does not replay its iteration's random
state differs."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from crashkit import assert_differs, assert_same
from forkserver import script_children_fixture

HERE = os.path.dirname(__file__)
SCRIPT = os.path.join(HERE, "scripts", "replay_shapes.py")
SHAPES = ("weighted", "subclass", "generator", "custom", "counting", "stateful", "stream")
KILL_AFTER = 13  # epoch 1 (10 batches an epoch), its 4th step; every=3: the save of step 12 is the newest


#: what replay_shapes.py imports before keepalive: its 33 children fork from a server that has imported it
#: (a fork that SIGKILLs itself ends by that signal as an interpreter does)
PRELOAD = ["numpy", "torch", "torch._dynamo", "torch.nn.functional", "torch.utils.data"]


forked_children = script_children_fixture(SCRIPT, "torch", PRELOAD, sys.modules[__name__])


def child(shape: str, out, *options: str, killed: bool = False) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(HERE, "scripts"), HERE]))
    proc = subprocess.run([sys.executable, SCRIPT, "--shape", shape, "--out", str(out), *options],
                          capture_output=True, text=True, env=env, timeout=300)
    if killed:
        assert proc.returncode == -9, proc.stdout[-2000:] + proc.stderr[-2000:]
    else:
        assert proc.returncode == 0 and "DONE" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def weights(path):
    return torch.load(path)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """keepalive's uninterrupted run of a shape (its weights file and output), made once: the
    controls compare against the same runs as the shape's own test."""
    made = {}

    def get(shape: str):
        if shape not in made:
            d = tmp_path_factory.mktemp(f"ref-{shape}")
            made[shape] = (d / "ref.pt", child(shape, d / "ref.pt", "--run", str(d / "ref")))
        return made[shape]

    return get


@pytest.mark.parametrize("shape", SHAPES)
def test_same_as_without_keepalive_and_exact_after_a_kill_mid_epoch(tmp_path, references, shape):
    child(shape, tmp_path / "plain.pt", "--plain")
    ref, ref_out = references(shape)
    assert_same(weights(tmp_path / "plain.pt"), weights(ref))  # transparent
    first = child(shape, tmp_path / "crash.pt", "--run", str(tmp_path / "crash"),
                  "--kill-after-steps", str(KILL_AFTER), killed=True)
    assert "COMMITTED 12" in first and "KILL" in first, first[-2000:]
    second = child(shape, tmp_path / "crash.pt", "--run", str(tmp_path / "crash"))
    assert "resuming" in second and "step 12" in second, second[-2000:]
    for text in (ref_out, first, second):
        assert "epoch ends only" not in text and "not bit-exact" not in text, text[-2000:]
    assert_same(weights(ref), weights(tmp_path / "crash.pt"))


def test_controls_another_seed_and_no_replay_differ(tmp_path, references):
    """The comparisons above can fail: a plain run with another seed differs from keepalive's, and
    resumed epochs whose loader starts from the saved step's state (not its iter()'s) differ, for
    the global generator (weighted) and a loader's generator= with 2 workers."""
    child("weighted", tmp_path / "other.pt", "--plain", "--seed", "99")
    assert_differs(weights(references("weighted")[0]), weights(tmp_path / "other.pt"))
    for shape in ("weighted", "generator"):
        run = str(tmp_path / f"ctl-{shape}")
        ref = references(shape)[0]
        child(shape, tmp_path / "ctl.pt", "--run", run, "--kill-after-steps", str(KILL_AFTER), killed=True)
        child(shape, tmp_path / "ctl.pt", "--run", run, "--control", "no-replay")
        assert_differs(weights(ref), weights(tmp_path / "ctl.pt"))


# ------------------------------------------------------------------- told once, in-process shapes
def _model_opt():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _loader(n=40, **kw):
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(n)
    return DataLoader(TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g)),
                      batch_size=4, **kw)


def _step(model, opt, x, y):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def test_a_loader_iterated_outside_ckpt_batches_is_named_once(tmp_path, capsys):
    """zip(ckpt.batches(labeled), unlabeled) and FixMatch's next(unlabeled_iter): named in one warning
    at the first save; a validation loader iterated whole inside the batch loop and after it is not."""
    from keepalive.callbacks.torch import DriveCheckpoint

    model, opt = _model_opt()
    labeled, unlabeled, val = _loader(40, shuffle=True), _loader(60, shuffle=True), _loader(12)
    ckpt = DriveCheckpoint(tmp_path / "zip", model=model, optimizer=opt, every=3, quiet=True)
    for _ in ckpt.epochs(2):
        for i, ((x, y), (xu, _)) in enumerate(zip(ckpt.batches(labeled), unlabeled)):
            _step(model, opt, x + 0 * xu.sum(), y)
            if i % 4 == 0:
                for _v in val:  # validation inside the batch loop: whole, between two steps
                    pass
        for _v in val:
            pass
    ckpt.close()
    err = capsys.readouterr().err
    assert err.count("unlabeled is iterated outside ckpt.batches()") == 1, err
    assert "val is iterated" not in err, err

    model, opt = _model_opt()
    ckpt = DriveCheckpoint(tmp_path / "fixmatch", model=model, optimizer=opt, every=3, quiet=True)
    unlabeled_iter = iter(unlabeled)
    for _ in ckpt.epochs(2):
        for x, y in ckpt.batches(labeled):
            try:
                xu, _ = next(unlabeled_iter)
            except StopIteration:
                unlabeled_iter = iter(unlabeled)
                xu, _ = next(unlabeled_iter)
            _step(model, opt, x + 0 * xu.sum(), y)
    ckpt.close()
    err = capsys.readouterr().err
    assert err.count("unlabeled is iterated outside ckpt.batches()") == 1, err

    # control: both through ckpt.batches(): nothing to say
    model, opt = _model_opt()
    ckpt = DriveCheckpoint(tmp_path / "both", model=model, optimizer=opt, every=3, quiet=True)
    for _ in ckpt.epochs(2):
        for (x, y), (xu, _) in zip(ckpt.batches(labeled), ckpt.batches(unlabeled)):
            _step(model, opt, x + 0 * xu.sum(), y)
    ckpt.close()
    assert "iterated outside" not in capsys.readouterr().err


def test_what_cannot_resume_exactly_is_told_once(tmp_path, capsys):
    """A streaming dataset shuffled with a buffer (its state_dict() lacks the buffer) and a sampler
    that keeps its last order in an attribute: one line each, at the first save / first use."""
    import datasets
    from torch.utils.data import DataLoader, Sampler

    from keepalive.callbacks.torch import DriveCheckpoint

    table = datasets.Dataset.from_dict({"x": torch.randn(40, 4).tolist(), "y": [i % 2 for i in range(40)]})
    stream = table.to_iterable_dataset(num_shards=2).shuffle(seed=1, buffer_size=8).with_format("torch")
    loader = DataLoader(stream, batch_size=4)
    model, opt = _model_opt()
    ckpt = DriveCheckpoint(tmp_path / "buffer", model=model, optimizer=opt, every=3, quiet=True)
    for epoch in ckpt.epochs(2):
        stream.set_epoch(epoch)
        for b in ckpt.batches(loader):
            _step(model, opt, b["x"].float(), b["y"])
    ckpt.close()
    err = capsys.readouterr().err
    assert err.count("shuffles with a buffer that its state_dict() does not hold") == 1, err

    class Rolling(Sampler):
        """Each pass: the last pass's order rolled by one (kept as a tuple keepalive cannot restore)."""

        def __init__(self, n):
            self.n, self.last = n, tuple(range(n))

        def __len__(self):
            return self.n

        def __iter__(self):
            self.last = self.last[1:] + self.last[:1]
            return iter(self.last)

    model, opt = _model_opt()
    counted = _loader(40, sampler=Rolling(40))
    ckpt = DriveCheckpoint(tmp_path / "counting", model=model, optimizer=opt, every=3, quiet=True)
    for _ in ckpt.epochs(2):
        for x, y in ckpt.batches(counted):
            _step(model, opt, x, y)
    ckpt.close()
    err = capsys.readouterr().err
    assert err.count("sampler Rolling changes its own attributes") == 1, err
