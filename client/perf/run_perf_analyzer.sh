#!/usr/bin/env bash
# perf_analyzer streaming (decoupled) concurrency sweep against a running tritonserver.
#
#   client/perf/run_perf_analyzer.sh [--model ensemble|llm] [--url localhost:8001]
#       [--concurrency 1 8 64] [--input-data FILE] [--request-count N] [--out DIR] [-- PA_ARGS...]
#
# Installs what perf_analyzer needs when missing (libb64-0d unpacked into the venv, nvidia-cuda-runtime-cu12
# via pip into .venv), then runs one perf_analyzer per concurrency level:
#   perf_analyzer -m MODEL -u URL -i grpc --streaming --input-data FILE --concurrency-range C:C
#       -f OUT/perf_cC.csv --verbose-csv --profile-export-file OUT/profile_cC.json ...
# and writes OUT/perf_analyzer.csv (all levels) and OUT/summary.json (tok/s, TTFT, ITL per level).
# See client/perf/run_perf_analyzer.py for the details.
# Relative paths (--input-data, --out, the default perf_results/) are the caller's: it runs from
# the caller's directory, with the repository on PYTHONPATH.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
PY=${PYTHON:-$REPO/.venv/bin/python}
[ -x "$PY" ] || PY=python3
PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" -m client.perf.run_perf_analyzer --install "$@"
