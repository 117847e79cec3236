#!/usr/bin/env bash
# Container entrypoint: tritonserver on model_repository/ + the OpenAI/SGLang frontend, supervised.
# DATA_PARALLEL_SIZE=N runs N tritonservers, one per GPU, behind the one frontend (README "Several
# GPUs"); each is supervised on its own, and the frontend routes around one that is down.
#
#   docker-entrypoint.sh [serve]       start both and supervise them (default)
#   docker-entrypoint.sh healthcheck   exit 0 when the frontend (or, without it, tritonserver) is ready
#   docker-entrypoint.sh <command...>  run anything else (e.g. bash, python scripts/soak.py ...)
#
# Supervision (every WATCHDOG_INTERVAL seconds, every second while a tritonserver loads), per
# tritonserver:
# - tritonserver exited            -> start it again (the frontend answers 503 meanwhile, or with
#                                     DATA_PARALLEL_SIZE > 1 sends its requests to the other
#                                     servers, and reconnects by itself);
# - the llm model's Python stub died -> restart tritonserver: Triton 2.51 neither restarts the stub of
#                                     a decoupled model nor fails its in-flight requests (they would
#                                     hang; triton-inference-server/server#7862), and new requests
#                                     would get "Stub process is not healthy" while /v2/health/ready
#                                     still says OK. Killing the server ends the hung streams: the
#                                     frontend reports an error on each of them;
# - the frontend exited            -> start it again.
# A restarted tritonserver that does not come up is started again too; only a failing first start
# exits at once (1). A restart does not hold up the others' supervision. More than MAX_RESTARTS
# restarts of one process (each server, the frontend) within RESTART_WINDOW seconds -> exit 1 (let
# the orchestrator act).
# SIGTERM/SIGINT: stop the frontend (uvicorn drains in-flight streams), then give the requests made
# to each tritonserver directly EXIT_TIMEOUT less 10 seconds and abort the rest (client/drain.py),
# then stop the tritonservers; exit 0, or 1 when one did not exit cleanly.
#
# Environment (defaults for the container; the same script runs on a host with other paths):
#   LLM_MODEL_PATH      HF model directory (default /opt/app/models/demo; the demo is built if missing)
#   SERVED_MODEL_NAME   model name clients use (default: the model directory's name)
#   HTTP_PORT GRPC_PORT METRICS_PORT FRONTEND_PORT   8000 8001 8002 9000 (tritonserver i: each + 3*i)
#   DATA_PARALLEL_SIZE  tritonservers, one per GPU (default 1): server i sees the i-th GPU of
#                       CUDA_VISIBLE_DEVICES (or GPU i) as its cuda:0
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
DATA_PARALLEL_SIZE=${DATA_PARALLEL_SIZE:-1}
case "$DATA_PARALLEL_SIZE" in
  ''|*[!0-9]*|0) echo "DATA_PARALLEL_SIZE takes a count (1 or more), not '$DATA_PARALLEL_SIZE'" >&2; exit 2 ;;
esac
DEVICES=()
[ -z "${CUDA_VISIBLE_DEVICES:-}" ] || IFS=, read -ra DEVICES <<< "$CUDA_VISIBLE_DEVICES"
if [ "$DATA_PARALLEL_SIZE" -gt 1 ] && [ "${#DEVICES[@]}" -gt 0 ] && [ "${#DEVICES[@]}" -lt "$DATA_PARALLEL_SIZE" ]; then
  echo "DATA_PARALLEL_SIZE=$DATA_PARALLEL_SIZE, but CUDA_VISIBLE_DEVICES names ${#DEVICES[@]} GPU(s)" >&2
  exit 2
fi

log() { echo "[entrypoint $(date -u +%H:%M:%S)] $*" >&2; }

port_of() { echo $(($1 + 3 * $2)); }  # tritonserver i's port: the base + 3*i, as scripts/serve.sh
servers() { seq 0 $((DATA_PARALLEL_SIZE - 1)); }
server_name() { if [ "$DATA_PARALLEL_SIZE" -gt 1 ]; then echo "tritonserver $1"; else echo tritonserver; fi; }
server_ready() { http_ok "http://127.0.0.1:$(port_of "$HTTP_PORT" "$1")/v2/health/ready"; }

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

# Healthy while anything serves: with several tritonservers, one that restarts leaves the rest serving
# (the frontend's /health is 200 while any server is ready), and an orchestrator that restarted the
# container over it would stop them all.
healthcheck() {
  if [ "$FRONTEND" = 1 ]; then
    http_ok "http://127.0.0.1:$FRONTEND_PORT/health"
  else
    local i
    for i in $(servers); do server_ready "$i" && return 0; done
    return 1
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

TRITON_PIDS=()    # per tritonserver
LOADING_SINCE=()  # per tritonserver: $SECONDS at its start while it loads, empty once it is ready
FRONTEND_PID=""
STOPPING=0
declare -A RESTARTS=()  # per tritonserver index, and "frontend": the times of its recent restarts

# Start tritonserver i, without waiting for it (poll_loading does).
launch_triton() {
  local i=$1 device=()
  [ "$DATA_PARALLEL_SIZE" -eq 1 ] || device=(env "CUDA_VISIBLE_DEVICES=${DEVICES[i]:-$i}")  # its GPU, as its cuda:0
  "$APP_DIR/scripts/sweep-shm.sh"  # regions left by a killed tritonserver would fill /dev/shm
  # shellcheck disable=SC2086 # TRITON_ARGS is a word list on purpose
  "${device[@]}" "$TRITONSERVER" --model-repository="$APP_DIR/model_repository" --backend-directory="$TRITON_BACKEND_DIR" \
    --http-port="$(port_of "$HTTP_PORT" "$i")" --grpc-port="$(port_of "$GRPC_PORT" "$i")" \
    --metrics-port="$(port_of "$METRICS_PORT" "$i")" \
    --allow-metrics=true --exit-timeout-secs="$EXIT_TIMEOUT" $TRITON_ARGS &
  TRITON_PIDS[i]=$!
  LOADING_SINCE[i]=$SECONDS
  log "$(server_name "$i") started (pid ${TRITON_PIDS[i]})"
}

# A loading tritonserver i: 0 once ready, 1 while it loads, 2 when it failed (exited, or still not
# ready after READY_TIMEOUT: then stopped).
poll_loading() {
  local i=$1
  if server_ready "$i"; then
    LOADING_SINCE[i]=""
    log "$(server_name "$i") ready"
    return 0
  fi
  if ! alive "${TRITON_PIDS[i]}"; then
    wait "${TRITON_PIDS[i]}" 2>/dev/null || true
    log "$(server_name "$i") exited while loading"
    return 2
  fi
  if [ $((SECONDS - LOADING_SINCE[i])) -ge "$READY_TIMEOUT" ]; then
    log "$(server_name "$i") not ready after ${READY_TIMEOUT}s"
    stop_pid "${TRITON_PIDS[i]}" 5
    return 2
  fi
  return 1
}

# The first start: every tritonserver loads at once; any that fails is fatal (a configuration
# error, most likely, that a restart would repeat).
start_all_triton() {
  local i rc loading=1
  for i in $(servers); do launch_triton "$i"; done
  while [ "$loading" = 1 ]; do
    loading=0
    for i in $(servers); do
      [ -n "${LOADING_SINCE[i]}" ] || continue
      rc=0
      poll_loading "$i" || rc=$?
      [ "$rc" != 2 ] || return 1
      [ "$rc" != 1 ] || loading=1
    done
    [ "$loading" = 0 ] || sleep 1
  done
}

start_frontend() {
  [ "$FRONTEND" = 1 ] || return 0
  local i urls=""
  for i in $(servers); do urls+="${urls:+,}127.0.0.1:$(port_of "$GRPC_PORT" "$i")"; done
  # shellcheck disable=SC2086 # FRONTEND_ARGS is a word list on purpose
  "$PYTHON" -m openai_frontend --host 0.0.0.0 --port "$FRONTEND_PORT" --triton-url "$urls" \
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

# Is the llm model's Python-backend stub (a child of tritonserver pid $1) alive?
llm_stub_alive() {
  local status
  for status in /proc/[0-9]*/status; do
    grep -q "^PPid:[[:space:]]*$1\$" "$status" 2>/dev/null || continue
    if tr '\0' ' ' <"${status%/status}/cmdline" 2>/dev/null | grep -q "triton_python_backend_stub .*/llm/1/model.py"; then
      return 0
    fi
  done
  return 1
}

# One restart of $1 (a tritonserver's index, or "frontend"). Each has a budget of its own: with
# several servers, one restart each (a driver hiccup on every GPU) is no reason to give up.
note_restart() {
  local now=$SECONDS kept=() t
  for t in ${RESTARTS[$1]:-}; do
    [ $((now - t)) -lt "$RESTART_WINDOW" ] && kept+=("$t")
  done
  kept+=("$now")
  RESTARTS[$1]="${kept[*]}"
  if [ "${#kept[@]}" -gt "$MAX_RESTARTS" ]; then
    local what=$1
    [ "$what" = frontend ] || what=$(server_name "$what")
    log "$what: more than $MAX_RESTARTS restarts in ${RESTART_WINDOW}s: giving up"
    shutdown 1
  fi
}

restart_triton() {
  local i=$1
  log "stopping $(server_name "$i"): $2"
  # In-flight requests of a dead stub never finish, so no grace beyond a few seconds.
  stop_pid "${TRITON_PIDS[i]}" 5
  if [ "$STOP_RC" = 137 ] && [ "$STOP_ESCALATED" = 0 ]; then
    # A SIGKILL we did not send: tritonserver itself was killed, and its stubs went with it
    # before it showed as exited (a loaded server can take longer than STUB_GRACE to die).
    log "$(server_name "$i") exited (status 137, killed from outside)"
  else
    log "restarting $(server_name "$i"): $2"
  fi
  note_restart "$i"
  launch_triton "$i"
}

# One watchdog look at tritonserver i. After the first start, a server that does not come up
# (stopped from outside while it loaded, or failing to load) is started again, within the restart
# budget (note_restart gives up past it): only a failing first start is fatal.
watch_triton() {
  local i=$1 rc
  if [ -n "${LOADING_SINCE[i]}" ]; then
    rc=0
    poll_loading "$i" || rc=$?
    if [ "$rc" = 2 ]; then
      note_restart "$i"
      launch_triton "$i"
    fi
    return 0
  fi
  if alive "${TRITON_PIDS[i]}" && ! llm_stub_alive "${TRITON_PIDS[i]}"; then
    # A tritonserver that is being killed hands its children to init before it shows as
    # exited, and tearing down a loaded server on busy cores can take seconds: give it up to
    # STUB_GRACE before blaming the stub (its in-flight requests hang either way).
    for _ in $(seq $((STUB_GRACE * 5))); do
      alive "${TRITON_PIDS[i]}" || break
      sleep 0.2
    done
  fi
  if ! alive "${TRITON_PIDS[i]}"; then
    wait "${TRITON_PIDS[i]}" 2>/dev/null && rc=0 || rc=$?
    log "$(server_name "$i") exited (status $rc)"
    note_restart "$i"
    launch_triton "$i"
  elif ! llm_stub_alive "${TRITON_PIDS[i]}"; then
    restart_triton "$i" "the llm model's Python stub process is gone"
  fi
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
  # and crashed on its way out. Every server drains at once.
  # (10 s: the llm model's own margin, backend/server_stop.py UNLOAD_MARGIN_S)
  local grace=$((EXIT_TIMEOUT > 10 ? EXIT_TIMEOUT - 10 : 0)) i drains=()
  for i in $(servers); do
    if alive "${TRITON_PIDS[i]:-}" && server_ready "$i"; then
      timeout -k 5 $((grace + 20)) "$PYTHON" -m client.drain --url "127.0.0.1:$(port_of "$GRPC_PORT" "$i")" \
        --grace "$grace" &
      drains+=($!)
    fi
  done
  [ "${#drains[@]}" = 0 ] || wait "${drains[@]}" || true
  # All signalled first, so that their exit timeouts run side by side.
  for i in $(servers); do ! alive "${TRITON_PIDS[i]:-}" || kill -TERM "${TRITON_PIDS[i]}" 2>/dev/null || true; done
  for i in $(servers); do
    stop_pid "${TRITON_PIDS[i]:-}" $((EXIT_TIMEOUT + 10))
    if [ "$STOP_RC" != 0 ]; then
      # A crash on the way out (a signal's status) or our SIGKILL: say so, and do not exit 0 over it.
      log "$(server_name "$i") exited with status $STOP_RC while stopping"
      [ "$code" != 0 ] || code=1
    fi
  done
  exit "$code"
}

trap 'shutdown 0' TERM INT

start_all_triton || shutdown 1
start_frontend
while [ "$STOPPING" = 0 ]; do
  interval=$WATCHDOG_INTERVAL
  for i in $(servers); do [ -z "${LOADING_SINCE[i]}" ] || interval=1; done  # a loading one: polled each second
  sleep "$interval" &
  wait $! || true # a trapped signal interrupts this wait at once
  for i in $(servers); do watch_triton "$i"; done
  if [ "$FRONTEND" = 1 ] && ! alive "$FRONTEND_PID"; then
    wait "$FRONTEND_PID" 2>/dev/null && rc=0 || rc=$?
    log "frontend exited (status $rc)"
    note_restart frontend
    start_frontend
  fi
done
