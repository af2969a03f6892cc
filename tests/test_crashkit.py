"""The crash harness itself: a planned kill always lands, however slow the parent is to read.

A child that finishes its training before the parent reads its ``STEP`` lines would make a test that
plans N kills get fewer (the run already finished when the next child starts): the harness holds the
child at the step after the planned kill. The negative control shows the race exists without it.
"""
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from crashkit import run_to_completion

SCRIPT = Path(__file__).parent / "scripts" / "instant_steps.py"
TOTAL = 400


class _KillLast(random.Random):
    def randint(self, a, b):
        return b


def _cmd(state):
    return [sys.executable, str(SCRIPT), str(state), str(TOTAL)]


def test_planned_kills_land_before_an_instant_child_finishes(tmp_path):
    report = run_to_completion(_cmd(tmp_path / "state"), total_steps=TOTAL, kills=3, rng=_KillLast(0))
    assert report.kills == 3 and "DONE" in report.final_output
    steps = [t.killed_after_step for t in report.trials[:-1]]
    assert all(s is not None and s <= TOTAL - 1 for s in steps), steps
    assert [t.resumed_step for t in report.trials[1:]] == sorted(t.resumed_step for t in report.trials[1:])


def test_control_without_the_hold_the_instant_child_outruns_the_parent(tmp_path):
    """Negative control: the same child without a hold point ends before a parent that reads late."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("CRASHKIT_HOLD_FROM", None)
    proc = subprocess.Popen(_cmd(tmp_path / "state"), stdout=subprocess.PIPE, text=True, env=env)
    time.sleep(0.5)  # a parent busy elsewhere for half a second
    finished = proc.poll() is not None or proc.wait(timeout=30) == 0
    out = proc.stdout.read()
    proc.stdout.close()
    assert finished and "DONE" in out  # nothing left to kill: the race the hold closes
    assert (tmp_path / "state").read_text() == str(TOTAL)
