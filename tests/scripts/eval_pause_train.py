"""The loop of nearly every PyTorch tutorial, checkpointed by keepalive, with a slow evaluation, for
tests/test_eval_pause.py: ``python eval_pause_train.py RUN_DIR OUT_FILE``.

    for epoch in ckpt.epochs(3):
        model.train()
        for x, y in ckpt.batches(loader): ...; opt.step()
        sched.step()
        evaluate()      # model.eval(); with torch.no_grad(): for x, y in val_loader: ...

3 epochs of 8 batches (32 samples, batch 4, shuffled; the model has dropout and a BatchNorm), an
SGD optimizer with momentum, a StepLR stepped once per epoch *before* the evaluation. The evaluation
draws random numbers (noise on its inputs). Prints ``LOSS e b <hex>`` per batch, ``EVAL e <hex>`` per
evaluation, ``EVAL START e`` / ``EVAL END e`` around the slow one, ``COMMITTED n`` per checkpoint
commit; at the end it saves the weights, the optimizer's and the scheduler's state and a last random
draw to OUT_FILE and prints ``DONE``.

Environment (test knobs):
EP_PLAIN=1: the same training without keepalive (the reference).
EP_EVAL=plain|ka: the evaluation iterates ``val_loader`` itself (keepalive's guard thread saves) or
    ``ckpt.batches(val_loader)`` (the training thread saves at the evaluation's next batch).
EP_SCHED=0: no scheduler at all.  EP_EVAL_SECONDS (20): epoch 1's evaluation lasts that long, in 10
    sleeping batches (its other evaluations do not sleep).
EP_TOUCH=bn|param: control: in the slow evaluation, a forward in training mode (the BatchNorm's
    running statistics change) or a weight written in place, before its batches.
EP_NO_PARTS=1: negative control: a save between steps writes the registered objects as they are now
    (the scheduler already stepped), not as the last step boundary left them.
EP_OLD_RULE=1: negative control: the registered objects' summary (the scheduler's step count) is
    compared with the last boundary's again, so a save during the evaluation is refused.
"""
import os
import sys
import time

import torch
from childio import emit
from torch.utils.data import DataLoader, TensorDataset


def knob(name, default):
    return type(default)(os.environ.get(name, default))


def main(run_dir: str, out_file: str) -> None:
    plain = bool(os.environ.get("EP_PLAIN"))
    eval_kind = os.environ.get("EP_EVAL", "plain")
    eval_seconds = knob("EP_EVAL_SECONDS", 20.0)
    touch = os.environ.get("EP_TOUCH", "")
    if os.environ.get("EP_NO_PARTS"):
        from keepalive.callbacks._torch_boundary import RegisteredState

        RegisteredState.put = lambda self, tree, kept: None  # the objects as they are at the save
    if os.environ.get("EP_OLD_RULE"):
        from keepalive.callbacks._torch_boundary import TorchBoundary

        TorchBoundary.unkept = lambda self: self.objects.summary()  # every object compared, as before

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    train_set = TensorDataset(torch.randn(32, 8, generator=gen), torch.randn(32, 1, generator=gen))
    val_set = TensorDataset(torch.randn(20, 8, generator=gen), torch.randn(20, 1, generator=gen))
    torch.manual_seed(1234)
    loader = DataLoader(train_set, batch_size=4, shuffle=True)
    val_loader = DataLoader(val_set, batch_size=2, shuffle=False)  # 10 batches
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if knob("EP_SCHED", 1) else None
    if plain:
        ckpt = None
        epochs = range(3)

        def batches(loader_):
            return loader_
    else:
        from keepalive.callbacks.torch import DriveCheckpoint

        ckpt = DriveCheckpoint(run_dir, model=model, optimizer=opt, scheduler=sched)
        ckpt.core.on_commit.append(lambda r: emit(f"COMMITTED {r.info.step}"))
        epochs = ckpt.epochs(3)
        batches = ckpt.batches

    def evaluate(epoch: int) -> None:
        slow = epoch == 1 and eval_seconds > 0
        model.eval()
        if epoch == 1:
            emit(f"EVAL START {epoch}")
            with torch.no_grad():
                if touch == "bn":  # a forward in training mode: the BatchNorm's running statistics move
                    model.train()
                    model(torch.ones(4, 8))
                    model.eval()
                elif touch == "param":
                    model[4].bias.add_(0.0)  # the same values, written in place
        total = torch.zeros(())
        with torch.no_grad():
            for x, y in (batches(val_loader) if eval_kind == "ka" else val_loader):
                noise = torch.randn(x.shape) * 0.01  # the evaluation draws random numbers too
                total += torch.nn.functional.mse_loss(model(x + noise), y)
                if slow:
                    time.sleep(eval_seconds / len(val_loader))
        if epoch == 1:
            emit(f"EVAL END {epoch}")
        emit(f"EVAL {epoch} {float(total).hex()}")

    for epoch in epochs:
        model.train()
        for i, (x, y) in enumerate(batches(loader)):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            emit(f"LOSS {epoch} {i} {float(loss.detach()).hex()}")
        if sched is not None:
            sched.step()
        evaluate(epoch)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                "sched": sched.state_dict() if sched is not None else None,
                "lr": [g["lr"] for g in opt.param_groups], "draw": torch.rand(4)}, out_file)
    emit("DONE")
    if ckpt is not None:
        ckpt.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
