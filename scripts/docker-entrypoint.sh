#!/usr/bin/env bash
# Container entrypoint: tritonserver on model_repository/ + the OpenAI/SGLang frontend, supervised.
#
#   docker-entrypoint.sh [serve]       start both and supervise them (default)
#   docker-entrypoint.sh healthcheck   exit 0 when the frontend (or, without it, tritonserver) is ready
#   docker-entrypoint.sh <command...>  run anything else (e.g. bash, python scripts/soak.py ...)
#
# Supervision (every WATCHDOG_INTERVAL seconds):
# - tritonserver exited            -> start it again (the frontend answers 503 meanwhile and
#                                     reconnects by itself);
# - the llm model's Python stub died -> restart tritonserver: Triton 2.51 neither restarts the stub of
#                                     a decoupled model nor fails its in-flight requests (they would
#                                     hang; triton-inference-server/server#7862), and new requests
#                                     would get "Stub process is not healthy" while /v2/health/ready
#                                     still says OK. Killing the server ends the hung streams: the
#                                     frontend reports an error on each of them;
# - the frontend exited            -> start it again.
# A restarted tritonserver that does not come up is started again too; only a failing first start
# exits at once (1). More than MAX_RESTARTS restarts within RESTART_WINDOW seconds -> exit 1 (let
# the orchestrator act).
# SIGTERM/SIGINT: stop the frontend (uvicorn drains in-flight streams), then give the requests made
# to tritonserver directly EXIT_TIMEOUT less 10 seconds and abort the rest (client/drain.py), then
# stop tritonserver; exit 0, or 1 when tritonserver did not exit cleanly.
#
# Environment (defaults for the container; the same script runs on a host with other paths):
#   LLM_MODEL_PATH      HF model directory (default /opt/app/models/demo; the demo is built if missing)
#   SERVED_MODEL_NAME   model name clients use (default: the model directory's name)
#   HTTP_PORT GRPC_PORT METRICS_PORT FRONTEND_PORT   8000 8001 8002 9000
#   FRONTEND            1 (0: tritonserver only)
#   TOOL_CALL_PARSER    the frontend's --tool-call-parser (default qwen25, as scripts/serve.sh; empty: none)
#   TRITONSERVER        tritonserver binary (default: tritonserver on PATH)
#   TRITON_BACKEND_DIR  backend directory (default /opt/tritonserver/backends)
#   PYTHON              interpreter with the project's dependencies (default python3 on PATH)
#   TRITON_ARGS FRONTEND_ARGS   extra arguments (word-split); the frontend runs `--workers auto`
#                       (one process per four CPUs, one to four) unless FRONTEND_ARGS says otherwise
#   WATCHDOG_INTERVAL (5) STUB_GRACE (5) EXIT_TIMEOUT (30) READY_TIMEOUT (600) MAX_RESTARTS (5) RESTART_WINDOW (600)
#   OPENAI_FRONTEND_API_KEY     read by the frontend: require this bearer token
#   LLM_* engine settings       read by the llm model (see README: LLM_NUM_KV_BLOCKS, LLM_MAX_MODEL_LEN, ...)
set -euo pipefail
# shellcheck source=scripts/default-sigint.sh
. "$(dirname "${BASH_SOURCE[0]}")/default-sigint.sh"  # `kill -INT` works when started with `&` too

APP_DIR=${APP_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
PYTHON=${PYTHON:-python3}
TRITONSERVER=${TRITONSERVER:-tritonserver}
TRITON_BACKEND_DIR=${TRITON_BACKEND_DIR:-/opt/tritonserver/backends}
export LLM_MODEL_PATH=${LLM_MODEL_PATH:-$APP_DIR/models/demo}
HTTP_PORT=${HTTP_PORT:-8000}
GRPC_PORT=${GRPC_PORT:-8001}
METRICS_PORT=${METRICS_PORT:-8002}
FRONTEND_PORT=${FRONTEND_PORT:-9000}
FRONTEND=${FRONTEND:-1}
TOOL_CALL_PARSER=${TOOL_CALL_PARSER-qwen25}
SERVED_MODEL_NAME=${SERVED_MODEL_NAME:-$(basename "$LLM_MODEL_PATH")}
TRITON_ARGS=${TRITON_ARGS:-}
FRONTEND_ARGS=${FRONTEND_ARGS:-}
WATCHDOG_INTERVAL=${WATCHDOG_INTERVAL:-5}
STUB_GRACE=${STUB_GRACE:-5}
EXIT_TIMEOUT=${EXIT_TIMEOUT:-30}
READY_TIMEOUT=${READY_TIMEOUT:-600}
MAX_RESTARTS=${MAX_RESTARTS:-5}
RESTART_WINDOW=${RESTART_WINDOW:-600}

log() { echo "[entrypoint $(date -u +%H:%M:%S)] $*" >&2; }

# A child that has exited stays visible to kill -0 until reaped: read its state instead.
alive() {
  local state
  [ -n "$1" ] && state=$(awk '/^State:/ {print $2}' "/proc/$1/status" 2>/dev/null) && [ -n "$state" ] && [ "$state" != Z ]
}

# 0 when GET url answers 200 within 3 s (Python, so the image needs no curl).
http_ok() {
  "$PYTHON" -c 'import sys, urllib.request
try:
    sys.exit(0 if urllib.request.urlopen(sys.argv[1], timeout=3).status == 200 else 1)
except Exception:
    sys.exit(1)' "$1"
}

healthcheck() {
  if [ "$FRONTEND" = 1 ]; then
    http_ok "http://127.0.0.1:$FRONTEND_PORT/health"
  else
    http_ok "http://127.0.0.1:$HTTP_PORT/v2/health/ready"
  fi
}

case "${1:-serve}" in
  serve) ;;
  healthcheck) healthcheck; exit $? ;;
  *) exec "$@" ;;
esac

cd "$APP_DIR"
if [ ! -f "$LLM_MODEL_PATH/config.json" ]; then
  if [ "$LLM_MODEL_PATH" = "$APP_DIR/models/demo" ]; then
    log "building the demo model into $LLM_MODEL_PATH"
    "$PYTHON" -m backend.demo_model --out "$LLM_MODEL_PATH"
  else
    log "no model at LLM_MODEL_PATH=$LLM_MODEL_PATH (mount a Hugging Face model directory there)"
    exit 2
  fi
fi

TRITON_PID=""
FRONTEND_PID=""
STOPPING=0
RESTARTS=()

start_triton() {
  "$APP_DIR/scripts/sweep-shm.sh"  # regions left by a killed tritonserver would fill /dev/shm
  # shellcheck disable=SC2086 # TRITON_ARGS is a word list on purpose
  "$TRITONSERVER" --model-repository="$APP_DIR/model_repository" --backend-directory="$TRITON_BACKEND_DIR" \
    --http-port="$HTTP_PORT" --grpc-port="$GRPC_PORT" --metrics-port="$METRICS_PORT" \
    --allow-metrics=true --exit-timeout-secs="$EXIT_TIMEOUT" $TRITON_ARGS &
  TRITON_PID=$!
  log "tritonserver started (pid $TRITON_PID)"
  local deadline=$((SECONDS + READY_TIMEOUT))
  until http_ok "http://127.0.0.1:$HTTP_PORT/v2/health/ready"; do
    if ! alive "$TRITON_PID"; then
      log "tritonserver exited while loading"
      return 1
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      log "tritonserver not ready after ${READY_TIMEOUT}s"
      return 1
    fi
    sleep 1
  done
  log "tritonserver ready"
}

start_frontend() {
  [ "$FRONTEND" = 1 ] || return 0
  # shellcheck disable=SC2086 # FRONTEND_ARGS is a word list on purpose
  "$PYTHON" -m openai_frontend --host 0.0.0.0 --port "$FRONTEND_PORT" --triton-url "127.0.0.1:$GRPC_PORT" \
    --tokenizer-path "$LLM_MODEL_PATH" --model-name "$SERVED_MODEL_NAME" \
    ${TOOL_CALL_PARSER:+--tool-call-parser "$TOOL_CALL_PARSER"} $FRONTEND_ARGS &
  FRONTEND_PID=$!
  log "frontend started (pid $FRONTEND_PID) on port $FRONTEND_PORT as model '$SERVED_MODEL_NAME'"
}

# Stop a process: SIGTERM, then SIGKILL after $2 seconds. Sets STOP_RC to its exit status and
# STOP_ESCALATED to 1 when it took our SIGKILL.
stop_pid() {
  local pid=$1 grace=$2
  STOP_RC=0
  STOP_ESCALATED=0
  if ! alive "$pid"; then
    [ -z "$pid" ] || { wait "$pid" 2>/dev/null || STOP_RC=$?; }
    return 0
  fi
  kill -TERM "$pid" 2>/dev/null || true
  local deadline=$((SECONDS + grace))
  while alive "$pid" && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.5; done
  if alive "$pid"; then
    log "pid $pid still running after ${grace}s: SIGKILL"
    STOP_ESCALATED=1
    kill -KILL "$pid" 2>/dev/null || true
  fi
  wait "$pid" 2>/dev/null || STOP_RC=$?
}

# Is the llm model's Python-backend stub (a child of tritonserver) alive?
llm_stub_alive() {
  local status
  for status in /proc/[0-9]*/status; do
    grep -q "^PPid:[[:space:]]*$TRITON_PID\$" "$status" 2>/dev/null || continue
    if tr '\0' ' ' <"${status%/status}/cmdline" 2>/dev/null | grep -q "triton_python_backend_stub .*/llm/1/model.py"; then
      return 0
    fi
  done
  return 1
}

note_restart() {
  local now=$SECONDS kept=() t
  for t in "${RESTARTS[@]}"; do
    [ $((now - t)) -lt "$RESTART_WINDOW" ] && kept+=("$t")
  done
  kept+=("$now")
  RESTARTS=("${kept[@]}")
  if [ "${#RESTARTS[@]}" -gt "$MAX_RESTARTS" ]; then
    log "more than $MAX_RESTARTS restarts in ${RESTART_WINDOW}s: giving up"
    shutdown 1
  fi
}

# After the first start: a server that does not come up (stopped from outside while it loaded,
# before this loop's readiness poll had seen it, or failing to load) is started again, within
# the restart budget (note_restart gives up past it). Only a failing first start is fatal.
start_triton_again() {
  until start_triton; do
    stop_pid "$TRITON_PID" 5 # one still loading after READY_TIMEOUT
    note_restart
  done
}

restart_triton() {
  log "stopping tritonserver: $1"
  # In-flight requests of a dead stub never finish, so no grace beyond a few seconds.
  stop_pid "$TRITON_PID" 5
  if [ "$STOP_RC" = 137 ] && [ "$STOP_ESCALATED" = 0 ]; then
    # A SIGKILL we did not send: tritonserver itself was killed, and its stubs went with it
    # before it showed as exited (a loaded server can take longer than STUB_GRACE to die).
    log "tritonserver exited (status 137, killed from outside)"
  else
    log "restarting tritonserver: $1"
  fi
  note_restart
  start_triton_again
}

shutdown() {
  local code=${1:-0}
  STOPPING=1
  trap - TERM INT
  log "shutting down"
  stop_pid "$FRONTEND_PID" 30
  # Before the signal, while tritonserver still serves everything: the requests made to it
  # directly get EXIT_TIMEOUT less 10 s to finish, the rest are aborted (client/drain.py). Signalled
  # with an ensemble stream in flight, tritonserver 2.51 stalled it, waited out its exit timeout
  # and crashed on its way out.
  # (10 s: the llm model's own margin, backend/server_stop.py UNLOAD_MARGIN_S)
  local grace=$((EXIT_TIMEOUT > 10 ? EXIT_TIMEOUT - 10 : 0))
  if alive "$TRITON_PID" && http_ok "http://127.0.0.1:$HTTP_PORT/v2/health/ready"; then
    timeout -k 5 $((grace + 20)) "$PYTHON" -m client.drain --url "127.0.0.1:$GRPC_PORT" \
      --grace "$grace" || true
  fi
  stop_pid "$TRITON_PID" $((EXIT_TIMEOUT + 10))
  if [ "$STOP_RC" != 0 ]; then
    # A crash on the way out (a signal's status) or our SIGKILL: say so, and do not exit 0 over it.
    log "tritonserver exited with status $STOP_RC while stopping"
    [ "$code" != 0 ] || code=1
  fi
  exit "$code"
}

trap 'shutdown 0' TERM INT

start_triton || shutdown 1
start_frontend
while [ "$STOPPING" = 0 ]; do
  sleep "$WATCHDOG_INTERVAL" &
  wait $! || true # a trapped signal interrupts this wait at once
  if alive "$TRITON_PID" && ! llm_stub_alive; then
    # A tritonserver that is being killed hands its children to init before it shows as
    # exited, and tearing down a loaded server on busy cores can take seconds: give it up to
    # STUB_GRACE before blaming the stub (its in-flight requests hang either way).
    for _ in $(seq $((STUB_GRACE * 5))); do
      alive "$TRITON_PID" || break
      sleep 0.2
    done
  fi
  if ! alive "$TRITON_PID"; then
    wait "$TRITON_PID" 2>/dev/null && rc=0 || rc=$?
    log "tritonserver exited (status $rc)"
    note_restart
    start_triton_again
  elif ! llm_stub_alive; then
    restart_triton "the llm model's Python stub process is gone"
  fi
  if [ "$FRONTEND" = 1 ] && ! alive "$FRONTEND_PID"; then
    wait "$FRONTEND_PID" 2>/dev/null && rc=0 || rc=$?
    log "frontend exited (status $rc)"
    note_restart
    start_frontend
  fi
done
