"""``torchrun`` jobs for the distributed tests (DDP, FSDP2): one job in its own process session, its
output collected by a thread, each restart attempt's rank PIDs read from the files the training script
writes (``pid.<attempt>.<rank>``), and the whole job stopped by its process group."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional

from servers import free_port  # tests/servers.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class TorchrunJob:
    """``torchrun --nproc_per_node=N script run_dir out_dir`` (the c10d rendezvous on a free port
    starts every restart afresh). Subclasses may change :meth:`command`."""

    def __init__(self, tmp, name: str, script: str, *, restarts: int = 0,
                 env: Optional[Dict[str, str]] = None, nproc: int = 2, run_dir: Optional[str] = None):
        self.script = script
        self.run_dir = run_dir or str(tmp / f"{name}-run")
        self.out_dir = str(tmp / f"{name}-out")
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {}))
        self.proc = subprocess.Popen(self.command(nproc, restarts), env=full_env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.output: List[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def command(self, nproc: int, restarts: int) -> List[str]:
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                f"--max-restarts={restarts}", "--monitor-interval=0.2",
                "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
                self.script, self.run_dir, self.out_dir]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in iter(self.proc.stdout.readline, ""):
            self.output.append(line)
        self.proc.stdout.close()

    def text(self) -> str:
        return "".join(self.output)

    def pids(self, after: int, timeout: float = 60.0) -> Optional[tuple]:
        """``(attempt, {rank: pid})`` of the newest attempt after ``after`` (torchrun counts restarts
        from 0), once both ranks wrote their PID; None if the job ended first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            names = os.listdir(self.out_dir) if os.path.isdir(self.out_dir) else []
            attempts = sorted({int(n.split(".")[1]) for n in names if n.startswith("pid.")}, reverse=True)
            for attempt in attempts:
                if attempt <= after:
                    break
                try:
                    return attempt, {r: int(open(os.path.join(self.out_dir, f"pid.{attempt}.{r}")).read())
                                     for r in (0, 1)}
                except (OSError, ValueError):
                    continue
            if self.proc.poll() is not None:
                return None
            time.sleep(0.05)
        raise AssertionError(f"no attempt after {after} started:\n{self.text()}")

    def wait(self, timeout: float = 150.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"the job did not finish in {timeout} s:\n{self.text()}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # our own session (start_new_session), by id
            self.proc.wait()
