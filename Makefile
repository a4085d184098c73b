# The two commands: `make demo` (main job on the embedded default) and `make test`.
# Both create .venv with the pinned stack if it is missing.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-v1

export WANDB_MODE ?= offline
export PYTHONUNBUFFERED := 1

.PHONY: demo test venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU stack verified together (DEVELOPERS.md): torch 2.13.0 + fbgemm-gpu-cpu 1.8.0,
	# torchrec 1.8.0 without its declared CUDA fbgemm-gpu dependency.
	$(PY) -m pip install -q torch==2.13.0 fbgemm-gpu-cpu==1.8.0
	$(PY) -m pip install -q --no-deps torchrec==1.8.0
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) shard.py

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) outputs multirun
