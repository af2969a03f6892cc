"""The fastai adapter and the data: keepalive does not change the training, and fastai's tabular and text
default loaders (``TabWeightedDL``, ``SortedDL``, ``LMDataLoader``) resume mid-epoch exactly.

* Transparency: ``fit_one_cycle`` with ``DriveCheckpoint(every=2)`` (mid-epoch saves, worker states
  taken) and no interruption gives the weights and the Recorder history of the same training without
  keepalive, bit for bit: shuffling, dropout, augmentation from all three global RNGs in the main
  process (0 workers) or in 2 DataLoader workers, batch transforms; tabular (``TabWeightedDL``: its
  order is NumPy's), text (``SortedDL`` with 2 workers, a random token dropped per item in them) and
  a language model (``LMDataLoader``: its shuffle permutes the documents in place, epoch after epoch).
  Control: the same with the workers seeded one off (what keepalive's per-batch worker seeding did)
  is caught.
* SIGKILL: the tabular, text and language-model trainings (tests/scripts/fastai_shapes.py), saving every 3 steps, are
  killed at random moments and re-run until they finish; they must end bit-identical to the
  uninterrupted training without keepalive (the in-process one above). Controls: a resumed epoch that
  does not put back the global NumPy state (the tabular order), the workers' saved random states or
  the language model's document order is caught.
"""
import os
import random
import sys

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))

from fastai.data.load import _wif  # noqa: E402
from fastai.torch_core import set_seed  # noqa: E402
from fastai_setup import history, make_learner, weights  # noqa: E402
from fastai_shapes import make_lm, make_tabular, make_text  # noqa: E402

import crashkit  # noqa: E402
from crashkit import assert_differs, assert_same, run_to_completion  # noqa: E402
from forkserver import ForkingSubprocess, ServerPool  # noqa: E402
from keepalive.callbacks.fastai import DriveCheckpoint  # noqa: E402
from keepalive.state import from_files  # noqa: E402
from keepalive.store import CheckpointStore  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "fastai_shapes.py")
EPOCHS, LR = 3, 1e-2
#: what fastai_shapes.py imports before keepalive: its 15 SIGKILLed children fork from a server that has
#: imported it
PRELOAD = ["numpy", "pandas", "torch", "torch._dynamo", "safetensors.torch", "fastai.data.core", "fastai.learner",
           "fastai.losses", "fastai.metrics", "fastai.tabular.all", "fastai.text.data", "fastai.torch_core",
           "fastai.callback.core"]


@pytest.fixture(scope="module", autouse=True)
def forked_children():
    pool = ServerPool(lambda argv, env: ("fastai", PRELOAD, "") if argv[0] == SCRIPT else None, quick_exit=True)
    try:
        with ForkingSubprocess(pool).installed_in(crashkit):
            yield pool
    finally:
        pool.close()

SCENARIOS = {  # name: (learner maker, DataLoader workers, batches per epoch)
    "images-0-workers": (lambda cbs: make_learner(workers=0, cbs=cbs), 0, 6),
    "images-2-workers": (lambda cbs: make_learner(workers=2, cbs=cbs), 2, 6),
    "tabular": (lambda cbs: make_tabular(cbs=cbs), 0, 12),
    "text": (lambda cbs: make_text(cbs=cbs), 2, 10),
    "lm": (lambda cbs: make_lm(cbs=cbs), 0, 11),
}


def _state(learn):
    h = history(learn)
    return {"weights": weights(learn), "history": {k: h[k] for k in ("values", "losses", "lrs")}}


def _fit(name, ckpt=None, tweak=None):
    learn = SCENARIOS[name][0](None)
    if tweak is not None:
        tweak(learn)
    with learn.no_bar():
        learn.fit_one_cycle(EPOCHS, LR, cbs=[ckpt] if ckpt is not None else None)
    return _state(learn)


@pytest.fixture(scope="module")
def plain():
    """The trainings without keepalive, each run once."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = _fit(name)
        return cache[name]

    return get


def _trees(run):
    store = CheckpointStore(str(run))
    return [from_files(store.read_files(i)) for i in store.list()]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_with_keepalive_equals_without(tmp_path, plain, name):
    ckpt = DriveCheckpoint(tmp_path / "run", every=2, keep=50)
    got = _fit(name, ckpt)
    assert_same(plain(name), got)
    # the saves were taken inside epochs, and with workers that draw, with their random states
    _, workers, n_iter = SCENARIOS[name]
    mid = [t["fastai"] for t in _trees(tmp_path / "run") if t["fastai"]["position"]["batch"]]
    assert len(mid) >= EPOCHS, [m["position"] for m in mid]
    if workers:
        assert all(sorted(m["workers"]) == [str(m["position"]["batch"] + w) for w in range(workers)]
                   for m in mid if m["position"]["batch"] + workers <= n_iter)


def _seeded_one_off(worker_id):
    _wif(worker_id)
    set_seed(torch.utils.data.get_worker_info().seed + 1)


def test_transparency_control_catches_other_worker_seeds(tmp_path, plain):
    """Negative control: the same training with keepalive, its workers seeded one off, differs."""
    def tweak(learn):
        learn.dls.train.fake_l.worker_init_fn = _seeded_one_off

    got = _fit("images-2-workers", DriveCheckpoint(tmp_path / "run", every=2), tweak)
    assert_differs(plain("images-2-workers"), got)


# ------------------------------------------------------------------------------------ SIGKILL
def _cmd(tmp_path, shape, *extra):
    return [sys.executable, SCRIPT, str(tmp_path / "run"), "--out", str(tmp_path / "w.st"), "--shape", shape,
            "--epochs", str(EPOCHS), "--every", "3", *extra]


def _result(tmp_path):
    import json

    with open(f"{tmp_path / 'w.st'}.json") as f:
        return {"weights": load_file(str(tmp_path / "w.st")), "history": json.load(f)}


@pytest.mark.parametrize("shape,seed", [("tabular", 3), ("text", 5), ("lm", 11)])
def test_sigkill_mid_epoch_is_bit_exact(tmp_path, plain, shape, seed):
    n_iter = SCENARIOS[shape][2]
    report = run_to_completion(_cmd(tmp_path, shape), total_steps=EPOCHS * n_iter, kills=2,
                               rng=random.Random(seed), run_dir=str(tmp_path / "run"), timeout=180,
                               mid_epoch_of=n_iter)
    assert report.kills == 2 and "DONE" in report.final_output
    resumed = [t.resumed_step for t in report.trials[1:]]
    assert any(r and r % n_iter for r in resumed), f"no resume inside an epoch: {resumed}"
    assert_same(plain(shape), _result(tmp_path))


class _KillLast(random.Random):
    """Makes crashkit kill right after the last step it is given."""

    def randint(self, a, b):
        return b


@pytest.mark.parametrize("shape,broken,commit", [
    ("tabular", "numpy", 15),  # TabWeightedDL's order: np.random.choice at epoch 1's start
    ("text", "workers", 12),   # SortedDL with 2 workers dropping random tokens, resumed at batch 2
    ("lm", "lm_order", 15),    # LMDataLoader: epoch 1 shuffles the documents from epoch 0's order
])
def test_sigkill_controls(tmp_path, plain, shape, broken, commit):
    """Negative controls: killed once inside epoch 1 (after the save at step ``commit``), resumed without
    one of the replayed states: the result must differ from the uninterrupted one."""
    report = run_to_completion(_cmd(tmp_path, shape, "--sleep", "0.05", "--break", broken),
                               total_steps=commit + 1, kills=1, rng=_KillLast(1), timeout=180,
                               kill_after_commit=commit)
    assert report.trials[1].resumed_step == commit
    assert "DONE" in report.final_output
    assert_differs(plain(shape), _result(tmp_path))


def test_a_loader_with_its_own_order_is_not_positioned():
    """fastai's own order methods (and TabWeightedDL's, SortedDL's, LMDataLoader's: the scenarios above
    save inside epochs) replay; a subclass or an instance with another order cannot be positioned."""
    from fastai.data.load import DataLoader

    from keepalive.callbacks._fastai_data import positionable

    class Reversed(DataLoader):
        def get_idxs(self):
            return list(range(self.n))[::-1]

    assert positionable(DataLoader(list(range(10)), bs=2, shuffle=True)) is None
    assert positionable(Reversed(list(range(10)), bs=2)) == "Reversed overrides get_idxs()"
    custom = DataLoader(list(range(10)), bs=2, shuffle_fn=lambda idxs: idxs[::-1])
    assert positionable(custom) == "the training loader has a custom shuffle_fn()"
