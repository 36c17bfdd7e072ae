#!/usr/bin/env bash
# Set up (if needed), check lint and formatting with ruff, and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/ruff check . && .venv/bin/ruff format --check .   # lint and format (pyproject.toml), enforced by CI
.venv/bin/python -m pytest -q -p no:cacheprovider -n 2 "$@"   # two workers (pytest-xdist), one torch thread each
