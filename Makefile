# Two entry points for a fresh machine: `make demo` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
# The suite starts hundreds of Python processes (nodes, ranks, Lambda handlers, harnesses): with
# PYTHONDONTWRITEBYTECODE set, as some machines' environments have it, each compiles every module
# it imports (torch's, moto's, samtranslator's) from source again. Bytecode goes to the virtualenv
# and to __pycache__ folders git ignores.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install test test-repeat test-loaded chaos demo clean sam-tools validate artifacts oldest-torch test-oldest-torch browser docs

install: $(VENV)/.installed

# Bytecode is compiled once, on every core, after the install: pip compiles one file at a time
# (half the install), and left to first imports, the suite's first processes all compile torch
# and moto at once, each for itself (cold, four imports of both took twice the CPU of warm ones).
# torch/testing/_internal is torch's own test helpers, one of them in Python 3.12 syntax.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile --upgrade pip
	$(PY) -m pip install -q --no-compile -e '.[trainer,local,cli,dev]'
	$(PY) -m compileall -q -j0 -x 'torch/testing/_internal/' $(VENV)/lib
	touch $@

# The two virtualenvs (and the browser) are installed side by side: each is about one core's work.
test:
	$(MAKE) -j3 install sam-tools browser
	$(PY) -m pytest

# Chromium, for the report page's test in a real browser (tests/test_report_page.py): Debian's
# package, where apt-get is at hand, we are root and no Chromium is installed yet; elsewhere that
# test says there is no browser. The package lists are refreshed only if the install needs it.
CHROMIUM := apt-get install -y -q --no-install-recommends chromium >/dev/null
browser:
	@if command -v chromium >/dev/null || ! command -v apt-get >/dev/null || [ "$$(id -u)" != 0 ]; then \
	    command -v chromium >/dev/null || echo "no Chromium installed: the report page's browser test is skipped"; \
	else $(CHROMIUM) 2>/dev/null || (apt-get update -q >/dev/null && $(CHROMIUM)); fi

# The oldest torch the trainer supports (node/health.py TORCH_MINIMUM, which preflight holds
# nodes to): images lag the newest release. Its own virtualenv, with torch's Linux wheel and the
# CUDA libraries it loads (PyPI has no CPU-only build of it: about 5 GB, under a minute).
TORCH_OLDEST := 2.11.0
OLDEST_VENV := .venv-torch-oldest

oldest-torch: $(OLDEST_VENV)/.installed

# Only the project's dependencies: the tests import the project from the tree (PYTHONPATH), so
# the two installs never write the same egg-info at once.
$(OLDEST_VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(OLDEST_VENV)
	$(PYTHON) -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
	    print('\n'.join(p['dependencies'] + [r for x in ('node', 'local', 'dev') for r in p['optional-dependencies'][x]]))" \
	    > $(OLDEST_VENV)/requirements.txt
	$(OLDEST_VENV)/bin/pip install -q --no-compile torch==$(TORCH_OLDEST) -r $(OLDEST_VENV)/requirements.txt
	touch $@

# The trainer's equivalence across layouts, and the Checkpointer's own tests (saves, commits,
# resumes: torch's checkpoint internals move between releases). CI runs it after `make test`.
# The eight-rank world (pp x tp x dp at once, 80 CPU-seconds) runs on the newest torch only: what
# moves between releases (pipeline schedules, FSDP2, DCP) the two- and four-rank layouts exercise,
# pp x tp and pp x dp and tp x dp among them.
test-oldest-torch: oldest-torch
	PYTHONPATH=$(CURDIR) $(OLDEST_VENV)/bin/python -m pytest -p no:cacheprovider -n 2 \
	    tests/test_trainer_equivalence.py tests/checkpoint/test_checkpoint_unit.py \
	    --deselect 'tests/test_trainer_equivalence.py::test_parallel_layouts_match_single_process[gpt-8]' \
	    --deselect 'tests/test_trainer_equivalence.py::test_parallel_layouts_match_single_process[llama-8]'

# The whole suite N times, each from a fresh clone of HEAD as CI runs it: wall times, the tests
# that failed in any run and how often, the slowest tests (.ci/repeat.py).
N ?= 3
test-repeat:
	$(PYTHON) .ci/repeat.py $(N)

# The suite from a fresh clone of HEAD while a busy loop keeps one core busy the whole time, as a
# developer's machine has other work running: it must pass, however long it takes (a product
# timeout that fires on a healthy but slow machine is a defect).
test-loaded:
	$(PYTHON) .ci/repeat.py 1 --loaded

# What a node installs (trainfleet/adapters/ec2_fleet.py node_user_data), into build/artifacts/,
# and with BUCKET=... to s3://BUCKET/artifacts/00/ .. /15/ (ARTIFACT_COPIES: each node copies from
# the one its instance id picks, so a large launch shares 16 prefixes' request rates): a
# relocatable CPython 3.11 (python.tar.gz, its top folder python/), never the image's, and a
# wheelhouse of trainfleet with its `trainer` extra for x86_64 Linux (torch 2.13.0's wheel: its
# CUDA runtime and NCCL) in one tar (wheelhouse.tar): two named objects a node copies, no listing.
# The first copy is uploaded, the others are copied inside S3. Needs the package index and uv's
# Python downloads.
NODE_PLATFORM := manylinux_2_28_x86_64
artifacts: install
	rm -rf build/artifacts build/wheelhouse build/node-python && mkdir -p build/artifacts build/wheelhouse
	$(PY) -m pip wheel -q --no-deps --wheel-dir build/wheelhouse .
	$(PY) -m pip download -q --dest build/wheelhouse --only-binary=:all: --platform $(NODE_PLATFORM) \
	    --python-version 3.11 "$$(ls build/wheelhouse/trainfleet-*.whl)[trainer]"
	tar -cf build/artifacts/wheelhouse.tar -C build/wheelhouse .
	$(PY) -m pip install -q uv
	$(PY) -m uv python install 3.11 --install-dir build/node-python
	found=$$(cd build/node-python && ls -d cpython-3.11*-linux-x86_64-gnu | head -1) && \
	    tar -czf build/artifacts/python.tar.gz -C build/node-python --transform "s,^$$found,python," "$$found"
	test -z "$(BUCKET)" || { \
	    copies=$$($(PY) -c "from trainfleet.adapters.ec2_fleet import ARTIFACT_COPIES as n; print(n)") && \
	    aws s3 sync --delete build/artifacts s3://$(BUCKET)/artifacts/00/ && \
	    for copy in $$(seq -f %02g 1 $$((copies - 1))); do \
	        aws s3 sync --delete s3://$(BUCKET)/artifacts/00/ s3://$(BUCKET)/artifacts/$$copy/ || exit 1; done; }

# Every fault at every phase of a real local run (tests/chaos, localcloud/chaos.py). Two workers:
# every cell is a real run whose timeouts are seconds, and its modules are split for two.
chaos: install sam-tools
	$(PY) -m pytest tests/chaos -m chaos -n 2

demo: install
	$(PY) -m trainfleet.cli demo

# The reference pages made from the code: docs/RUNSPEC.md and docs/CLI.md (tests/test_reference_pages.py).
docs: install
	$(PY) -c "from trainfleet.cli import write_reference_pages; write_reference_pages()"

# aws-sam-cli pins its own boto3, so the deployment judges get a virtualenv of their own.
SAM_VENV := .venv-sam
SAM_TOOLS := aws-sam-cli==1.170.0 cfn-lint==1.58.0 statelint==3.1.0

sam-tools: $(SAM_VENV)/.installed

$(SAM_VENV)/.installed: Makefile
	$(PYTHON) -m venv $(SAM_VENV)
	$(SAM_VENV)/bin/pip install -q --no-compile $(SAM_TOOLS)
	touch $@

validate: install sam-tools
	$(PY) -m trainfleet.cli validate

# `sam build` (BuildMethod: makefile, build_in_source in samconfig.toml) calls these with
# ARTIFACTS_DIR set. The layer gets the project's runtime dependencies as Lambda's Linux
# wheels; each function gets only the control-plane packages, the trainer's torch-free
# checkpoint catalogue (the commit protocol the control plane reads) and its torch-free config
# checks with what they import (Validate runs them on the RunSpec's trainer section).
# Lambda's python3.11 runs on Amazon Linux 2023 (glibc 2.34): manylinux_2_28 wheels load there.
LAMBDA_WHEELS := --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --implementation cp \
	--python-version 3.11 --only-binary=:all:

build-LambdaDependencies:
	$(PYTHON) -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > $(ARTIFACTS_DIR)/requirements.txt
	$(PYTHON) -m pip install -q --target $(ARTIFACTS_DIR)/python $(LAMBDA_WHEELS) -r $(ARTIFACTS_DIR)/requirements.txt
	rm $(ARTIFACTS_DIR)/requirements.txt

# The Report function's own layer: the `report` extra, beside what LambdaDependencies holds.
build-ReportDependencies:
	$(PYTHON) -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['report']))" > $(ARTIFACTS_DIR)/requirements.txt
	$(PYTHON) -m pip install -q --target $(ARTIFACTS_DIR)/python $(LAMBDA_WHEELS) -r $(ARTIFACTS_DIR)/requirements.txt
	rm $(ARTIFACTS_DIR)/requirements.txt

# The DataPrep functions' layer: the `data` extra without the dependencies it does not load
# (tokenizers' huggingface_hub serves from_pretrained only), and pyarrow without what reading
# Parquet never loads (Flight, Gandiva, its tests and C++ headers): about 150 MB
# unpacked beside LambdaDependencies' 58, under Lambda's 250 MB for a function and its layers.
build-DataDependencies:
	$(PYTHON) -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['data']))" > $(ARTIFACTS_DIR)/requirements.txt
	$(PYTHON) -m pip install -q --no-deps --target $(ARTIFACTS_DIR)/python $(LAMBDA_WHEELS) -r $(ARTIFACTS_DIR)/requirements.txt
	rm $(ARTIFACTS_DIR)/requirements.txt
	cd $(ARTIFACTS_DIR)/python/pyarrow && rm -rf tests include *flight* *gandiva* \
	    libarrow_python.so libarrow_python.so.*.*.*

build-%Function:
	mkdir -p $(ARTIFACTS_DIR)
	cp -r functions trainfleet $(ARTIFACTS_DIR)/
	mkdir -p $(ARTIFACTS_DIR)/trainer
	cp trainer/__init__.py trainer/checkpoint_catalog.py trainer/config.py trainer/schedules.py trainer/tokenizer.py \
		trainer/shards.py trainer/prepare.py \
		$(ARTIFACTS_DIR)/trainer/
	find $(ARTIFACTS_DIR) -name __pycache__ -prune -exec rm -rf {} +

clean:
	rm -rf $(VENV) $(OLDEST_VENV) .pytest_cache build *.egg-info
