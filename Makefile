# Two entry points for a fresh machine: `make demo` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: install test demo clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[trainer,local,dev]'
	touch $@

test: install
	$(PY) -m pytest

demo: install
	$(PY) -m trainfleet.cli demo

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
