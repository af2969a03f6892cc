"""The run's events (keepalive.lifecycle.events) from a real torch loop: started / resumed, a step per
batch, a save per checkpoint, one end (finished, stopped, crashed) -- what notifications and the heartbeat
listen to."""
import os
import subprocess
import sys
import textwrap

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from keepalive.callbacks.torch import DriveCheckpoint
from keepalive.lifecycle.events import RunListener


class Recorder(RunListener):
    def __init__(self):
        self.seen = []

    def started(self, ckpt, resumed_from):
        self.seen.append(("started", None if resumed_from is None else resumed_from.name))

    def stepped(self, ckpt):
        self.seen.append(("step", ckpt.state.counters.step))

    def saved(self, ckpt, result):
        self.seen.append(("saved", result.info.name))

    def ended(self, ckpt, outcome, reason):
        self.seen.append((outcome, reason))


def _train(path, epochs, recorder, stop_at=None):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = DriveCheckpoint(path, model=model, optimizer=opt, quiet=True)
    ckpt.core.events.subscribe(recorder)
    data = DataLoader(TensorDataset(torch.randn(6, 4), torch.randint(0, 2, (6,))), batch_size=3)
    for epoch in ckpt.epochs(epochs):
        for x, y in ckpt.batches(data):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        if stop_at is not None and epoch == stop_at:
            break
    ckpt.close()


def test_a_run_tells_its_start_steps_saves_and_one_end(tmp_path):
    first = Recorder()
    _train(tmp_path / "run", 2, first)
    kinds = [k for k, _ in first.seen]
    assert first.seen[0] == ("started", None)
    assert kinds.count("step") == 4 and kinds.count("saved") == 2
    assert first.seen[-1] == ("finished", "end of training")
    assert kinds.count("finished") == 1  # close() after the end tells nothing more

    again = Recorder()
    _train(tmp_path / "run", 3, again)  # one more epoch on the same run: resumed from the newest
    assert again.seen[0][0] == "started" and again.seen[0][1] is not None
    assert [k for k, _ in again.seen].count("step") == 2 and again.seen[-1][0] == "finished"


def test_a_loop_left_by_break_is_finished_once(tmp_path):
    # `break` out of ckpt.epochs() is how early stopping ends a training: its end, saved as such
    rec = Recorder()
    _train(tmp_path / "run", 3, rec, stop_at=0)
    assert rec.seen[-1][0] == "finished" and [k for k, _ in rec.seen].count("finished") == 1


def test_a_script_that_raises_tells_crashed_once(tmp_path):
    script = textwrap.dedent(f"""
        import torch
        from keepalive.callbacks.torch import DriveCheckpoint
        from keepalive.lifecycle.events import RunListener
        class Tell(RunListener):
            def ended(self, ckpt, outcome, reason):
                print("ENDED", outcome, reason, flush=True)
        model = torch.nn.Linear(2, 1)
        ckpt = DriveCheckpoint({str(tmp_path / "run")!r}, model=model, quiet=True)
        ckpt.core.events.subscribe(Tell())
        for epoch in ckpt.epochs(2):
            for x in ckpt.batches(torch.utils.data.DataLoader(torch.ones(1, 2))):
                raise ValueError("loss is nan\\nsecond line")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 1, out.stderr
    assert out.stdout.count("ENDED") == 1, out.stdout
    assert "ENDED crashed ValueError: loss is nan" in out.stdout
    assert "Traceback" in out.stderr  # Python's own report still comes


def test_a_close_is_taken_back_by_a_next_fit_and_told_only_when_nothing_follows():
    from keepalive.lifecycle.events import RunEvents, tell_crash

    class Ends(RunListener):
        def __init__(self):
            self.ends = []

        def ended(self, ckpt, outcome, reason):
            self.ends.append(outcome)

    between_fits = RunEvents(ckpt=None)  # fastai's fine_tune: closed after its frozen fit, then trains on
    between_fits.subscribe(listener := Ends())
    between_fits.started(None)
    between_fits.ended("closed")
    assert listener.ends == []
    between_fits.stepped()
    between_fits.ended("finished", "end of training")
    between_fits.tell_close()
    assert listener.ends == ["finished"]

    left = RunEvents(ckpt=None)  # closed, nothing follows: told at exit (control)
    left.subscribe(listener := Ends())
    left.started(None)
    left.ended("closed")
    left.tell_close()
    assert listener.ends == ["closed"]

    raised = RunEvents(ckpt=None)  # an adapter closes before a notebook cell's error is seen
    raised.subscribe(listener := Ends())
    raised.started(None)
    raised.ended("closed")
    tell_crash(ValueError("boom"))
    raised.tell_close()
    assert listener.ends == ["crashed"]
