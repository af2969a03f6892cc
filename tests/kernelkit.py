"""Real IPython kernels for the notebook tests (jupyter_client), started with this interpreter.

:func:`kernelspec` writes a kernelspec ``keepalive-test`` (argv = ``sys.executable -m
ipykernel_launcher``) into a private folder and puts that folder first on ``JUPYTER_PATH``, so kernels
(and nbclient) run the venv's Python whatever other kernelspecs the machine has. Idempotent.
"""
from __future__ import annotations

import atexit
import json
import os
import queue
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

KERNEL_NAME = "keepalive-test"
_SPEC_ROOT: Optional[str] = None


def kernelspec() -> str:
    """The name of a kernelspec running ``sys.executable`` (created once per process)."""
    global _SPEC_ROOT
    if _SPEC_ROOT is None:
        root = tempfile.mkdtemp(prefix="keepalive-kernelspec-")
        spec_dir = os.path.join(root, "kernels", KERNEL_NAME)
        os.makedirs(spec_dir)
        with open(os.path.join(spec_dir, "kernel.json"), "w") as f:
            json.dump({"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                       "display_name": "keepalive tests", "language": "python",
                       "metadata": {"debugger": False}}, f)
        _SPEC_ROOT = root
        atexit.register(shutil.rmtree, root, True)
    paths = os.environ.get("JUPYTER_PATH", "").split(os.pathsep)
    if _SPEC_ROOT not in paths:
        os.environ["JUPYTER_PATH"] = os.pathsep.join([_SPEC_ROOT] + [p for p in paths if p])
    return KERNEL_NAME


def kernel_env(ckpt_dir, tmp_path) -> Dict[str, str]:
    """The environment of a test kernel: checkpoints under ``ckpt_dir``, its own IPython profile, no
    progress bars, one thread, a headless matplotlib."""
    return {"KEEPALIVE_DIR": str(ckpt_dir), "IPYTHONDIR": str(tmp_path / "ipython"),
            "KEEPALIVE_PROGRESS": "0", "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}


@dataclass
class CellResult:
    status: str = "ok"
    stdout: str = ""
    stderr: str = ""
    displays: List[Dict[str, object]] = field(default_factory=list)   # display_data / execute_result data
    ename: Optional[str] = None
    evalue: Optional[str] = None

    @property
    def text(self) -> str:
        """Everything a reader sees as text: streams, text/plain of displays, the error."""
        parts = [self.stdout, self.stderr]
        parts += [str(d.get("text/plain", "")) for d in self.displays]
        if self.ename:
            parts.append(f"{self.ename}: {self.evalue}")
        return "\n".join(parts)

    @property
    def plain(self) -> str:
        return "\n".join(str(d.get("text/plain", "")) for d in self.displays)


class Kernel:
    """One IPython kernel process; always :meth:`shutdown` it (use as a context manager)."""

    def __init__(self, env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None):
        from jupyter_client import KernelManager

        self.km = KernelManager(kernel_name=kernelspec())
        full_env = dict(os.environ)
        full_env.update(env or {})
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        self.km.start_kernel(env=full_env, cwd=cwd or os.getcwd())
        self.kc = self.km.client()
        self.kc.start_channels()
        try:
            self.kc.wait_for_ready(timeout=90)
        except Exception:
            self.shutdown()
            raise

    @property
    def pid(self) -> int:
        return self.km.provisioner.pid

    def __enter__(self) -> "Kernel":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def run(self, code: str, timeout: float = 180.0) -> CellResult:
        out = CellResult()

        def hook(msg) -> None:
            _collect(out, msg)

        reply = self.kc.execute_interactive(code, timeout=timeout, output_hook=hook, allow_stdin=False)
        out.status = reply["content"]["status"]
        if out.status == "error" and out.ename is None:
            out.ename = reply["content"].get("ename")
            out.evalue = reply["content"].get("evalue")
        return out

    def run_ok(self, code: str, timeout: float = 180.0) -> CellResult:
        res = self.run(code, timeout)
        assert res.status == "ok", f"cell failed: {res.text}\n--- code:\n{code}"
        return res

    def start(self, code: str) -> str:
        """Start executing ``code`` without waiting; read its output with :meth:`read_until`."""
        self._pending = CellResult()
        return self.kc.execute(code, allow_stdin=False)

    def read_until(self, predicate, timeout: float = 120.0) -> CellResult:
        """Collect the running cell's output until ``predicate(result)`` is true."""
        deadline = time.monotonic() + timeout
        out = self._pending
        while not predicate(out):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"kernel output never matched; so far:\n{out.text}")
            try:
                msg = self.kc.get_iopub_msg(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            _collect(out, msg)
        return out

    def kill(self) -> None:
        """SIGKILL the kernel process (no cleanup of any kind runs in it)."""
        os.kill(self.pid, signal.SIGKILL)

    def shutdown(self) -> None:
        try:
            self.kc.stop_channels()
        except Exception:  # noqa: BLE001
            pass
        try:
            self.km.shutdown_kernel(now=True)
        except Exception:  # noqa: BLE001
            pass
        try:
            self.km.cleanup_resources()
        except Exception:  # noqa: BLE001
            pass


def _collect(out: CellResult, msg) -> None:
    kind, content = msg["header"]["msg_type"], msg["content"]
    if kind == "stream":
        if content["name"] == "stdout":
            out.stdout += content["text"]
        else:
            out.stderr += content["text"]
    elif kind in ("display_data", "execute_result", "update_display_data"):
        out.displays.append(content["data"])
    elif kind == "error":
        out.ename, out.evalue = content["ename"], content["evalue"]
        out.stderr += "\n".join(content.get("traceback") or [])
