"""What the kill tests over ``tests/scripts/objects_train.py`` share (tests/test_plain_objects.py,
tests/test_unregistered.py): children forked from a server that has imported torch, and one run of
the script, killed by itself (``--kill-at``) or to its end."""
from __future__ import annotations

import os
from typing import Any

import pytest

from forkserver import ForkServer

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "objects_train.py")


def forks_fixture(quick_exit: bool = False) -> Any:
    """A module fixture (assign it to ``forks``): a fork server that has imported torch, closed at the
    module's end (also tests/test_persistent_workers.py's). ``quick_exit``: tests/forkserver.py's."""

    @pytest.fixture(scope="module")
    def forks():
        server = ForkServer(["torch", "torch.utils.data"], dict(os.environ, PYTHONUNBUFFERED="1"),
                            quick_exit=quick_exit)
        try:
            yield server
        finally:
            server.close()

    return forks


def run_script(forks: ForkServer, *argv: str) -> str:
    """One process of objects_train.py forked from ``forks``; its output. It either killed itself
    (prints ``KILL``, dies of SIGKILL) or finished (prints ``DONE``, exits 0)."""
    child = forks.spawn([SCRIPT, *argv], dict(os.environ, PYTHONUNBUFFERED="1"))
    out = child.stdout.read()
    child.stdout.close()
    code = child.wait(timeout=240)
    assert ("KILL" in out and code == -9) or (code == 0 and "DONE" in out), f"exit {code}:\n{out[-3000:]}"
    return out
