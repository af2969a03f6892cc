#!/usr/bin/env bash
# The main job: a resilient PyTorch training on a local folder that is SIGKILLed a few times,
# resumes each time, and ends bit-identical to an uninterrupted run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh torch
exec .venv/bin/python examples/demo.py "$@"
