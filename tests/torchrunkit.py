"""``torchrun`` jobs for the distributed tests (DDP, FSDP2): one job in its own process session, its
output collected by a thread, each restart attempt's rank PIDs read from the files the training script
writes (``pid.<attempt>.<rank>``), and the whole job stopped by its process group.

``with forked_ranks(modules):`` (a test module's fixture): the jobs started inside it run each rank as a
fork of a server that has imported ``modules`` (tests/forkserver.py, ``listen=True``): torchrun starts
tests/forkclient.py in the rank's place (``--no-python``), which has the server fork the script with the
rank's arguments, environment and streams; torchrun itself (the agent) forks from it too. Importing torch
and its distributed modules, then tearing them down at exit, is most of a small rank's CPU time, paid
for every rank of every attempt."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional

from forkserver import ForkServer  # tests/forkserver.py
from servers import free_port  # tests/servers.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLIENT = os.path.join(ROOT, "tests", "forkclient.py")
SOCKET_ENV = "FORKSERVER_SOCKET"  # forkclient.py's
_RANK_SERVER: List[ForkServer] = []  # the one of forked_ranks(), while it is open
_FORKED_RANKS: List[bool] = []  # whether its ranks fork (or only the agents)


#: ``child_setup`` for ranks that import Lightning (forked_ranks): it reads a rank's number from the
#: environment when imported, and sets one variable there
LIGHTNING_CHILD_SETUP = """
import os
from lightning.fabric.utilities.rank_zero import _get_rank, rank_zero_only
rank_zero_only.rank = _get_rank() or 0
os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
"""


@contextlib.contextmanager
def forked_ranks(modules: List[str], pythonpath: str = "", child_setup: str = "", setup: str = "",
                 env: Optional[Dict[str, str]] = None, ranks: bool = True):
    """The ranks of the jobs started inside are forks of one server that has imported ``modules``
    with ``pythonpath`` (a fork's ``sys.path`` is the server's, its first entry the script's folder):
    the PYTHONPATH the jobs' ranks get. Imports that read the environment read the server's (this
    process's, with ``OMP_NUM_THREADS=1`` as the jobs have it, and ``env``); ``child_setup`` (Python code)
    runs in each fork with the rank's environment, before the script: to read it again where that
    matters. ``setup``: code the server runs before its imports (forkserver.ForkServer's). ``ranks=False``:
    only the agents fork, the ranks are fresh interpreters (a test of what happens at their imports)."""
    pythonpath = pythonpath or os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    server_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env or {}), PYTHONPATH=pythonpath)
    server = ForkServer([*modules, "torch.distributed.run"], server_env, setup=setup, quick_exit=True, listen=True,
                        child_setup=child_setup)
    _RANK_SERVER.append(server)
    _FORKED_RANKS.append(ranks)
    try:
        yield server
    finally:
        _RANK_SERVER.remove(server)
        _FORKED_RANKS.pop()
        server.close()


def rank_entry(script: str) -> List[str]:
    """What follows torchrun's options in place of the script: the fork client's command inside
    :func:`forked_ranks`, else the script."""
    if not _RANK_SERVER or not _FORKED_RANKS[-1]:
        return [script]
    return ["--no-python", sys.executable, "-S", CLIENT, script]


def python_command(script: str) -> List[str]:
    """``python script`` (or ``python -m``) for a job's process (its environment with :func:`rank_env`):
    through the fork client inside :func:`forked_ranks` (torchrun's agent, a one-process job)."""
    return [sys.executable, *(["-S", CLIENT] if _RANK_SERVER else []), script]


def rank_env() -> Dict[str, str]:
    """The environment a job adds for :func:`rank_entry`'s command."""
    return {SOCKET_ENV: str(_RANK_SERVER[-1].socket_path)} if _RANK_SERVER else {}


class TorchrunJob:
    """``torchrun --nproc_per_node=N script run_dir out_dir`` (the c10d rendezvous on a free port
    starts every restart afresh). Subclasses may change :meth:`command`."""

    def __init__(self, tmp, name: str, script: str, *, restarts: int = 0,
                 env: Optional[Dict[str, str]] = None, nproc: int = 2, run_dir: Optional[str] = None):
        self.script = script
        self.run_dir = run_dir or str(tmp / f"{name}-run")
        self.out_dir = str(tmp / f"{name}-out")
        extra = dict(env or {})
        # the caller's PYTHONPATH (tests/shims for lightning) goes after the repository's
        path = os.pathsep.join(p for p in (ROOT, extra.pop("PYTHONPATH", ""), os.environ.get("PYTHONPATH", "")) if p)
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=path, **rank_env(),
                        **extra)
        self.proc = subprocess.Popen(self.command(nproc, restarts), env=full_env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.output: List[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def command(self, nproc: int, restarts: int) -> List[str]:
        return [*python_command("-m"), "torch.distributed.run", f"--nproc_per_node={nproc}",
                f"--max-restarts={restarts}", "--monitor-interval=0.2",
                "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
                *rank_entry(self.script), self.run_dir, self.out_dir]

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


def kill_ranks_at_random(job: TorchrunJob, rng, kills: int, pause: tuple, resume_re) -> tuple:
    """SIGKILL a random rank of each attempt of ``job`` (torchrun restarts them), ``pause`` seconds
    (uniform) after the attempt starts training; then wait for the job's end. Returns ``(log,
    resumed)``: per kill ``(rank, newest step committed before it, folders without manifest right
    after it, resumes seen before it)``, and the steps the job's attempts resumed at
    (``resume_re``'s group). A job that fails is an AssertionError with its output."""
    import re

    log: list = []
    attempt = -1
    try:
        for _ in range(kills):
            found = job.pids(attempt)
            if found is None:
                break
            attempt, pids = found
            while f"attempt {attempt}\n" not in job.text() and job.proc.poll() is None:
                time.sleep(0.02)  # until this attempt trains
            time.sleep(rng.uniform(*pause))  # a few steps (and saves) later
            if job.proc.poll() is not None:
                break
            victim = rng.choice((0, 1))
            text = job.text()
            committed = [int(m) for m in re.findall(r"^COMMITTED (\d+)$", text, re.M)]
            resumes_before = len(resume_re.findall(text))
            try:
                os.kill(pids[victim], signal.SIGKILL)
            except ProcessLookupError:
                break
            torn = [n for n in os.listdir(job.run_dir) if n.startswith("ckpt-")  # mid-save kills
                    and not os.path.exists(os.path.join(job.run_dir, n, "MANIFEST.json"))]
            log.append((victim, max(committed, default=None), len(torn), resumes_before))
        assert job.wait() == 0, job.text()
    finally:
        job.stop()
    resumed = [int(s) for s in resume_re.findall(job.text())]
    print("kills (rank, last committed step, folders without manifest, resumes before):", log,
          "resumed at:", resumed)
    # the restart after a kill resumes, never before a checkpoint committed before that kill
    for _, committed, _, resumes_before in log:
        if committed is not None:
            assert len(resumed) > resumes_before and resumed[resumes_before] >= committed, (log, resumed)
    return log, resumed


class MultiNodeJob:
    """``nodes`` torchrun agents of ``nproc`` processes each on 127.0.0.1, one c10d rendezvous: what
    ``torchrun --nnodes=N`` on N machines does, each agent in its own process session (stopped by its
    process group). Every agent's output is collected, prefixed ``[node i]``."""

    def __init__(self, tmp, name: str, script: str, *, nodes: int = 2, nproc: int = 1, restarts: int = 3,
                 env: Optional[Dict[str, str]] = None, run_dir: Optional[str] = None):
        self.run_dir = run_dir or str(tmp / f"{name}-run")
        self.out_dir = str(tmp / f"{name}-out")
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                        PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests", "scripts"),
                                                    os.environ.get("PYTHONPATH", "")]))
        full_env.update(env or {})  # a PYTHONPATH of the caller's replaces ours
        full_env.update(rank_env())
        endpoint = f"127.0.0.1:{free_port()}"
        self.output: List[str] = []
        self._lock = threading.Lock()
        self.agents: List[subprocess.Popen] = []
        for node in range(nodes):
            command = [*python_command("-m"), "torch.distributed.run", f"--nnodes={nodes}",
                       f"--nproc-per-node={nproc}", f"--max-restarts={restarts}", "--monitor-interval=0.2",
                       "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={name}",
                       "--local-addr=127.0.0.1", *rank_entry(script), self.run_dir, self.out_dir]
            agent = subprocess.Popen(command, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
            self.agents.append(agent)
            threading.Thread(target=self._read, args=(node, agent), daemon=True).start()

    def _read(self, node: int, agent: subprocess.Popen) -> None:
        assert agent.stdout is not None
        for line in iter(agent.stdout.readline, ""):
            with self._lock:
                self.output.append(f"[node {node}] {line}")
        agent.stdout.close()

    def text(self) -> str:
        with self._lock:
            return "".join(self.output)

    def wait(self, timeout: float) -> List[Optional[int]]:
        """Every agent's exit code; an agent still running after ``timeout`` (all agents together) is
        stopped and reads None."""
        deadline = time.monotonic() + timeout
        codes: List[Optional[int]] = []
        for agent in self.agents:
            try:
                codes.append(agent.wait(max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        self.stop()
        return codes

    def stop(self) -> None:
        for agent in self.agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)  # our own session (start_new_session), by id
                agent.wait()


def finish(job: TorchrunJob) -> str:
    """The output of a job that must end with 0 (stopped in any case)."""
    try:
        assert job.wait(240) == 0, job.text()[-6000:]
    finally:
        job.stop()
    return job.text()


def killed(job: TorchrunJob, victim: int, timeout: float = 240.0) -> str:
    """Wait until rank ``victim`` has SIGKILLed itself (it prints ``KILL rank``), then kill the whole job
    (every process)."""
    deadline = time.monotonic() + timeout
    try:
        while "KILL rank" not in job.text():
            assert job.proc.poll() is None, f"the job ended before its kill:\n{job.text()[-6000:]}"
            assert time.monotonic() < deadline, f"no kill in {timeout} s:\n{job.text()[-6000:]}"
            time.sleep(0.02)
        pid = int(open(os.path.join(job.out_dir, f"pid.0.{victim}")).read())
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        job.stop()
    return job.text()


def alive(pid: int) -> bool:
    """The process ``pid`` runs (not gone, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False
