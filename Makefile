# The two commands: `make demo` (main job on the embedded default) and `make test`.
# Both create .venv with the pinned stack if it is missing.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-v1

export WANDB_MODE ?= offline
export PYTHONUNBUFFERED := 1

.PHONY: demo test venv clean checkpoint neuroshard-eval

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

# NeuroShard on this CPU. Cost data is measured on shards of a separate 512-table synthetic
# pool (seed 1); evaluation tasks use the test half of a 128-table pool (seed 0), so every
# evaluation table is unseen in pre-training. `make checkpoint` rebuilds the shipped
# checkpoint from scratch (about 20 min here); `make neuroshard-eval` the held-out comparison.
NS := experiments/neuroshard_cpu
NS_DATA := dataset.num_tables=128 dataset.batch_size=4096
NS_PRETRAIN_DATA := dataset.num_tables=512 dataset.batch_size=2048 dataset.seed=1
NS_ALGOS := [random,round_robin,size_greedy,dim_greedy,lookup_greedy,size_lookup_greedy,torchrec,neuroshard]

checkpoint: $(STAMP)
	$(PY) train.py stage=collect $(NS_PRETRAIN_DATA) collect.compute.num_samples=1200 \
		collect.comm.num_samples=200 out_dir=$(NS)/costdata_pool512
	$(PY) train.py stage=pretrain data_dir=$(NS)/costdata_pool512 out_dir=checkpoints/cpu_fbgemm

neuroshard-eval: $(STAMP)
	$(PY) train.py stage=tasks task=neuroshard_cpu $(NS_DATA) out_dir=$(NS)/tasks4
	$(PY) train.py stage=tasks task=neuroshard_cpu task.num_devices=8 $(NS_DATA) out_dir=$(NS)/tasks8
	$(PY) shard.py task_file=$(NS)/tasks4/test algorithms=$(NS_ALGOS) out_dir=$(NS)/runs/4dev
	$(PY) shard.py task_file=$(NS)/tasks8/test algorithms=$(NS_ALGOS) out_dir=$(NS)/runs/8dev
