# The two commands a new machine needs: `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
DIST   ?= dist
# Framework plugins pull in torch / onnxruntime / tensorflow (GBs): only `make test` installs
# them. `make run` (install) gets the light plugins: every other plugins/pyserve-backend-*.
FRAMEWORK_PLUGINS := plugins/pyserve-backend-onnxruntime plugins/pyserve-backend-pytorch plugins/pyserve-backend-tensorflow
LIGHT_PLUGINS := $(filter-out $(FRAMEWORK_PLUGINS),$(wildcard plugins/pyserve-backend-*))
EXAMPLE_PLUGINS := $(wildcard examples/pyserve-backend-*)
# The core distribution (pyserve-server) holds the server, the hookspecs contract and the bundled
# example repository (setup.py); every plugin is a distribution of its own. tritonclient[http]:
# the README's client call runs in .venv as pasted.
PACKAGES := -e . $(addprefix -e ,$(LIGHT_PLUGINS)) $(addprefix -e ,$(EXAMPLE_PLUGINS)) 'tritonclient[http]'
# The checkout's packages are built with the venv's own setuptools: no fresh build environment
# (a setuptools install) for each of them.
PIP_LOCAL := $(BIN)/python -m pip install --quiet --no-build-isolation
BUILD_DEPS := 'setuptools>=77'
# torch is pinned and installed first, on its own: an unpinned resolve would fetch a CUDA build.
TORCH_VERSION ?= 2.13.0
FRAMEWORK_PACKAGES := -e 'plugins/pyserve-backend-onnxruntime[cpu]' -e plugins/pyserve-backend-pytorch \
	-e 'plugins/pyserve-backend-tensorflow[cpu]' 'onnx>=1.15'
# The checkout's own packages are installed editable, so pip compiles none of them: they are
# compiled once here, and `pyserve run` starts from bytecode also where PYTHONDONTWRITEBYTECODE
# is set (as in many containers), instead of compiling some 200 modules at every start.
COMPILE := $(BIN)/python -m compileall -q -j 0 pyserve hookspecs/src $(wildcard plugins/*/src) $(wildcard examples/*/src)
PYPROJECTS := pyproject.toml setup.py $(wildcard plugins/*/pyproject.toml) $(wildcard examples/*/pyproject.toml)

.PHONY: run test install install-test dist proto clean

run: $(VENV)/.installed  ## install, then serve the bundled example repository on :8000
	$(BIN)/pyserve run $(ARGS)

# Run a second time with PYSERVE_TEST_LAYOUT=frontends (every connection goes to a frontend
# process): the tests of what frontends relay or answer with replicas (model control,
# sequences, ensembles, shared memory, statistics, metrics, Python and native models). The
# default layout reaches those paths only when a test opens a second connection.
FRONTEND_PATH_TESTS := tests/handoff tests/dataplane tests/metrics tests/runtime/test_model_control.py \
	tests/runtime/test_sequence_batching.py tests/runtime/test_ensemble.py tests/runtime/test_ensemble_decoupled.py \
	tests/runtime/test_dynamic_batching.py plugins/pyserve-backend-python plugins/pyserve-backend-native

# PYSERVE_TEST_LAYOUT=default: the suite's servers run in the process layout `pyserve run`
# chooses on this machine (frontend processes, replicas), as users get it
test: $(VENV)/.installed-test  ## install what the tests need, lint, then run them all
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/mypy
	PYSERVE_TEST_LAYOUT=default $(BIN)/python -m pytest $(PYTEST_ARGS)
	PYSERVE_TEST_LAYOUT=frontends $(BIN)/python -m pytest $(PYTEST_ARGS) $(FRONTEND_PATH_TESTS)

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python $(PYPROJECTS)
	$(BIN)/python -m pip install --quiet $(BUILD_DEPS)
	$(PIP_LOCAL) $(PACKAGES)
	$(COMPILE)
	touch $@

# One resolve of everything the tests need (make install's packages included), so nothing is
# installed twice.
$(VENV)/.installed-test: $(BIN)/python $(PYPROJECTS)
	# The status page's browser test drives Debian's Chromium; without apt (or root) it is skipped.
	command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
		chromium fonts-dejavu-core >/dev/null; } || echo "chromium not installed: the browser test will be skipped"
	$(BIN)/python -m pip install --quiet $(BUILD_DEPS) torch==$(TORCH_VERSION)
	$(PIP_LOCAL) $(PACKAGES) $(FRAMEWORK_PACKAGES) -e '.[test,ray]'
	# Triton's own compiled Python backend, hosted by pyserve-backend-native's tests. --no-deps:
	# its requirements would replace the server's numpy.
	$(BIN)/python -m pip install --quiet --no-deps nvidia-pytriton==0.7.0
	$(COMPILE)
	touch $(VENV)/.installed $@

# Wheels of the core and of every plugin (docs/packaging.md): `pip install dist/pyserve_server-*.whl`
# serves the bundled example repository once its backends are installed too.
dist: $(BIN)/python  ## build the wheels of the core and of every plugin into dist/
	$(BIN)/python -m pip install --quiet $(BUILD_DEPS)
	rm -rf build $(addsuffix /build,$(wildcard plugins/* examples/pyserve-backend-*))
	$(BIN)/python -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir $(DIST) \
		. $(wildcard plugins/pyserve-backend-*) $(EXAMPLE_PLUGINS)

proto:  ## regenerate pyserve/protocol/descriptors.binpb from the .proto files
	$(BIN)/python scripts/gen_protos.py

clean:
	rm -rf $(VENV) build dist *.egg-info */*/build */*/src/*.egg-info hookspecs/src/*.egg-info
