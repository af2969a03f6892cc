"""Costs told and bad input in one line.

* Saves that cost more than a few percent of the training (keepalive/savecosts.py): one warning with
  the measured figure and the ``every=`` that keeps it under 1 %; silent when saves are cheap, and for
  ``every="auto"``. The real loops make a save slow with a patched writer delay: the store's commit
  (the background write) sleeps, as a large state's write to a slow disk takes long; with ``every=1``
  the next save waits for it, so the training stalls as in the issue (``every=1``, 190 MB, 2x slower).
  The thresholds themselves are checked on the trigger with a clock of the test's own.
* ``s3://`` without credentials: one line at construction (a moto server on 127.0.0.1 for the run
  that has them), and fsspec's cached filesystem of the failed attempt is not handed out again.
* Any FUSE mount in the mount table is Drive-like wherever it is mounted: a /proc/mounts fixture.
"""
from __future__ import annotations

import os
import re
import time
import traceback
import uuid

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from keepalive import backends, savecosts
from keepalive.autointerval import Uptime
from keepalive.callbacks.torch import DriveCheckpoint
from keepalive.errors import StorageError
from keepalive.session import platforms
from keepalive.spool import SpooledStore
from keepalive.spool import mount as mount_mod
from keepalive.store import CheckpointStore
from keepalive.trigger import SaveTrigger

# ------------------------------------------------------------------------------ costs told
#: what the patched writer adds to each background write (seconds)
SLOW_WRITE = 0.4
STEP_SLEEP = 0.01


def _train(path, every, slow_write: float = 0.0, epochs: int = 2, batches: int = 15) -> float:
    """A small torch loop with keepalive; returns its wall time."""
    if slow_write:
        real_commit = CheckpointStore.commit

        def slow_commit(self, *args, **kwargs):
            time.sleep(slow_write)
            return real_commit(self, *args, **kwargs)

        CheckpointStore.commit = slow_commit  # restored below: the test's own patch of the writer
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 8)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(TensorDataset(torch.randn(16 * batches, 8)), batch_size=16)
        ckpt = DriveCheckpoint(str(path), model=model, optimizer=opt, every=every, track_globals=False)
        started = time.perf_counter()
        for _ in ckpt.epochs(epochs):
            for (x,) in ckpt.batches(loader):
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                opt.step()
                time.sleep(STEP_SLEEP)
        took = time.perf_counter() - started
        ckpt.close()
        return took
    finally:
        if slow_write:
            CheckpointStore.commit = real_commit


def _cost_lines(err: str):
    return [line for line in err.splitlines() if "saves cost" in line]


def test_saves_that_double_the_training_time_are_told_once_with_the_figure(tmp_path, capsys):
    took = _train(tmp_path / "slow", every=1, slow_write=SLOW_WRITE, batches=10)  # told after ~12 saves
    lines = _cost_lines(capsys.readouterr().err)
    assert len(lines) == 1, lines
    line = lines[0]
    assert "(every=1, " in line and "every='auto' or every=" in line and "keeps it under 1 %" in line, line
    told = int(re.search(r"saves cost (?:at least )?(\d+) %", line).group(1)) / 100
    # the figure is what the saves took: the same loop's steps alone take ~STEP_SLEEP each
    plain = 2 * 10 * STEP_SLEEP
    assert told >= 0.5 and abs(told - (1 - plain / took)) < 0.2, (told, took)


def test_cheap_saves_and_every_auto_say_nothing(tmp_path, capsys):
    _train(tmp_path / "cheap", every=1)                                   # the same loop, no slow write
    _train(tmp_path / "auto", every="auto", slow_write=SLOW_WRITE)       # slow saves, auto interval
    assert _cost_lines(capsys.readouterr().err) == []


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _feed(trigger: SaveTrigger, clock: Clock, steps: int, step_seconds: float, stall: float):
    """``steps`` step boundaries of ``step_seconds``; each save stalls ``stall`` and is durable at once."""
    lines = []
    for _ in range(steps):
        clock.now += step_seconds
        if trigger.after_step().save:
            clock.now += stall
            trigger.record_save(stall)
            trigger.record_stall(stall)
            trigger.saved()
        news = trigger.take_costs()
        if news:
            lines.append(news)
    return lines


def _trigger(every) -> "tuple[SaveTrigger, Clock]":
    clock = Clock()
    return SaveTrigger(every=every, clock=clock, remaining_fn=lambda: None,
                       uptime_fn=lambda: Uptime(3 * 3600.0, "test")), clock


def test_the_threshold_and_the_suggestion_on_the_trigger():
    costly, clock = _trigger(1)
    lines = _feed(costly, clock, 200, step_seconds=1.0, stall=0.2)        # 17 % of the time
    assert len(lines) == 1 and re.fullmatch(
        r"saves cost at least 17 % of the training time \(every=1, 0\.20 s per save, measured over 2[56] saves\): "
        r"every='auto' or every=20 keeps it under 1 %", lines[0]), lines
    cheap, clock = _trigger(1)
    assert _feed(cheap, clock, 400, step_seconds=1.0, stall=0.04) == []   # 4 %: under the threshold
    assert cheap.costs.spent_seconds >= savecosts.MIN_SPENT_SECONDS      # (measured long enough)
    few, clock = _trigger("10s")
    assert _feed(few, clock, 20, step_seconds=1.0, stall=2.0) == []      # 17 %, but 2 saves only
    timed, clock = _trigger("10s")
    assert _feed(timed, clock, 80, step_seconds=1.0, stall=2.0) == [
        "saves cost 17 % of the training time (every='10s', 2.00 s per save, measured over 5 saves): "
        "every='auto' or every='4min' keeps it under 1 %"]


def test_every_auto_is_never_told_control():
    """The same costly saves on every="auto" (made at every step here, as if it chose so): the figures
    say too costly, and nothing is said, since the interval it chooses limits the cost itself."""
    auto, clock = _trigger("auto")
    for _ in range(200):
        clock.now += 1.0
        auto.after_step()
        clock.now += 0.2
        auto.record_save(0.2)
        auto.record_stall(0.2)
        assert auto.take_costs() is None
    assert auto.costs.too_costly()


# -------------------------------------------------------------------- s3 without credentials
@pytest.fixture
def no_aws_credentials(monkeypatch):
    """A machine with no AWS credentials at all (and no EC2 metadata service to ask)."""
    for name in list(os.environ):
        if name.startswith(("AWS_", "FSSPEC_S3")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)


def test_s3_without_credentials_is_one_line_at_construction(s3_server, no_aws_credentials, monkeypatch):
    import fsspec

    url = s3_server.url(uuid.uuid4().hex[:8], "run")
    endpoint = {"client_kwargs": {"endpoint_url": s3_server.endpoint}}
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # the notebook's own filesystem, used before the credentials were set: fsspec caches it per arguments
    stale = fsspec.filesystem("s3", **endpoint)
    with pytest.raises(Exception, match="credentials"):
        stale.ls(s3_server.bucket)
    with pytest.raises(StorageError) as err:
        DriveCheckpoint(url, model=model, optimizer=opt, storage_options=endpoint)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"no AWS credentials for {url} ("), message
    assert "AWS_ACCESS_KEY_ID" in message and "storage_options={'key'" in message
    frames = traceback.extract_tb(err.value.__traceback__)
    assert err.value.__cause__ is None and err.value.__context__ is None
    assert not any("botocore" in f.filename or "s3fs" in f.filename for f in frames), frames

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    assert backends.backend_for(url, endpoint)[0].fs is not stale  # not the one without credentials
    ckpt = DriveCheckpoint(url, model=model, optimizer=opt, storage_options=endpoint, quiet=True)
    for _ in ckpt.epochs(2):
        model(torch.randn(4, 2)).sum().backward()
        opt.step()
    ckpt.close()
    assert [c.step for c in CheckpointStore(url, storage_options=endpoint).list()][-1] == 2


def test_the_filesystem_of_a_failed_attempt_is_not_reused_control(s3_server, no_aws_credentials, monkeypatch):
    """The control: without dropping fsspec's cached filesystems the one that failed without
    credentials comes back once they are set, and fails again."""
    import fsspec

    url = s3_server.url(uuid.uuid4().hex[:8], "run")
    endpoint = {"client_kwargs": {"endpoint_url": s3_server.endpoint},
                "config_kwargs": {"user_agent_extra": uuid.uuid4().hex}}  # a filesystem of its own
    stale = fsspec.filesystem("s3", **endpoint)
    with pytest.raises(Exception, match="credentials"):
        stale.ls(s3_server.bucket)
    monkeypatch.setattr(backends, "_forget_s3_filesystems", lambda: None)
    with pytest.raises(StorageError):
        backends.backend_for(url, endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    assert backends.backend_for(url, endpoint)[0].fs is stale
    with pytest.raises(Exception, match="credentials"):
        stale.ls(s3_server.bucket)


# ------------------------------------------------------------------- any FUSE mount is Drive-like
@pytest.fixture
def mounts(tmp_path, monkeypatch):
    """A mount table in /proc/mounts' format: Drive where old tutorials mount it, rclone, gcsfuse,
    sshfs at a path with a space, and FUSE file systems that are local storage."""
    points = {name: tmp_path / name for name in ("gdrive", "rclone", "gcs", "my drive", "overlay", "disk")}
    for point in points.values():
        point.mkdir()
    table = tmp_path / "mounts"
    lines = {"root": "/dev/sda1 / ext4 rw,relatime 0 0",
             "disk": f"/dev/sdb1 {points['disk']} ext4 rw,relatime 0 0",
             "gdrive": f"drive {points['gdrive']} fuse.drive rw,nosuid,nodev,relatime,user_id=0,group_id=0 0 0",
             "rclone": f"remote: {points['rclone']} fuse.rclone rw,nosuid,nodev,relatime,user_id=0 0 0",
             "gcs": f"bucket {points['gcs']} fuse rw,nosuid,nodev,relatime,user_id=0,group_id=0 0 0",
             "my drive": f"me@host: {str(points['my drive']).replace(' ', chr(92) + '040')} fuse.sshfs rw 0 0",
             "overlay": f"fuse-overlayfs {points['overlay']} fuse.fuse-overlayfs rw 0 0"}

    def write(*unmounted: str) -> None:
        table.write_text("".join(line + "\n" for name, line in lines.items() if name not in unmounted))

    write()
    monkeypatch.setattr(backends, "MOUNTS_FILE", str(table))
    return points, write


def test_every_fuse_mount_is_found_wherever_it_is_mounted(mounts):
    points, _ = mounts
    for name in ("gdrive", "rclone", "gcs", "my drive"):
        assert backends.fuse_mount_of(str(points[name] / "runs" / "x")) == str(points[name]), name
        assert not backends.maps_safely(str(points[name] / "runs" / "x")), name
    for name in ("overlay", "disk"):
        assert backends.fuse_mount_of(str(points[name] / "runs" / "x")) is None, name
    assert mount_mod.is_drive_path(str(points["gdrive"] / "MyDrive" / "x"))      # Drive's own type
    assert not mount_mod.is_drive_path(str(points["rclone"] / "x"))
    for name in ("gdrive", "rclone"):                                              # outlives the VM
        assert platforms.storage_warning("colab", str(points[name] / "runs")) is None
    assert "lost when the runtime is recycled" in platforms.storage_warning("colab", str(points["disk"] / "r"))


@pytest.mark.parametrize("name", ["gdrive", "rclone", "my drive"])
def test_a_fuse_destination_is_spooled_and_watched_like_drive(mounts, name):
    points, write = mounts
    store = SpooledStore(CheckpointStore(str(points[name] / "runs" / "x"), keep=None), quiet=True)
    assert store.spooling and store.reason == "destination"
    store.mount.check()                                  # mounted: nothing to say
    write(name)                                          # unmounted (or its daemon gone)
    with pytest.raises(mount_mod.MountVanished, match="not mounted at .* any more"):
        store.mount.check()
    store.close()


def test_a_local_disk_or_a_local_fuse_is_written_directly_control(mounts):
    points, _ = mounts
    for name in ("disk", "overlay"):
        store = SpooledStore(CheckpointStore(str(points[name] / "runs" / "x"), keep=None), quiet=True)
        assert not store.spooling, name
        store.mount.check()
        store.close()


def test_the_default_folder_is_in_drive_wherever_a_tutorial_mounted_it(tmp_path, monkeypatch):
    from keepalive.session import platforms

    monkeypatch.delenv("KEEPALIVE_DIR", raising=False)
    today, older = tmp_path / "content" / "drive" / "MyDrive", tmp_path / "content" / "gdrive" / "MyDrive"
    monkeypatch.setattr(platforms, "MY_DRIVE_FOLDERS", (str(today), str(older)))
    monkeypatch.chdir(tmp_path)
    assert platforms.default_checkpoint_dir() == str(tmp_path / "keepalive-checkpoints")  # control: no Drive
    older.mkdir(parents=True)  # drive.mount('/content/gdrive'), as older tutorials do
    assert platforms.default_checkpoint_dir() == f"{older}/keepalive"
    today.mkdir(parents=True)  # both: Colab's own mount point first
    assert platforms.default_checkpoint_dir() == f"{today}/keepalive"
