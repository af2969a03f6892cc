"""Registered objects without state_dict() that carry a position (build-nanogpt's ``DataLoaderLite``):
saved by their plain attributes and put back on a resume; what cannot be saved that way is refused at
the registration with the line to add, and an attribute left unsaved that changes is named once.

The kill test: build-nanogpt's loop (tests/scripts/objects_train.py: token shards in .npy files,
gradient accumulation) SIGKILLed mid-iteration and run again is bit-exact, weights and the loader's
position; without registering the loader the resumed run differs.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from crashkit import assert_differs, assert_same
from keepalive.callbacks import torchstate
from keepalive.callbacks.torch import DriveCheckpoint
from objectskit import forks_fixture, run_script


class Position:
    """A plain loader-like object: its position in plain attributes, its data in a big one."""

    def __init__(self, data: torch.Tensor):
        self.current_shard, self.current_position = 0, 0
        self.history = [(0, 0)]
        self.mask = np.zeros(4, dtype=np.float32)
        self.half = torch.zeros(3, dtype=torch.bfloat16)
        self.seen = {"tokens": np.int64(0)}
        self.tokens = data

    def next_batch(self) -> torch.Tensor:
        batch = self.tokens[self.current_position:self.current_position + 4]
        self.current_position += 4
        self.history.append((self.current_shard, self.current_position))
        self.mask[self.current_position % 4] += 1
        self.half += 1
        self.seen["tokens"] += 4
        return batch


def test_a_plain_object_is_saved_by_its_attributes_and_put_back(tmp_path, capsys):
    data = torch.arange(64)
    loader = Position(data)
    model = torch.nn.Linear(2, 2)
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, loader=loader)
    assert "loader: a Position without state_dict(): its attributes current_shard, current_position, " \
           "history, mask, half, seen, tokens are saved and put back on a resume" in capsys.readouterr().out
    for _ in range(3):
        loader.next_batch()
    state = ckpt.state_dict()
    fresh = Position(torch.arange(64))
    again = DriveCheckpoint(tmp_path / "run2", model=torch.nn.Linear(2, 2), loader=fresh, quiet=True)
    again._objects.objects["loader"].load_state_dict(state["objects"]["loader"])
    assert (fresh.current_position, fresh.history, fresh.seen) == (12, [(0, 0), (0, 4), (0, 8), (0, 12)],
                                                                   {"tokens": 12})
    assert fresh.half.dtype == torch.bfloat16 and torch.equal(fresh.half, loader.half)
    assert isinstance(fresh.mask, np.ndarray) and np.array_equal(fresh.mask, loader.mask)
    assert fresh.tokens is not loader.tokens and torch.equal(fresh.tokens, data)


def test_an_unsaved_attribute_that_changes_is_named_once_and_an_unchanged_one_never(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torchstate, "PLAIN_ARRAY_BYTES", 64)  # the token array is "big" here
    loader = Position(torch.arange(64))
    ckpt = DriveCheckpoint(tmp_path / "run", model=torch.nn.Linear(2, 2), loader=loader)
    assert "not saved (they must not change): tokens" in capsys.readouterr().out
    loader.next_batch()
    ckpt.state_dict()
    assert "changed since" not in capsys.readouterr().err  # read from, never changed: no noise
    loader.tokens = torch.arange(64, 128)  # the next shard
    ckpt.state_dict()
    ckpt.state_dict()
    err = capsys.readouterr().err
    assert err.count("changed since") == 1, err
    assert "loader.tokens (Tensor, 0 MiB) changed since loader was registered and is not in the checkpoint" in err
    assert "Give Position a state_dict() and a load_state_dict(state) that rebuilds tokens" in err


class Slotted:
    __slots__ = ("position",)

    def __init__(self):
        self.position = 0


class Holder:
    def __init__(self):
        self.model = torch.nn.Linear(2, 2)


@pytest.mark.parametrize("obj, says", [
    (3, "foo: a int has no state_dict()/load_state_dict() and no attributes keepalive can save"),
    (Slotted(), "its __slots__ (position) cannot be saved by attribute: give Slotted a state_dict()"),
    (Holder(), "none of its attributes is a plain value (it holds model (Linear)): give Holder a state_dict()"),
    (torch.utils.data.DataLoader(range(4)), "pass it through `for batch in ckpt.batches(foo):`"),
    (len, "no attributes keepalive can save"),
])
def test_what_cannot_be_saved_by_attributes_is_refused_with_the_line_to_add(tmp_path, obj, says):
    with pytest.raises(TypeError) as err:
        DriveCheckpoint(tmp_path / "run", foo=obj)
    assert says in str(err.value)


def test_a_misspelled_option_holding_a_plain_object_is_still_refused_as_an_option(tmp_path):
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'evry'; did you mean every=\?"):
        DriveCheckpoint(tmp_path / "run", model=torch.nn.Linear(2, 2), evry=Position(torch.arange(8)))


def test_a_checkpoint_of_a_plain_object_is_not_loaded_into_one_with_its_own_state_dict(tmp_path):
    from keepalive.errors import StateMismatchError

    ckpt = DriveCheckpoint(tmp_path / "run", model=torch.nn.Linear(2, 2), loader=Position(torch.arange(8)), quiet=True)
    for _ in ckpt.epochs(1):
        pass

    class Position2(Position):  # the fix: the same class given state_dict() / load_state_dict()
        def state_dict(self):
            return {"position": self.current_position}

        def load_state_dict(self, state):
            self.current_position = state["position"]

    Position2.__name__ = "Position"
    again = DriveCheckpoint(tmp_path / "run", model=torch.nn.Linear(2, 2), loader=Position2(torch.arange(8)),
                            quiet=True)
    with pytest.raises(StateMismatchError, match=r"holds a Position \(attributes\), this run has a Position"):
        again.resume()


# ---------------------------------------------------------------------------------- SIGKILL
forks = forks_fixture(quick_exit=True)


def test_build_nanogpt_dataloaderlite_registered_resumes_exact_after_sigkill(tmp_path, forks):
    shards = tmp_path / "shards"
    shards.mkdir()
    rng = np.random.default_rng(0)
    for i in range(3):  # 3-6 batches of 2x8 tokens each: the 14 iterations of 2 micro-steps cross shards
        np.save(shards / f"edufineweb_train_{i:06d}.npy", rng.integers(0, 64, size=70 + 10 * i).astype(np.uint16))
    common = ["--scenario", "nanogpt", "--shards", str(shards)]
    out = run_script(forks, *common, "--run", str(tmp_path / "ref"), "--out", str(tmp_path / "ref.pt"))
    assert "STEP 5 shard 2" in out and "STEP 12 shard 0" in out  # it moves through every shard and wraps
    reference = torch.load(tmp_path / "ref.pt", weights_only=False)
    for registered, run in ((True, "kept"), (False, "lost")):
        flag = [] if registered else ["--unregistered"]
        argv = [*common, "--run", str(tmp_path / run), "--out", str(tmp_path / f"{run}.pt"), *flag]
        assert "KILL" in run_script(forks, *argv, "--kill-at", "6")  # between the micro-steps of iteration 6
        out = run_script(forks, *argv)
        resumed = torch.load(tmp_path / f"{run}.pt", weights_only=False)
        named = [line for line in out.splitlines() if "`train_loader` (DataLoaderLite) changed" in line]
        if registered:
            assert_same(reference, resumed)
            assert not named, out
        else:  # the loader restarted at shard 0, position 0: other batches, other weights; and it is named
            assert named == ["keepalive: warning: `train_loader` (DataLoaderLite) changed during the training (its "
                             "current_position) and is not in the checkpoint: a resume would start it again from "
                             "its state before the loop. Register it with `ckpt.register('train_loader', "
                             "train_loader)` before the loop."], out
            assert_differs(reference["model"], resumed["model"])
            assert reference["loader"]["current_position"] != resumed["loader"]["current_position"]
            delta = max((reference["model"][k] - resumed["model"][k]).abs().max().item() for k in reference["model"])
            print(f"DataLoaderLite unregistered, after a resume: weights max |delta| {delta:.3g}")


def test_under_several_processes_a_plain_object_is_said_to_resume_with_rank_0s_values(tmp_path, capsys, monkeypatch):
    import types

    from keepalive import distributed

    ckpt = DriveCheckpoint(tmp_path / "run", model=torch.nn.Linear(2, 2), quiet=True)
    monkeypatch.setattr(distributed, "GROUP", types.SimpleNamespace(active=True, world_size=2, rank=0, is_main=True))
    ckpt.register("loader", Position(torch.arange(8)))
    assert "loader: under 2 processes the checkpoint holds rank 0's Position attributes (current_shard, " \
           "current_position," in capsys.readouterr().err
