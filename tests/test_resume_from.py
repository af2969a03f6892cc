"""``resume_from=``: resume from one place, write to another.

A training is SIGKILLed; its run folder is then mounted read-only at another path (a bind mount
remounted ``ro``: ``chmod`` does not stop root). A new process with ``path=<a new folder>`` and
``resume_from=<the read-only folder>`` resumes from the newest checkpoint there and ends bit-identical
to the uninterrupted training, although it is given another seed; nothing in the read-only folder
changes, and the new checkpoints are in the new folder. Negative control: without ``resume_from`` the
same process starts from scratch (its first step is step 1) and ends elsewhere.
"""
from __future__ import annotations

import os
import re
import subprocess
from typing import Dict, Iterator, Tuple

import pytest
import torch

from crashkit import assert_differs, assert_same
from forkserver import ForkServer
from objectskit import forks_fixture

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "relay_train.py")
forks = forks_fixture()


def run(forks: ForkServer, *argv: str, killed: bool = False) -> str:
    """One process of relay_train.py; its output (it killed itself, or finished)."""
    child = forks.spawn([SCRIPT, *argv], dict(os.environ, PYTHONUNBUFFERED="1"))
    out = child.stdout.read()
    child.stdout.close()
    code = child.wait(timeout=120)
    assert (code == -9 and "KILL" in out) if killed else (code == 0 and "DONE" in out), f"exit {code}:\n{out[-3000:]}"
    return out


def files_of(folder: str) -> Dict[str, Tuple[int, int]]:
    """Every file below ``folder``: its size and modification time (ns)."""
    found = {}
    for root, _, names in os.walk(folder):
        for name in names:
            st = os.stat(os.path.join(root, name))
            found[os.path.relpath(os.path.join(root, name), folder)] = (st.st_size, st.st_mtime_ns)
    return found


@pytest.fixture
def read_only(tmp_path) -> Iterator[Tuple[str, str]]:
    """``(source, mounted)``: a folder and a read-only bind mount of it."""
    source, mounted = tmp_path / "shared", tmp_path / "mounted"
    source.mkdir()
    mounted.mkdir()
    try:
        subprocess.run(["mount", "--bind", str(source), str(mounted)], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"a bind mount needs root here: {exc}")
    try:
        yield str(source), str(mounted)
    finally:
        subprocess.run(["umount", str(mounted)], check=False, capture_output=True)


def test_resume_from_a_read_only_folder_writes_elsewhere_bit_exact(forks, read_only, tmp_path):
    source, mounted = read_only
    reference = str(tmp_path / "ref.pt")
    run(forks, "unused", reference, "--plain")
    run(forks, os.path.join(source, "run"), str(tmp_path / "x.pt"), "--kill-at", "5", killed=True)
    subprocess.run(["mount", "-o", "remount,ro,bind", mounted], check=True, capture_output=True)
    with pytest.raises(OSError):  # the mount refuses writes, root's too
        open(os.path.join(mounted, "run", "probe"), "w").close()
    before = files_of(mounted)
    assert any(name.endswith("MANIFEST.json") for name in before)

    new, out = str(tmp_path / "new" / "run"), str(tmp_path / "out.pt")
    text = run(forks, new, out, "--resume-from", os.path.join(mounted, "run"), "--seed", "99")
    line = next(line for line in text.splitlines() if "resuming run" in line)
    assert re.search(rf"from {re.escape(mounted)}/run/ckpt-0000000004-\w+: .*step 4", line), line
    assert line.endswith(f"saving to {new}"), line
    assert re.findall(r"^STEP (\d+)", text, re.M)[0] == "5"  # steps 1-4 are not trained again
    assert_same(torch.load(reference), torch.load(out))
    assert files_of(mounted) == before  # nothing written, renamed or removed there
    assert any(name.startswith("ckpt-0000000012") for name in os.listdir(new))

    # negative control: the same process without resume_from= starts from scratch, elsewhere
    alone = str(tmp_path / "alone.pt")
    text = run(forks, str(tmp_path / "alone" / "run"), alone, "--seed", "99")
    assert "resuming" not in text and re.findall(r"^STEP (\d+)", text, re.M)[0] == "1"
    a, b = torch.load(reference), torch.load(alone)
    delta = max((a["model"][k] - b["model"][k]).abs().max().item() for k in a["model"])
    print(f"negative control: max |delta| of the weights {delta:.3g}")
    assert_differs(a, b)


def test_a_resume_from_without_checkpoints_is_said(tmp_path, capsys):
    from keepalive.callbacks.torch import DriveCheckpoint

    model = torch.nn.Linear(2, 1)
    ckpt = DriveCheckpoint(str(tmp_path / "mine"), model=model, resume_from=str(tmp_path / "typo"))
    for _ in ckpt.epochs(1):
        pass
    ckpt.close()
    assert f"resume_from={tmp_path / 'typo'} holds no valid checkpoint: the training starts from scratch" \
        in capsys.readouterr().err
    assert not (tmp_path / "typo").exists()  # not even made
