# syntax=docker/dockerfile:1
#
# The serving stack on the official Triton image, for GPU hosts:
#   tritonserver (model_repository/: preprocessing -> llm -> postprocessing) + the OpenAI frontend.
#
# Base: nvcr.io/nvidia/tritonserver:24.10-py3 = Triton Inference Server 2.51.0, the same server the
# CI runs from the nvidia-pytriton==0.7.0 wheel (Ubuntu 22.04, CUDA 12.6.2, Python 3.10).
#
# Build:  docker build -t triton-llm .
# Run:    docker run --gpus all --shm-size=1g -p 8000-8002:8000-8002 -p 9000:9000 \
#           -v /models/Qwen2.5-0.5B-Instruct:/models/llm:ro -e LLM_MODEL_PATH=/models/llm triton-llm
#         (without -v/-e it serves the built-in demo model). See README "GPU hosts".
#         Several GPUs: -e DATA_PARALLEL_SIZE=N, one tritonserver per GPU behind the one frontend
#         (README "Several GPUs").
#
# Python: the pinned stack (transformers 5.x, triton 3.9) needs Python >= 3.11, the image has 3.10.
# So the project runs in a Python 3.11 venv, and the llm models' Python-backend stub is the 3.11
# build of the same 2.51 backend that the nvidia-pytriton wheel ships (python_backend_stubs/3.11),
# placed where tritonserver looks for it.
#
# Decode attention here is the Triton kernel on the GPU. The C++ CPU kernel (kernels/csrc) is not
# built into the image (no Python headers); run on CPU in this image, the engine logs that and
# uses the gathered-block attention instead.
#
# torch: requirements.txt pins torch==2.13.0, which CI installs as its CPU build. Here the CUDA build
# of the same version comes from TORCH_INDEX_URL; pick the CUDA variant your driver supports
# (cu126 runs on the drivers the 24.10 image supports: R560+, or R470/R525/R535/R545 on data
# center GPUs).
ARG TRITON_IMAGE=nvcr.io/nvidia/tritonserver:24.10-py3
FROM ${TRITON_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126
ARG TORCH_VERSION=2.13.0
# 1: build the deterministic demo model into the image (a real model is mounted at run time).
ARG BUILD_DEMO_MODEL=1

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Python 3.11 (Ubuntu 22.04 universe): interpreter, venv support, and libpython for the stub;
# libb64-0d for perf_analyzer (tritonclient's, in the venv: client/perf/run_perf_analyzer.sh).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv libpython3.11 libb64-0d \
    && rm -rf /var/lib/apt/lists/* \
    && python3.11 -m venv /opt/venv

# The venv first on PATH: the stub's embedded interpreter takes its prefix (site-packages) from the
# first python on PATH. nvidia_pytriton.libs holds the stub's bundled libcudart (hashed names, so
# nothing of the system's is shadowed).
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:/opt/tritonserver/bin:${PATH} \
    PYTHONPATH=/opt/app \
    LD_LIBRARY_PATH=/opt/venv/lib/python3.11/site-packages/nvidia_pytriton.libs:${LD_LIBRARY_PATH}

WORKDIR /opt/app

# Dependencies first (cached while only the code changes). Test-only packages are left out.
COPY requirements.txt constraints.txt ./
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
    && grep -vE '^(pytest|pytest-timeout|schemathesis|hypothesis|matplotlib)==' requirements.txt > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt -c constraints.txt \
    && rm /tmp/requirements.txt \
    && python -c 'import numpy, torch; assert numpy.__version__.startswith("1."), numpy.__version__; print("torch", torch.__version__, "cuda", torch.version.cuda)'

# The 3.11 stub of the Triton 2.51 Python backend, next to the image's libtriton_python.so.
RUN cp /opt/venv/lib/python3.11/site-packages/pytriton/tritonserver/python_backend_stubs/3.11/triton_python_backend_stub \
        /opt/tritonserver/backends/python/triton_python_backend_stub

COPY . .
RUN if [ "${BUILD_DEMO_MODEL}" = 1 ]; then python -m backend.demo_model --out /opt/app/models/demo; fi \
    && useradd --create-home --uid 1001 --user-group app \
    && mkdir -p /opt/app/models /opt/app/kernels/.build \
    && chown -R app:app /opt/app/models /opt/app/kernels/.build

USER 1001:1001
ENV LLM_MODEL_PATH=/opt/app/models/demo \
    PYTHON=/opt/venv/bin/python \
    TRITON_BACKEND_DIR=/opt/tritonserver/backends

# HTTP, gRPC, metrics (tritonserver); the OpenAI/SGLang frontend.
EXPOSE 8000 8001 8002 9000
HEALTHCHECK --interval=15s --timeout=10s --start-period=600s --retries=3 \
    CMD ["/opt/app/scripts/docker-entrypoint.sh", "healthcheck"]
# SIGTERM drains: the frontend's streams first, then tritonserver's in-flight requests.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/opt/app/scripts/docker-entrypoint.sh"]
CMD ["serve"]
