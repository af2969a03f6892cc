"""One epoch numbering in every line keepalive prints: the one the user's loop prints.

``for epoch in ckpt.epochs(n)`` yields 0, 1, ...; a line that names an epoch names the value that
variable had (docs/concepts.md, "How messages number epochs and batches"), and batches done are
counts. Checked on real resumes of a plain torch loop (left by an error inside an epoch, and at an
epoch's end): the epoch the resume line names is the epoch the loop yields first after it, and the
batch count is the number of that epoch's batches the resumed loop skips. An unsized loader (an
``IterableDataset``) is said as one, never as ``30/0``. The adapters' own resume words (HF Trainer,
Keras, Lightning) carry no second, differently numbered position.
"""
from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")
for _name in ("torchvision::nms", "torchvision::qnms"):  # the CUDA torchvision here (DESIGN.md)
    try:
        torch.library.define(_name, "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    except Exception:  # noqa: BLE001 - already defined
        pass

from torch.utils.data import DataLoader, IterableDataset, TensorDataset  # noqa: E402

from keepalive.callbacks import _hf_resume, _keras_state, _lightning_fit  # noqa: E402
from keepalive.callbacks.torch import DriveCheckpoint  # noqa: E402
from keepalive.runs import position  # noqa: E402

RESUME = re.compile(r"resuming run '\w+' from \S+: (?:in epoch (\d+) after (\d+) batches|at the end of epoch (\d+))")


class Stop(Exception):
    """Raised by the loop to leave it (as a crash would) after a checkpoint."""


def _build():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _step(model, opt, x, y):
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _train(path, loader, stop_at=None, epochs=3, every=2):
    """Runs the loop; ``stop_at=(epoch, batch index)`` leaves it there. Returns the (epoch, batch
    index) pairs the loop saw."""
    model, opt = _build()
    ckpt = DriveCheckpoint(path, model=model, optimizer=opt, every=every, keep=2)
    seen = []
    try:
        for epoch in ckpt.epochs(epochs):
            for i, (x, y) in ckpt.enumerate(loader):
                if (epoch, i) == stop_at:
                    raise Stop
                _step(model, opt, x, y)
                seen.append((epoch, i))
    except Stop:
        pass
    finally:
        ckpt.close()
    return seen


def _loader():
    data = TensorDataset(torch.randn(24, 4), torch.randn(24, 2))
    return DataLoader(data, batch_size=4)  # 6 batches per epoch


def test_a_resume_inside_an_epoch_names_the_epoch_the_loop_goes_on_with(tmp_path, capsys):
    _train(tmp_path / "run", _loader(), stop_at=(1, 5))  # saved after 4 batches of epoch 1 (every=2)
    capsys.readouterr()
    seen = _train(tmp_path / "run", _loader())
    out = capsys.readouterr().out
    m = RESUME.search(out)
    assert m and m.group(1) is not None, out
    epoch, batches = int(m.group(1)), int(m.group(2))
    assert (epoch, batches) == (1, 4), out
    assert seen[0] == (epoch, batches), seen  # the loop's own numbers: epoch 1, batch index 4 next
    assert "/0" not in out and "completed" not in out, out


def test_a_resume_at_an_epoch_end_names_the_epoch_that_ended(tmp_path, capsys):
    _train(tmp_path / "run", _loader(), stop_at=(2, 1), every="epoch")  # the newest save: epoch 1's end
    capsys.readouterr()
    seen = _train(tmp_path / "run", _loader(), every="epoch")
    out = capsys.readouterr().out
    m = RESUME.search(out)
    assert m and m.group(3) is not None, out
    assert seen[0] == (int(m.group(3)) + 1, 0), (seen, out)


class Stream(IterableDataset):
    """A loader without a length (a stream), replayable from its start."""

    def __iter__(self):
        g = torch.Generator().manual_seed(3)
        for _ in range(6):
            yield torch.randn(4, generator=g), torch.randn(2, generator=g)


def test_an_unsized_loader_is_said_as_one():
    assert position({"epoch": 0, "batch": 30, "step": 30}, batches=0) == \
        "in epoch 0 after 30 batches of an unsized loader, step 30"
    assert position({"epoch": 2, "batch": 30, "step": 230}, batches=100) == \
        "in epoch 2 after 30 of 100 batches, step 230"
    stream = {"data": {"epoch": 0, "batch": 30, "steps_in_epoch": 0}, "hf": {}}
    assert _hf_resume.describe(stream) == "an unsized loader (its epochs have no known length)"
    assert _hf_resume.describe({"data": {"epoch": 0, "batch": 30, "steps_in_epoch": 40}}) == "40 batches per epoch"


def test_a_stream_resumes_with_its_position_counted(tmp_path, capsys):
    loader = DataLoader(Stream(), batch_size=None)
    _train(tmp_path / "run", loader, stop_at=(1, 3))
    capsys.readouterr()
    _train(tmp_path / "run", loader)
    out = capsys.readouterr().out
    m = RESUME.search(out)
    assert m, out
    assert "/0" not in out and "of 0 batches" not in out, out


def test_adapter_words_carry_no_second_position():
    """The resume line already says where; the adapters' words add what is restored, not an epoch in
    another numbering."""
    counters = {"epoch": 1, "batch": 2, "step": 8}
    keras_words = _keras_state.describe({"counters": counters, "keras": {}})
    assert "epoch" not in keras_words and "data position" in keras_words, keras_words
    assert _lightning_fit.describe({"counters": counters}) == ""
