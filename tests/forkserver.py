"""Child processes forked from a server that has already imported the heavy modules (torch: ~2.5 s of
CPU per process, most of a small test child's cost; a test file starts dozens of them on a 2-core CI
machine).

``ForkServer(["torch", ...], env)`` starts ``python forkserver.py MODULES...`` once; ``spawn(argv, env)``
asks it to fork and run ``argv`` (a script and its arguments) as ``__main__`` in the fork, with that
environment, and returns a :class:`Forked` that the tests use as they use ``subprocess.Popen``: its
``pid`` (the fork's own: signals reach it), ``stdout`` (the fork's stdout and stderr, through a FIFO:
end of file when it exits), ``send_signal``, ``kill``, ``poll``, ``wait``, ``returncode``.

For the files whose children a helper starts (tests/crashkit.py ``run_to_completion``), ``ServerPool``
starts a server per kind of child on first use and ``ForkingSubprocess(pool).installed_in(crashkit)``
makes that helper's ``subprocess.Popen([sys.executable, script, ...])`` a fork (the test module's own
``subprocess.run`` too, installed in it); a child the pool has no server for stays a fresh interpreter.

What a fork shares with a fresh interpreter: keepalive and the script are imported after the fork (its
signal handlers, threads and state are its own); Python's, NumPy's and torch's global generators are
seeded from the OS again (as at a fresh start); the fork leaves through the interpreter's normal exit (non-daemon
threads joined, ``atexit`` run) with the script's exit code. What it does not: the server's environment
applies to what the server imported (OMP_NUM_THREADS, for instance, is read by torch's import).

``ForkServer(..., listen=True)``: the server also takes requests from other processes, on the Unix
socket ``socket_path``, sent by tests/forkclient.py (``python -S forkclient.py script args...``, with
``FORKSERVER_SOCKET`` naming the socket in its environment): the fork runs the script with the client's
arguments, environment, working folder and stdin / stdout / stderr (passed over the socket), in a
session of its own, as a fresh interpreter started in the client's place would; the client forwards
the signals it gets to the fork and exits as the fork did (the same code, or killed by the same
signal), and a client gone before its fork (SIGKILLed) takes the fork with it. For children that
another program starts (torchrun's ranks) or that must be a process of its own (torchrun's agent:
``torchrunkit.forked_ranks``). A request's ``argv`` may be ``["-m", module, args...]``, run as
``python -m`` runs it.

``quick_exit=True`` (``ForkServer``, ``ServerPool``; off by default): a fork's exit stops after the
interpreter's own first steps (non-daemon threads joined, ``atexit`` run, stdout and stderr flushed)
and skips the teardown of the modules the server imported (0.8 s of CPU per child with torch loaded,
2 s with TensorFlow); the server itself ends the same way when closed. For children whose results are
files they write and close themselves and lines they print: an object's ``__del__`` at interpreter exit,
or a file left open in a global, is not run or flushed then.
"""
from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import Future
from typing import IO, Callable, Dict, Hashable, Iterator, List, Optional, Sequence, Tuple


class Forked:
    """A forked child, used like ``subprocess.Popen`` (text stdout)."""

    def __init__(self, pid: int, fifo: str, exited: "Future[int]"):
        self.pid = pid
        self._exited = exited
        self.returncode: Optional[int] = None
        # blocks until the fork opens the write end (its first act): end of file once it and every
        # thread or process it started are gone, as with a pipe
        self.stdout: IO[str] = open(fifo, encoding="utf-8", errors="replace")

    def poll(self) -> Optional[int]:
        if self._exited.done():
            self.returncode = self._exited.result()
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        try:
            self.returncode = self._exited.result(timeout=timeout)
        except TimeoutError:
            raise subprocess.TimeoutExpired(f"forked pid {self.pid}", timeout or 0.0) from None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        import signal

        self.send_signal(signal.SIGTERM)


class ForkServer:
    """One server process per test module; ``spawn`` is safe from several threads."""

    def __init__(self, modules: Sequence[str], env: Dict[str, str], setup: str = "", quick_exit: bool = False,
                 listen: bool = False, child_setup: str = ""):
        """``setup``: Python code the server runs before it imports ``modules`` (what the children's
        scripts do first, e.g. define operator schemas). ``quick_exit``, ``listen``: see the module's
        docstring. ``child_setup`` (with ``listen``): Python code each fork of a socket request runs
        with its own environment, before the script (what a module imported in the server read from
        the server's environment at its import, read again: a rank's number, for instance)."""
        self._dir = tempfile.mkdtemp(prefix="forkserver-")
        self._quick_exit = quick_exit
        self.socket_path: Optional[str] = None
        if listen:
            self.socket_path = os.path.join(self._dir, "socket")
            env = dict(env, **{LISTEN_ENV: self.socket_path, QUICK_EXIT_ENV: "1" if quick_exit else "",
                               CHILD_SETUP_ENV: child_setup})
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), setup, *modules], env=env,
                                     text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._lock = threading.Lock()  # one request and its answer at a time
        self._exits_lock = threading.Lock()
        self._started: "queue.Queue[Tuple[int, Future[int]]]" = queue.Queue()
        self._exits: Dict[int, "Future[int]"] = {}  # the running children's, by pid
        self._count = 0
        assert self.proc.stdout is not None
        ready = self.proc.stdout.readline()
        assert ready.strip() == "READY", f"the fork server did not start: {ready!r}"
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in iter(self.proc.stdout.readline, ""):
            kind, pid, *code = line.split()
            if kind == "STARTED":  # always before the same child's EXIT (one stream, in order)
                exited: "Future[int]" = Future()
                with self._exits_lock:
                    self._exits[int(pid)] = exited
                self._started.put((int(pid), exited))
            elif kind == "EXIT":
                with self._exits_lock:
                    exited = self._exits.pop(int(pid))
                exited.set_result(int(code[0]))

    def spawn(self, argv: List[str], env: Dict[str, str], cwd: Optional[str] = None) -> Forked:
        """Fork the server and run ``argv`` (``[script, *args]``) in the fork with ``env``."""
        with self._lock:
            self._count += 1
            fifo = os.path.join(self._dir, f"out{self._count}")
            os.mkfifo(fifo)
            assert self.proc.stdin is not None
            request = {"argv": argv, "env": env, "cwd": cwd or os.getcwd(), "out": fifo}
            if self._quick_exit:
                request["quick_exit"] = True
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            pid, exited = self._started.get(timeout=60)
        return Forked(pid, fifo, exited)

    def close(self) -> None:
        """Ends the server (its children still running are killed)."""
        with self._exits_lock:
            running = list(self._exits)
        for pid in running:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        if self.proc.stdin is not None:
            with self._lock:
                if self._quick_exit:
                    self.proc.stdin.write(json.dumps({"quick_exit": True}) + "\n")
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)


class ServerPool:
    """Fork servers started on first use, one per kind of child: ``choose(argv, env)`` says which
    (``(key, modules, setup)``; the key names what the preloaded imports depend on, e.g. Keras'
    backend, read when keras is imported) or ``None`` for a fresh interpreter (a child whose exit
    status or signal behaviour as a real interpreter is the point, or one the server has not
    imported for). A server starts with the environment of the first child of its kind."""

    def __init__(self, choose: Callable[[List[str], Dict[str, str]],
                                        Optional[Tuple[Hashable, Sequence[str], str]]], quick_exit: bool = False):
        self._choose = choose
        self._quick_exit = quick_exit  # see the module's docstring
        self._servers: Dict[Hashable, ForkServer] = {}
        self._lock = threading.Lock()
        self.forked = 0  # children forked so far (tests print it; fresh interpreters are not counted)

    def server_for(self, argv: List[str], env: Dict[str, str]) -> Optional[ForkServer]:
        chosen = self._choose(argv, env)
        if chosen is None:
            return None
        key, modules, setup = chosen
        with self._lock:
            if key not in self._servers:
                self._servers[key] = ForkServer(modules, env, setup=setup, quick_exit=self._quick_exit)
            self.forked += 1
            return self._servers[key]

    def close(self) -> None:
        with self._lock:
            servers, self._servers = list(self._servers.values()), {}
        for server in servers:
            server.close()


class ForkingSubprocess:
    """Stands in for the ``subprocess`` module inside a helper that starts the children itself
    (tests/crashkit.py ``run_to_completion``): ``Popen([sys.executable, script, *args], stdout=PIPE,
    stderr=STDOUT, text=True, env=...)`` and ``run([sys.executable, script, ...], capture_output=True,
    text=True, ...)`` fork from the pool's server when it has one for that child (``run``'s
    ``stderr`` then comes within ``stdout``: a fork has one stream); any other call is the real
    module's. ``with ForkingSubprocess(pool).installed_in(crashkit):`` for the time of a module."""

    def __init__(self, pool: ServerPool):
        self.pool = pool

    def __getattr__(self, name: str):
        return getattr(subprocess, name)

    def _server(self, args, env: Optional[Dict[str, str]]) -> Optional[ForkServer]:
        argv = [str(a) for a in args] if isinstance(args, (list, tuple)) else []
        if len(argv) < 2 or argv[0] != sys.executable or not argv[1].endswith(".py"):
            return None  # python -c / -m, another program: as it was
        return self.pool.server_for(argv[1:], dict(os.environ if env is None else env))

    def Popen(self, args, stdout=None, stderr=None, text=None, env=None, cwd=None, **kw):  # noqa: N802
        server = None
        if stdout == subprocess.PIPE and stderr == subprocess.STDOUT and text and not kw:
            server = self._server(args, env)
        if server is None:
            return subprocess.Popen(args, stdout=stdout, stderr=stderr, text=text, env=env, cwd=cwd, **kw)
        return server.spawn([str(a) for a in args[1:]], dict(os.environ if env is None else env), cwd=cwd)

    def run(self, args, capture_output=False, text=None, env=None, cwd=None, timeout=None, check=False,
            **kw):
        server = self._server(args, env) if capture_output and text and not kw else None
        if server is None:
            return subprocess.run(args, capture_output=capture_output, text=text, env=env, cwd=cwd,
                                  timeout=timeout, check=check, **kw)
        child = server.spawn([str(a) for a in args[1:]], dict(os.environ if env is None else env), cwd=cwd)
        out: List[str] = []
        reader = threading.Thread(target=lambda: out.append(child.stdout.read()), daemon=True)
        reader.start()
        try:
            code = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            raise subprocess.TimeoutExpired(args, timeout or 0.0) from None
        reader.join(timeout=30)  # a grandchild may hold the stream open a moment longer
        child.stdout.close()
        done = subprocess.CompletedProcess(args, code, out[0] if out else "", "")
        if check:
            done.check_returncode()
        return done

    @contextlib.contextmanager
    def installed_in(self, module) -> Iterator["ForkingSubprocess"]:
        """``module.subprocess`` is this one inside the block, the real module again after it."""
        was = module.subprocess
        module.subprocess = self
        try:
            yield self
        finally:
            module.subprocess = was


def script_children_fixture(script: str, kind: str, preload: Sequence[str], *modules: object,
                             setup: str = "") -> object:
    """A module fixture (autouse; assign it to ``forked_children``): the children a test file starts
    with ``subprocess`` to run ``script`` fork from a server (``kind``) that has imported ``preload``
    (and run ``setup``), with ``quick_exit``; ``modules`` (crashkit, the test module) use it for their
    ``subprocess`` inside the file's tests. Other commands run as they would."""
    import pytest

    @pytest.fixture(scope="module", autouse=True)
    def forked_children():
        pool = ServerPool(lambda argv, env: (kind, list(preload), setup) if argv[0] == script else None,
                          quick_exit=True)
        forking = ForkingSubprocess(pool)
        try:
            with contextlib.ExitStack() as stack:
                for module in modules:
                    stack.enter_context(forking.installed_in(module))
                yield pool
        finally:
            pool.close()

    return forked_children


# ------------------------------------------------------------------------------------ the server
_SCRIPT_GLOBALS: List[Dict[str, object]] = []
#: the server's environment: the socket it listens on (``listen=True``), and whether the forks of
#: socket requests leave quickly
LISTEN_ENV = "_FORKSERVER_LISTEN"
QUICK_EXIT_ENV = "_FORKSERVER_QUICK_EXIT"
CHILD_SETUP_ENV = "_FORKSERVER_CHILD_SETUP"


def _run_child(request: Dict[str, object], fds: Sequence[int] = ()) -> None:
    """In the fork: become the script's process. Never returns: raises SystemExit with its exit code,
    which unwinds the server's frames to the interpreter's normal exit. ``fds``: a socket client's
    stdin, stdout and stderr (else stdout and stderr go to the request's FIFO, stdin is /dev/null)."""
    import random
    import runpy

    if fds:
        os.setsid()  # as torchrun starts its ranks (start_new_session): no signal of the server's group
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
    else:
        out = os.open(str(request["out"]), os.O_WRONLY)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in dict(request["env"]).items()})  # type: ignore[call-overload]
    os.chdir(str(request["cwd"]))
    exec(str(request.get("child_setup") or ""), {})  # noqa: S102 - the test's own code
    argv = [str(a) for a in request["argv"]]  # type: ignore[attr-defined]
    module = argv[1] if argv[0] == "-m" else None  # ["-m", module, args...]: as ``python -m`` runs it
    sys.argv = argv[1:] if module else argv  # (run_module puts the module's file first, as -m does)
    sys.path[0] = os.getcwd() if module else os.path.dirname(os.path.abspath(argv[0]))
    # a fresh interpreter's global generators are seeded from the OS: not shared with a sibling fork
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    quick = bool(request.get("quick_exit"))
    try:
        # its globals kept to the interpreter's exit, as a script's are (finalizers run at the same moment)
        if module:
            # imported by the server (its code preloaded), run afresh as __main__, as by python -m
            sys.modules.pop(module, None)
            _SCRIPT_GLOBALS.append(runpy.run_module(module, run_name="__main__", alter_sys=True))
        else:
            _SCRIPT_GLOBALS.append(runpy.run_path(argv[0], run_name="__main__"))
    except SystemExit as exc:
        if quick:
            leave_quickly(exc.code)
        raise
    except BaseException:  # noqa: BLE001 - printed as an uncaught exception would be, exit code 1
        # through sys.excepthook, as the interpreter prints it (torch.distributed's prefixes each line
        # with the rank), from the script's frame on (not this function's and runpy's)
        kind, value, tb = sys.exc_info()
        while tb is not None and tb.tb_frame.f_code.co_filename in (_run_child.__code__.co_filename,
                                                                    runpy.__file__, "<frozen runpy>"):
            tb = tb.tb_next
        if value is not None:
            value.__traceback__ = tb  # what the interpreter's hook prints
        sys.excepthook(kind, value, tb)  # type: ignore[arg-type]
        if quick:
            leave_quickly(1)
        raise SystemExit(1) from None
    if quick:
        leave_quickly(0)
    raise SystemExit(0)


def _kill_group(pid: int, signum: int) -> None:
    """Signal the process group that the fork ``pid`` leads (or the fork alone, before its setsid)."""
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signum)
            return
        except ProcessLookupError:
            continue


def leave_quickly(code: object) -> None:
    """The interpreter's exit as far as a program sees it (non-daemon threads joined, ``atexit``
    handlers run, stdout and stderr flushed), then ``os._exit`` with the status that exit would have,
    without the teardown of every imported module."""
    import atexit
    import threading

    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:  # sys.exit("message"): printed after what stdout holds, status 1, as the interpreter does
        sys.stdout.flush()
        print(code, file=sys.stderr)
        status = 1
    threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter's exit calls first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status & 0xFF)


def _serve(setup: str, modules: List[str]) -> None:
    import importlib
    import select
    import socket

    exec(setup, {})  # noqa: S102 - the test's own code
    for name in modules:
        importlib.import_module(name)
    answer = os.fdopen(os.dup(1), "w", buffering=1)
    listener = None
    if os.environ.get(LISTEN_ENV):
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(os.environ[LISTEN_ENV])
        listener.listen(64)
    answer.write("READY\n")
    pending = b""
    children = set()  # the forks of the test's requests (stdin)
    clients: Dict[int, "socket.socket"] = {}  # a socket client's fork -> the connection to that client
    orphans = set()  # forks whose client went away (killed, not reaped yet)
    quick_exit = False

    def fork(request: Dict[str, object], fds: Sequence[int] = ()) -> int:
        pid = os.fork()
        if pid == 0:  # none of the server's streams stays open in a child
            answer.close()
            for sock in [*([listener] if listener else []), *clients.values()]:
                sock.close()
            _run_child(request, fds)
        return pid

    while True:  # one thread only: a fork copies no other thread's held lock
        watched: list = [0, *([listener] if listener else []), *clients.values()]
        readable, _, _ = select.select(watched, [], [], 0.05)
        while children or clients or orphans:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                break
            code = os.waitstatus_to_exitcode(status)
            orphans.discard(pid)
            if pid in children:
                children.discard(pid)
                answer.write(f"EXIT {pid} {code}\n")
            elif pid in clients:
                conn = clients.pop(pid)
                with contextlib.suppress(OSError):
                    conn.sendall(f"EXIT {code}\n".encode())
                conn.close()
        for pid, conn in list(clients.items()):
            if conn in readable and not conn.recv(64):  # the client is gone (SIGKILLed): its fork too,
                _kill_group(pid, 9)  # with the processes it started (the fork leads its process group)
                conn.close()
                del clients[pid]
                orphans.add(pid)
        if listener is not None and listener in readable:
            conn, _ = listener.accept()
            data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
            while data and not data.endswith(b"\n"):
                more = conn.recv(1 << 16)
                if not more:
                    break
                data += more
            if len(fds) == 3 and data.endswith(b"\n"):
                request = json.loads(data)
                request["quick_exit"] = bool(os.environ.get(QUICK_EXIT_ENV))
                request["child_setup"] = os.environ.get(CHILD_SETUP_ENV, "")
                pid = fork(request, fds)
                conn.sendall(f"STARTED {pid}\n".encode())
                clients[pid] = conn
            else:
                conn.close()
            for fd in fds:
                os.close(fd)
        if 0 not in readable:
            continue
        data = os.read(0, 1 << 16)
        if not data:
            break
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            if "argv" not in request:  # closing, with quick_exit: this server ends as its forks do
                quick_exit = True
                continue
            pid = fork(request)
            children.add(pid)
            answer.write(f"STARTED {pid}\n")
    for pid in [*children, *clients, *orphans]:  # the test is gone: no child outlives it
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    if quick_exit:
        answer.flush()
        os._exit(0)


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2:])
