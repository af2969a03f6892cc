"""The stand-in for a fresh interpreter that another program starts (torchrun's ranks), run as
``python -S forkclient.py script args...`` (or ``... forkclient.py -m module args...``): it asks the fork
server named by ``FORKSERVER_SOCKET`` (tests/forkserver.py, ``listen=True``) to run the script in a
fork, with this process's arguments,
environment, working folder and stdin / stdout / stderr; it forwards the signals it gets to the fork
(its process group) and exits as the fork did (the same code, or killed by the same signal). Without
``FORKSERVER_SOCKET`` it becomes the interpreter running the script. Only the standard library, no
site-packages (``-S``): it starts in a few milliseconds."""
import json
import os
import signal
import socket
import sys

SOCKET_ENV = "FORKSERVER_SOCKET"
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def main() -> None:
    argv = sys.argv[1:]
    env = dict(os.environ)  # with the socket's name: a fork may start clients too (torchrun's agent)
    path = env.get(SOCKET_ENV, "")
    if not path:
        os.execve(sys.executable, [sys.executable, *argv], env)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    request = json.dumps({"argv": argv, "env": env, "cwd": os.getcwd()}).encode() + b"\n"
    socket.send_fds(sock, [request], [0, 1, 2])
    answers = sock.makefile("rb")
    pid = int(answers.readline().split()[1])  # STARTED <pid>

    def forward(signum, _frame) -> None:
        # to the fork's process group (it leads one, as a rank started in a new session does), or to
        # the fork alone before it made its group
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signum)
                return
            except ProcessLookupError:
                continue

    for signum in FORWARDED:
        signal.signal(signum, forward)
    line = answers.readline()  # EXIT <code>: negative when a signal ended the fork
    code = int(line.split()[1]) if line else -signal.SIGKILL
    if code < 0:
        for signum in FORWARDED:
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code  # a signal that does not end a process by default
    os._exit(code)


if __name__ == "__main__":
    main()
