"""What notifications cost a training: the same small torch loop with no notifier, with a receiver
that refuses every connection (a dead webhook), and with a live JSON receiver on 127.0.0.1.

Printed per variant: the loop's wall time (best of ``--repeats``), its ratio to the loop without a
notifier, and the time the training thread spent in ``Notifier.send`` and ``Notifier.flush`` (what a
notifier can take from the training: the sends only queue; the end of training waits, bounded, for
the "finished" message of a live receiver, and not at all for a receiver that failed).

    python benchmarks/notify_cost.py [--epochs 100] [--repeats 3]
"""
from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

import torch
from torch.utils.data import DataLoader, TensorDataset

from keepalive import notify
from keepalive.callbacks.torch import DriveCheckpoint

SPENT: List[float] = []  # seconds the training thread spent in send / flush


def timed(method: Callable) -> Callable:
    def run(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            SPENT.append(time.perf_counter() - started)
    return run


#: the live receiver, a process of its own (its CPU is not the training's): answers every POST with 200
RECEIVER = """
import http.server, sys
class R(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), R)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"json://127.0.0.1:{s.getsockname()[1]}/hook"


def loop(folder: str, epochs: int, url: Optional[str]) -> float:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = DataLoader(TensorDataset(torch.randn(256, 64), torch.randint(0, 2, (256,))), batch_size=32)
    options: Dict[str, object] = {"notify": url} if url else {}
    started = time.perf_counter()
    ckpt = DriveCheckpoint(folder, model=model, optimizer=opt, quiet=True, **options)
    for _ in ckpt.epochs(epochs):
        for x, y in ckpt.batches(data):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    ckpt.close()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    notify.Notifier.send = timed(notify.Notifier.send)  # type: ignore[method-assign]
    notify.Notifier.flush = timed(notify.Notifier.flush)  # type: ignore[method-assign]
    server = subprocess.Popen([sys.executable, "-c", RECEIVER], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    live = f"json://127.0.0.1:{int(server.stdout.readline())}/hook"
    try:
        with tempfile.TemporaryDirectory() as tmp:
            loop(f"{tmp}/warm", 1, live)  # Apprise's and its HTTP client's first use
            results = {}
            for name, url in (("none", None), ("dead receiver", dead_url()), ("live receiver", live)):
                times, spent = [], []
                for i in range(args.repeats):
                    SPENT.clear()
                    times.append(loop(f"{tmp}/{name}-{i}", args.epochs, url))
                    spent.append(sum(SPENT))
                results[name] = (min(times), min(spent))
    finally:
        server.terminate()
        server.wait()
    base = results["none"][0]
    print(f"{args.epochs} epochs of 8 steps, best of {args.repeats}:")
    for name, (wall, spent) in results.items():
        print(f"  {name:14s} loop {wall:.3f} s = {wall / base:.3f}x none; in send/flush {spent * 1e3:.2f} ms "
              f"({spent / wall:.2%} of the loop)")


if __name__ == "__main__":
    main()
