#!/usr/bin/env bash
# Set up, lint (ruff) and type-check (mypy, configured in pyproject.toml), then run the whole test suite (tests/unit, tests/integration, tests/system),
# or what the arguments pick: `bash scripts/test.sh tests/unit tests/integration` for the fast tiers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .   # lint first: a finding stops the run, before 10 minutes of tests
.venv/bin/mypy           # the packages listed in [tool.mypy]; about 30 s from a cold cache
exec .venv/bin/python -m pytest -q --durations=15 "$@"
