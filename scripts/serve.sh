#!/usr/bin/env bash
# Sets up the environment, builds the demo model if missing, and serves it on the real
# tritonserver (and the OpenAI/SGLang frontend when it is present).
#   scripts/serve.sh [--model-path DIR] [--http-port 8000] [--grpc-port 8001] [--metrics-port 8002]
#                    [--frontend-port 9000] [--frontend-workers auto] [--no-frontend] [--tool-call-parser qwen25]
#                    [--api-key KEY] [--chat-template FILE] [--trust-request-chat-template]
#                    [--logits-processor-pattern REGEX] [--reasoning-parser NAME]
#                    [--lora-modules name=path,name2=path2] [--allow-runtime-lora-updating]
#                    [--kv-cache-dtype auto|bfloat16|fp8|...] [--speculative-config JSON]
#                    [--graceful-shutdown-timeout 10] [--served-model-name NAME] [--stream-timeout S]
#                    [--enable-custom-logit-processor] [--data-parallel-size 1] [-- FRONTEND OPTIONS...]
# --served-model-name: the name /v1/models lists and requests give (default: the model directory's
# name; without it, requests may also name the model by its path, as in vLLM and SGLang).
# --enable-custom-logit-processor: SGLang's custom_logit_processor, in the engine and the frontend.
# --data-parallel-size N (--dp-size): N tritonservers, one per GPU (server i sees the i-th of
# CUDA_VISIBLE_DEVICES, or GPU i), behind the one frontend, which routes each request to one of
# them (its --router-policy, default cache_aware). Server i listens on each port given + 3 * i.
# Everything after `--` goes to the frontend as is (python -m openai_frontend --help: --max-n,
# --max-body-bytes, --retry-after, --frontend-id, ...).
# Stopping it (SIGTERM, SIGINT, Ctrl-C) stops the frontend first, which lets in-flight requests and
# streams finish for up to --graceful-shutdown-timeout seconds, then cancels the rest (aborted in
# the engine, their connections closed); then the requests made to tritonserver directly get the
# same seconds, and the rest are aborted (each ends with finish reason "abort"; Triton 2.51 stops
# passing an ensemble's responses on once told to stop, so this happens before the signal); then
# tritonserver is stopped (its exit timeout: the same seconds and 10 more) and is killed 10 s after
# that. A second Ctrl-C or signal cancels the frontend's streams at once (still aborting them in
# the engine), or cuts the direct requests' grace short.
# Every other engine setting: env LLM_<NAME> (README, "Engine settings").
set -euo pipefail
# shellcheck source=scripts/default-sigint.sh
. "$(dirname "${BASH_SOURCE[0]}")/default-sigint.sh"  # `kill -INT` works when started with `&` too
CALLER=$PWD
# A path the caller gave, relative to the caller's directory (this script works from the repo's).
abspath() { case "$1" in /*) printf '%s\n' "$1" ;; *) printf '%s\n' "$CALLER/$1" ;; esac; }
cd "$(dirname "$0")/.."
MODEL_PATH=models/demo
[ -z "${LLM_MODEL_PATH:-}" ] || MODEL_PATH=$(abspath "$LLM_MODEL_PATH")
HTTP_PORT=8000 GRPC_PORT=8001 METRICS_PORT=8002 FRONTEND_PORT=9000 FRONTEND=1 FRONTEND_WORKERS=auto
TOOL_CALL_PARSER=${TOOL_CALL_PARSER:-qwen25} API_KEY=${OPENAI_FRONTEND_API_KEY:-} REASONING_PARSER= RUNTIME_LORA=
SHUTDOWN_TIMEOUT=10 SERVED_MODEL_NAME= STREAM_TIMEOUT= CUSTOM_LOGIT_PROCESSOR= FRONTEND_EXTRA=() DP_SIZE=1
while [ $# -gt 0 ]; do
  case "$1" in
    --model-path|--http-port|--grpc-port|--metrics-port|--frontend-port|--frontend-workers|--tool-call-parser|--api-key|--chat-template|--logits-processor-pattern|\
    --reasoning-parser|--lora-modules|--kv-cache-dtype|--speculative-config|--graceful-shutdown-timeout|\
    --served-model-name|--stream-timeout|--data-parallel-size|--dp-size)
      [ $# -ge 2 ] || { echo "serve.sh: $1 needs a value (--help lists the options)" >&2; exit 2; } ;;
  esac
  case "$1" in
    --model-path) MODEL_PATH=$(abspath "$2"); shift 2 ;;
    --http-port) HTTP_PORT=$2; shift 2 ;;
    --grpc-port) GRPC_PORT=$2; shift 2 ;;
    --metrics-port) METRICS_PORT=$2; shift 2 ;;
    --frontend-port) FRONTEND_PORT=$2; shift 2 ;;
    --frontend-workers) FRONTEND_WORKERS=$2; shift 2 ;;
    --no-frontend) FRONTEND=0; shift ;;
    --tool-call-parser) TOOL_CALL_PARSER=$2; shift 2 ;;
    --api-key) API_KEY=$2; shift 2 ;;
    --chat-template) LLM_CHAT_TEMPLATE=$(abspath "$2"); export LLM_CHAT_TEMPLATE; shift 2 ;;
    --trust-request-chat-template) export LLM_TRUST_REQUEST_CHAT_TEMPLATE=1; shift ;;
    --logits-processor-pattern) export LLM_LOGITS_PROCESSOR_PATTERN=$2; shift 2 ;;
    --reasoning-parser) REASONING_PARSER=$2; shift 2 ;;
    --lora-modules)
      mods=() items=()
      IFS=, read -ra items <<< "$2"  # split at commas only: a path may hold spaces or glob characters
      for item in "${items[@]}"; do
        case "$item" in *=*) mods+=("${item%%=*}=$(abspath "${item#*=}")") ;; *) mods+=("$item") ;; esac
      done
      LLM_LORA_MODULES=$(IFS=,; printf '%s' "${mods[*]}"); export LLM_LORA_MODULES; shift 2 ;;
    --allow-runtime-lora-updating) RUNTIME_LORA=1; export LLM_ALLOW_RUNTIME_LORA_UPDATING=1; shift ;;
    --kv-cache-dtype) export LLM_KV_CACHE_DTYPE=$2; shift 2 ;;
    --speculative-config) export LLM_SPECULATIVE_CONFIG=$2; shift 2 ;;
    --graceful-shutdown-timeout) SHUTDOWN_TIMEOUT=$2; shift 2 ;;
    --served-model-name) SERVED_MODEL_NAME=$2; shift 2 ;;
    --stream-timeout) STREAM_TIMEOUT=$2; shift 2 ;;
    --enable-custom-logit-processor) CUSTOM_LOGIT_PROCESSOR=1; export LLM_ENABLE_CUSTOM_LOGIT_PROCESSOR=1; shift ;;
    --data-parallel-size|--dp-size) DP_SIZE=$2; shift 2 ;;
    --) shift; FRONTEND_EXTRA=("$@"); break ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "unknown option $1 (--help lists them)" >&2; exit 2 ;;
  esac
done
case "$SHUTDOWN_TIMEOUT" in
  ''|*[!0-9]*) echo "serve.sh: --graceful-shutdown-timeout takes whole seconds, not '$SHUTDOWN_TIMEOUT'" >&2; exit 2 ;;
esac
case "$DP_SIZE" in
  ''|*[!0-9]*|0) echo "serve.sh: --data-parallel-size takes a count (1 or more), not '$DP_SIZE'" >&2; exit 2 ;;
esac
DEVICES=()
[ -z "${CUDA_VISIBLE_DEVICES:-}" ] || IFS=, read -ra DEVICES <<< "$CUDA_VISIBLE_DEVICES"
if [ "$DP_SIZE" -gt 1 ] && [ "${#DEVICES[@]}" -gt 0 ] && [ "${#DEVICES[@]}" -lt "$DP_SIZE" ]; then
  echo "serve.sh: --data-parallel-size $DP_SIZE, but CUDA_VISIBLE_DEVICES names ${#DEVICES[@]} GPU(s)" >&2
  exit 2
fi
if [ "$MODEL_PATH" != "models/demo" ] && [ ! -d "$MODEL_PATH" ]; then
  echo "serve.sh: no model directory at $MODEL_PATH" >&2  # rather than the config's default model
  exit 2
fi
scripts/setup.sh
if [ "$MODEL_PATH" = "models/demo" ] && [ ! -f models/demo/config.json ]; then
  .venv/bin/python -m backend.demo_model --out models/demo
fi
LLM_MODEL_PATH=$(cd "$MODEL_PATH" && pwd)
export LLM_MODEL_PATH
# shellcheck source=scripts/env.sh
. scripts/env.sh
pids=() TRITON_PIDS=() FRONTEND_PID= STOPPING=
# Server i's port for a port given: the port + 3 * i (8000-8002, then 8003-8005, ...).
port_of() { echo $(($1 + 3 * $2)); }
# A child that has exited stays visible to kill -0 until it is reaped: read its state instead.
alive() {
  local state
  [ -n "$1" ] && state=$(awk '/^State:/ {print $2}' "/proc/$1/status" 2>/dev/null) && [ -n "$state" ] && [ "$state" != Z ]
}
# Wait for a child to exit; a trapped signal (stop_now) interrupts `wait`, so wait again.
reap() {
  while alive "$1"; do wait "$1" 2>/dev/null || true; done
  wait "$1" 2>/dev/null || true
}
# The frontend first, then tritonserver: a tritonserver told to stop at the same time stops passing
# the ensemble's responses on, and cannot exit while the frontend holds their gRPC streams, which
# froze in-flight streams until their clients gave up. The frontend's graceful shutdown is bounded
# (--graceful-shutdown-timeout): streams still running then are cancelled and aborted in the engine.
cleanup() {
  [ -z "$STOPPING" ] || return 0
  STOPPING=1
  trap stop_now INT TERM
  if alive "$FRONTEND_PID"; then
    kill -TERM "$FRONTEND_PID" 2>/dev/null || true
    reap "$FRONTEND_PID"
  fi
  local i pid stubs="" stub live=()
  for i in "${!TRITON_PIDS[@]}"; do alive "${TRITON_PIDS[i]}" && live+=("$i"); done
  if [ "${#live[@]}" -gt 0 ]; then
    # Still serving everything: the requests made to tritonserver directly get the same grace to
    # finish, then the rest are aborted (client/drain.py). Signalled with an ensemble stream in
    # flight, tritonserver 2.51 stalled it, waited out its exit timeout and crashed on its way out.
    # In the background (every server's at once), so that a second signal reaches stop_now (bash
    # runs no trap while a foreground child runs), which then cuts the grace short.
    for i in "${live[@]}"; do
      if curl -sf "localhost:$(port_of "$HTTP_PORT" "$i")/v2/health/ready" >/dev/null 2>&1; then
        timeout -k 5 "$((SHUTDOWN_TIMEOUT + 20))" .venv/bin/python -m client.drain \
          --url "localhost:$(port_of "$GRPC_PORT" "$i")" --grace "$SHUTDOWN_TIMEOUT" &
        DRAIN_PIDS+=($!)
      fi
    done
    for pid in "${DRAIN_PIDS[@]}"; do reap "$pid"; done
    DRAIN_PIDS=()
    for i in "${live[@]}"; do
      stubs+=" $(pgrep -P "${TRITON_PIDS[i]}" -f triton_python_backend_stub || true)"
      kill -TERM "${TRITON_PIDS[i]}" 2>/dev/null || true
    done
    # Its exit timeout does not bound it: a tritonserver 2.51 whose timeout expired with a direct
    # client's stream open logged "Exiting immediately" and then waited for that client to hang up
    # (QA: 600 s, a tritonclient's default timeout; perf_analyzer never does). 10 s past it, SIGKILL.
    local deadline=$((SECONDS + SHUTDOWN_TIMEOUT + 20))
    for i in "${live[@]}"; do
      pid=${TRITON_PIDS[i]}
      while alive "$pid" && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.5; done
      if alive "$pid"; then
        echo "serve.sh: tritonserver still running 10 s past its exit timeout: SIGKILL" >&2
        kill -KILL "$pid" 2>/dev/null || true
      fi
      reap "$pid"
    done
    # A tritonserver 2.51 that reaches its exit timeout with requests in flight crashes, and can
    # leave a stub behind (with the model's memory): give them 3 s, then SIGKILL.
    for _ in $(seq 15); do
      for stub in $stubs; do alive "$stub" && break; stub=; done
      [ -n "${stub:-}" ] || break
      sleep 0.2
    done
    for stub in $stubs; do
      if alive "$stub" && grep -q triton_python_backend_stub "/proc/$stub/cmdline" 2>/dev/null; then
        echo "serve.sh: a Python backend stub (pid $stub) outlived tritonserver: SIGKILL" >&2
        kill -KILL "$stub" 2>/dev/null || true
      fi
    done
  fi
  wait || true
}
# A second Ctrl-C or signal while the frontend stops: a second SIGINT makes uvicorn cancel its
# streams at once (its --workers' too; it still sends their aborts), and tritonserver is stopped
# next as usual (not alongside: it would refuse those aborts and wait for the requests). A third:
# SIGKILL. While tritonserver stops, its exit timeout (the same seconds, and 10 more to unload),
# and then our SIGKILL 10 s later, bound it.
FORCED=0 DRAIN_PIDS=()
stop_now() {
  local pid draining=
  for pid in "${DRAIN_PIDS[@]}"; do
    # timeout passes the signal on to the drain, which then aborts the direct requests at once.
    if alive "$pid"; then draining=1; kill -TERM "$pid" 2>/dev/null || true; fi
  done
  [ -z "$draining" ] || return 0
  alive "$FRONTEND_PID" || return 0
  FORCED=$((FORCED + 1))
  local sig=INT
  [ "$FORCED" -eq 1 ] || sig=KILL
  pkill "-$sig" -P "$FRONTEND_PID" 2>/dev/null || true
  kill "-$sig" "$FRONTEND_PID" 2>/dev/null || true
}
trap 'rc=$?; cleanup; exit $rc' EXIT
trap 'cleanup; exit 130' INT
trap 'cleanup; exit 143' TERM
# tritonserver with SIGINT blocked: Ctrl-C signals the whole process group, and tritonserver must
# wait for the frontend (cleanup stops it with SIGTERM). Its exit timeout bounds its wait for
# requests made to it directly, or left in flight by a forced stop, and then for its models to
# unload: 10 s more for that (the llm model's engine shutdown took over 3 s on a busy CI host, and
# an exit timeout that runs out while a stub unloads ends tritonserver with an error).
# tritonserver i, as the messages name it.
server_name() { if [ "$DP_SIZE" -gt 1 ]; then echo "tritonserver $1"; else echo tritonserver; fi; }
scripts/sweep-shm.sh  # regions left by a tritonserver killed before would fill /dev/shm
for ((i = 0; i < DP_SIZE; i++)); do
  device=()
  [ "$DP_SIZE" -eq 1 ] || device=(env "CUDA_VISIBLE_DEVICES=${DEVICES[i]:-$i}")  # its GPU, as its cuda:0
  "${device[@]}" .venv/bin/python -c 'import os, signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
os.execvp(sys.argv[1], sys.argv[1:])' tritonserver --model-repository="$PWD/model_repository" \
    --backend-directory="$TRITON_HOME/backends" --http-port="$(port_of "$HTTP_PORT" "$i")" \
    --grpc-port="$(port_of "$GRPC_PORT" "$i")" --metrics-port="$(port_of "$METRICS_PORT" "$i")" \
    --exit-timeout-secs="$((SHUTDOWN_TIMEOUT + 10))" &
  TRITON_PIDS+=($!)
  pids+=($!)
done
if [ "$FRONTEND" = 1 ] && [ -f openai_frontend/__main__.py ]; then
  TRITON_URLS=
  for i in "${!TRITON_PIDS[@]}"; do
    until curl -sf "localhost:$(port_of "$HTTP_PORT" "$i")/v2/health/ready" >/dev/null; do
      # A server that failed to load its models has exited: say so rather than wait for it forever.
      if ! kill -0 "${TRITON_PIDS[i]}" 2>/dev/null; then
        rc=0
        wait "${TRITON_PIDS[i]}" || rc=$?
        echo "serve.sh: $(server_name "$i") exited (status $rc) before it was ready; its log is above" >&2
        [ "$rc" -ne 0 ] || rc=1
        exit "$rc"
      fi
      sleep 1
    done
    TRITON_URLS+="${TRITON_URLS:+,}localhost:$(port_of "$GRPC_PORT" "$i")"
  done
  # In a session of its own, as tritonserver ignores SIGINT: Ctrl-C reaches only this script, whose
  # trap stops the frontend (SIGTERM: drain, then cancel) and then tritonserver. A frontend that
  # took the group's SIGINT itself and exited 0 made bash treat the Ctrl-C as handled (its "wait
  # and cooperative exit"): the trap did not run and serve.sh exited 0.
  OPENAI_FRONTEND_API_KEY="$API_KEY" setsid .venv/bin/python -m openai_frontend --triton-url "$TRITON_URLS" \
    --port "$FRONTEND_PORT" --workers "$FRONTEND_WORKERS" --tokenizer-path "$LLM_MODEL_PATH" --tool-call-parser "$TOOL_CALL_PARSER" \
    ${REASONING_PARSER:+--reasoning-parser "$REASONING_PARSER"} ${LLM_LORA_MODULES:+--lora-modules "$LLM_LORA_MODULES"} \
    ${RUNTIME_LORA:+--allow-runtime-lora-updating} --graceful-shutdown-timeout "$SHUTDOWN_TIMEOUT" \
    ${SERVED_MODEL_NAME:+--served-model-name "$SERVED_MODEL_NAME"} ${STREAM_TIMEOUT:+--stream-timeout "$STREAM_TIMEOUT"} \
    ${CUSTOM_LOGIT_PROCESSOR:+--enable-custom-logit-processor} "${FRONTEND_EXTRA[@]}" &
  FRONTEND_PID=$!
  pids+=($!)
fi
rc=0
wait -n "${pids[@]}" || rc=$?
# A stop we were asked for runs the traps above; here tritonserver or the frontend ended on its
# own, which is a failure whatever its status: the stub watcher stops tritonserver with SIGTERM
# when a stub or the engine process dies, and tritonserver then exits 0 (QA: serve.sh exited 0,
# and a supervisor that restarts on failure left the service down).
what="the frontend"
for i in "${!TRITON_PIDS[@]}"; do alive "${TRITON_PIDS[i]}" || what=$(server_name "$i"); done
echo "serve.sh: $what exited (status $rc) without being asked to; stopping" >&2
[ "$rc" -ne 0 ] || rc=1
exit "$rc"
