"""Real torch trainings (tests/scripts/torch_train_remote.py, the torch adapter unchanged) against
destinations that fail for a while and then recover: a `faulty://` filesystem (ENOTCONN), a local
folder whose writes fail (EIO), and the S3 / GCS protocol servers behind an HTTP proxy that answers
503 (and is slow). The training keeps stepping during the outage, every checkpoint reaches the
destination once it recovers and verifies there, and SIGKILLs during the outage (and while the
backlog uploads) still resume bit for bit from the newest checkpoint that was durable anywhere.

Failure windows are tied to the children's starts (tests/faultyfs.py `fail_until_start`), not to the
clock, so the kills land in them whatever this machine's speed."""
from __future__ import annotations

import glob
import json
import os
import queue
import random
import statistics
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

import crashkit
import faultyfs
from crashkit import COMMITTED_RE, run_to_completion
from forkserver import script_children_fixture
from keepalive import cli, runs
from keepalive.store import MANIFEST, CheckpointStore

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "torch_train_remote.py")
EPOCHS, SAMPLES, BATCH, HIDDEN = 3, 300, 16, 256
STEPS = EPOCHS * -(-SAMPLES // BATCH)
FAR = 4e9


#: what torch_train_remote.py imports before keepalive: its 15 children fork from a server that has
#: imported it (faultyfs, keepalive and the storage clients are imported in each child, after its start)
PRELOAD = ["numpy", "torch", "torch._dynamo", "torch.nn.functional", "torch.utils.data", "safetensors.torch"]


forked_children = script_children_fixture(SCRIPT, "torch", PRELOAD, crashkit, sys.modules[__name__])


def cmd(run, out, *extra):
    return [sys.executable, SCRIPT, str(run), "--out", str(out), "--epochs", str(EPOCHS),
            "--samples", str(SAMPLES), "--hidden", str(HIDDEN), *map(str, extra)]


def child_env(tmp_path, **extra):
    env = dict(os.environ)
    env.pop("KEEPALIVE_SPOOL_MODE", None)
    env.update(KEEPALIVE_SPOOL=str(tmp_path / "spool"), KEEPALIVE_PROGRESS="0",
               KEEPALIVE_FAULTY_CONTROL=str(tmp_path / "control.json"),
               KEEPALIVE_FAULTY_STARTS=str(tmp_path / "starts"), KEEPALIVE_FLUSH_TIMEOUT="90")
    env.update(extra)
    faultyfs.write_control(env["KEEPALIVE_FAULTY_CONTROL"])
    return env


def assert_same(a, b):
    wa, wb = load_file(str(a)), load_file(str(b))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), f"{k} differs: max |diff| {(wa[k] - wb[k]).abs().max()}"


def steps_at(path):
    if not os.path.isdir(path):
        return []
    return sorted(int(d.split("-")[1]) for d in os.listdir(path)
                  if d.startswith("ckpt-") and os.path.exists(os.path.join(path, d, MANIFEST)))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same training, never interrupted, written directly to a healthy local folder."""
    d = tmp_path_factory.mktemp("reference")
    env = child_env(d, KEEPALIVE_SPOOL_MODE="never")
    r = run_to_completion(cmd(d / "run", d / "ref.st", "--every", "5"), total_steps=STEPS, kills=0,
                          rng=random.Random(0), env=env)
    assert "DONE" in r.final_output
    return d / "ref.st"


def _read(proc, q):
    for line in iter(proc.stdout.readline, ""):
        q.put((time.time(), line))
    q.put((time.time(), None))


def test_training_keeps_its_pace_while_the_destination_fails(tmp_path, reference, capsys):
    dest = tmp_path / "dest" / "run"
    env = child_env(tmp_path)
    control = env["KEEPALIVE_FAULTY_CONTROL"]
    proc = subprocess.Popen(cmd(f"faulty://{dest}", tmp_path / "out.st", "--every", "3", "--sleep", "0.03",
                                "--keep", "0"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    q: "queue.Queue" = queue.Queue()
    threading.Thread(target=_read, args=(proc, q), daemon=True).start()
    lines = []
    t_fail = t_rec = None
    during_steps = during_commits = 0
    try:
        while True:
            t, line = q.get(timeout=120)
            if line is None:
                break
            lines.append((t, line))
            if line.startswith("STEP ") and t_fail is None and int(line.split()[1]) >= 6:
                faultyfs.write_control(control, fail_until=FAR, errno="ENOTCONN")
                t_fail = time.time()
            elif t_fail is not None and t_rec is None:
                during_steps += line.startswith("STEP ")
                during_commits += line.startswith("COMMITTED ")
                if during_steps >= 20 and during_commits >= 3:
                    # 20 steps and 3 commits while every destination operation fails: it did not wait
                    faultyfs.write_control(control)
                    t_rec = time.time()
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(line for _, line in lines)
    assert "DONE" in out and t_rec is not None, out[-3000:]
    assert faultyfs.hits(control) > 0
    assert out.count("cannot upload checkpoints") == 1, out  # reported once
    assert out.count("works again") == 1, out
    committed = {int(line.split()[1]) for _, line in lines if line.startswith("COMMITTED ")}
    assert committed <= set(steps_at(dest)), (sorted(committed), steps_at(dest))
    assert runs.pending_summary(str(tmp_path / "spool")) is None
    capsys.readouterr()
    assert cli.main(["verify", f"faulty://{dest}"]) == 0
    assert_same(reference, tmp_path / "out.st")

    def step_times(t0, t1):
        ts = [float(line.split()[2]) for _, line in lines if line.startswith("STEP ")]
        ts = [t for t in ts if t0 <= t < t1]
        return [b - a for a, b in zip(ts, ts[1:])]

    before, during, after = step_times(0, t_fail), step_times(t_fail, t_rec), step_times(t_rec, FAR)
    with capsys.disabled():
        print(f"\nmedian step time: before the outage {statistics.median(before) * 1e3:.1f} ms, during "
              f"{statistics.median(during) * 1e3:.1f} ms ({len(during) + 1} steps, {during_commits} "
              f"commits), after {statistics.median(after) * 1e3:.1f} ms" if after else "")


class _Window(threading.Thread):
    """Opens a proxy's failure window once the first checkpoint was spooled (when ``after_spooled``,
    else at once) and closes it when child number ``until_start`` starts (the test-process twin of
    faultyfs's control file)."""

    def __init__(self, proxy, starts_file, spool_root, until_start, after_spooled=True, methods=None,
                 delay=0.0):
        super().__init__(daemon=True)
        self.proxy, self.starts_file, self.spool_root = proxy, starts_file, spool_root
        self.until = until_start
        self.after_spooled, self.methods, self.delay = after_spooled, methods, delay
        self.done = threading.Event()

    def run(self):
        seen = False
        while not self.done.is_set():
            n = faultyfs.starts(self.starts_file)
            seen = seen or not self.after_spooled or bool(
                glob.glob(os.path.join(self.spool_root, "*", "*", "ckpt-*", MANIFEST)))
            if n >= self.until:
                self.proxy.fail(0)
                self.proxy.delay(0, 0)
            elif seen:
                if self.proxy.fail_until < FAR:
                    self.proxy.fail(FAR, methods=self.methods)
                    if self.delay:
                        self.proxy.delay(self.delay, FAR)
            time.sleep(0.05)


CASES = [
    pytest.param("faulty", 4, id="faulty-ENOTCONN"),
    pytest.param("local", 2, id="local-EIO-on-writes"),
    pytest.param("s3", 2, id="s3-503"),
    pytest.param("gcs", 1, id="gcs-503-on-writes-and-slow"),
]


@pytest.mark.parametrize("kind,kills", CASES)
def test_sigkill_during_an_outage_resumes_bit_exact(tmp_path, reference, request, capsys, kind, kills):
    env = child_env(tmp_path)
    control, starts = env["KEEPALIVE_FAULTY_CONTROL"], env["KEEPALIVE_FAULTY_STARTS"]
    # the outage covers every killed child but the last, which sees the recovery and is killed
    # while the backlog uploads; the final child runs with a healthy destination
    until = kills if kills >= 2 else kills + 1
    extra = ["--every", "4", "--sleep", "0.04", "--keep", "0"]
    proxy = window = None
    local_dest = None
    if kind == "faulty":
        local_dest = tmp_path / "dest" / "run"
        run = f"faulty://{local_dest}"
        faultyfs.write_control(control, fail_until_start=until, fail_after_spooled=True, errno="ENOTCONN")
    elif kind == "local":
        local_dest = tmp_path / "disk" / "run"
        run = str(local_dest)
        extra += ["--local-faults", str(tmp_path / "disk")]
        faultyfs.write_control(control, fail_until_start=until, errno="EIO", ops=["write", "meta"])
    else:
        server = request.getfixturevalue("s3_server" if kind == "s3" else "gcs_server")
        proxy = faultyfs.FaultProxy(server.port, flavor=kind).start()
        options = dict(server.storage_options)
        if kind == "s3":
            options["client_kwargs"] = {"endpoint_url": proxy.endpoint}
            options["config_kwargs"] = {"retries": {"max_attempts": 2}}
            window = _Window(proxy, starts, env["KEEPALIVE_SPOOL"], until_start=until)
        else:
            options["endpoint_url"] = proxy.endpoint
            window = _Window(proxy, starts, env["KEEPALIVE_SPOOL"], until_start=until, after_spooled=False,
                             methods={"PUT", "POST", "PATCH", "DELETE"}, delay=0.1)
        window.start()
        run = server.url(f"crash-{kind}-{os.getpid()}-{time.time_ns()}", "run")
        extra += ["--storage-options", json.dumps(options)]
    try:
        report = run_to_completion(cmd(run, tmp_path / "out.st", *extra), total_steps=STEPS, kills=kills,
                                   rng=random.Random(2024 + kills), env=env, timeout=180)
    finally:
        if window is not None:
            window.done.set()
        if proxy is not None:
            failed = proxy.failed
            proxy.stop()
    assert report.kills == kills
    assert_same(reference, tmp_path / "out.st")
    assert (failed if proxy is not None else faultyfs.hits(control)) > 0, "the outage never happened"
    assert runs.pending_summary(str(tmp_path / "spool")) is None, "something was never uploaded"
    committed = {int(m.group(1)) for m in map(COMMITTED_RE.match, report.final_output.splitlines()) if m}
    if local_dest is not None:
        at_dest = steps_at(local_dest)
        capsys.readouterr()
        assert cli.main(["verify", str(local_dest)]) == 0
    else:
        store = CheckpointStore(run, storage_options=server.storage_options, keep=None)
        infos = store.list()
        assert all(store.verify(i).valid for i in infos)
        at_dest = sorted(i.step for i in infos)
    assert committed <= set(at_dest) and STEPS in at_dest, (sorted(committed), at_dest)
    with capsys.disabled():
        print(f"\n{kind}: {report.kills} kills survived, resumed at steps "
              f"{[t.resumed_step for t in report.trials]}, {len(at_dest)} checkpoints at the destination")
