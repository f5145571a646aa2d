# The two commands a new machine needs: `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PACKAGES := -e hookspecs -e . $(addprefix -e ,$(wildcard plugins/pyserve-backend-*)) -e examples/pyserve-backend-string-processor
PYPROJECTS := pyproject.toml hookspecs/pyproject.toml $(wildcard plugins/*/pyproject.toml) $(wildcard examples/*/pyproject.toml)

.PHONY: run test install install-test proto clean

run: $(VENV)/.installed  ## install, then serve the bundled example repository on :8000
	$(BIN)/pyserve run $(ARGS)

test: $(VENV)/.installed-test  ## install what the tests need, then run them all
	$(BIN)/python -m pytest $(PYTEST_ARGS)

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python $(PYPROJECTS)
	$(BIN)/python -m pip install --quiet $(PACKAGES)
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet $(PACKAGES) -e '.[test]'
	touch $@

proto:  ## regenerate pyserve/protocol/descriptors.binpb from the .proto files
	$(BIN)/python scripts/gen_protos.py

clean:
	rm -rf $(VENV) build dist *.egg-info */*.egg-info */*/src/*.egg-info hookspecs/src/*.egg-info
