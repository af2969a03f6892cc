"""The tiny commands tests/test_supervise.py runs under ``keepalive run``:
``python supervised_child.py COUNTER MODE``. Each start adds a line to the file COUNTER (the time).

``stop-twice``: exits 143 (stopped, continue me) at the first two starts, 0 at the third.
``refuse``: dies of a StateMismatchError (a checkpoint that does not fit), as a training would.
``crash``: dies of a RuntimeError at every start.
``trap``: prints ``READY`` and waits; SIGTERM makes it print ``SAVED`` and exit 143.
"""
import signal
import sys
import time

counter, mode = sys.argv[1], sys.argv[2]
with open(counter, "a") as f:
    f.write(f"{time.time()}\n")
with open(counter) as f:
    starts = len(f.readlines())

if mode == "stop-twice":
    sys.exit(143 if starts <= 2 else 0)
if mode in ("refuse", "crash"):
    from keepalive.errors import StateMismatchError
    from keepalive.lifecycle.events import install_crash_hook

    install_crash_hook()  # what every checkpointer does when it is made
    if mode == "refuse":
        raise StateMismatchError("the checkpoint's model has other shapes: 'fc.weight' (10, 4) != (10, 8)")
    raise RuntimeError("CUDA out of memory")
if mode == "trap":
    def saved(signum, frame):
        print("SAVED", flush=True)
        sys.exit(143)

    signal.signal(signal.SIGTERM, saved)
    print("READY", flush=True)
    time.sleep(60)
    sys.exit(0)
