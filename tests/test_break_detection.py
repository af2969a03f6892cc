"""``break`` out of ``for epoch in ckpt.epochs(n)`` (the run's end) against an interruption (the next
run trains on), as keepalive.callbacks._torch_break reads it: on this Python, and on every CPython
from 3.9 found here (pyenv, PATH; 3.12 is Colab's), since the instruction that drops a loop's
iterator is each version's own. The cases (tests/scripts/break_cases.py) need no torch; the adapter's
own behaviour on a break and on an error is tested in tests/test_torch_stages.py.
"""
import functools
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = os.path.join(HERE, "scripts", "break_cases.py")

#: a break / return out of the loop is a break; an exception, close(), del, a rebinding are not; an
#: unreadable frame is undecidable, read as no break (an interruption, today's meaning)
EXPECTED = {
    "a_break": True, "a_break_after_a_call": True, "a_return": True, "a_return_with_a_value": True,
    "a_break_in_a_with": True, "a_break_in_a_finally": True, "a_break_in_a_nested_loop": True,
    "an_exception_caught_outside": False, "an_exception_from_a_call": False, "a_keyboard_interrupt": False,
    "an_explicit_close": False, "a_del": False, "a_rebinding": False,
    "a_break_at_module_level": True, "an_error_at_module_level": False,
    "a_break_under_a_tracer": True, "an_exception_under_a_tracer": False,
    "a_break_under_sys_monitoring": True,
    "no_frame": False, "an_unreadable_frame": False, "a_frame_not_started": False,
}


VERSIONS = ["3.9", "3.10", "3.11", "3.12", "3.13", "3.14"]


@functools.cache
def _pythons():
    """CPython interpreters on this machine (pyenv, PATH), one per minor version of VERSIONS."""
    found = {}
    for minor in (int(v.split(".")[1]) for v in VERSIONS):
        candidates = sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/3.{minor}*/bin/python3.{minor}")))
        candidates.append(shutil.which(f"python3.{minor}"))
        exe = next((c for c in candidates if c and _runs(c)), None)
        if exe is not None:
            found[f"3.{minor}"] = exe
    return found


def _runs(python):
    """A working interpreter (a pyenv shim of a version not selected answers with an error)."""
    try:
        return subprocess.run([python, "-c", "pass"], capture_output=True, timeout=60).returncode == 0
    except OSError:
        return False


def _run(python):
    out = subprocess.run([python, CASES], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_every_way_out_of_the_loop_on_this_python():
    assert _run(sys.executable)["said"] == EXPECTED


@pytest.mark.parametrize("version", VERSIONS)
def test_every_way_out_of_the_loop_on_another_python(version):
    """requires-python is >=3.9; from 3.14 a loop's iterator is popped by POP_ITER, not POP_TOP."""
    python = _pythons().get(version)
    if python is None:
        pytest.skip(f"no Python {version} on this machine (pyenv, PATH)")
    got = _run(python)
    assert got["python"] == [int(v) for v in version.split(".")]
    assert got["said"] == EXPECTED


def test_an_unreadable_code_is_no_break(monkeypatch):
    """A ``dis`` that cannot read the frame's code (another implementation): an interruption."""
    from keepalive.callbacks import _torch_break

    def unreadable(code):
        raise TypeError("no bytecode here")

    monkeypatch.setattr(_torch_break.dis, "get_instructions", unreadable)
    assert _torch_break.closed_by_break(sys._getframe()) is False
