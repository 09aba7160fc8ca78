# Everything a fresh machine needs: `make test` (every test tier) and `make demo`.
# Python packages come from PyPI pinned by constraints.txt; Kubernetes binaries are
# built from Go modules once per machine into $(RAYTPU_K8S_CACHE).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | sha256sum | cut -c1-12)
PYTEST := $(PY) -m pytest -p no:cacheprovider

.PHONY: demo docs install test test-unit test-kube test-k8s test-ray k8s-binaries constraints clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev,local,gke]'
	rm -f $(VENV)/.installed-*
	touch $@

# nightly_finetune end to end on the local backend (fake GCS, emulated v4 2x2x2 slice); prints a summary.
demo: install
	$(PY) example_dags/demo/run.py

test: install k8s-binaries
	$(VENV)/bin/mkdocs build --strict --quiet -d build/site
	$(PYTEST) tests/unit -q
	$(PYTEST) tests/fakekube tests/kube -q
	RAYTPU_REQUIRE_K8S=1 $(PYTEST) tests/k8s -q


test-unit: install
	$(PYTEST) tests/unit -q

test-kube: install


# The real control plane (etcd, kube-apiserver, scheduler, controller manager, KubeRay) built
# from Go modules once per machine into ~/.cache/airflow-provider-raytpu/k8s: 9-25 min cold, 0.05 s warm.
k8s-binaries:
	bash tests/k8s/build_binaries.sh

test-k8s: install k8s-binaries
	RAYTPU_REQUIRE_K8S=1 $(PYTEST) tests/k8s -q

docs: install
	$(VENV)/bin/mkdocs build --strict -d build/site

# Real Ray: the local backend, Ray jobs, Serve, Ray Data and JaxTrainer on emulated TPU slices.
test-ray: install
	$(PYTEST) tests/local tests/workloads -q

# Re-pin after changing dependencies in pyproject.toml.
constraints: install
	$(PY) -m pip freeze --exclude-editable | grep -vi '^airflow-provider-raytpu' > constraints.txt

clean:
	rm -rf $(VENV) build *.egg-info
