# The image the Helm chart runs (helm/tandem): Tandem, Ray and the bundled demo models, for the
# router, the Ray head and both worker pools alike. It installs as the Makefile does, pip with
# constraints.txt, without the dev extra.
#
#   CPU (default):  docker build -t tandem:0.1.0 .
#   CUDA:           docker build -t tandem:0.1.0-cuda \
#                     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#                     --build-arg EXTRAS=http,otlp,gpu .
#
# docs/kubernetes.md ("The image") explains the variants.
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim

# Where pip finds torch's build: its CPU wheels by default (constraints.txt pins the version; the
# index's 2.13.0+cpu satisfies torch==2.13.0). Empty: PyPI's default build, which on Linux is CUDA's.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Extras of the tandem-serve package: http (OpenAI API), otlp (trace export), gpu (NCCL).
ARG EXTRAS=http,otlp

# KubeRay's default probes on Ray pods call wget. g++ builds the CPU kernels (cluster/model/kernel_build.py):
# here, for every instruction set the dispatch knows, so a pod on any x86 node finds its own built; a
# pod whose image lacks them (a changed source) builds them on its first start, under
# TANDEM_KERNELS_DIR; without g++ workers fall back to torch's paths.
RUN apt-get update \
    && apt-get install -y --no-install-recommends wget g++ \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/tandem
COPY . .
RUN python -m pip install --no-cache-dir --upgrade pip \
    && python -m pip install --no-cache-dir ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} \
        -c constraints.txt ".[${EXTRAS}]"
ENV TANDEM_KERNELS_DIR=/opt/tandem/kernels
RUN python -m cluster.model.kernel_build every && chmod -R a+rX "$TANDEM_KERNELS_DIR"

# The chart runs every pod as user 1000.
RUN useradd --create-home --uid 1000 tandem
USER 1000
ENV HOME=/home/tandem
CMD ["tandem", "--help"]
