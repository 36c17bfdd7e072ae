#!/usr/bin/env bash
# Set up (if needed) and run the quickstart: MoCo pretraining on Fashion-MNIST, offline, on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/moco-lightning fit --config configs/quickstart.yaml "$@"
