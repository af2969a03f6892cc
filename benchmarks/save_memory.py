"""How much host memory do saves take? Peak RSS of the same CPU training, saved four ways.

A minGPT-like model (token and position embeddings, ``--layers`` pre-norm transformer blocks of
``--width``, an untied head; AdamW) trains ``--steps`` steps on random tokens, on the CPU. Each variant
runs in a process of its own, so each peak is its own:

* ``none``      - no saving;
* ``torch.save``- ``torch.save`` of the model's and the optimizer's ``state_dict`` every ``--every`` steps;
* ``full copy`` - keepalive with room for a full host copy (the default budget on this machine):
  the state is copied to a host buffer and written in the background;
* ``budget``    - keepalive under ``memory_budget=`` too small for a copy (``--budget``, default a
  quarter of the state): the saves stream, the loop waits, no full copy.

Per variant: the peak RSS (``VmHWM`` of ``/proc/self/status``: the kernel's own high-water mark, not a
sample), the RSS after the training loop and ``close()`` (no ``del``, no ``gc.collect()``), the seconds
the loop took. Then the ratios, and the two goals:

* the budgeted run's peak <= ``torch.save``'s + the piece size (the bounded buffer) + 10 %;
* every keepalive run's RSS after ``close()`` within 10 % of the run without saving.

    python benchmarks/save_memory.py [--layers 4] [--width 512] [--steps 6] [--every 3] [--dir /tmp/x]

The defaults give a state of ~0.25 GiB and take ~1-2 min on 2 cores. (Whether a streamed save resumes
bit-exactly is tests/test_memory_budget.py's part.)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict

VARIANTS = ["none", "torch.save", "full copy", "budget"]


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def build(layers: int, width: int, vocab: int, block: int) -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.attn = nn.MultiheadAttention(width, max(1, width // 64), batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

        def forward(self, x: Any) -> Any:
            h = self.ln1(x)
            mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
            x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(block, width)
            self.blocks = nn.Sequential(*[Block() for _ in range(layers)])
            self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

        def forward(self, idx: Any) -> Any:
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
            return self.head(self.ln(self.blocks(x)))

    return GPT()


def child(args: argparse.Namespace) -> Dict[str, Any]:
    """One variant, in this process: the figures as a dict."""
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(max(1, (os.cpu_count() or 2)))
    model = build(args.layers, args.width, args.vocab, args.block)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    state_bytes = 3 * sum(p.numel() * p.element_size() for p in model.parameters())  # weights + Adam's two moments
    data = torch.randint(0, args.vocab, (args.steps, args.batch, args.block + 1))
    ckpt = None
    folder = os.path.join(args.dir, args.variant.replace(" ", "-").replace(".", "-"))
    if args.variant in ("full copy", "budget"):
        from keepalive.callbacks.torch import DriveCheckpoint

        budget = args.budget or max(1, state_bytes // 4)
        ckpt = DriveCheckpoint(folder, model=model, optimizer=opt, every=args.every, spool="never",
                               memory_budget=budget if args.variant == "budget" else None)
        steps = ckpt.epochs(args.steps)  # an "epoch" of one step: saved every --every steps
    else:
        steps = iter(range(args.steps))
    t0 = time.perf_counter()
    for step in steps:
        x, y = data[step, :, :-1], data[step, :, 1:]
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        if args.variant == "torch.save" and (step + 1) % args.every == 0:
            os.makedirs(folder, exist_ok=True)
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, os.path.join(folder, "ckpt.pt"))
    streamed = None
    if ckpt is not None:
        ckpt.close()
        s = ckpt.core.writer.streamed
        streamed = None if s is None else {"piece": s.piece, "limit": s.limit}
    return {"variant": args.variant, "seconds": time.perf_counter() - t0, "state_bytes": state_bytes,
            "peak_kib": _status_kib("VmHWM"), "after_close_kib": _status_kib("VmRSS"), "streamed": streamed}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--budget", type=int, default=0, help="bytes (default: a quarter of the state)")
    p.add_argument("--dir", default=None)
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant is not None:
        print(json.dumps(child(args)))
        return 0
    root = args.dir or tempfile.mkdtemp(prefix="keepalive-save-memory-")
    results = {}
    try:
        for variant in VARIANTS:
            argv = [a for a in sys.argv[1:] if not a.startswith("--dir")]
            cmd = [sys.executable, os.path.abspath(__file__), *argv, "--dir", root, "--variant", variant]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                print(done.stdout, done.stderr, file=sys.stderr)
                return 1
            results[variant] = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    return report(results)


def report(results: Dict[str, Dict[str, Any]]) -> int:
    mib = 1024.0
    state = results["none"]["state_bytes"] / 2**20
    print(f"training state: {state:.0f} MiB (weights + AdamW moments); peak RSS = VmHWM")
    print(f"{'variant':<12} {'peak RSS':>10} {'x none':>7} {'x torch.save':>13} {'after close':>12} "
          f"{'x none':>7} {'loop s':>7}")
    none, tsave = results["none"], results["torch.save"]
    for name in VARIANTS:
        r = results[name]
        print(f"{name:<12} {r['peak_kib'] / mib:>7.0f} MiB {r['peak_kib'] / none['peak_kib']:>7.2f} "
              f"{r['peak_kib'] / tsave['peak_kib']:>13.2f} {r['after_close_kib'] / mib:>8.0f} MiB "
              f"{r['after_close_kib'] / none['after_close_kib']:>7.2f} {r['seconds']:>7.1f}")
    budget = results["budget"]
    ok = True
    if budget["streamed"] is None:
        print("FAIL: the budgeted run did not stream")
        return 1
    piece_kib = budget["streamed"]["piece"] / 1024
    limit = (tsave["peak_kib"] + piece_kib) * 1.10
    print(f"budget {budget['streamed']['limit'] / 2**20:.0f} MiB, piece {piece_kib / mib:.0f} MiB: budgeted peak "
          f"{budget['peak_kib'] / mib:.0f} MiB <= (torch.save {tsave['peak_kib'] / mib:.0f} + piece "
          f"{piece_kib / mib:.0f}) x 1.10 = {limit / mib:.0f} MiB: {'ok' if budget['peak_kib'] <= limit else 'FAIL'}")
    ok &= budget["peak_kib"] <= limit
    for name in ("full copy", "budget"):
        ratio = results[name]["after_close_kib"] / none["after_close_kib"]
        print(f"{name}: RSS after close() {ratio:.2f}x the run without saving (goal <= 1.10): "
              f"{'ok' if ratio <= 1.10 else 'FAIL'}")
        ok &= ratio <= 1.10
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
