#!/usr/bin/env bash
# Set up (if needed), check lint and formatting with ruff, and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/ruff check .            # lint (pyproject.toml), enforced by CI: each on its own line, so that set -e stops
.venv/bin/ruff format --check .   # at either (a failure left of && did not stop the script)
.venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup "$@"   # two workers (pytest-xdist; a method's matrix tests share one), one torch thread each
