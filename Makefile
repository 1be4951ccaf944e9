# The README's two commands: `make lab` (set up, open the quickstart) and `make test` (set up, run every test).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# OpenMP threads that spin while waiting make small CPU steps 10x slower on a busy machine.
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: lab test lint notebooks bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt torch==2.13.0
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[lab,dev]"
	touch $(STAMP)

# Jupyter refuses to run as root unless told; containers and cloud machines often are root.
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)
LAB_ARGS ?=

lab: $(STAMP)
	$(BIN)/jupyter lab $(ROOT_FLAG) $(LAB_ARGS) notebooks/00_quickstart.ipynb

test: $(STAMP)
	$(BIN)/ruff check memkit tests bench
	$(BIN)/python -m pytest tests --cov=memkit --cov-report=term-missing:skip-covered
	MEMKIT_SMOKE=1 PLOTLY_RENDERER=json $(BIN)/python -m pytest --nbval-lax notebooks

lint: $(STAMP)
	$(BIN)/ruff check memkit tests bench
	$(BIN)/ruff format --check memkit tests bench

# Re-run every notebook and store it executed, with static PNG figures so GitHub shows them.
# Needs Chromium for kaleido (Debian: apt-get install chromium).
notebooks: $(STAMP)
	BROWSER_PATH=$${BROWSER_PATH:-/usr/bin/chromium} PLOTLY_RENDERER=png $(BIN)/jupyter nbconvert --to notebook --execute --inplace notebooks/*.ipynb

bench: $(STAMP)
	$(BIN)/python -m bench

# Mutation testing (mutmut): each module of memory/, handle, compare and optimizations/ mutated alone against its
# own fast tests; per-module results and the surviving mutants in bench/MUTATION.md. Too slow for `make test` and CI
# (well over an hour on 2 cores). Some modules: `make mutate MODULES="events timeline"` (names: bench/mutation.py).
.PHONY: mutate
MODULES ?=
MUTATION_STAMP := $(VENV)/.installed-mutation

$(MUTATION_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev,mutation]"
	touch $(MUTATION_STAMP)

mutate: $(MUTATION_STAMP)
	$(BIN)/python -m bench.mutation $(MODULES)

clean:
	rm -rf $(VENV) .pytest_cache
