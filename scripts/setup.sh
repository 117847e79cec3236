#!/usr/bin/env bash
# Creates .venv with the pinned dependencies and puts the Python-backend stub where tritonserver
# looks for it. Idempotent: a second run only checks, and not even that when nothing it depends on
# changed since one that finished (delete .venv/.setup.done to check again).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# What this setup depends on: when none of it changed since a run that finished, there is
# nothing to check (the checks import torch and friends, ~9 s that every serve.sh start paid).
fingerprint() {
  cat requirements.txt constraints.txt scripts/setup.sh kernels/cpu_build.py kernels/csrc/* 2>/dev/null
  grep -m2 -E '^(model name|flags)' /proc/cpuinfo 2>/dev/null  # the kernels build for this CPU
  .venv/bin/python -c 'import sys; print(sys.version)' 2>/dev/null
}
STAMP=.venv/.setup.done
if [ -x .venv/bin/python ] && [ -f "$STAMP" ] && [ -d kernels/.build ] \
   && [ "$(fingerprint | sha256sum)" = "$(cat "$STAMP")" ]; then
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import tritonclient, torch, transformers, xgrammar, fastapi, openai" 2>/dev/null \
   || ! cmp -s requirements.txt .venv/.requirements.installed; then
  # The venv takes about 2.7 GB; pip's own error for a full disk names no size.
  need_kb=$((3500 * 1024))
  free_kb=$(df -Pk .venv | awk 'NR == 2 {print $4}')
  if [ -n "$free_kb" ] && [ "$free_kb" -lt "$need_kb" ]; then
    echo "[setup] not enough disk for .venv: about 3.5 GB needed, $((free_kb / 1024)) MB free on $(df -P .venv | awk 'NR == 2 {print $6}')" >&2
    exit 1
  fi
  echo "[setup] installing pinned requirements (first run takes a few minutes)"
  .venv/bin/python -m pip install -q --no-cache-dir --upgrade pip
  .venv/bin/python -m pip install -q --no-cache-dir -r requirements.txt -c constraints.txt
  cp requirements.txt .venv/.requirements.installed
fi
# The stub must match the interpreter whose site-packages the models import from.
.venv/bin/python - <<'PY'
import os, shutil, sys, sysconfig
import pytriton
root = os.path.join(os.path.dirname(pytriton.__file__), "tritonserver")
ver = f"{sys.version_info.major}.{sys.version_info.minor}"
src = os.path.join(root, "python_backend_stubs", ver, "triton_python_backend_stub")
dst = os.path.join(root, "backends", "python", "triton_python_backend_stub")
if not os.path.exists(dst) or os.path.getsize(dst) != os.path.getsize(src):
    shutil.copy2(src, dst)
    print(f"[setup] installed the Python {ver} backend stub")
PY
# Build the CPU kernels now (once, then cached), not during model load. Each compile keeps one
# core busy for ~50 s on the 2-core CI machine, in its own build directory: side by side.
.venv/bin/python -m kernels.cpu_attention &
attention=$!
.venv/bin/python -m kernels.cpu_sampling
wait "$attention"
# perf_analyzer (tritonclient's) loads Debian's libb64.so.0d: unpacked into .venv when the host
# lacks it, so its tests run on a fresh machine too. Not fatal: only perf_analyzer needs it.
if .venv/bin/python -c 'from client.perf.run_perf_analyzer import ensure_installed; ensure_installed(install=True)'; then
  fingerprint | sha256sum > "$STAMP"  # checked in full again only when something above changes
else
  echo "[setup] perf_analyzer's libraries could not be installed: its tests will be skipped" >&2
fi
echo "[setup] environment ready"
