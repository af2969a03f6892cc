"""Output for the crash-test children: one whole line per write.

A training child prints ``STEP n`` from the main thread and ``COMMITTED n`` from the background
writer thread; ``print`` writes the text and the newline separately, so two threads can interleave
into ``52STEP``. One ``write`` of the whole line cannot be split that way.
"""
import sys


def emit(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
