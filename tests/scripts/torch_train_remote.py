"""tests/scripts/torch_train.py's training, for destinations that fail: the same model, data, seeds
and output (`STEP n` after each optimizer step, `COMMITTED n` after each commit, the final weights
with safetensors), plus

* the `faulty://` test protocol (tests/faultyfs.py) registered, so a control file can make the
  destination fail or slow down while this process trains;
* `--local-faults ROOT`: the same faults for plain local paths under ROOT (keepalive's LocalBackend);
* `--storage-options JSON` (the S3 / GCS servers behind the fault proxy), `--keep` (0: keep all).

Spooling is chosen through the environment (`KEEPALIVE_SPOOL`, `KEEPALIVE_SPOOL_MODE`,
`KEEPALIVE_FLUSH_TIMEOUT`): the torch adapter itself is used unchanged."""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from childio import emit  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import faultyfs  # noqa: E402,F401  (registers faulty://)
from keepalive.callbacks.torch import DriveCheckpoint  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("run")
p.add_argument("--out", required=True)
p.add_argument("--every", default="5")
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--hidden", type=int, default=256)
p.add_argument("--samples", type=int, default=300)
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--keep", type=int, default=3)
p.add_argument("--storage-options", default=None)
p.add_argument("--local-faults", default=None)
args = p.parse_args()
faultyfs.note_start()
torch.set_num_threads(1)
torch.manual_seed(1234)
if args.local_faults:
    faultyfs.patch_local_backend(args.local_faults)


class NoisyData(Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(n, 32, generator=g)
        self.y = torch.randint(0, 4, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.05 * torch.randn(32), self.y[i]


model = torch.nn.Sequential(
    torch.nn.Linear(32, args.hidden), torch.nn.ReLU(), torch.nn.Dropout(0.2),
    torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(), torch.nn.Dropout(0.2),
    torch.nn.Linear(args.hidden, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)
loader = DataLoader(NoisyData(args.samples), batch_size=16, shuffle=True)
every = int(args.every) if args.every.isdigit() else args.every
options = json.loads(args.storage_options) if args.storage_options else None
ckpt = DriveCheckpoint(args.run, model=model, optimizer=opt, scheduler=sched, every=every,
                       keep=args.keep or None, storage_options=options)
ckpt.core.on_commit.append(lambda r: emit(f"COMMITTED {r.info.step}"))
for epoch in ckpt.epochs(args.epochs):
    model.train()
    for x, y in ckpt.batches(loader):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        emit(f"STEP {ckpt.step + 1} {time.time():.3f}")
        if args.sleep:
            time.sleep(args.sleep)
    sched.step()
ckpt.close()
save_file({k: v.contiguous() for k, v in model.state_dict().items()}, args.out)
print("DONE", flush=True)
