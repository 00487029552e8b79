# moeverify: the README's two commands are `make demo` and `make test`; both set everything up first.
PY := .venv/bin/python
NPROC ?= 2

BUSY ?= 4

.PHONY: setup demo lint test test-unit test-load test-distributed release bench clean

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
# torchrun scenario tests.
test: setup lint
	@mkdir -p runs
	$(PY) -m pytest -q -n $(NPROC) -m "not timing" tests/unit
	$(PY) tools/under_load.py --busy $(BUSY) -- $(PY) -m pytest -q -n $(NPROC) -m timing tests/unit
	$(PY) -m moeverify run scenarios/release.yaml scenarios/families_ci.yaml --json runs/release.json --junit runs/release.xml
	$(PY) -m pytest -q -p no:xdist --durations=15 -m "not release" tests/special_distributed

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

bench: setup
	$(PY) -m moeverify bench

clean:
	rm -rf .venv runs .pytest_cache
