"""Lightning beside the files a fit writes: a ``CSVLogger`` starts a new ``version_N`` folder on every fit
and flushes its rows every N logging steps. A fit SIGKILLed (inside epochs, after commits and inside
writes) and re-run until it finishes must leave one ``version_0/metrics.csv``, byte-identical to the one an
uninterrupted fit without keepalive writes (the redone steps' rows cut back, the unflushed rows of the
checkpoint written), and the same weights. Control: the same kills without the logger's place restored
give a second version folder.
"""
import filecmp
import os
import random
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SHIMS = os.path.join(HERE, "shims")
SCRIPT = os.path.join(HERE, "scripts", "lightning_stages.py")
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([SHIMS, os.path.join(HERE, "scripts"), os.path.dirname(HERE)]),
           KEEPALIVE_PROGRESS="0", OMP_NUM_THREADS="1")
TOTAL = 36  # 96 samples / batch 8 = 12 steps per epoch, 3 epochs

torch = pytest.importorskip("torch")
import crashkit  # noqa: E402
from crashkit import run_to_completion  # noqa: E402
from forkserver import script_children_fixture  # noqa: E402

#: the children fork from a server that has imported torch and Lightning (tests/forkserver.py), started
#: with their environment (the shims on its path): most of a child's CPU time
PRELOAD = ["torch", "lightning.pytorch", "lightning.pytorch.loggers", "safetensors.torch"]


forked_children = script_children_fixture(SCRIPT, "lightning", PRELOAD, crashkit, sys.modules[__name__])


def _cmd(root, *extra):
    return [sys.executable, SCRIPT, str(root), "--out", str(root / "w.st"), *extra]


def _versions(root):
    return sorted(os.listdir(root / "logs"))


def _weights(root):
    from safetensors.torch import load_file

    return load_file(str(root / "w.st"))


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    root = tmp_path_factory.mktemp("plain")
    subprocess.run(_cmd(root, "--mode", "plain"), check=True, env=ENV, capture_output=True, text=True, timeout=300)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("control", [False, True], ids=["kept", "control-new-version"])
def test_csv_logger_resumes_in_its_version_byte_identical(tmp_path, plain, control):
    root = tmp_path / "run"
    extra = ["--control-new-version"] if control else []
    kills = 1 if control else 2
    report = run_to_completion(_cmd(root, "--every", "5", "--sleep", "0.02", *extra), total_steps=TOTAL, kills=kills,
                               rng=random.Random(21), env=ENV, max_substep_delay=0.05, timeout=240,
                               mid_epoch_of=12)
    assert report.kills == kills and "DONE" in report.final_output
    assert all(t.resumed_step is not None for t in report.trials[1:]), report.trials
    ref_w, got_w = _weights(plain), _weights(root)
    assert all(torch.equal(ref_w[k], got_w[k]) for k in ref_w)  # the training itself is exact either way
    if control:
        assert _versions(root) != ["version_0"]
        return
    assert _versions(root) == ["version_0"]
    assert filecmp.cmp(plain / "logs" / "version_0" / "metrics.csv", root / "logs" / "version_0" / "metrics.csv",
                       shallow=False)
