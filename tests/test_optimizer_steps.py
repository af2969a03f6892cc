"""Steps are the optimizer's steps, counted by the optimizers' step hooks, whatever the loop shape."""
from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

from keepalive.callbacks.torch import DriveCheckpoint


def data(n: int = 32) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)), batch_size=8)


def test_a_step_the_grad_scaler_skipped_is_no_step(tmp_path):
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, scaler=scaler, quiet=True)
    taken = []
    for _ in ckpt.epochs(1):
        for i, (x, y) in enumerate(ckpt.batches(data())):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            if i == 1:
                loss = loss * float("inf")  # an overflow: the scaler skips this step
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            taken.append(ckpt.step)
    assert taken == [0, 1, 1, 2]  # ckpt.step before each batch's end: batch 1's step was skipped
    assert ckpt.step == 3


def test_two_optimizers_stepping_in_one_batch_make_one_step(tmp_path):
    gen, disc = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3)
    ckpt = DriveCheckpoint(tmp_path / "run", model={"g": gen, "d": disc}, optimizer={"g": opt_g, "d": opt_d},
                           quiet=True)
    for _ in ckpt.epochs(1):
        for x, _y in ckpt.batches(data()):
            opt_d.zero_grad()
            disc(gen(x).detach()).mean().backward()
            opt_d.step()
            opt_g.zero_grad()
            (-disc(gen(x)).mean()).backward()
            opt_g.step()
    assert ckpt.step == 4  # 4 batches, each with one step of each optimizer


def test_an_iteration_loop_counts_every_step_at_its_end(tmp_path):
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, every=5, keep=None, quiet=True)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    for _ in ckpt.epochs(4):  # an "epoch" of three hand-made steps, no loader at all
        for _ in range(3):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    ckpt.flush()
    assert ckpt.step == 12
    steps = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "run").glob("ckpt-*"))
    assert steps == [6, 12]  # every 5 steps, at the first epoch end where 5 had been made; and the end


def test_steps_made_while_a_checkpoint_is_restored_are_not_counted(tmp_path):
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, quiet=True)
    ckpt.core.steps_paused = True
    opt.step()  # e.g. DCP creating an optimizer's state by a step
    ckpt.core.steps_paused = False
    assert ckpt.core.state.counted_steps == 0 and ckpt.core.optimizer_steps == 0
    opt.step()
    assert ckpt.core.state.counted_steps == 1
