# syntax=docker/dockerfile:1
# One image for every kvmesh service (`kvmesh gateway|tokenizer|scheduler|prefix-cache|worker|serve|keys`).
#
# The CUDA base matches the GPU build the project is measured on (BENCHMARKS.md): torch 2.11.0+cu130
# with Triton 3.6 on Python 3.12, Ubuntu 24.04; the cu130 wheels need an NVIDIA driver >= 580.
#
#   docker build -t ghcr.io/<you>/kvmesh:0.1.0 .
#   docker push ghcr.io/<you>/kvmesh:0.1.0
ARG CUDA_IMAGE=nvidia/cuda:13.0.0-runtime-ubuntu24.04

# ---------------------------------------------------------------------------- builder: every wheel
FROM ${CUDA_IMAGE} AS builder
ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.12 python3.12-venv python3.12-dev build-essential \
 && rm -rf /var/lib/apt/lists/*
RUN python3.12 -m venv /opt/build && /opt/build/bin/pip install "pip>=25" "setuptools>=68" wheel
WORKDIR /src
# Only what the wheel is built from (pyproject's packages); .dockerignore keeps the rest out.
COPY pyproject.toml README.md ./
COPY services ./services
COPY tokenizer_svc ./tokenizer_svc
COPY scheduler_svc ./scheduler_svc
COPY gpu_worker ./gpu_worker
COPY prefix_cache_svc ./prefix_cache_svc
# torch first, from the CUDA 13.0 index, so the kvmesh requirement `torch>=2.6` takes that build.
RUN /opt/build/bin/pip wheel --wheel-dir /wheels --extra-index-url "${TORCH_INDEX_URL}" \
        "torch==${TORCH_VERSION}" . \
 && ls /wheels

# ---------------------------------------------------------------------------- runtime
FROM ${CUDA_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/kvmesh/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    HOME=/home/kvmesh
# gcc and the Python headers are here because Triton compiles its kernel launcher (a small C
# extension) at run time, on first use; nothing else in this stage builds code.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.12 python3.12-venv gcc libc6-dev libpython3.12-dev \
 && rm -rf /var/lib/apt/lists/*
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    python3.12 -m venv /opt/kvmesh \
 && /opt/kvmesh/bin/pip install --no-index --find-links=/wheels kvmesh torch \
 && /opt/kvmesh/bin/pip check \
 && /opt/kvmesh/bin/pip uninstall -y pip
RUN groupadd --gid 10001 kvmesh \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/kvmesh --shell /usr/sbin/nologin kvmesh
USER 10001:10001
WORKDIR /home/kvmesh
ENTRYPOINT ["kvmesh"]
CMD ["--help"]
