"""A crashkit child that runs its steps as fast as it can print them (tests/test_crashkit.py).

Its "checkpoint" is a file holding the last step done; a re-run resumes after it. With nothing to
slow it, the whole run ends long before a loaded parent reads the first lines: only the harness's
hold (childio.hold_if_planned) lets the parent's planned kill land.
"""
import os
import sys

from childio import emit

state, total = sys.argv[1], int(sys.argv[2])
done = int(open(state).read()) if os.path.exists(state) else 0
if done:
    emit(f"resuming run instant from epoch 0, step {done}")
for step in range(done + 1, total + 1):
    with open(state + ".tmp", "w") as f:
        f.write(str(step))
    os.replace(state + ".tmp", state)
    emit(f"STEP {step}")
emit("DONE")
