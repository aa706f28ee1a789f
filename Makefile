# The two commands of the README, on a fresh machine:
#   make demo   - bootstrap .venv and run the demo on a local multi-node Ray cluster
#   make test   - bootstrap .venv and run the test suite
#   make test-unit - tests/unit only (no Ray, under a minute)
#   make test-pygloo - bootstrap .venv310 (Python 3.10, pygloo, no torch) and run the pygloo lane
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# the pygloo lane: pygloo has wheels up to Python 3.10 only, and this venv has no torch
PY310 ?= PYENV_VERSION=3.10.13 python3.10
VENV310 := .venv310
STAMP310 := $(VENV310)/.installed

.PHONY: demo demo-docs test test-unit test-pygloo fuzz lint bench bench-link soak venv venv310 clean nettools

venv: $(STAMP)

# torch's CPU build, pinned, from PyTorch's own index (torch from PyPI pulls the CUDA build and its packages).
# That index is used when it answers within 5 s; otherwise (a machine with no internet) the choice is left to
# pip's configuration, e.g. a local wheel mirror, instead of minutes of retries against an unreachable index.
# TORCH_INDEX=URL picks an index; TORCH_INDEX= (empty) always leaves it to pip's configuration.
PYTORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
TORCH_INDEX ?= $(shell $(PY) -c "import urllib.request as u; u.urlopen('$(PYTORCH_CPU_INDEX)/', timeout=5)" \
	>/dev/null 2>&1 && echo $(PYTORCH_CPU_INDEX))

# torch first, pinned, so pip never resolves a CUDA build; then the package and its extras
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install -q -e '.[torch,test,examples,data,lightning,transformers]'
	touch $(STAMP)

venv310: $(STAMP310)

$(STAMP310): pyproject.toml
	test -x $(VENV310)/bin/python || $(PY310) -m venv $(VENV310)
	$(VENV310)/bin/pip install -q --upgrade pip
	$(VENV310)/bin/pip install -q -e '.[pygloo,test]'
	touch $(STAMP310)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

# the demo run whose printed lines and plot the README shows: both are rewritten from one run
demo-docs: $(STAMP)
	mkdir -p demo_output
	PYTHONUNBUFFERED=1 $(BIN)/python examples/demo.py > demo_output/printed.txt 2>&1; status=$$?; \
		cat demo_output/printed.txt; [ $$status = 0 ] && $(BIN)/python examples/demo.py --readme demo_output/printed.txt

# tests/integration/test_netns.py needs iproute2's ip and tc: installed where missing (as root; without root those tests skip)
nettools:
	@command -v ip >/dev/null && command -v tc >/dev/null || \
		{ [ "$$(id -u)" = 0 ] && apt-get update -q && apt-get install -y -q iproute2; } || \
		echo "iproute2 not installed: tests/integration/test_netns.py will skip"

# the static checks first: ruff, the import contracts (pyproject's [tool.importlinter]) and mypy on the package
test: $(STAMP) nettools
	$(BIN)/ruff check ray_elastic tests examples bench
	$(BIN)/lint-imports
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -ra --durations=30 tests/unit tests/integration

# tests/unit only: no Ray, no rings of processes; on two pytest-xdist workers, in under a minute
test-unit: $(STAMP)
	$(BIN)/python -m pytest -q -ra -n 2 tests/unit

# the model-based test of the driver's core with 100,000 random scripts (the unit lane runs 5,000): before a release
fuzz: $(STAMP)
	RAY_ELASTIC_FUZZ_SCRIPTS=100000 $(BIN)/python -m pytest -q -ra -n 2 tests/unit/test_driver_model.py

# the conformance suite and the numpy example through a SIGKILL, on pygloo
test-pygloo: $(STAMP310)
	$(VENV310)/bin/python -m pytest -q -ra tests/integration/test_conformance.py tests/unit/test_backends.py tests/integration/test_backends_cluster.py tests/unit/test_collective_checks.py

# Ray Train (the peer the benchmarks compare with) only for the benchmarks
BENCH_STAMP := $(VENV)/.installed-bench

$(BENCH_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[torch,test,examples,bench]'
	touch $(BENCH_STAMP)

# every benchmark; each prints a table and writes bench/results/<name>.json (bench/RESULTS.md is written from them).
# Up to control_plane.py within 15 minutes on the 2-core machine bench/RESULTS.md names; lightning.py and
# transformers.py took 10.6 and 12.7 minutes more there, at load 13-29 (fewer repetitions: --rt-reps 1 --rounds 3)
bench: $(BENCH_STAMP)
	$(BIN)/python bench/commit.py
	$(BIN)/python bench/throughput.py
	$(BIN)/python bench/step_costs.py
	$(BIN)/python bench/rendezvous_scale.py
	$(BIN)/python bench/memory.py
	$(BIN)/python bench/allreduce.py --ranks 2,4 --rounds 11
	$(BIN)/python bench/shm_allreduce.py
	$(BIN)/python bench/scale.py
	$(BIN)/python bench/recovery.py
	$(BIN)/python bench/state_size.py
	$(BIN)/python bench/control_plane.py
	$(BIN)/python bench/lightning.py
	$(BIN)/python bench/transformers.py

# the newcomer's sync where the network is the limit: nodes in network namespaces, links capped at 10 Gbit/s
# (needs root; about 5 minutes)
bench-link: $(BENCH_STAMP) nettools
	$(BIN)/python bench/state_size.py --sizes 10,100 --link-gbit 10 --out state_size_link10

# the long chaos soak: 30 events on a 4-node local cluster (a few minutes); then 10 minutes without a slow node,
# a durable checkpoint every 10 commits, in which no worker may be evicted as a straggler; then 10 minutes of
# rank 0 waiting on a checkpoint store that takes 1.5 s per write (a commit every ~20 ms step, a checkpoint
# every 10 commits): its duties are not slowness, and no worker may be evicted either
soak: $(STAMP)
	$(BIN)/python tests/support/soak.py --events 30
	$(BIN)/python bench/straggler.py --arms calm,duties

lint: $(STAMP)
	$(BIN)/ruff check ray_elastic tests examples bench
	$(BIN)/lint-imports
	$(BIN)/mypy

clean:
	rm -rf $(VENV) $(VENV310)
