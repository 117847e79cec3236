#!/usr/bin/env bash
# The GPU path's checks and figures in one go, on a CUDA host that cannot reach a package index
# (the GPU machine some sessions are lent holds torch, triton and transformers, not the rest):
#
#   scripts/gpu_check.sh fetch                    # where PyPI is reachable: the wheels that host lacks -> .whl/
#   scripts/gpu_check.sh run [OUT_DIR [STEP...]]  # on the GPU host, from the repository root (.whl/ beside it)
#
# `run` installs .whl/ into /tmp/site (nothing else is touched) and runs the steps (default: all),
# each allowed to fail without stopping the others, into OUT_DIR (default bench/results/gpu-<stamp>):
# gpu_check.log (the GPU, torch and triton versions, then every step's output and exit status)
# and one JSON per benchmark. Steps:
#   tests      CUDA-only tests: real CUDA-graph capture against the eager engine, bf16 paged
#              attention, the Triton kernels compiled for the GPU
#   engine     the engine and sampling tests with the engine on CUDA (LLM_TEST_DEVICE=cuda)
#   demo       engine vs HF generate on the demo model, with cuda_graphs_vs_eager -> engine_vs_hf_demo.json
#   0.4b       the same on a random 0.4B Qwen2 (bench/make_random_model.py) -> engine_vs_hf_0.4b.json
#   moe        the same on a random 1.2B Qwen3-MoE (64 experts, 8 a token, bench/make_random_model.py
#              --experts): whether grouped_mm runs on this GPU and its decode graphs hold the MoE
#              layers (cuda_graphs_vs_eager), the engine against HF -> engine_vs_hf_moe.json
#   kernels    the sampling kernels against their torch references, batch 256, vocab 128k -> kernels_vs_torch.json
#   serving_variants  the engine and the ensemble at c=8 and 64, one tritonserver per llm setting in
#              SERVING_VARIANTS (default "engine_process=in_stub max_responses_per_step=16
#              response_senders=8 stream_interval=2": each against the CUDA defaults, which are
#              separate, no cap, 4 senders, every token; 4 JSON files + the log, under the 8 a call
#              brings back) -> variant_<key>_<value>.json. frontend_workers=N instead runs the
#              engine and the frontend (streaming and not) with the frontend's --workers N
#   prefill    one prefill at prompt lengths unseen and seen, SDPA's cuDNN backend off (the engine's
#              CUDA setting) and on, profiled -> prefill_probe.json (bench/prefill_probe.py)
#   chunked    where a chunked-prefill step's time goes: decode steps of 8 streams against the steps
#              that also carry a chunk of a 3072-token prompt, at chunk caps 128/256/512, flat steps
#              off (eager mixed steps), profiled -> chunked_probe.json (bench/chunked_probe.py)
#   chunked_flat  the same with flat_prefill_tokens 128 (the CUDA default since an H100 measured
#              it: chunk steps 7.4 -> 1.9-2.3 ms) at caps 64/512 (chunks then cut to 128 less the
#              decodes): the steps that carry a chunk laid out as decode rows and replayed from the
#              decode graphs (max_num_seqs 128 buckets) -> chunked_flat_probe.json
#   chunked_tiles  chunked_flat's probe on the 0.4B model at cap 128, LLM_QUERY_TILE 1 (each chunk
#              row reads its own prefix) then auto (a chunk's rows scored in query tiles, from tiled
#              graphs of their own), then auto with flat steps (eager past the graphs) and chunks of
#              up to 512 -> chunked_0.4b_query_tile_{1,auto}_flat_{128,512}.json
#   spec       speculative decoding against one token a step: n-gram on the demo model and on its
#              repeating variant (every draft holds), and a draft model (a random 38M target drafted
#              by its first layer), batch 1 and 8, outputs checked equal
#              -> spec_decode.json (bench/spec_decode.py)
#   predicted  Predicted Outputs (OpenAI's prediction) against none: the output itself, edited,
#              half, unrelated; 8- and 16-token drafts -> predicted_outputs.json
#   decode     where a decode step's time goes on the 0.4B model: step and forward pass from the decode
#              graphs and eagerly at batch 1/8/64 over 1k contexts, the eager steps' kernels profiled,
#              with LLM_DECODE_SPLITS 1 and auto (the paged kernel's flash-decoding splits, the default
#              since an H200 measured it) -> decode_probe_0.4b.json (bench/decode_probe.py)
#   paged      the paged decode-attention kernel alone at tile sizes 16-128 keys, one split and auto,
#              against SDPA over gathered blocks, the 0.4B model's shapes (decode batches over 1k
#              contexts, a flat chunk's 128 rows over 3k, also in query tiles of 2-16 rows) -> paged_decode_bench.json
#              (bench/paged_decode_bench.py; small cases are bound by the launch's host time); then
#              a Llama-3-8B layer's shapes (head dim 128) at tiles 32 and 64 -> paged_decode_bench_d128.json
#   kvdtype    the 0.4B model's engine with a bf16 vs fp8 / fp8_e5m2 KV cache in the same tight cache memory
#              (KV_MB, default 48) -> kv_cache_dtype_0.4b.json
#   serving    bench/serving_bench.py on the GPU: the engine, tritonserver (ensemble and llm) and the
#              frontend streaming / non-streaming at concurrency 1, 8, 64, then three alternating
#              rounds of each at c=64 whose medians give the ratios (one 64-request run at c=64 lasts
#              ~1 s on an H100 and moves by +-20%) -> serving_bench.json + .png;
#              every engine (this process's and the server's) gets a KV pool of SERVING_KV_MB (8192):
#              left to take 0.85 of the free memory, the bench's engines and the server's cannot
#              all fit (an H200 run's second in-process engine lost its CUDA graphs to OOM)
#              (SERVING_ARGS adds arguments). tritonserver comes from .whl/serving/ (see fetch)
#   perf       perf_analyzer (from .whl/serving/perf_analyzer.tar.xz, see fetch) against the served
#              ensemble, streaming, at concurrency 1, 8, 64: serving_bench's perf_analyzer section
#              -> perf_analyzer.json (its csv and profile exports stay on the host)
#   tiles_0.4b  serving_bench's prefix-caching and chunked-prefill sections (engine in process) on
#              the 0.4B model with LLM_QUERY_TILE 1 then auto: the two GPU targets a flat step's
#              per-row reads missed -> prefix_chunked_0.4b_query_tile_{1,auto}.json
#   chunked_unit  the chunk steps' cost against their context on the 0.4B model (flat chunks of 128):
#              chunked_probe with prefill_context_unit 0 (the CUDA default: a token counts 1 against
#              the cap at any context) and 1024..8192 (a token at context c counts 1 + c / unit), and
#              a fit of the step's time to tokens and keys read -> chunked_0.4b_units.json; then
#              serving_bench's chunked section at units 2048 and 4096 -> chunked_0.4b_unit_{2048,4096}.json
#   prefix_0.4b  where TTFT goes with a cached 1k prefix and without, on the 0.4B model: the steps to
#              the first token hand-stepped against the step loop's -> prefix_probe_0.4b.json
#              (bench/prefix_probe.py; cached, TTFT was ~2.5 decode steps, the prefix target's edge)
#   serving_0.4b  the same on the random 0.4B Qwen2 -> serving_bench_0.4b.json + .png (SERVING_0_4B_ARGS
#              replaces its default "--c1-requests 8 --alternating-rounds 0"; SERVING_ARGS still adds)
# DEMO_ARGS adds arguments to both engine_vs_hf runs (e.g. --skip-one-by-one --rounds 3); SPEC_ARGS and
# PREDICTED_ARGS to the spec and predicted steps' benchmarks (e.g. --repeats 1 --num-prompts 8).
#   checks     tests and engine side by side (both only check; the benchmarks run alone)
# Each step is cut off after its limit (STEP_LIMIT_<step> seconds, defaults below) so that one
# slow step cannot eat a lent GPU's minutes. Every step prints its figures into gpu_check.log as they
# land; serving_bench, engine_vs_hf and kv_cache_dtype also save their JSON as they go, the probes
# and the other benchmarks only at their end (a step cut off at its limit leaves its log, no JSON).
# A device call runs 10 minutes at most: `run OUT checks demo 0.4b kernels prefill` (the default,
# ~5 min on an H200) is sized to fit, and `run OUT serving` (~2.5 min with the default sections;
# ~4 min adding hf/prefix/chunked through SERVING_ARGS' --only) goes in a call of its own. A
# session's device time is 15 minutes, each machine start ~1 min of it: plan two calls.
# `fetch` also builds .whl/serving/: tritonserver cut from the nvidia-pytriton wheel (the binary, the
# Python backend, the stub for GPU_PY_VERSION and the bundled libraries; ~27 MB as .tar.xz, the whole
# wheel is past what a device call carries) and the frontend's and tritonclient's packages with
# numpy < 2 for the stub (numpy itself as .tar.xz: 9 MB, not 18), installed apart
# (/tmp/serving-site) so the other steps keep the host's; and perf_analyzer.tar.xz (perf_bundle).
set -uo pipefail
SCRIPT="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$0")/.."

# The engine's imports that a CUDA image with torch/transformers/triton lacks, at this
# repository's pinned versions (constraints.txt), for the GPU host's Python (3.12 there).
WHEELS=(pydantic pydantic_core annotated-types typing-inspection xgrammar apache-tvm-ffi dill jsonschema
        jsonschema-specifications referencing rpds-py)
PY_VERSION=${GPU_PY_VERSION:-3.12}
# The serving step's packages: resolved with their dependencies against constraints.txt, less
# grpcio (the host has one) and what WHEELS already carries.
SERVING=(fastapi uvicorn sse-starlette openai "tritonclient[grpc]")
SERVING_SKIP=(grpcio)
PLATFORMS=(--platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
           --platform manylinux1_x86_64)

pinned() {  # name -> name==version from constraints.txt (names compared the way pip does)
  local want
  want=$(echo "$1" | tr '_.' '--' | tr '[:upper:]' '[:lower:]')
  while IFS= read -r line; do
    local name=${line%%==*}
    if [ "$(echo "$name" | tr '_.' '--' | tr '[:upper:]' '[:lower:]')" = "$want" ]; then
      echo "$line"
      return 0
    fi
  done < <(grep -E '^[A-Za-z0-9_.-]+==' constraints.txt)
  echo "gpu_check: $1 is not pinned in constraints.txt" >&2
  return 1
}

fetch() {
  local py=${PYTHON:-.venv/bin/python}
  mkdir -p .whl
  for name in "${WHEELS[@]}"; do
    spec=$(pinned "$name") || exit 1
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
      "${PLATFORMS[@]}" -d .whl "$spec" || exit 1
  done
  fetch_serving "$py" || exit 1
  du -sh .whl
  echo "carry .whl to the GPU host (the device tool: carry [\".whl\"]), then: scripts/gpu_check.sh run"
}

normal() { echo "$1" | tr '_.' '--' | tr '[:upper:]' '[:lower:]'; }

perf_bundle() {  # python, tmp dir -> .whl/serving/perf_analyzer.tar.xz: bin/perf_analyzer and lib/
  # perf_analyzer from tritonclient's wheel and the two libraries it loads that a CUDA image may
  # lack (../shared/TRITON_ON_CPU.md): libb64.so.0d (Debian's libb64-0d, this machine's or
  # downloaded) and libcudart.so.12 (nvidia-cuda-runtime-cu12; the GPU host's CUDA is 13).
  local py=$1 dir=$2/perf spec lib
  mkdir -p "$dir/bin" "$dir/lib"
  unzip -q -j -o .whl/serving/tritonclient-*.whl '*/data/bin/perf_analyzer' -d "$dir/bin" || return 1
  lib=$(ldconfig -p | awk '/libb64\.so\.0d / {print $NF; exit}')
  if [ -z "$lib" ]; then
    (cd "$2" && apt-get download libb64-0d > /dev/null && dpkg-deb -x libb64-0d_*.deb deb) || return 1
    lib=$(find "$2/deb" -name 'libb64.so.0d*' | head -1)
  fi
  cp -L "$lib" "$dir/lib/libb64.so.0d" || return 1
  spec=$(pinned nvidia-cuda-runtime-cu12) || return 1
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    "${PLATFORMS[@]}" -d "$2/cudart" "$spec" || return 1
  unzip -q -j -o "$2"/cudart/*.whl 'nvidia/cuda_runtime/lib/libcudart.so.12' -d "$dir/lib" || return 1
  tar -C "$dir" -cJf .whl/serving/perf_analyzer.tar.xz bin lib || return 1
}

fetch_serving() {  # python -> .whl/serving/: tritonserver.tar.xz and the serving step's wheels
  local py=$1 tmp
  tmp=$(mktemp -d)
  rm -rf .whl/serving && mkdir -p .whl/serving
  "$py" -m pip download -q --only-binary=:all: --python-version "$PY_VERSION" --implementation cp "${PLATFORMS[@]}" \
    -c constraints.txt -d "$tmp/wheels" "${SERVING[@]}" || return 1
  local have=" " w name
  for w in .whl/*.whl; do have+="$(normal "$(basename "$w" | cut -d- -f1)") "; done
  for name in "${SERVING_SKIP[@]}"; do have+="$(normal "$name") "; done
  for w in "$tmp"/wheels/*.whl; do
    name=$(normal "$(basename "$w" | cut -d- -f1)")
    [[ "$have" == *" $name "* ]] || mv "$w" .whl/serving/
  done
  perf_bundle "$py" "$tmp" || return 1
  # numpy's wheel is 18 MB, its files 9 MB as .tar.xz: with perf_analyzer's bundle beside the
  # engine's wheels, the 18 MB did not fit a device call's 64 MiB. `serving` unpacks it.
  for w in .whl/serving/numpy-*.whl; do
    mkdir -p "$tmp/numpy" && unzip -q "$w" -d "$tmp/numpy" || return 1
    tar -C "$tmp/numpy" -cJf .whl/serving/numpy.tar.xz . && rm -f "$w" || return 1
  done
  # tritonclient's wheel is mostly the perf_analyzer binaries (2 x 20 MB): perf_bundle took the one
  # the `perf` step runs.
  "$py" - .whl/serving/tritonclient-*.whl <<'PY' || return 1
import sys, zipfile
path = sys.argv[1]
with zipfile.ZipFile(path) as src:
    items = [(i, src.read(i)) for i in src.infolist() if "/data/bin/" not in i.filename]
with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as dst:
    for info, data in items:
        if info.filename.endswith(".dist-info/RECORD"):
            data = b"".join(l for l in data.splitlines(True) if b"/data/bin/" not in l)
        dst.writestr(info, data)
PY
  local spec
  spec=$(pinned nvidia-pytriton) || return 1
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    "${PLATFORMS[@]}" -d "$tmp/pytriton" "$spec" || return 1
  mkdir -p "$tmp/tree"
  (cd "$tmp/tree" && unzip -q "$tmp"/pytriton/*.whl 'pytriton/tritonserver/*' 'nvidia_pytriton.libs/*') || return 1
  # Only this Python's stub; pytriton's own libpython (not what tritonserver links) stays behind.
  find "$tmp/tree/pytriton/tritonserver/python_backend_stubs" -mindepth 1 -maxdepth 1 ! -name "$PY_VERSION" \
    -exec rm -rf {} +
  rm -f "$tmp"/tree/nvidia_pytriton.libs/libpython*
  [ -f "$tmp/tree/pytriton/tritonserver/python_backend_stubs/$PY_VERSION/triton_python_backend_stub" ] \
    || { echo "gpu_check: no Python backend stub for Python $PY_VERSION in $spec" >&2; return 1; }
  tar -C "$tmp/tree" -cJf .whl/serving/tritonserver.tar.xz pytriton nvidia_pytriton.libs || return 1
  rm -rf "$tmp"
  du -sh .whl/serving
}

declare -A LIMIT=([perf]=240 [tests]=170 [engine]=170 [demo]=140 [make_0.4b]=120 [0.4b]=140 [kernels]=50 [paged]=90 [prefill]=90 [decode]=150 [chunked]=90 [chunked_flat]=90 [chunked_tiles]=120 [spec]=120 [predicted]=120 [kvdtype]=170
                  [serving]=300 [serving_0.4b]=200 [tiles_0.4b]=120 [chunked_unit]=150 [prefix_0.4b]=90)

step() {  # name, command...: run it (within its limit) into its log, record its exit status, keep going
  local name=$1
  shift
  local var="STEP_LIMIT_${name//./_}"
  local limit=${!var:-${LIMIT[$name]:-300}}
  local log="$OUT/.step-$name.log"
  local start=$SECONDS
  echo "==== $name (limit ${limit}s): $*" > "$log"
  timeout -k 30 "$limit" "$@" >> "$log" 2>&1
  local rc=$?
  [ $rc -eq 124 ] && echo "==== $name: cut off at its ${limit}s limit" >> "$log"
  echo "==== $name: exit $rc after $((SECONDS - start))s" >> "$log"
  cat "$log" >> "$LOG" && rm -f "$log"
  echo "$name: exit $rc after $((SECONDS - start))s"
}

run() {
  OUT=${1:-bench/results/gpu-$(date +%Y%m%d-%H%M%S)}
  shift || true
  local steps=("$@")
  [ ${#steps[@]} -gt 0 ] || steps=(checks demo 0.4b kernels prefill)
  mkdir -p "$OUT"
  LOG="$OUT/gpu_check.log"
  local py=${PYTHON:-python3}
  if ls .whl/*.whl > /dev/null 2>&1; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || { echo "gpu_check: installing .whl/ failed" >&2; exit 1; }
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  fi
  export PYTHONUNBUFFERED=1
  unset TRITON_INTERPRET  # compile the Triton kernels for the GPU
  {
    date -u
    nvidia-smi -L
    "$py" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__); print(torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA DEVICE")'
  } >> "$LOG" 2>&1
  [ -f models/demo/config.json ] || "$py" -m backend.demo_model --out models/demo >> "$LOG" 2>&1
  local tests_cmd=("$py" -m pytest -q -p no:cacheprovider tests/test_decode_graphs.py tests/test_paged_attention.py
                   tests/test_kernels.py tests/test_kernel_distribution.py)
  local engine_cmd=(env LLM_TEST_DEVICE=cuda "$py" -m pytest -q -p no:cacheprovider tests/test_engine.py
                    tests/test_engine_sampling.py tests/test_hidden_states.py tests/test_input_embeds.py
                    tests/test_kv_cache_dtype.py tests/test_fp8_checkpoint.py tests/test_speculative.py
                    tests/test_predicted_outputs.py tests/test_draft_model.py tests/test_architectures.py)
  local make_cmd=("$py" -m bench.make_random_model --out /tmp/model-0.4b)
  for s in "${steps[@]}"; do
    case "$s" in
      checks) step tests "${tests_cmd[@]}" &
              # The 0.4B model is built on the CPU meanwhile, if a later step wants it.
              if [[ " ${steps[*]} " == *" 0.4b "* && ! -f /tmp/model-0.4b/config.json ]]; then
                step make_0.4b "${make_cmd[@]}" &
              fi
              step engine "${engine_cmd[@]}"
              wait ;;
      tests) step tests "${tests_cmd[@]}" ;;
      engine) step engine "${engine_cmd[@]}" ;;
      demo) step demo "$py" -m bench.engine_vs_hf --device cuda --model-path models/demo --num-requests 64 \
              --json "$OUT/engine_vs_hf_demo.json" ${DEMO_ARGS:-} ;;
      0.4b) [ -f /tmp/model-0.4b/config.json ] || step make_0.4b "${make_cmd[@]}"
            step 0.4b "$py" -m bench.engine_vs_hf --device cuda --model-path /tmp/model-0.4b --num-requests 64 \
              --skip-one-by-one --json "$OUT/engine_vs_hf_0.4b.json" ${DEMO_ARGS:-} ;;
      moe) [ -f /tmp/model-moe/config.json ] || step make_moe "$py" -m bench.make_random_model --out /tmp/model-moe \
             --hidden 1024 --layers 12 --heads 16 --kv-heads 4 --experts 64 --experts-per-tok 8 --moe-intermediate 512
           step moe "$py" -m bench.engine_vs_hf --device cuda --model-path /tmp/model-moe --num-requests 64 \
             --skip-one-by-one --json "$OUT/engine_vs_hf_moe.json" ;;
      decode) [ -f /tmp/model-0.4b/config.json ] || step make_0.4b "${make_cmd[@]}"
              step decode "$py" -m bench.decode_probe --device cuda --model-path /tmp/model-0.4b \
                --json "$OUT/decode_probe_0.4b.json" ;;
      kvdtype) [ -f /tmp/model-0.4b/config.json ] || step make_0.4b "${make_cmd[@]}"
               step kvdtype "$py" -m bench.kv_cache_dtype --device cuda --model-path /tmp/model-0.4b \
                 --memory-mb "${KV_MB:-48}" --max-model-len 1024 --rounds 2 --dtypes bfloat16 fp8 fp8_e5m2 --baseline bfloat16 \
                 --json "$OUT/kv_cache_dtype_0.4b.json" ;;
      serving_variants)
        # llm model settings on this GPU, one server each (engine and ensemble, c=8 and 64): where
        # the streamed-response path (the stub's GIL) meets the engine's step loop.
        for variant in ${SERVING_VARIANTS:-engine_process=in_stub max_responses_per_step=16 response_senders=8 stream_interval=2}; do
          key=${variant%%=*} val=${variant#*=}
          # frontend_workers=N: the OpenAI frontend's --workers, not an llm setting
          if [ "$key" = frontend_workers ]; then
            what="--only engine,frontend,frontend_nonstream --frontend-workers $val"
          else
            what="--only engine,triton --server-env LLM_${key^^}=$val"
          fi
          SERVING_ARGS="$what --concurrency 8 64 --alternating-rounds 0 --c1-requests 8 ${SERVING_ARGS:-}" \
            STEP_LIMIT_serving_variant=${STEP_LIMIT_serving_variant:-100} \
            step serving_variant bash "$SCRIPT" _serving "$py" "$OUT" "variant_${key}_$val" nopng
        done ;;
      prefill) step prefill "$py" -m bench.prefill_probe --device cuda --profile --json "$OUT/prefill_probe.json" ;;
      chunked) step chunked "$py" -m bench.chunked_probe --device cuda --profile --json "$OUT/chunked_probe.json" ;;
      chunked_flat) step chunked_flat "$py" -m bench.chunked_probe --device cuda --caps 64 512 --flat-prefill-tokens 128 \
                      --json "$OUT/chunked_flat_probe.json" ;;
      chunked_tiles) [ -f /tmp/model-0.4b/config.json ] || step make_0.4b "${make_cmd[@]}"
                     for run in "1 128" "auto 128" "auto 512"; do
                       set -- $run
                       step chunked_tiles env LLM_QUERY_TILE=$1 "$py" -m bench.chunked_probe --device cuda \
                         --model-path /tmp/model-0.4b --caps "$2" --flat-prefill-tokens "$2" \
                         --json "$OUT/chunked_0.4b_query_tile_${1}_flat_$2.json"
                     done ;;
      paged) step paged "$py" -m bench.paged_decode_bench --json "$OUT/paged_decode_bench.json"
             # and a Llama-3-8B layer's shape (head dim 128: twice the registers per tile)
             step paged "$py" -m bench.paged_decode_bench --heads 32 --kv-heads 8 --head-dim 128 --tiles 32 64 \
               --json "$OUT/paged_decode_bench_d128.json" ;;
      kernels) step kernels "$py" -m bench.kernels_vs_torch --json "$OUT/kernels_vs_torch.json" ;;
      spec) step spec "$py" -m bench.spec_decode --device cuda --json "$OUT/spec_decode.json" ${SPEC_ARGS:-} ;;
      predicted) step predicted "$py" -m bench.predicted_outputs --device cuda --draft-tokens 8 16 \
                   --json "$OUT/predicted_outputs.json" ${PREDICTED_ARGS:-} ;;
      serving) step serving bash "$SCRIPT" _serving "$py" "$OUT" serving_bench ;;
      perf) SERVING_ARGS="--only perf_analyzer ${SERVING_ARGS:-}" \
              step perf bash "$SCRIPT" _serving "$py" "$OUT" perf_analyzer nopng ;;
      tiles_0.4b) [ -f /tmp/model-0.4b/config.json ] || step make_0.4b "${make_cmd[@]}"
                  for tile in 1 auto; do
                    LLM_QUERY_TILE=$tile SERVING_ARGS="--model-path /tmp/model-0.4b --only prefix,chunked ${SERVING_ARGS:-}" \
                      step tiles_0.4b bash "$SCRIPT" _serving "$py" "$OUT" "prefix_chunked_0.4b_query_tile_$tile" nopng
                  done ;;
      chunked_unit) [ -f /tmp/model-0.4b/config.json ] || step make_0.4b "${make_cmd[@]}"
                    step chunked_unit "$py" -m bench.chunked_probe --device cuda --model-path /tmp/model-0.4b \
                      --caps 128 --flat-prefill-tokens 128 --context-units 0 1024 2048 4096 8192 \
                      --json "$OUT/chunked_0.4b_units.json"
                    for unit in 2048 4096; do
                      SERVING_ARGS="--model-path /tmp/model-0.4b --only chunked --engine-arg prefill_context_unit=$unit ${SERVING_ARGS:-}" \
                        step chunked_unit bash "$SCRIPT" _serving "$py" "$OUT" "chunked_0.4b_unit_$unit" nopng
                    done ;;
      prefix_0.4b) [ -f /tmp/model-0.4b/config.json ] || step make_0.4b "${make_cmd[@]}"
                   step prefix_0.4b "$py" -m bench.prefix_probe --device cuda --model-path /tmp/model-0.4b \
                     --json "$OUT/prefix_probe_0.4b.json" ;;
      serving_0.4b) [ -f /tmp/model-0.4b/config.json ] || step make_0.4b "${make_cmd[@]}"
                    SERVING_ARGS="--model-path /tmp/model-0.4b ${SERVING_0_4B_ARGS:---c1-requests 8 --alternating-rounds 0} ${SERVING_ARGS:-}" \
                      step serving_0.4b bash "$SCRIPT" _serving "$py" "$OUT" serving_bench_0.4b ;;
      *) echo "gpu_check: unknown step $s" >&2 ;;
    esac
  done
  echo "log: $LOG"
}

serving() {  # python, out dir, name[, nopng]: the serving paths on this host's GPU, tritonserver from .whl/serving/
  local py=$1 out=$2 name=${3:-serving_bench} png=${4:-png} pyv home=/tmp/triton/pytriton/tritonserver
  pyv=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])') || return 1
  if [ ! -x "$home/bin/tritonserver" ]; then
    [ -f .whl/serving/tritonserver.tar.xz ] || { echo "no .whl/serving/tritonserver.tar.xz: run fetch first"; return 1; }
    mkdir -p /tmp/triton && tar -C /tmp/triton -xJf .whl/serving/tritonserver.tar.xz || return 1
  fi
  local stub="$home/python_backend_stubs/$pyv/triton_python_backend_stub"
  [ -f "$stub" ] || { echo "the bundle has no stub for Python $pyv (fetch with GPU_PY_VERSION=$pyv)"; return 1; }
  cp "$stub" "$home/backends/python/" || return 1
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/serving-site \
    .whl/serving/*.whl || return 1
  if [ -f .whl/serving/numpy.tar.xz ]; then
    rm -rf /tmp/serving-site/numpy /tmp/serving-site/numpy-*.dist-info /tmp/serving-site/numpy.libs
    tar -C /tmp/serving-site -xJf .whl/serving/numpy.tar.xz || return 1
  fi
  # perf_analyzer (the `perf` step): client/perf/run_perf_analyzer.py finds it through
  # $PERF_ANALYZER, here a wrapper that gives its libraries to it alone (not to tritonserver).
  if [ -f .whl/serving/perf_analyzer.tar.xz ]; then
    mkdir -p /tmp/perf && tar -C /tmp/perf -xJf .whl/serving/perf_analyzer.tar.xz || return 1
    printf '%s\n' '#!/bin/sh' \
      'LD_LIBRARY_PATH=/tmp/perf/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} exec /tmp/perf/bin/perf_analyzer "$@"' \
      > /tmp/perf/perf_analyzer && chmod +x /tmp/perf/perf_analyzer || return 1
    export PERF_ANALYZER=/tmp/perf/perf_analyzer
  fi
  # numpy < 2 (for the stub) shadows the host's numpy 2 here, but the host's scipy is built for
  # numpy 2 (np.long at import) and transformers imports scipy and sklearn at import time whenever
  # they are installed (modeling_utils -> object-detection losses; generation). Nothing here needs
  # either: hide them (find_spec -> None, so transformers skips them; an import -> ImportError).
  printf '%s\n' '# gpu_check.sh: hide the host'"'"'s scipy/sklearn (built for numpy 2) under numpy < 2' \
    'import sys' 'for _name in ("scipy", "sklearn"):' '    sys.modules.setdefault(_name, None)' \
    > /tmp/serving-site/sitecustomize.py
  # The Python backend stub starts its interpreter isolated (PyConfig_InitIsolatedConfig): it
  # ignores PYTHONPATH and finds the venv from the first python on PATH. A .pth file in that
  # venv's site-packages is still read; its import line puts the carried packages first.
  local purelib
  purelib=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return 1
  echo 'import sys; sys.path[0:0] = [p for p in ("/tmp/serving-site", "/tmp/site") if p not in sys.path]' \
    > "$purelib/000-gpu-check-serving.pth" || return 1
  # The stub links this Python's libpython; say so at once if the host has none to give it.
  local libdir
  libdir=$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')
  LD_LIBRARY_PATH="$libdir" ldd "$home/backends/python/triton_python_backend_stub" | grep "not found" \
    && echo "the Python backend stub lacks the libraries above (LIBDIR $libdir)"
  local results=/tmp/serving-results/$name
  rm -rf "$results"  # a rerun on a warm machine that writes nothing must not pass off the last run's result
  # A step's time limit sends SIGTERM to this whole process group: the bench stops its servers
  # and writes what has landed (bench/serving_bench.py's CutOff); this shell must outlive it to
  # copy the result out. A no-op trap (not an ignored signal) leaves the children's default.
  trap 'true' TERM
  TRITON_HOME=$home PYTHONPATH="/tmp/serving-site:${PYTHONPATH:-}" "$py" -m bench.serving_bench --device "${SERVING_DEVICE:-cuda}" \
    --only engine,triton,triton_llm,frontend,frontend_nonstream,alternating --concurrency 1 8 64 --out "$results" \
    --engine-arg "kv_cache_memory_mb=${SERVING_KV_MB:-8192}" ${SERVING_ARGS:-}
  local rc=$? last
  last=$(ls -t "$results"/*.json 2>/dev/null | head -1)
  if [ -n "$last" ]; then
    cp "$last" "$out/$name.json"
    [ "$png" = png ] && [ -f "${last%.json}.png" ] && cp "${last%.json}.png" "$out/$name.png"
    for log in "${last%.json}"/*.log; do
      [ -f "$log" ] || continue
      echo "---- errors in $(basename "$log")"
      grep -E "^E[0-9]{4} |Error|error:" "$log" | cut -c1-600 | head -n 20
      echo "---- tail of $(basename "$log")"
      tail -n 30 "$log"
    done
  fi
  return $rc
}

case "${1:-}" in
  fetch) fetch ;;
  run) shift; run "$@" ;;
  _serving) shift; serving "$@" ;;
  *) awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; exit 2 ;;
esac
