# draftwise: two commands do all set-up on a fresh machine.
#   make demo   - create .venv (pip), install draftwise, run the main job on the embedded models
#   make test   - same set-up, then the test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install models bench clean

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

models: $(STAMP)
	$(BIN)/python -m draftwise.cli.main train all --out models --target-minutes 80 --draft-minutes 15 --draft-continue-minutes 100

clean:
	rm -rf $(VENV) build *.egg-info
