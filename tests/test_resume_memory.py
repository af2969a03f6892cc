"""After a resume the optimizer and model state must not stay file-backed where the file can vanish.

On a plain local disk the store maps checkpoint files (copy-on-write, fast); a deleted file stays
readable through its mapping. On Google Drive's FUSE mount (or a network file system) a dropped
daemon (``Errno 107``) or retention deleting the checkpoint turns the next page fault into SIGBUS, so
there the files are read into private memory. Real FUSE cannot be mounted here (no /dev/fuse in the
test machine): the mount table is the stand-in, patched to say the run folder is ``fuse.rclone``.
"""
from __future__ import annotations

import mmap
import shutil

import torch
from torch.utils.data import DataLoader, TensorDataset

from keepalive import backends
from keepalive.callbacks.torch import DriveCheckpoint
from keepalive.store import CheckpointStore


def _train(path, epochs, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(7)  # the same data in every session
    data = TensorDataset(torch.randn(40, 6, generator=g), torch.randn(40, 2, generator=g))
    loader = DataLoader(data, batch_size=8, shuffle=True)
    ckpt = DriveCheckpoint(path, model=model, optimizer=opt, quiet=True)
    return model, opt, loader, ckpt


def _run(ckpt, model, opt, loader, epochs, after_resume=None):
    for _ in ckpt.epochs(epochs):
        if after_resume is not None:
            after_resume()
            after_resume = None
        for x, y in ckpt.batches(loader):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    ckpt.close()


def _backing(store):
    info = store.list()[-1]
    return list(store.read_files(info).values())


def test_local_disk_maps_and_fuse_reads_into_memory(tmp_path, monkeypatch):
    model, opt, loader, ckpt = _train(tmp_path / "run", 1)
    _run(ckpt, model, opt, loader, 1)
    assert backends.maps_safely(str(tmp_path / "run"))
    mapped = _backing(CheckpointStore(tmp_path / "run"))
    assert any(isinstance(getattr(b, "obj", None), mmap.mmap) for b in mapped)  # the control: it maps here
    monkeypatch.setattr(backends, "_mounts", lambda: [(str(tmp_path), "fuse.rclone")])
    assert backends.filesystem_type(str(tmp_path / "run")) == "fuse.rclone"
    assert not backends.maps_safely(str(tmp_path / "run"))
    copied = _backing(CheckpointStore(tmp_path / "run"))
    assert not any(isinstance(getattr(b, "obj", None), mmap.mmap) for b in copied)
    assert all(isinstance(b, (bytes, bytearray)) for b in copied)


def test_drive_paths_are_never_mapped():
    assert not backends.maps_safely("/content/drive/MyDrive/runs/x/ckpt-1/tensors.safetensors")


def test_deleting_the_resumed_checkpoint_cannot_crash_training(tmp_path, monkeypatch):
    ref_model, ref_opt, ref_loader, ref = _train(tmp_path / "ref", 3)
    _run(ref, ref_model, ref_opt, ref_loader, 3)

    model, opt, loader, ckpt = _train(tmp_path / "run", 1)
    _run(ckpt, model, opt, loader, 1)
    monkeypatch.setattr(backends, "_mounts", lambda: [(str(tmp_path), "fuse.drive")])
    model, opt, loader, ckpt = _train(tmp_path / "run", 3, seed=123)

    def delete_checkpoints():  # what a dropped FUSE daemon or retention does to the source file
        for folder in (tmp_path / "run").glob("ckpt-*"):
            shutil.rmtree(folder)

    _run(ckpt, model, opt, loader, 3, after_resume=delete_checkpoints)
    assert ckpt.core.resumed_from is not None and ckpt.finished
    for a, b in zip(ref_model.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)
    for a, b in zip(ref_opt.state_dict()["state"].values(), opt.state_dict()["state"].values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"])
