#!/usr/bin/env bash
# The main job: a resilient PyTorch training on a local folder that is SIGKILLed a few times,
# resumes each time, and ends bit-identical to an uninterrupted run. It prints, for each kill, the
# step the kill landed at, and for each restart, the checkpoint (epoch, step) it resumed from.
set -euo pipefail
cd "$(dirname "$0")/.."
# a venv that already runs torch with this checkout's keepalive is used as it is
if ! .venv/bin/python -c "import torch, keepalive.callbacks.torch" >/dev/null 2>&1; then
  bash scripts/setup-venv.sh torch
fi
exec .venv/bin/python examples/demo.py "$@"
