# The README's two commands: `make lab` (set up, open the quickstart) and `make test` (set up, run every test).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# OpenMP threads that spin while waiting make small CPU steps 10x slower on a busy machine.
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: lab test test-matrix test-min min-venv browser-test colab-test lint notebooks bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt torch==2.13.0
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[lab,dev,finetune]"
	touch $(STAMP)

# Jupyter refuses to run as root unless told; containers and cloud machines often are root.
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)
LAB_ARGS ?=

# The quickstart and the Playground (notebook 06) open as two tabs: `jupyter lab` opens only its first path, so the
# layout is a workspace (notebooks/memkit.jupyterlab-workspace), copied where JupyterLab looks for workspace "memkit"
# (file name: jupyterlab_server's slug of it) each time, so `make lab` starts from it; the browser opens it.
LAB_WORKSPACES := $(VENV)/lab-workspaces

lab: $(STAMP)
	mkdir -p $(LAB_WORKSPACES)
	cp notebooks/memkit.jupyterlab-workspace $(LAB_WORKSPACES)/memkit-00a7.jupyterlab-workspace
	$(BIN)/jupyter lab $(ROOT_FLAG) $(LAB_ARGS) --ServerApp.root_dir=notebooks \
		--LabApp.workspaces_dir=$(LAB_WORKSPACES) --LabApp.default_url=/lab/workspaces/memkit

# The unit tests and the notebooks (a notebook's cells kept together in one worker: --dist loadfile) run in
# TEST_WORKERS processes (pytest-xdist): most tests are single-threaded Python over small models, so two workers keep
# both cores of a 2-core machine busy. TEST_WORKERS=0 runs them one after another in one process.
TEST_WORKERS ?= 2
# Each unit-test worker runs with its share of the cores (tests/conftest.py: a thread per core in each worker
# oversubscribes the machine, ~3x slower on real tensors). The notebooks keep torch's default, as a reader's kernel
# has: notebook 01's largest allocation is CPU flash attention's per-thread buffer, whose size follows the threads.

# The notebooks go to the workers longest first (smoke seconds on 2 cores: 09 ~60, 03 ~45, 00 ~38, 08 ~35, ...): in
# alphabetical order the longest, 09, started last and ran alone for a minute. Any notebook not named runs after them.
NOTEBOOKS_FIRST := $(addprefix notebooks/,09_planning.ipynb 03_checkpointing.ipynb 00_quickstart.ipynb \
	08_finetuning.ipynb 01_memory_timelines.ipynb 07_fsdp.ipynb 02_ema.ipynb 06_playground.ipynb)
NOTEBOOKS_LONGEST_FIRST := $(NOTEBOOKS_FIRST) $(filter-out $(NOTEBOOKS_FIRST),$(sort $(wildcard notebooks/*.ipynb)))

# .venv-colab is created in the background while the unit tests run (about 4 minutes, mostly downloads and unpacking:
# in sequence it would take CI past 20 minutes); its log is .venv-colab.log. No coverage here: coverage's tracer
# makes memkit's Python-heavy tracking ~1.7x slower (one full-size estimate test: 28 s -> 48 s), which would take
# CI past 20 minutes; `make coverage` measures it.
test: $(STAMP)
	$(BIN)/ruff check memkit tests bench
	$(MAKE) --no-print-directory $(COLAB_FINETUNE) > $(COLAB_VENV).log 2>&1 & colab=$$!; \
	$(BIN)/python -m pytest tests --ignore=tests/browser --ignore=tests/colab -m "not extended" -n $(TEST_WORKERS) \
		--dist worksteal --durations=15 \
	&& MEMKIT_SMOKE=1 PLOTLY_RENDERER=json $(BIN)/python -m pytest --nbval-lax -n $(TEST_WORKERS) --dist loadfile \
		$(NOTEBOOKS_LONGEST_FIRST) \
	&& { wait $$colab || { tail -50 $(COLAB_VENV).log; echo "creating $(COLAB_VENV) failed"; exit 1; }; }
	$(MAKE) browser-test colab-test-all

# The edit-test loop: the unit tests not marked slow (the `slow` marker, pyproject.toml: every preset trained, the
# CPU-path subprocesses, fresh interpreters, the README, tests of several seconds, and the cases of parametrized suites
# beyond the one per code path a module's FAST_CASES keeps: tests/conftest.py), in TEST_WORKERS processes, no coverage,
# no notebooks; ~300 CPU-seconds, 2:32 on two idle cores (bench/RESULTS.md). `make test` runs them all.
.PHONY: test-fast
test-fast: $(STAMP)
	$(BIN)/python -m pytest tests --ignore=tests/browser --ignore=tests/colab -m "not slow" -n $(TEST_WORKERS) --durations=15

# The extended tier (the `extended` marker, tests/conftest.py): the slow suites' cases for the presets beyond
# CORE_PRESETS (every preset trained in every setting, ~1-2 minutes per preset), and cases that repeat a CI case at a
# larger size; `make test` runs the core presets' cases and every preset's fast contract, within CI's 20 minutes.
.PHONY: test-extended
test-extended: $(STAMP)
	$(BIN)/python -m pytest tests --ignore=tests/browser --ignore=tests/colab -m extended -n $(TEST_WORKERS) --durations=15

# The GPU suite (tests/gpu, bench/GPU.md): a tracked step, the allocator model and every preset's small estimate held
# against a CUDA device's own counters, in one process; then bench/gpu_report.py writes the figures into bench/GPU.md
# (skipped when the run wrote none). On a machine without CUDA every test is skipped, with one line saying why
# (`make test` collects tests/gpu too, at no cost, for the same line).
.PHONY: test-gpu
test-gpu: $(STAMP)
	$(BIN)/python -m pytest -p no:cacheprovider tests/gpu -n 0 -v -rs; status=$$?; \
	if ls bench/gpu_results/*.jsonl > /dev/null 2>&1; then $(BIN)/python -m bench.gpu_report; fi; exit $$status

# Line coverage of memkit by the unit tests (pytest-cov; the missed lines listed). Slower than `make test`'s run.
.PHONY: coverage
coverage: $(STAMP)
	$(BIN)/python -m pytest tests --ignore=tests/browser --ignore=tests/colab -n $(TEST_WORKERS) \
		--cov=memkit --cov-report=term-missing:skip-covered

# The Playground in JupyterLab in headless Chromium (Playwright): notebook 06 run, a toggle changed, Run pressed,
# the live timeline and the table checked; and every kind of memkit figure drawn by plotly.js at 700, 800 and 1400 px
# wide, failing on overlapping titles, legends, annotations and tick labels (tests/browser/test_figure_layout.py;
# MEMKIT_FIGURE_DIR=dir saves each drawing). Needs Chromium (Debian: apt-get install chromium); skips without it.
# MEMKIT_SCREENSHOT_DIR=notebooks/screenshots also saves the app's screenshot there.
# MEMKIT_BROWSER_THROTTLE=6 slows the page's CPU 6x during Run All (the race that once left the figures blank);
# MEMKIT_BROWSER_CONTROL=1 adds the control: plotly's own FigureWidget in the app's place, expected blank (3 min each).
browser-test: $(STAMP)
	$(BIN)/python -m pytest -p no:cacheprovider tests/browser

# A second environment with Colab's widget and plotly versions (constraints-colab.txt) and what the notebooks' own
# %pip lines install there (memkit with the fine-tuning extra, which 00, 08 and 09 need): `make colab-test-all`, run by
# `make test` and CI, checks the app's static-figure path and runs every notebook's quick run there, in TEST_WORKERS
# workers longest first as in `make test` (~2.5 minutes on 2 cores). `make colab-test`: the Playground notebook (06)
# alone, without the fine-tuning extra (~35 s).
COLAB_VENV := .venv-colab
COLAB_STAMP := $(COLAB_VENV)/.installed

$(COLAB_STAMP): pyproject.toml constraints.txt constraints-colab.txt
	$(PYTHON) -m venv $(COLAB_VENV)
	$(COLAB_VENV)/bin/python -m pip install --quiet -c constraints.txt -c constraints-colab.txt torch==2.13.0
	$(COLAB_VENV)/bin/python -m pip install --quiet -c constraints.txt -c constraints-colab.txt -e . "pytest>=8" \
		"nbval>=0.11"
	touch $(COLAB_STAMP)

# The fine-tuning extra (peft, transformers, bitsandbytes, torchao: notebooks 00, 08 and 09 install it on Colab), for
# colab-test-all; notebook 06 needs none of it.
COLAB_FINETUNE := $(COLAB_VENV)/.installed-finetune

$(COLAB_FINETUNE): $(COLAB_STAMP)
	$(COLAB_VENV)/bin/python -m pip install --quiet -c constraints.txt -c constraints-colab.txt -e ".[finetune]" \
		"pytest-xdist>=3"
	touch $(COLAB_FINETUNE)

colab-test: $(COLAB_STAMP)
	MEMKIT_COLAB_ENV=1 $(COLAB_VENV)/bin/python -m pytest -p no:cacheprovider tests/colab
	MEMKIT_SMOKE=1 PLOTLY_RENDERER=json $(COLAB_VENV)/bin/python -m pytest -p no:cacheprovider --nbval-lax \
		notebooks/06_playground.ipynb

.PHONY: colab-test-all
colab-test-all: $(COLAB_FINETUNE)
	MEMKIT_COLAB_ENV=1 $(COLAB_VENV)/bin/python -m pytest -p no:cacheprovider tests/colab
	MEMKIT_SMOKE=1 PLOTLY_RENDERER=json $(COLAB_VENV)/bin/python -m pytest -p no:cacheprovider --nbval-lax \
		-n $(TEST_WORKERS) --dist loadfile $(NOTEBOOKS_LONGEST_FIRST)

# The torch version matrix (memkit/_torch_compat.py: the supported range, and which feature needs which torch): the
# fast tests under the oldest and the newest torch pyproject.toml allows, each in its own virtualenv .venv-torch-X.Y
# with X.Y's newest patch release from PyPI. `make test` stays on the pinned 2.13.0 (a local CPU wheel); the others
# are CUDA builds: creating one venv downloads ~3.5 GB and takes ~4 minutes plus ~1 for the project (6.5 GB on disk),
# once. tests/test_torch_compat.py checks that MATRIX_TORCH names the ends of the declared range.
MATRIX_TORCH := 2.8 2.14
MATRIX_TESTS ?= tests/test_torch_compat.py tests/test_tracker_fast.py tests/test_allocator.py tests/test_cuda.py \
	tests/test_events.py tests/test_offload.py tests/test_cpu_paths.py tests/test_workspace_fast.py tests/test_fsdp.py
# CI's share of it (.ci/run, beside `make test`): the shims and the features that broke on old torch (saved-tensor
# hooks in disk offload's training, the tracker's patches, the FSDP refusal), about a minute on 2 cores.
MIN_TESTS ?= tests/test_torch_compat.py tests/test_tracker_fast.py tests/test_allocator.py \
	tests/test_offload.py::test_training_keeps_only_the_groups_in_use \
	tests/test_offload.py::test_a_tracker_sees_each_mapping_as_parameter_memory_made_and_freed
MIN_TORCH := $(firstword $(MATRIX_TORCH))

.PRECIOUS: .venv-torch-%/.installed
.venv-torch-%/.installed: pyproject.toml
	$(PYTHON) -m venv .venv-torch-$*
	.venv-torch-$*/bin/python -m pip install --quiet "torch==$*.*"
	.venv-torch-$*/bin/python -m pip install --quiet -e . "torch==$*.*" "pytest>=8" "pytest-xdist>=3" "hypothesis>=6"
	touch $@

# The oldest diffusers pyproject.toml allows (memkit.models.DIFFUSERS_FLOOR), beside the pinned torch: the fast tests of
# what depends on diffusers' model code (presets, estimates, the optimizations). Pure Python: about a minute to create.
DIFFUSERS_MIN := 0.35
DIFFUSERS_TESTS ?= tests/test_models.py tests/test_estimate.py tests/test_checkpointing.py tests/test_offload.py \
	tests/test_feedforward.py tests/test_ema.py tests/test_step.py tests/test_categories.py

.venv-diffusers-$(DIFFUSERS_MIN)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv .venv-diffusers-$(DIFFUSERS_MIN)
	.venv-diffusers-$(DIFFUSERS_MIN)/bin/python -m pip install --quiet -c constraints.txt torch==2.13.0
	.venv-diffusers-$(DIFFUSERS_MIN)/bin/python -m pip install --quiet -c constraints.txt -e ".[dev]" \
		"diffusers==$(DIFFUSERS_MIN).*"
	touch $@

test-matrix: $(foreach v,$(MATRIX_TORCH),.venv-torch-$(v)/.installed) .venv-diffusers-$(DIFFUSERS_MIN)/.installed
	@failed=""; for v in $(MATRIX_TORCH); do \
		echo "== torch $$(.venv-torch-$$v/bin/python -c 'import torch; print(torch.__version__)')"; \
		.venv-torch-$$v/bin/python -m pytest -p no:cacheprovider -q -n $(TEST_WORKERS) $(MATRIX_TESTS) || failed="$$failed torch-$$v"; \
	done; \
	echo "== diffusers $$(.venv-diffusers-$(DIFFUSERS_MIN)/bin/python -c 'import diffusers; print(diffusers.__version__)')"; \
	.venv-diffusers-$(DIFFUSERS_MIN)/bin/python -m pytest -p no:cacheprovider -q -n $(TEST_WORKERS) -m "not slow" \
		$(DIFFUSERS_TESTS) || failed="$$failed diffusers-$(DIFFUSERS_MIN)"; \
	[ -z "$$failed" ] || { echo "failed under$$failed"; exit 1; }

min-venv: .venv-torch-$(MIN_TORCH)/.installed

test-min: min-venv
	.venv-torch-$(MIN_TORCH)/bin/python -m pytest -p no:cacheprovider -q -n $(TEST_WORKERS) $(MIN_TESTS)

lint: $(STAMP)
	$(BIN)/ruff check memkit tests bench
	$(BIN)/ruff format --check memkit tests bench

# Re-run every notebook and store it executed, with static PNG figures so GitHub shows them, and each widget output
# as the Playground's screenshot (notebooks/_store.py: GitHub cannot draw a live widget).
# Needs Chromium for kaleido (Debian: apt-get install chromium).
notebooks: $(STAMP)
	BROWSER_PATH=$${BROWSER_PATH:-/usr/bin/chromium} PLOTLY_RENDERER=png+json $(BIN)/jupyter nbconvert --to notebook --execute --inplace notebooks/*.ipynb
	$(BIN)/python notebooks/_store.py notebooks/*.ipynb

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
	rm -rf $(VENV) $(COLAB_VENV) $(COLAB_VENV).log .venv-torch-* .venv-diffusers-* .pytest_cache
