# gpulaunch in a container: the launcher, its workloads and Ray, for docker-compose.yml (a Ray
# head plus workers) or for running `launch` itself in a container.
#
#   docker build -t gpulaunch .                                            # torch from PyPI (CUDA build)
#   docker build -t gpulaunch --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .   # CPU only
#
# GPUs reach a container through the NVIDIA Container Toolkit on the host (see docker-compose.yml).
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# openssh-client: `--cluster` launches from inside a container; procps/iproute2: ps, ip for debugging.
RUN apt-get update \
 && apt-get install -y --no-install-recommends openssh-client procps iproute2 \
 && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 1000 gpulaunch
WORKDIR /opt/gpulaunch

# Dependencies first (cached while only the code changes): torch, then the package with Ray.
ARG TORCH_INDEX_URL=
ARG TORCH_VERSION=2.13.0
RUN if [ -n "$TORCH_INDEX_URL" ]; then \
      pip install --index-url "$TORCH_INDEX_URL" "torch==${TORCH_VERSION}"; \
    else \
      pip install "torch==${TORCH_VERSION}"; \
    fi
COPY pyproject.toml README.md ./
COPY launcher ./launcher
RUN pip install ".[ray]"
COPY jobs ./jobs
COPY configs ./configs

USER gpulaunch
# 6379 GCS, 8265 dashboard + Jobs API, 10001 Ray client
EXPOSE 6379 8265 10001
CMD ["launch", "--help"]
