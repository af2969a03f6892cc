"""A benchmark workload on tiny synthetic data, for the crash tests of tests/test_workloads.py.

    python tests/scripts/bench_run.py NAME RUN_DIR [--epochs N] [--every E] [--threads N] [--deterministic]

Trains like ``keepalive bench run NAME --synthetic --size tiny`` (same defaults) through
``keepalive.workloads.run``, and prints what ``tests/crashkit.py`` reads to kill it at a chosen step:
``STEP n`` after each optimizer step (the ``on_step`` hook), ``COMMITTED n`` after each checkpoint
commit (``on_commit``, from the writer thread), and ``DONE`` when the training completed. Exit 0
when completed, 143 when it stopped before the end (as ``keepalive bench run``).
"""
import argparse
import sys
import threading

from childio import emit

from keepalive import workloads

p = argparse.ArgumentParser()
p.add_argument("name")
p.add_argument("run_dir")
p.add_argument("--epochs", type=int, default=None)
p.add_argument("--every", default="epoch")
p.add_argument("--threads", type=int, default=None)
p.add_argument("--deterministic", action="store_true")
args = p.parse_args()

lock = threading.Lock()  # the training thread's lines and the writer thread's never interleave


def line(text: str) -> None:
    with lock:
        emit(text)


every = int(args.every) if args.every.isdigit() else args.every
doc = workloads.run(args.name, args.run_dir, epochs=args.epochs, synthetic=True, size="tiny", every=every,
                    threads=args.threads, deterministic=args.deterministic,
                    on_step=lambda step: line(f"STEP {step}"),
                    on_commit=lambda step: line(f"COMMITTED {step}"))
if doc.get("completed"):
    line("DONE")
sys.exit(0 if doc.get("completed") else 143)
