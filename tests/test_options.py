"""A misspelled option is a TypeError naming the closest option, never an object to register."""
from __future__ import annotations

import pytest
import torch

from keepalive.callbacks.torch import DriveCheckpoint
from keepalive.config import CheckpointConfig
from keepalive.core import Checkpointer


@pytest.mark.parametrize("typo, meant", [("evry", "every"), ("kep", "keep"), ("on_dedline", "on_deadline"),
                                         ("quite", "quiet"), ("keep_evry", "keep_every")])
def test_a_misspelled_option_of_the_torch_adapter_names_the_right_one(tmp_path, typo, meant):
    with pytest.raises(TypeError, match=rf"unexpected keyword argument '{typo}'; did you mean {meant}=\?"):
        DriveCheckpoint(tmp_path / "run", model=torch.nn.Linear(2, 2), **{typo: 100})


def test_an_object_under_any_other_name_is_registered(tmp_path):
    ckpt = DriveCheckpoint(tmp_path / "run", model=torch.nn.Linear(2, 2), ema=torch.nn.Linear(2, 2), quiet=True)
    assert set(ckpt.objects) == {"model", "ema"}
    with pytest.raises(TypeError, match="foo: a int has no state_dict"):
        DriveCheckpoint(tmp_path / "run2", foo=3)


def test_adapters_without_objects_refuse_an_unknown_option_with_the_closest(tmp_path):
    with pytest.raises(TypeError, match=r"Checkpointer\(\) got an unexpected keyword argument 'evry'; "
                                        r"did you mean every=\?"):
        Checkpointer(tmp_path / "run", evry=3)
    with pytest.raises(TypeError, match="'zzz'; the options are path, run, every"):
        CheckpointConfig.strict(None, None, {"zzz": 1}, "DriveCheckpoint")
