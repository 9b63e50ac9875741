#!/usr/bin/env bash
# Set up, lint (ruff), then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .   # lint first: a finding stops the run, before 10 minutes of tests
exec .venv/bin/python -m pytest -q "$@"
