#!/usr/bin/env bash
# Sets up the environment, builds the demo model if missing, and serves it on the real
# tritonserver (and the OpenAI/SGLang frontend when it is present).
#   scripts/serve.sh [--model-path DIR] [--http-port 8000] [--grpc-port 8001] [--metrics-port 8002]
#                    [--frontend-port 9000] [--frontend-workers auto] [--no-frontend] [--tool-call-parser qwen25]
#                    [--api-key KEY] [--chat-template FILE] [--trust-request-chat-template]
#                    [--logits-processor-pattern REGEX] [--reasoning-parser NAME]
#                    [--lora-modules name=path,name2=path2] [--allow-runtime-lora-updating]
#                    [--kv-cache-dtype auto|bfloat16|fp8|...] [--speculative-config JSON]
# Every other engine setting: env LLM_<NAME> (README, "Engine settings").
set -euo pipefail
CALLER=$PWD
# A path the caller gave, relative to the caller's directory (this script works from the repo's).
abspath() { case "$1" in /*) printf '%s\n' "$1" ;; *) printf '%s\n' "$CALLER/$1" ;; esac; }
cd "$(dirname "$0")/.."
MODEL_PATH=models/demo
[ -z "${LLM_MODEL_PATH:-}" ] || MODEL_PATH=$(abspath "$LLM_MODEL_PATH")
HTTP_PORT=8000 GRPC_PORT=8001 METRICS_PORT=8002 FRONTEND_PORT=9000 FRONTEND=1 FRONTEND_WORKERS=auto
TOOL_CALL_PARSER=${TOOL_CALL_PARSER:-qwen25} API_KEY=${OPENAI_FRONTEND_API_KEY:-} REASONING_PARSER= RUNTIME_LORA=
while [ $# -gt 0 ]; do
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
      mods=()
      for item in ${2//,/ }; do
        case "$item" in *=*) mods+=("${item%%=*}=$(abspath "${item#*=}")") ;; *) mods+=("$item") ;; esac
      done
      LLM_LORA_MODULES=$(IFS=,; printf '%s' "${mods[*]}"); export LLM_LORA_MODULES; shift 2 ;;
    --allow-runtime-lora-updating) RUNTIME_LORA=1; shift ;;
    --kv-cache-dtype) export LLM_KV_CACHE_DTYPE=$2; shift 2 ;;
    --speculative-config) export LLM_SPECULATIVE_CONFIG=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
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
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait; }
trap cleanup EXIT INT TERM
tritonserver --model-repository="$PWD/model_repository" --backend-directory="$TRITON_HOME/backends" \
  --http-port="$HTTP_PORT" --grpc-port="$GRPC_PORT" --metrics-port="$METRICS_PORT" &
pids+=($!)
if [ "$FRONTEND" = 1 ] && [ -f openai_frontend/__main__.py ]; then
  until curl -sf "localhost:$HTTP_PORT/v2/health/ready" >/dev/null; do
    # A server that failed to load its models has exited: say so rather than wait for it forever.
    if ! kill -0 "${pids[0]}" 2>/dev/null; then
      rc=0
      wait "${pids[0]}" || rc=$?
      echo "serve.sh: tritonserver exited (status $rc) before it was ready; its log is above" >&2
      [ "$rc" -ne 0 ] || rc=1
      exit "$rc"
    fi
    sleep 1
  done
  OPENAI_FRONTEND_API_KEY="$API_KEY" .venv/bin/python -m openai_frontend --triton-url "localhost:$GRPC_PORT" \
    --port "$FRONTEND_PORT" --workers "$FRONTEND_WORKERS" --tokenizer-path "$LLM_MODEL_PATH" --tool-call-parser "$TOOL_CALL_PARSER" \
    ${REASONING_PARSER:+--reasoning-parser "$REASONING_PARSER"} ${LLM_LORA_MODULES:+--lora-modules "$LLM_LORA_MODULES"} \
    ${RUNTIME_LORA:+--allow-runtime-lora-updating} &
  pids+=($!)
fi
wait -n "${pids[@]}"
