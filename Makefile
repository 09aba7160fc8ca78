# Everything a fresh machine needs: `make test` (every test tier) and `make demo`.
# Python packages come from PyPI pinned by constraints.txt; Kubernetes binaries are
# built from Go modules once per machine into $(RAYTPU_K8S_CACHE).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | sha256sum | cut -c1-12)
PYTEST := $(PY) -m pytest -p no:cacheprovider

.PHONY: install test test-unit test-kube lint constraints clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev,local,gke]'
	rm -f $(VENV)/.installed-*
	touch $@

test: install
	$(PYTEST) tests/unit -q
	$(PYTEST) tests/fakekube tests/kube -q


test-unit: install
	$(PYTEST) tests/unit -q

test-kube: install


# Re-pin after changing dependencies in pyproject.toml.
constraints: install
	$(PY) -m pip freeze --exclude-editable | grep -vi '^airflow-provider-raytpu' > constraints.txt

clean:
	rm -rf $(VENV) build *.egg-info
