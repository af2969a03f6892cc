"""The cloud notice watcher (keepalive/session/cloud.py): detection, polling, back-off, status.

The real metadata services (GCE's metadata server, AWS IMDSv2, Azure Scheduled Events) answer only
on a cloud VM's own link and cannot run here: tests/metaserver.py stands in for them on 127.0.0.1,
with the same paths and required headers, and misbehaves on demand (garbage, HTTP 500, accepting
and never answering, answering after 3 s). Every request the watcher makes is real HTTP to it.

Waits are on events (a subscriber's callback, the server's request count), never on a fixed
sleep; the only timing assertions are generous bounds on a long poll's latency and the step-time
ratio, which compares medians over alternating blocks.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Callable, List, Tuple

import pytest

from keepalive.session import cloud

sys.path.insert(0, os.path.dirname(__file__))
from metaserver import MetadataServer, MetadataServerProcess  # noqa: E402

PYTHON = sys.executable
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: short pauses for tests (the product's: 5 s between polls, 60 s the most between tries, 2 s a request)
FAST = {"interval": 0.1, "long_poll": 1, "max_backoff": 0.4, "timeout": 2.0}
NOTICE_PATH = {"gce": "/computeMetadata/v1/instance/preempted", "aws": "/latest/meta-data/spot/instance-action",
               "azure": "/metadata/scheduledevents"}


def write_dmi(folder, **files: str) -> str:
    os.makedirs(folder, exist_ok=True)
    for name, text in files.items():
        with open(os.path.join(folder, name), "w") as f:
            f.write(text + "\n")
    return str(folder)


PLAIN_PC = {"sys_vendor": "Dell Inc.", "product_name": "OptiPlex 7090", "board_asset_tag": "",
            "chassis_asset_tag": "CN-0ABC"}


@pytest.fixture(autouse=True)
def plain_machine(tmp_path, monkeypatch):
    """Every test starts on a plain PC (whatever this machine is), with no decided watcher."""
    monkeypatch.setenv("KEEPALIVE_DMI_DIR", write_dmi(tmp_path / "dmi-plain", **PLAIN_PC))
    monkeypatch.delenv("KEEPALIVE_CLOUD", raising=False)
    monkeypatch.delenv("KEEPALIVE_METADATA_URL", raising=False)
    monkeypatch.setattr(cloud, "HYPERVISOR_UUID", str(tmp_path / "no-hypervisor-uuid"))
    cloud.reset()
    yield
    cloud.reset()


def wait_until(condition: Callable[[], bool], timeout: float = 30.0, what: str = "") -> None:
    """Wait for a state the watcher's threads reach (checked every 10 ms; fails after ``timeout``)."""
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"not reached within {timeout} s: {what}")
        time.sleep(0.01)


class Seen:
    """A subscriber: the notices passed to it, and an event set at the first."""

    def __init__(self) -> None:
        self.notices: List[cloud.Notice] = []
        self.event = threading.Event()

    def __call__(self, notice: cloud.Notice) -> None:
        self.notices.append(notice)
        self.event.set()


# -------------------------------------------------------------------------------------- detection
AWS_XEN_UUID = "ec2e1916-9099-7caf-fd21-012345abcdef"


@pytest.mark.parametrize("files,uuid,expected", [
    ({"sys_vendor": "Google", "product_name": "Google Compute Engine"}, None, "gce"),
    ({"sys_vendor": "Amazon EC2", "product_name": "g5.xlarge", "board_asset_tag": "i-0123456789abcdef0"},
     None, "aws"),
    ({"sys_vendor": "Amazon EC2", "product_name": "m5.metal"}, None, "aws"),
    ({"sys_vendor": "Xen", "product_name": "HVM domU", "board_asset_tag": "i-0abc"}, None, "aws"),
    ({"sys_vendor": "Xen", "product_name": "HVM domU"}, AWS_XEN_UUID, "aws"),
    ({"sys_vendor": "Microsoft Corporation", "product_name": "Virtual Machine",
      "chassis_asset_tag": cloud.AZURE_ASSET_TAG}, None, "azure"),
    # Hyper-V on a desk says the same vendor and product, without Azure's asset tag
    ({"sys_vendor": "Microsoft Corporation", "product_name": "Virtual Machine",
      "chassis_asset_tag": "4217-0361-2222"}, None, None),
    ({"sys_vendor": "Xen", "product_name": "HVM domU"}, "3f2504e0-4f89-11d3-9a0c-0305e82c3301", None),
    (PLAIN_PC, None, None),
    ({}, None, None),  # no DMI at all (a container without /sys/class/dmi)
], ids=["gce", "aws-nitro", "aws-metal", "aws-asset-tag", "aws-xen-uuid", "azure", "hyperv-desktop",
        "plain-xen", "plain-pc", "no-dmi"])
def test_detect_from_dmi(tmp_path, monkeypatch, files, uuid, expected):
    monkeypatch.setenv("KEEPALIVE_DMI_DIR", write_dmi(tmp_path / "dmi", **files))
    if uuid is not None:
        (tmp_path / "uuid").write_text(uuid + "\n")
        monkeypatch.setattr(cloud, "HYPERVISOR_UUID", str(tmp_path / "uuid"))
    assert cloud.detect() == expected


def test_keepalive_cloud_forces_the_answer(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KEEPALIVE_DMI_DIR", write_dmi(tmp_path / "gce", sys_vendor="Google",
                                                        product_name="Google Compute Engine"))
    assert cloud.detect() == "gce"
    monkeypatch.setenv("KEEPALIVE_CLOUD", "none")
    assert cloud.detect() is None
    assert cloud.watcher() is None
    monkeypatch.setenv("KEEPALIVE_DMI_DIR", write_dmi(tmp_path / "plain", **PLAIN_PC))
    for value, expected in [("aws", "aws"), ("AZURE", "azure"), ("gcp", "gce"), ("auto", None)]:
        monkeypatch.setenv("KEEPALIVE_CLOUD", value)
        assert cloud.detect() == expected, value
    monkeypatch.setenv("KEEPALIVE_CLOUD", "digitalocean")  # a typo: said once, the detection decides
    assert cloud.detect() is None
    assert "ignoring KEEPALIVE_CLOUD='digitalocean'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------- notices
def seen_after(srv: MetadataServer, watcher: cloud.NoticeWatcher, arm: Callable[[], None],
               timeout: float = 30.0) -> cloud.Notice:
    """Arm a notice on the server, wait for the subscriber; the notice endpoint must have been asked
    at most once after arming (the next poll sees it; GCE's long poll in flight answers it)."""
    seen = Seen()
    watcher.subscribe(seen)
    armed_at = srv.count
    arm()
    assert seen.event.wait(timeout), f"no notice within {timeout} s; status {watcher.status()}"
    asked = [r for r in srv.requests[armed_at:] if r.path.startswith(NOTICE_PATH[srv.cloud])]
    assert len(asked) <= 1, [r.path for r in asked]
    assert watcher.notice() is seen.notices[0]
    return seen.notices[0]


@pytest.mark.parametrize("name", ["gce", "aws", "azure"])
def test_no_notice_then_preemption_is_seen_at_the_next_poll(name):
    with MetadataServer(name) as srv:
        watcher = cloud.NoticeWatcher(name, srv.url, **FAST)
        try:
            assert srv.wait_for_requests(4), srv.requests
            wait_until(lambda: watcher.status()["last_answer"] is not None, what="a first answer")
            assert watcher.notice() is None
            status = watcher.status()
            assert status["errors"] == 0 and status["watched"] and status["notice"] is None, status
            before = time.time()
            notice = seen_after(srv, watcher, lambda: srv.preempt(seconds=90))
            assert (notice.cloud, notice.kind) == (name, "preemption")
            assert notice.detail.startswith({"gce": "GCE: ", "aws": "AWS: ", "azure": "Azure: "}[name])
            if name == "gce":  # the endpoint gives no time: GCE's ~30 s
                assert notice.detail == "GCE: instance/preempted is TRUE (the VM stops in about 30 s)"
                assert before + 29 <= notice.stops_at <= time.time() + 31
            else:  # the server's time (AWS "time", Azure NotBefore), to the second
                assert before + 88 <= notice.stops_at <= before + 91
                assert 85 < notice.seconds_left() <= 91
            if name == "azure":
                assert notice.event_id == "EV-PREEMPT-1"
            # sticky: the same notice object while the server keeps saying it
            polled = srv.count
            assert srv.wait_for_requests(polled + 3)
            assert watcher.notice() is notice
            assert watcher.status()["notice"]["kind"] == "preemption"
        finally:
            watcher.stop()


def test_gce_long_poll_answers_within_the_poll_not_after_it():
    """GCE's preempted is long-polled with the last ETag: the request in flight answers the change."""
    with MetadataServer("gce") as srv:
        watcher = cloud.NoticeWatcher("gce", srv.url, interval=5.0, long_poll=30, timeout=2.0)
        try:
            waiting = lambda: any("wait_for_change=true" in r.path and "preempted" in r.path  # noqa: E731
                                  for r in srv.requests)
            wait_until(waiting, what="a long poll in flight")
            started = time.monotonic()
            seen_after(srv, watcher, srv.preempt)
            assert time.monotonic() - started < 5.0  # not the 30 s the long poll holds
            assert "last_etag=" in [r.path for r in srv.requests if "wait_for_change" in r.path][0]
            assert all(r.headers.get("metadata-flavor") == "Google" for r in srv.requests)
        finally:
            watcher.stop()


@pytest.mark.parametrize("name,kind", [("gce", "maintenance"), ("azure", "maintenance"), ("aws", "rebalance")])
def test_maintenance_and_rebalance_then_a_preemption_replaces_them(name, kind):
    with MetadataServer(name) as srv:
        watcher = cloud.NoticeWatcher(name, srv.url, **FAST)
        try:
            before = time.time()
            arm = srv.rebalance if kind == "rebalance" else (lambda: srv.maintenance(seconds=600))
            seen = Seen()
            watcher.subscribe(seen)
            arm()
            assert seen.event.wait(30), watcher.status()
            first = seen.notices[0]
            assert first.kind == kind
            if name == "gce":  # GPU VMs are told ~60 min ahead; the endpoint gives no time
                assert before + 3599 <= first.stops_at <= time.time() + 3601
                assert "TERMINATE_ON_HOST_MAINTENANCE" in first.detail
            elif name == "azure":
                assert before + 598 <= first.stops_at <= before + 601
                assert first.event_id == "EV-REDEPLOY-1" and "Redeploy" in first.detail
            else:
                assert first.stops_at is None and "rebalance" in first.detail
            srv.preempt(seconds=60)  # more urgent: replaces it, and is passed on once more
            wait_until(lambda: len(seen.notices) == 2, what="the preemption after the first notice")
            assert watcher.notice() is seen.notices[1] and seen.notices[1].kind == "preemption"
            srv.clear()
            srv.rebalance() if name == "aws" else srv.maintenance()  # less urgent: the preemption stays
            assert srv.wait_for_requests(srv.count + 4)
            assert watcher.notice() is seen.notices[1] and len(seen.notices) == 2
        finally:
            watcher.stop()


@pytest.mark.parametrize("name", ["gce", "aws", "azure"])
def test_notice_after_n_requests(name):
    with MetadataServer(name) as srv:
        srv.preempt(after_requests=6)
        watcher = cloud.NoticeWatcher(name, srv.url, **FAST)
        seen = Seen()
        watcher.subscribe(seen)
        try:
            assert seen.event.wait(30), watcher.status()
            assert srv.count >= 6
            assert len(seen.notices) == 1
        finally:
            watcher.stop()


def test_a_subscriber_that_raises_does_not_stop_the_watching():
    with MetadataServer("aws") as srv:
        watcher = cloud.NoticeWatcher("aws", srv.url, **FAST)
        seen = Seen()

        def broken(notice: cloud.Notice) -> None:
            raise RuntimeError("a subscriber's bug")

        watcher.subscribe(broken)
        watcher.subscribe(seen)
        try:
            srv.rebalance()
            assert seen.event.wait(30)
            srv.preempt()
            wait_until(lambda: len(seen.notices) == 2, what="the second notice")
            assert watcher.watched
            late = Seen()
            watcher.subscribe(late)  # subscribing after the notice: passed at once
            assert late.notices == [watcher.notice()]
        finally:
            watcher.stop()


def test_azure_acknowledge_posts_the_event_id():
    with MetadataServer("azure") as srv:
        watcher = cloud.NoticeWatcher("azure", srv.url, **FAST)
        try:
            notice = seen_after(srv, watcher, lambda: srv.preempt(seconds=30, event_id="EV-0042"))
            watcher.acknowledge(notice)
            posts = [r for r in srv.requests if r.method == "POST"]
            assert len(posts) == 1
            assert posts[0].path == "/metadata/scheduledevents?api-version=2020-07-01"
            assert posts[0].headers["metadata"] == "true"
            assert json.loads(posts[0].body) == {"StartRequests": [{"EventId": "EV-0042"}]}
            assert srv.acknowledged == ["EV-0042"]
            assert watcher.status()["acknowledged"] == ["EV-0042"]
            assert watcher.notice() is notice  # the VM still goes away: the notice stays
        finally:
            watcher.stop()
    # elsewhere, or when the service is gone: nothing is posted, nothing raised
    with MetadataServer("gce") as srv:
        gce = cloud.NoticeWatcher("gce", srv.url, start=False)
        gce.acknowledge(cloud.Notice("gce", "preemption", None, "x"))
        assert srv.count == 0
    gone = cloud.NoticeWatcher("azure", "http://127.0.0.1:9", start=False, timeout=0.5)
    gone.acknowledge(cloud.Notice("azure", "preemption", None, "x", "EV-1"))
    assert "acknowledging EV-1: no answer" in gone.status()["endpoints"]["/metadata/scheduledevents?api-version"
                                                                          "=2020-07-01"]["last_answer"]


# ---------------------------------------------------------------------------------- misbehaving
SAYS = {"garbage": {"gce": "not TRUE or FALSE", "aws": "not a token", "azure": "not a Scheduled Events document"},
        "error": "HTTP 500", "hang": "no answer (", "slow": "no answer ("}


@pytest.mark.parametrize("name", ["gce", "aws", "azure"])
@pytest.mark.parametrize("mode", ["garbage", "error", "hang"])
def test_an_endpoint_that_misbehaves_backs_off_and_recovers(name, mode):
    # a short request timeout only where the test is the timeout: on a loaded machine an answer of
    # garbage can take longer than 0.25 s to arrive, and would read as a timeout
    options = dict(FAST, timeout=0.25 if mode == "hang" else 2.0)
    with MetadataServer(name, mode=mode) as srv:
        watcher = cloud.NoticeWatcher(name, srv.url, **options)
        try:
            main = cloud._probes(name, 1, 1)[0].path  # the notice endpoint's state in the status
            wait_until(lambda: watcher.status()["endpoints"][main]["errors"] >= 4, timeout=60,
                       what="four failed tries")
            status = watcher.status()
            state = status["endpoints"][main]
            # each failure doubles the pause (0.1, 0.2, then the most, 0.4), recorded, not raised
            assert state["backoff_seconds"] == pytest.approx(min(0.4, 0.1 * 2 ** (state["errors"] - 1)))
            expected = SAYS[mode] if isinstance(SAYS[mode], str) else SAYS[mode][name]
            assert expected in state["last_answer"], state
            assert status["watched"] and watcher.notice() is None
            if mode == "hang":
                assert "timed out" in state["last_answer"]
            # the service comes back: the watcher still asks, the back-off ends, a notice is seen
            srv.misbehave("ok")
            seen = Seen()
            watcher.subscribe(seen)
            srv.preempt()
            assert seen.event.wait(30), watcher.status()
            wait_until(lambda: watcher.status()["endpoints"][main]["backoff_seconds"] == 0.0,
                       what="the back-off reset")
        finally:
            watcher.stop()


def test_a_slow_endpoint_is_cut_at_the_request_timeout():
    """An answer after 3 s: the product's 2 s timeout gives up first; notice() never waits for it."""
    with MetadataServer("azure", mode="slow", delay=3.0) as srv:
        watcher = cloud.NoticeWatcher("azure", srv.url, interval=0.1, max_backoff=0.4)  # timeout: 2 s
        try:
            assert srv.wait_for_requests(1)
            started = time.monotonic()
            wait_until(lambda: watcher.status()["errors"] >= 1, timeout=60, what="the first timeout")
            assert time.monotonic() - started < 2.9  # cut before the server's 3 s answer
            assert "timed out" in watcher.status()["last_answer"]
            t = time.thread_time()  # this thread's CPU time: what a request here would cost, load or not
            for _ in range(1000):
                watcher.notice()
            assert time.thread_time() - t < 0.05  # an attribute read, not a request
        finally:
            watcher.stop()


def step_times(steps: int) -> List[float]:
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t)
    return times


#: the bounds on (median step time, total time of a block) with the watcher over without: the
#: median is the issue's measure; it does not see a thread that stalls one step in twenty (see the
#: control below), the total does, and gets a looser bound for a 2-core machine shared under load
MEDIAN_BOUND, TOTAL_BOUND = 1.10, 1.5


def step_time_ratios(start_background: Callable[[], Callable[[], None]], rounds: int = 3,
                     steps: int = 400) -> List[Tuple[float, float]]:
    """(median step time, block total) with ``start_background()`` running (it returns its stop)
    over without: five pairs of adjacent blocks of ``steps`` steps, the median of the pairs' ratios
    (adjacent pairs cancel the drift of the machine's load). Another round (of at most ``rounds``)
    only while a bound is exceeded."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ratios: List[Tuple[float, float]] = []
    try:
        step_times(50)  # warm up
        for _round in range(rounds):
            medians, totals = [], []
            for _block in range(5):
                without = step_times(steps)
                stop = start_background()
                try:
                    with_it = step_times(steps)
                finally:
                    stop()
                medians.append(statistics.median(with_it) / statistics.median(without))
                totals.append(sum(with_it) / sum(without))
            ratios.append((statistics.median(medians), statistics.median(totals)))
            if ratios[-1][0] <= MEDIAN_BOUND and ratios[-1][1] <= TOTAL_BOUND:
                break
    finally:
        torch.set_num_threads(threads)
    return ratios


@pytest.mark.parametrize("mode", ["hang", "garbage"])
def test_a_misbehaving_endpoint_never_slows_a_training_step(mode):
    """A small CPU MLP's steps (~0.2 ms), with the watcher polling a misbehaving endpoint as fast
    as the tests' back-off allows (a new try every 0.05-0.15 s; the product waits 5 s to 60 s),
    against no watcher. The server runs in a child process, as the real service is not in the
    training's process (its request handling would share our GIL)."""
    with MetadataServerProcess("aws", mode=mode) as srv:
        def start() -> Callable[[], None]:
            asked = srv.count
            watcher = cloud.NoticeWatcher("aws", srv.url, interval=0.02, max_backoff=0.05, timeout=0.1)

            def stop() -> None:
                watcher.stop(wait=5.0)  # the next block without it has none of its threads
                assert not watcher.watched
                assert srv.count > asked, "the watcher did not poll while the steps ran"
            return stop

        ratios = step_time_ratios(start)
    print(f"(median step, block total) with / without the watcher: {ratios}")
    assert any(m <= MEDIAN_BOUND and t <= TOTAL_BOUND for m, t in ratios), \
        f"(median step, block total) with / without the watcher: {ratios}"


def test_the_step_time_measurement_catches_a_thread_that_holds_the_training_up():
    """Control: a stand-in for a watcher that blocks the training thread (a C call holding the GIL
    ~5 ms at a time, between polls) fails the measurement above, through the block total (measured
    3x to 5x here; the median moves only a few %: most steps run between two stalls)."""
    def start() -> Callable[[], None]:
        done = threading.Event()

        def hog() -> None:
            while not done.is_set():
                sum(range(300_000))  # one C call: the GIL is held throughout

        thread = threading.Thread(target=hog, daemon=True)
        thread.start()

        def stop() -> None:
            done.set()
            thread.join()
        return stop

    (median, total), = step_time_ratios(start, rounds=1, steps=150)
    assert total > TOTAL_BOUND, (median, total)


# ------------------------------------------------------------------------------ not a cloud VM
def test_not_a_cloud_makes_no_request(tmp_path, monkeypatch):
    """A plain PC with KEEPALIVE_METADATA_URL pointing at the counting server: no watcher, no
    request, even through a training with keepalive and through ``keepalive status``."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from keepalive.callbacks.torch import DriveCheckpoint

    with MetadataServer("gce") as srv:
        monkeypatch.setenv("KEEPALIVE_METADATA_URL", srv.url)
        assert cloud.watcher() is None
        assert cloud.status() == {"cloud": None, "watched": False}
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,))), batch_size=4)
        ckpt = DriveCheckpoint(str(tmp_path / "run"), model=model, optimizer=opt, every=2, quiet=True)
        for _ in ckpt.epochs(2):
            for x, y in ckpt.batches(loader):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
        ckpt.close()
        env = {**os.environ, "KEEPALIVE_METADATA_URL": srv.url}
        out = subprocess.run([PYTHON, "-m", "keepalive", "status", "--json", "--dir", str(tmp_path)], env=env,
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["cloud"] is None
        text = subprocess.run([PYTHON, "-m", "keepalive", "status", "--dir", str(tmp_path)], env=env,
                              capture_output=True, text=True, timeout=120, cwd=ROOT).stdout
        assert [line for line in text.splitlines() if line.startswith("  cloud ")] == [
            "  cloud     not a cloud VM (no preemption notices to watch; KEEPALIVE_CLOUD=gce|aws|azure forces it)"]
        assert srv.count == 0, srv.requests


def test_the_process_watcher_starts_once_on_a_cloud(monkeypatch):
    with MetadataServer("aws") as srv:
        monkeypatch.setenv("KEEPALIVE_CLOUD", "aws")
        monkeypatch.setenv("KEEPALIVE_METADATA_URL", srv.url)
        first = cloud.watcher()
        assert first is not None and first.cloud == "aws" and first.base_url == srv.url
        assert cloud.watcher() is first
        assert srv.wait_for_requests(2)  # the token, then the notice
        assert [r.method + " " + r.path for r in srv.requests[:2]] == [
            "PUT /latest/api/token", "GET /latest/meta-data/spot/instance-action"]
        assert cloud.status()["watched"] is True  # this process's watcher, no extra request
        cloud.reset()
        assert not first.watched


# ----------------------------------------------------------------------------------- status CLI
def run_status(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "keepalive", "status", *args], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_keepalive_status_shows_the_cloud_and_its_notice(tmp_path):
    with MetadataServer("gce") as srv:
        env = {"KEEPALIVE_CLOUD": "gce", "KEEPALIVE_METADATA_URL": srv.url}
        quiet = run_status(env, "--json", "--dir", str(tmp_path))
        assert quiet.returncode == 0, quiet.stderr
        report = json.loads(quiet.stdout)["cloud"]
        assert report["cloud"] == "gce" and report["watched"] is True
        assert report["last_answer"] == "FALSE" and report["notice"] is None
        assert report["endpoint"] == srv.url + "/computeMetadata/v1/instance/preempted"
        assert srv.count == 1 and "wait_for_change" not in srv.requests[0].path  # one quick request

        srv.preempt()
        out = run_status(env, "--json", "--dir", str(tmp_path))
        report = json.loads(out.stdout)
        assert report["cloud"]["last_answer"] == "TRUE"
        assert report["cloud"]["notice"]["kind"] == "preemption"
        assert report["cloud"]["notice"]["detail"] in " ".join(report["warnings"])
        text = run_status(env, "--dir", str(tmp_path)).stdout
        lines = [line for line in text.splitlines() if line.startswith("  cloud ")]
        assert lines == [f"  cloud     gce: notices watched at {srv.url}/computeMetadata/v1/instance/preempted; "
                         "NOTICE: GCE: instance/preempted is TRUE (the VM stops in about 30 s)"], text


def test_keepalive_status_does_not_wait_for_a_hanging_service(tmp_path):
    with MetadataServer("aws", mode="hang") as srv:
        started = time.monotonic()
        out = run_status({"KEEPALIVE_CLOUD": "aws", "KEEPALIVE_METADATA_URL": srv.url}, "--json",
                         "--dir", str(tmp_path))
        elapsed = time.monotonic() - started
        report = json.loads(out.stdout)["cloud"]
        assert report["cloud"] == "aws" and report["notice"] is None
        assert report["last_answer"].startswith("no answer (") and report["errors"] == 1
        assert srv.count == 1  # the token request hung: nothing more was asked
        assert elapsed < 60  # (the 1 s timeout; the process start dominates under load)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_decides_again(monkeypatch):
    """A forked child has none of its parent's threads: its watcher() is a new one, not the parent's
    dead copy (torch's DataLoader workers and multiprocessing fork the training process)."""
    with MetadataServer("aws") as srv:
        monkeypatch.setenv("KEEPALIVE_CLOUD", "aws")
        monkeypatch.setenv("KEEPALIVE_METADATA_URL", srv.url)
        parent = cloud.watcher()
        assert parent is not None and parent.watched
        pid = os.fork()
        if pid == 0:  # the child: exit code 0 only when it starts a watcher of its own
            code = 1
            try:
                child = cloud.watcher()
                code = 0 if child is not None and child is not parent and child.watched else 1
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert cloud.watcher() is parent and parent.watched
