"""A small torch training with code after its loop, for tests/test_stops_stop.py:
``python stop_train.py RUN_DIR OUT_FILE``.

4 epochs of 5 batches (20 samples, batch 4, shuffled, dropout). Prints ``STEP n`` after each optimizer
step and ``COMMITTED n`` per checkpoint commit; the loop's ``finally`` prints ``FINALLY``. The code after
the loop is what a script does once its training has finished: it saves the weights, the optimizer's
state and a last random draw to OUT_FILE and prints ``AFTER``.

Environment (test knobs):
ST_PLAIN=1: the same training without keepalive (the reference).
ST_STEP_SLEEP: seconds after each step (a notice has time to arrive).
ST_DEADLINE_AT=k: the session's deadline comes after the k-th optimizer step (``remaining_fn``).
ST_ON_PREEMPT: DriveCheckpoint's on_preempt.
ST_NO_EXIT=1: negative control: the stop's end of the training call taken away (it returns, as before).
"""
import os
import sys
import time

import torch
from childio import emit
from torch.utils.data import DataLoader, TensorDataset


def main(run_dir: str, out_file: str) -> None:
    if os.environ.get("ST_NO_EXIT"):
        from keepalive.lifecycle.stops import Stops

        Stops.raise_stop = lambda self: setattr(self, "to_raise", None)  # negative control
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(20, 6, generator=gen), torch.randn(20, 1, generator=gen))
    torch.manual_seed(1234)
    loader = DataLoader(data, batch_size=4, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sleep = float(os.environ.get("ST_STEP_SLEEP", "0"))
    steps = [0]
    if os.environ.get("ST_PLAIN"):
        ckpt, epochs, batches = None, range(4), (lambda loader_: loader_)
    else:
        from keepalive.callbacks.torch import DriveCheckpoint

        options = {}
        if os.environ.get("ST_DEADLINE_AT"):
            at = int(os.environ["ST_DEADLINE_AT"])
            options.update(remaining_fn=lambda: 1e6 if steps[0] < at else 1.0, deadline_margin="2s")
        if os.environ.get("ST_ON_PREEMPT"):
            options["on_preempt"] = os.environ["ST_ON_PREEMPT"]
        ckpt = DriveCheckpoint(run_dir, model=model, optimizer=opt, every=100, **options)
        ckpt.core.on_commit.append(lambda r: emit(f"COMMITTED {r.info.step}"))
        epochs, batches = ckpt.epochs(4), ckpt.batches
    try:
        for _ in epochs:
            for x, y in batches(loader):
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                steps[0] += 1
                emit(f"STEP {steps[0]}")
                time.sleep(sleep)
    finally:
        emit("FINALLY")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "draw": torch.rand(4)}, out_file)
    emit("AFTER")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
