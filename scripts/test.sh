#!/usr/bin/env bash
# Set up, lint (ruff), then run the whole test suite (tests/unit, tests/integration, tests/system),
# or what the arguments pick: `bash scripts/test.sh tests/unit tests/integration` for the fast tiers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .   # lint first: a finding stops the run, before 10 minutes of tests
exec .venv/bin/python -m pytest -q "$@"
