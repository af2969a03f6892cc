"""Kaggle version chaining (keepalive/kagglechain.py), against a stand-in of Kaggle's API.

Kaggle's real service cannot be reached from here (no network): a stand-in of the two calls that
``kaggle kernels pull`` / ``kernels push`` make (``KernelsApiService/GetKernel`` and ``SaveKernel``,
JSON over HTTP, as kagglesdk sends them) listens on 127.0.0.1:7777, where Kaggle's own client sends
its requests when ``KAGGLE_API_ENVIRONMENT=TEST`` (kagglesdk's setting; keepalive does not change the
endpoint itself). The platform is forced to Kaggle and its folders are temporary ones
(``KEEPALIVE_KAGGLE_WORKING`` / ``KEEPALIVE_KAGGLE_INPUT``).

Version 1 trains until its session's deadline (after 5 steps), saves, pushes the next version (the
notebook's own source, its output added as a data source, the token sent only in the request's
header: in no file under the working folder) and stops. Version 2: version 1's working folder is
mounted read-only under the input folder, its own working folder is new and empty; the same script,
unchanged, resumes from the input copy, finishes bit-identical to an uninterrupted training and
writes only to its working folder. A chain that has pushed its most versions pushes no more.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, List, Tuple

import pytest
import torch

from crashkit import assert_same
from forkserver import ForkServer
from objectskit import forks_fixture
from test_resume_from import files_of

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "relay_train.py")
TOKEN = "KGAT_0123456789abcdef-standin"
NOTEBOOK = "someone/long-training"
SOURCE = json.dumps({"cells": [{"cell_type": "code", "source": "!python train.py", "metadata": {}}],
                     "metadata": {}, "nbformat": 4, "nbformat_minor": 5})
forks = forks_fixture()


class KaggleStandIn(BaseHTTPRequestHandler):
    """GetKernel answers the notebook; SaveKernel records the push and answers version 2."""

    calls: List[Tuple[str, Dict, str]] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        self.calls.append((self.path, body, self.headers.get("Authorization") or ""))
        if self.path.endswith("/GetKernel"):
            answer = {"metadata": {"ref": NOTEBOOK, "id": 42, "title": "Long training", "language": "python",
                                   "kernelType": "notebook", "isPrivate": True, "enableGpu": True,
                                   "enableInternet": True, "datasetDataSources": ["someone/pets"]},
                      "blob": {"source": SOURCE, "language": "python", "kernelType": "notebook",
                               "slug": "long-training"}}
        elif self.path.endswith("/SaveKernel"):
            answer = {"ref": NOTEBOOK, "url": f"https://www.kaggle.com/code/{NOTEBOOK}", "versionNumber": 2}
        else:
            self.send_error(404)
            return
        out = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def kaggle_api():
    KaggleStandIn.calls = []
    server = ThreadingHTTPServer(("127.0.0.1", 7777), KaggleStandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield KaggleStandIn.calls
    finally:
        server.shutdown()
        server.server_close()


def kaggle_env(tmp_path, working: str, chain: int = 3) -> Dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", HOME=str(tmp_path / "home"), KEEPALIVE_PLATFORM="kaggle",
                KEEPALIVE_KAGGLE_WORKING=working, KEEPALIVE_KAGGLE_INPUT=str(tmp_path / "input"),
                KEEPALIVE_KAGGLE_CHAIN=str(chain), KEEPALIVE_KAGGLE_NOTEBOOK=NOTEBOOK, KEEPALIVE_NOTIFY="",
                KAGGLE_API_ENVIRONMENT="TEST", KAGGLE_API_TOKEN=TOKEN)


def run(forks: ForkServer, env: Dict[str, str], *argv: str) -> Tuple[int, str]:
    child = forks.spawn([SCRIPT, *argv], env)
    out = child.stdout.read()
    child.stdout.close()
    return child.wait(timeout=120), out


def no_token_below(folder: str) -> None:
    for root, _, names in os.walk(folder):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                assert TOKEN.encode() not in f.read(), os.path.join(root, name)


def test_a_chained_version_resumes_from_the_previous_output_read_only(forks, kaggle_api, tmp_path):
    (tmp_path / "home").mkdir()
    reference = str(tmp_path / "ref.pt")
    assert run(forks, dict(os.environ), "unused", reference, "--plain")[0] == 0

    working1 = str(tmp_path / "working1")
    code, out = run(forks, kaggle_env(tmp_path, working1), os.path.join(working1, "keepalive", "run"),
                    str(tmp_path / "x.pt"), "--stop-after", "5")
    assert code == 143, out[-3000:]
    assert f"Kaggle chain: pushed version 2 of {NOTEBOOK} (1 of 3)" in out and TOKEN not in out, out[-3000:]
    pushes = [body for path, body, _ in kaggle_api if path.endswith("/SaveKernel")]
    assert [path.rsplit("/", 1)[1] for path, _, _ in kaggle_api] == ["GetKernel", "SaveKernel"]
    assert all(auth == f"Bearer {TOKEN}" for _, _, auth in kaggle_api)  # sent by Kaggle's client, in a header
    push = pushes[0]
    assert push["slug"] == NOTEBOOK and push["text"] == SOURCE and push["kernelType"] == "notebook"
    assert push["kernelDataSources"] == [NOTEBOOK] and push["datasetDataSources"] == ["someone/pets"]
    assert push["enableGpu"] is True
    chain = json.load(open(os.path.join(working1, "keepalive-kaggle-chain.json")))
    assert [(p["version"], p["step"]) for p in chain["pushes"]] == [(2, 5)]
    no_token_below(working1)

    # version 2: version 1's output mounted read-only in the input folder, a new empty working folder
    mounted = tmp_path / "input" / "long-training"
    mounted.mkdir(parents=True)
    try:
        subprocess.run(["mount", "--bind", working1, str(mounted)], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"a bind mount needs root here: {exc}")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(mounted)], check=True, capture_output=True)
        before = files_of(str(mounted))
        working2, out2 = str(tmp_path / "working2"), str(tmp_path / "out.pt")
        code, out = run(forks, kaggle_env(tmp_path, working2), os.path.join(working2, "keepalive", "run"), out2)
        assert code == 0, out[-3000:]
        assert re.search(rf"resuming run 'run' from {re.escape(str(mounted))}/keepalive/run/ckpt-0000000005-[\w-]+: "
                         r".*step 5.*; saving to " + re.escape(os.path.join(working2, "keepalive", "run")), out), out
        assert re.findall(r"^STEP (\d+)", out, re.M)[0] == "6"
        assert_same(torch.load(reference), torch.load(out2))
        assert files_of(str(mounted)) == before  # the input copy is only read
        assert len([p for p, _, _ in kaggle_api if p.endswith("/SaveKernel")]) == 1  # finished: no push
        no_token_below(working2)
    finally:
        subprocess.run(["umount", str(mounted)], check=False, capture_output=True)


def test_the_chain_stops_at_its_most_versions(kaggle_api, tmp_path, monkeypatch):
    from keepalive import kagglechain

    earlier = tmp_path / "input" / "long-training"
    earlier.mkdir(parents=True)
    (earlier / kagglechain.CHAIN_FILE).write_text(json.dumps(
        {"notebook": NOTEBOOK, "pushes": [{"version": 2}, {"version": 3}]}))
    for name, value in kaggle_env(tmp_path, str(tmp_path / "working")).items():
        monkeypatch.setenv(name, value)
    (tmp_path / "working").mkdir()
    notify = pytest.importorskip("keepalive.notify")
    sent: List[Tuple[str, str, str]] = []

    class Recorder:
        def send(self, title: str, body: str, kind: str = "info") -> None:
            sent.append((title, body, kind))

        def flush(self, timeout=None) -> bool:
            return True

    monkeypatch.setattr(notify, "notifier_from", lambda urls: Recorder() if urls == "json://here" else None)
    assert kagglechain.push_next_version(NOTEBOOK, 2, notify="json://here") is None
    assert kaggle_api == []  # nothing asked of Kaggle
    assert kagglechain.push_next_version(NOTEBOOK, 3, notify="json://here") == 2
    assert [(kind, "not pushed" in body, "pushed version 2" in body) for _, body, kind in sent] == [
        ("warning", True, False), ("info", False, True)]  # each push (and the chain's end) notified
    assert [p["version"] for p in json.load(open(tmp_path / "working" / kagglechain.CHAIN_FILE))["pushes"]] == [2, 3, 2]
