#!/usr/bin/env bash
# Set up (if needed), check lint and formatting with ruff, and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/ruff check . && .venv/bin/ruff format --check .   # lint and format (pyproject.toml), enforced by CI
.venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup "$@"   # two workers (pytest-xdist; a method's matrix tests share one), one torch thread each
