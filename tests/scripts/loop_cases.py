"""The loops whose variables keepalive.loopstate reads, each run under the Python running this script:
the child of tests/test_loop_state.py, run by every Python found (it needs neither torch nor pytest,
and loads keepalive/loopstate.py by its path). A stand-in ``ckpt.epochs()`` reads its caller's frame as
the adapter does. Prints one JSON object: {case: {"globals", "locals", "carried", "reads"}}.
"""
import importlib.util
import json
import os
import sys

_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "keepalive", "loopstate.py")
_spec = importlib.util.spec_from_file_location("loopstate", _PATH)
loopstate = importlib.util.module_from_spec(_spec)
sys.modules["loopstate"] = loopstate
_spec.loader.exec_module(loopstate)

seen = {}


class Ckpt:
    """Stands for a DriveCheckpoint: reads the loop over its call, then runs two iterations."""

    def __init__(self, case):
        self.case = case

    def _read(self):
        frame = loopstate.caller_frame(2)
        lv = loopstate.LoopVariables(lambda m: None, lambda m, key=None: None)
        lv.watch(frame)
        loop = lv.loop
        seen[self.case] = {"globals": list(loop.globals), "locals": list(loop.locals),
                           "carried": sorted(loop.carried), "module_level": loop.module_level}

    def epochs(self, n):
        self._read()
        return iter(range(n))

    def batches(self, items):
        frame = loopstate.caller_frame(1)
        seen.setdefault("reads", {})[self.case] = list(loopstate.reads_after(frame.f_code, frame.f_lasti))
        return iter(items)


NANOGPT = '''
X, Y = get_batch()
best = 1e9
local_iter_num = 0
for it in ckpt.epochs(2):
    lr = it * 0.1
    if it % 2 == 0:
        val = evaluate()
        if val < best:
            best = val
    for micro in range(2):
        loss = X + Y
        X, Y = get_batch()
    local_iter_num += 1
    squares = [k * k for k in range(3)]
'''

POSTLOOP = '''
for epoch in ckpt.epochs(2):
    for x in ckpt.batches([1, 2]):
        loss = x * 2
        total = x
    shown = str(loss)
    total = 0
'''


# containers the loop changes in place (a history, a dict of scores) are loop state too; a method
# that reads (cfg.get) is not a change
MUTATED = '''
for epoch in ckpt.epochs(2):
    history.append(epoch)
    scores[epoch] = 1
    n = cfg.get("k")
'''


def run_at_module_level(case, src):
    ns = {"ckpt": Ckpt(case), "get_batch": lambda: (1, 2), "evaluate": lambda: 0.5,
          "history": [], "scores": {}, "cfg": {}}
    exec(compile(src, case, "exec"), ns)


def run_in_function(case, src, head=""):
    ns = {"ckpt": Ckpt(case), "get_batch": lambda: (1, 2), "evaluate": lambda: 0.5, "tqdm": iter}
    body = "".join("    " + line + "\n" for line in src.strip("\n").splitlines())
    exec(compile(f"def main():\n{head}{body}main()\n", case, "exec"), ns)


run_at_module_level("module", NANOGPT)
run_in_function("function", NANOGPT)
run_in_function("global", NANOGPT, head="    global best\n")
run_in_function("wrapped", "for it in tqdm(ckpt.epochs(2)):\n    n = it\n")
run_at_module_level("postloop", POSTLOOP)
run_in_function("postloop_function", POSTLOOP)
run_at_module_level("mutated", MUTATED)
run_in_function("mutated_function", MUTATED, head="    history, scores, cfg = [], {}, {}\n")
print(json.dumps({"python": list(sys.version_info[:2]), "said": seen}))
