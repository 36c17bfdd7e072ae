#!/usr/bin/env bash
# Creates .venv with the pinned torch/torchvision and moco-lightning (editable) plus the extras named in $1.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
[ -n "${MOCO_SKIP_APT:-}" ] || bash scripts/install_data.sh
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.14.1 torchvision==0.29.1
.venv/bin/python -m pip install -q -e ".${extras:+[$extras]}"
