#!/usr/bin/env bash
# Sets up the environment, builds the demo model if missing, runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
[ -f models/demo/config.json ] || .venv/bin/python -m backend.demo_model --out models/demo
exec .venv/bin/python -m pytest -q --durations=15 "$@"
