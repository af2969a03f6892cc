"""The heart of the torch adapter: SIGKILL a real training process at random moments (mid-step and
mid-write included), restart it until it finishes, and compare its final weights bit for bit with a
run that was never interrupted. Works for num_workers=0 and >0 (worker augmentation is random)."""
import os
import random
import sys

import pytest
import torch
from safetensors.torch import load_file

import crashkit
from crashkit import run_to_completion
from forkserver import ForkingSubprocess, ServerPool
from keepalive import CheckpointStore

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "torch_train.py")
#: what torch_train.py imports before keepalive: its 30 children fork from a server that has imported it
PRELOAD = ["numpy", "torch", "torch._dynamo", "torch.nn.functional", "torch.utils.data", "safetensors.torch"]
EPOCHS, SAMPLES, BATCH = 3, 300, 16
STEPS = EPOCHS * -(-SAMPLES // BATCH)


@pytest.fixture(scope="module", autouse=True)
def forked_children():
    pool = ServerPool(lambda argv, env: ("torch", PRELOAD, "") if argv[0] == SCRIPT else None, quick_exit=True)
    try:
        with ForkingSubprocess(pool).installed_in(crashkit):
            yield pool
    finally:
        pool.close()


def _cmd(run, out, *extra):
    return [sys.executable, SCRIPT, str(run), "--out", str(out), "--epochs", str(EPOCHS),
            "--samples", str(SAMPLES), *extra]


def _assert_same(a, b):
    wa, wb = load_file(a), load_file(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), f"{k} differs: max |diff| {(wa[k] - wb[k]).abs().max()}"


@pytest.mark.parametrize("workers,every,kills", [(0, "5", 10), (2, "4", 6)])
def test_sigkill_resume_is_bit_exact(tmp_path, workers, every, kills):
    extra = ["--workers", str(workers), "--every", every, "--hidden", "1536"]
    ref = run_to_completion(_cmd(tmp_path / "ref", tmp_path / "ref.st", *extra), total_steps=STEPS,
                            kills=0, rng=random.Random(0))
    assert "DONE" in ref.final_output
    rng = random.Random(1000 + workers)
    report = run_to_completion(_cmd(tmp_path / "crash", tmp_path / "crash.st", *extra),
                               total_steps=STEPS, kills=kills, rng=rng, run_dir=str(tmp_path / "crash"))
    assert report.kills == kills
    _assert_same(tmp_path / "ref.st", tmp_path / "crash.st")
    # Every restart after the first resumed, and lost at most one save interval plus what ran while
    # the (single) in-flight background write was still going: < 2 intervals.
    n = int(every)
    for prev, cur in zip(report.trials, report.trials[1:]):
        if prev.killed_after_step and prev.last_committed:
            assert cur.resumed_step is not None, "a restart did not resume"
            assert prev.killed_after_step - cur.resumed_step <= 2 * n, (prev, cur)
    redone = [p.killed_after_step - c.resumed_step for p, c in zip(report.trials, report.trials[1:])
              if p.killed_after_step and c.resumed_step is not None]
    print(f"\nworkers={workers}: {report.kills} kills survived, torn folders seen after kills: "
          f"{sum(t.torn_folders_after_kill for t in report.trials)}, steps redone per kill: {redone}")


def test_sigkill_with_gradient_accumulation_and_time_based_saves(tmp_path):
    """Gradient accumulation (a step every 3 batches and at each epoch's last) with every="0.2s":
    saves come due between two optimizer steps and wait for the next one. Random SIGKILLs (between two
    steps, mid-step, mid-write) until the run finishes: bit-identical to the uninterrupted run, and no
    checkpoint holds a point where gradients were pending."""
    acc = 3
    batches = -(-SAMPLES // BATCH)
    steps = EPOCHS * -(-batches // acc)
    extra = ["--accum", str(acc), "--every", "0.2s", "--sleep", "0.02", "--hidden", "256"]
    ref = run_to_completion(_cmd(tmp_path / "ref", tmp_path / "ref.st", *extra), total_steps=steps,
                            kills=0, rng=random.Random(0))
    assert "DONE" in ref.final_output
    kills = 6
    report = run_to_completion(_cmd(tmp_path / "crash", tmp_path / "crash.st", *extra), total_steps=steps,
                               kills=kills, rng=random.Random(77), run_dir=str(tmp_path / "crash"),
                               max_substep_delay=0.06)
    assert report.kills == kills
    _assert_same(tmp_path / "ref.st", tmp_path / "crash.st")
    for prev, cur in zip(report.trials, report.trials[1:]):
        if prev.killed_after_step and prev.last_committed:
            assert cur.resumed_step is not None, "a restart did not resume"
    kept = CheckpointStore(str(tmp_path / "crash")).list()
    assert kept
    for info in kept:
        batch = info.manifest["metadata"]["counters"]["batch"]
        assert batch == 0 or batch % acc == 0 or batch == batches, f"{info.name}: saved after batch {batch}"
    print(f"\naccumulation, every=0.2s: {report.kills} kills survived, resumed at steps "
          f"{[t.resumed_step for t in report.trials[1:]]}")


def test_detects_divergence(tmp_path):
    """The comparison can fail: a run with another seed-affecting setting differs."""
    a = run_to_completion(_cmd(tmp_path / "a", tmp_path / "a.st", "--hidden", "64"), total_steps=STEPS,
                          kills=0, rng=random.Random(0))
    b = run_to_completion(_cmd(tmp_path / "b", tmp_path / "b.st", "--hidden", "64", "--drop-last"),
                          total_steps=STEPS, kills=0, rng=random.Random(0))
    assert a.final_output and b.final_output
    with pytest.raises(AssertionError):
        _assert_same(tmp_path / "a.st", tmp_path / "b.st")
