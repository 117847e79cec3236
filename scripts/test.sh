#!/usr/bin/env bash
# Sets up the environment, builds the demo model if missing, runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
[ -f models/demo/config.json ] || .venv/bin/python -m backend.demo_model --out models/demo
# Two lanes (tests/conftest.py): the tests that start servers in order on one worker, the rest at a
# lower priority on the other. -n 0 after this script's name runs everything in one process.
exec .venv/bin/python -m pytest -q -n 2 --durations=15 "$@"
