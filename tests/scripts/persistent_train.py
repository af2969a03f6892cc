"""A U-Net-like training whose loaders keep their workers (persistent_workers=True, timm's default):
random augmentation in 2 workers (torch's generator in ``__getitem__``), dropout in the main process,
a validation pass with its own persistent workers (random test-time augmentation) after each epoch.

``python persistent_train.py RUN_DIR OUT [--kill train:E:B | val:E:B] [--plain] [--every N]``:
with ``--kill`` the process waits until its newest checkpoint is committed at that point (after the
step of batch B of epoch E, or inside batch B of epoch E's validation) and SIGKILLs itself; a re-run
resumes. ``--plain``: the same loop without keepalive. OUT gets the final weights and every logged
loss (``epoch:batch`` -> value; a re-run's lines replace those of the batches it ran again).
"""
import argparse
import json
import os
import signal
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from childio import wait_committed  # noqa: E402

EPOCHS, TRAIN, VAL, BATCH, WORKERS = 4, 32, 16, 4, 2


class Augmented(torch.utils.data.Dataset):
    """8x8 images and masks; each fetch flips and adds noise from torch's generator (in the worker)."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 1, 8, 8, generator=g)
        self.y = (self.x > 0).float()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x, y = self.x[i], self.y[i]
        if torch.rand(()) < 0.5:
            x, y = x.flip(-1), y.flip(-1)
        return x + 0.1 * torch.randn_like(x), y


def noisy_collate(items):
    x, y = torch.utils.data.default_collate(items)
    return x + 0.01 * torch.randn_like(x), y


class TinyUNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.down = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.mid = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(), nn.Dropout2d(0.2))
        self.up = nn.ConvTranspose2d(4, 4, 2, stride=2)
        self.out = nn.Conv2d(5, 1, 1)

    def forward(self, x):
        return self.out(torch.cat([self.up(self.mid(self.down(x))), x], 1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("out")
    ap.add_argument("--kill", default="")
    ap.add_argument("--plain", action="store_true")
    ap.add_argument("--every", default="3")
    ap.add_argument("--old", action="store_true", help="keepalive's behaviour before persistent workers were carried")
    ap.add_argument("--generator", action="store_true", help="the training loader shuffles with its own generator=")
    ap.add_argument("--collate", action="store_true", help="a collator that draws random numbers too")
    ap.add_argument("--workers", type=int, default=WORKERS)
    ap.add_argument("--rebuild", action="store_true", help="the loaders are built anew inside each epoch")
    ap.add_argument("--blind", action="store_true",
                    help="keepalive does not see which loaders an epoch built (the control of --rebuild)")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = TinyUNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    kw = dict(batch_size=BATCH, num_workers=args.workers, persistent_workers=True)
    if args.collate:
        kw["collate_fn"] = noisy_collate
    gen = torch.Generator().manual_seed(5) if args.generator else None
    train_set, val_set = Augmented(TRAIN, 1), Augmented(VAL, 2)

    def loaders():
        return (torch.utils.data.DataLoader(train_set, shuffle=True, generator=gen, **kw),
                torch.utils.data.DataLoader(val_set, **kw))

    train, val = loaders()
    where, kill_epoch, kill_batch = (args.kill.split(":") + ["", "", ""])[:3] if args.kill else ("", -1, -1)
    kill_epoch, kill_batch = int(kill_epoch), int(kill_batch)
    log = {}
    if os.path.exists(args.out + ".log"):
        with open(args.out + ".log") as f:
            log = json.load(f)

    def note(key, value):
        log[key] = value
        with open(args.out + ".log", "w") as f:
            json.dump(log, f)

    if args.plain:
        ckpt, epochs, batches = None, range(EPOCHS), enumerate
    else:
        import keepalive.callbacks._torch_replay as replay
        from keepalive.callbacks.torch import DriveCheckpoint

        replay.CARRY_PERSISTENT = not args.old
        if args.blind:
            replay.LoaderBirths.built_this_epoch = lambda self, *loaders: False
        ckpt = DriveCheckpoint(args.run, model=model, optimizer=opt, every=int(args.every)
                               if args.every.isdigit() else args.every)
        epochs, batches = ckpt.epochs(EPOCHS), ckpt.enumerate

    def kill_here(steps):
        every = int(args.every) if args.every.isdigit() else TRAIN // BATCH  # "epoch"
        wait_committed(args.run, steps // every * every)  # the newest checkpoint before the kill
        os.kill(os.getpid(), signal.SIGKILL)

    for epoch in epochs:
        if args.rebuild:  # new loaders (and new persistent workers) each epoch
            train, val = loaders()
        model.train()
        for i, (x, y) in batches(train):
            loss = nn.functional.binary_cross_entropy_with_logits(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            note(f"train:{epoch}:{i}", loss.item())
            if where == "train" and (epoch, i) == (kill_epoch, kill_batch):
                kill_here(epoch * len(train) + i + 1)
        model.eval()
        with torch.no_grad():
            for i, (x, y) in batches(val):
                note(f"val:{epoch}:{i}", nn.functional.binary_cross_entropy_with_logits(model(x), y).item())
                if where == "val" and (epoch, i) == (kill_epoch, kill_batch):
                    kill_here((epoch + 1) * len(train))
    if ckpt is not None:
        ckpt.close()
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, args.out)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
