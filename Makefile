# moeverify: the README's two commands are `make demo` and `make test`; both set everything up first.
PY := .venv/bin/python
NPROC ?= 2

.PHONY: setup demo lint test test-unit test-distributed release bench clean

setup:
	@bash tools/setup.sh

demo: setup
	@mkdir -p runs
	$(PY) -m moeverify run scenarios/smoke.yaml --json runs/demo.json

lint: setup
	.venv/bin/ruff check .
	.venv/bin/lint-imports

# Lint (ruff and the import layers contract, seconds), unit tests, then the release matrix bit for bit on CPU ranks (a subset of the families matrix),
# then the torchrun scenario tests.
test: setup
	.venv/bin/ruff check .
	.venv/bin/lint-imports
	@mkdir -p runs
	$(PY) -m pytest -q -n $(NPROC) tests/unit
	$(PY) -m moeverify run scenarios/release.yaml scenarios/families_ci.yaml --json runs/release.json --junit runs/release.xml
	$(PY) -m pytest -q -p no:xdist -m "not release" tests/special_distributed

test-unit: setup
	$(PY) -m pytest -q -n $(NPROC) tests/unit

test-distributed: setup
	$(PY) -m pytest -q -p no:xdist -m "not release" tests/special_distributed

release: setup
	@mkdir -p runs
	$(PY) -m moeverify run scenarios/release.yaml scenarios/families_matrix.yaml --json runs/release.json --junit runs/release.xml
	$(PY) -m moeverify run scenarios/production_cpu.yaml --timeout 1800 --json runs/production_cpu.json --junit runs/production_cpu.xml
	$(PY) -m pytest -q -p no:xdist -m release tests/special_distributed

bench: setup
	$(PY) -m moeverify bench

clean:
	rm -rf .venv runs .pytest_cache
