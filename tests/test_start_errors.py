"""A checkpoint destination that cannot be used at the start of training is one line, not a traceback.

* In a script (a fresh interpreter: the exit status and ``sys.excepthook`` are the point): a path
  below a regular file, and a read-only folder (a read-only bind mount, where this machine allows
  mounting: as root, permissions alone are ignored), end the process with status 1 and one line on
  stderr naming the problem; control: ``KEEPALIVE_VERBOSITY=debug`` shows the traceback, and an
  error of the user's own code keeps Python's traceback.
* In a real IPython kernel: the cell's error output is that one line (with the ``%tb`` hint at its
  end); ``%tb`` still shows the whole traceback.
* The error is still the ``StorageError`` it was (class, ``errno``): code that catches it sees no change.
"""
from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap

import pytest

from keepalive import errors
from keepalive.magics.tracebacks import HINT

torch = pytest.importorskip("torch")

TRAIN = textwrap.dedent("""
    import torch
    from keepalive.callbacks.torch import DriveCheckpoint
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = DriveCheckpoint({path!r}, model=model, optimizer=opt)
    for epoch in ckpt.epochs(2):
        {body}
""")


def _script(path, body="pass", **env):
    code = TRAIN.format(path=str(path), body=body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **env))


def _lines(text):
    return [ln for ln in text.strip().splitlines() if ln.strip()]


@pytest.fixture
def below_a_file(tmp_path):
    (tmp_path / "notes.txt").write_text("a file, not a folder")
    return tmp_path / "notes.txt" / "run"


def test_a_script_ends_with_one_line(below_a_file):
    r = _script(below_a_file)
    assert r.returncode == 1, r.stderr
    lines = _lines(r.stderr)
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("StorageError: ") and "is a file" in lines[0], lines
    assert errors.DEBUG_HINT in lines[0] and "Traceback" not in r.stderr

    # control: the traceback is one setting away
    debug = _script(below_a_file, KEEPALIVE_VERBOSITY="debug")
    assert debug.returncode == 1 and "Traceback (most recent call last)" in debug.stderr, debug.stderr
    assert len(_lines(debug.stderr)) > 10 and errors.DEBUG_HINT not in debug.stderr


def test_the_users_own_errors_keep_their_traceback(tmp_path):
    """Control: the hook acts only on the error it was installed for."""
    r = _script(tmp_path / "run", body="raise ValueError('my own bug')")
    assert r.returncode == 1 and "Traceback (most recent call last)" in r.stderr, r.stderr
    assert r.stderr.strip().endswith("ValueError: my own bug"), r.stderr


def test_the_error_keeps_its_class_and_errno(below_a_file):
    from keepalive.callbacks.torch import DriveCheckpoint

    model = torch.nn.Linear(2, 2)
    ckpt = DriveCheckpoint(below_a_file, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(errors.StorageError) as info:
        for _ in ckpt.epochs(1):
            pass
    assert info.value.errno == errno.ENOTDIR and errors.is_one_line(info.value)
    assert errors.one_line(info.value).startswith("StorageError: ") and "[Errno" not in errors.one_line(info.value)


@pytest.fixture
def read_only(tmp_path):
    """A read-only folder even for root: a read-only bind mount of an empty folder."""
    folder = tmp_path / "ro"
    folder.mkdir()
    ok = subprocess.run(["mount", "--bind", str(folder), str(folder)], capture_output=True).returncode == 0
    if ok and subprocess.run(["mount", "-o", "remount,ro,bind", str(folder)], capture_output=True).returncode:
        subprocess.run(["umount", str(folder)], capture_output=True)
        ok = False
    if not ok:
        pytest.skip("this machine does not allow a bind mount (not root, or no CAP_SYS_ADMIN)")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], capture_output=True)


def test_a_read_only_folder_is_one_line(read_only):
    r = _script(read_only / "run")
    lines = _lines(r.stderr)
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert "Read-only file system" in lines[0] and "cannot create or write the run folder" in lines[0], lines


def test_a_notebook_cell_shows_one_line(below_a_file, tmp_path):
    pytest.importorskip("ipykernel")
    from kernelkit import Kernel, kernel_env  # tests/kernelkit.py

    with Kernel(env=kernel_env(tmp_path / "default", tmp_path)) as k:
        res = k.run(TRAIN.format(path=str(below_a_file), body="pass"))
        assert res.status == "error" and res.ename == "StorageError", res.text
        lines = _lines(res.stderr)
        assert len(lines) == 1, res.stderr
        assert "is a file" in lines[0] and lines[0].endswith(HINT) and "[Errno" not in lines[0], lines
        full = k.run("%tb")
        assert "keepalive/store.py" in full.text and len(_lines(full.text)) > 10, full.text
