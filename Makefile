# Everything a fresh machine needs: `make demo` and `make test` (every test tier).
# Python packages come from PyPI pinned by constraints.txt; the test control plane's
# Kubernetes binaries are built from Go modules once per machine (tests/controlplane/build_binaries.sh).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | sha256sum | cut -c1-12)
PYTEST := $(PY) -m pytest -p no:cacheprovider --durations=15
UV_VERSION := 0.13.8

.PHONY: install demo lint test test-full docs test-unit test-fakeapi test-controlplane test-ray test-ray-training test-ray-rest test-deployment browser k8s-binaries kuberay-samples kueue bench constraints clean

install: $(STAMP)

# uv installs the ~300 pinned packages faster than pip, with the same resolution (`pip freeze` of
# both venvs is equal). It compiles the bytecode up front, as pip does: without it, the first tier
# that starts many Ray processes at once compiled Ray's modules in each of them (the control-plane
# tier took 672 s instead of 365 s).
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet uv==$(UV_VERSION)
	$(VENV)/bin/uv pip install --python $(PY) --quiet --compile-bytecode -c constraints.txt -e '.[dev,local,gke,report]'
	rm -f $(VENV)/.installed-*
	touch $@

# nightly_finetune end to end on the local backend (fake GCS, emulated v4 2x2x2 slice); prints a summary.
demo: install
	$(PY) example_dags/demo/run.py

# Lint and the docs first, then the tiers in two lanes (tests/tiers.py): the control plane's builds, its tier
# and the Ray training tier in one; unit, fake API, deployment and the rest of the Ray tier beside them.
# Budget: tests/README.md.
test: install lint docs
	MAKE="$(MAKE)" $(PY) tests/tiers.py

# ruff over the repository; mypy, strict, over the package (its settings and third-party gaps: pyproject.toml).
# mypy's cache is kept per machine, as the control plane's binaries are: a clean clone checks only what changed.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy --cache-dir $(HOME)/.cache/airflow-provider-raytpu/mypy

# Everything `make test` runs: it leaves nothing out for CI's budget any more (nightly_embeddings, the
# preempted-host + promotion run of nightly_finetune and two-slice training that loses a slice, all on the real
# operator, are in test-controlplane).
test-full: test

docs: install
	$(VENV)/bin/mkdocs build --strict --quiet -d build/site

# Pure logic: slices, manifests (against the KubeRay CRD schemas and KubeRay's TPU samples), status, packaging.
test-unit: install kuberay-samples
	RAYTPU_REQUIRE_SAMPLES=1 $(PYTEST) tests/unit -q

# KubeRay's TPU samples at the control plane's KubeRay tag, from its Go module (a download, no build).
kuberay-samples:
	bash tests/controlplane/build_binaries.sh --samples >/dev/null

# Hooks, operators, triggers and DAG runs against a fake Kubernetes API over real HTTP.
test-fakeapi: install
	$(PYTEST) tests/fakeapi -q

# The real control plane: etcd, kube-apiserver, scheduler, controller manager and the KubeRay
# operator, built once per machine into ~/.cache/airflow-provider-raytpu/k8s (9-25 min cold).
k8s-binaries:
	bash tests/controlplane/build_binaries.sh

# Kueue's manager, CRDs and webhook registrations, from its Go module (about 3 min cold), for tests/controlplane/test_kueue.py.
kueue:
	bash tests/controlplane/build_binaries.sh --kueue >/dev/null

test-controlplane: install k8s-binaries kueue
	RAYTPU_REQUIRE_K8S=1 $(PYTEST) tests/controlplane -q

# Real Ray: the local backend, Ray jobs, Serve, Ray Data and JaxTrainer on emulated TPU slices.
test-ray: install
	$(PYTEST) tests/ray -q

# The Ray tier in two parts that `make test` runs in different lanes: JaxTrainer on multi-host emulated
# slices (in this order: the tests that kill a host last) and everything else in tests/ray.
RAY_TRAINING := tests/ray/local_backend/test_training.py tests/ray/local_backend/test_demo.py \
	tests/ray/local_backend/test_multislice.py tests/ray/workloads/test_fault_tolerance.py
test-ray-training: install
	$(PYTEST) $(RAY_TRAINING) -q

test-ray-rest: install
	$(PYTEST) tests/ray $(addprefix --ignore=,$(RAY_TRAINING)) -q

# A real Airflow deployment: api-server, scheduler, dag-processor and triggerer as separate processes
# (LocalExecutor on SQLite, a private AIRFLOW_HOME), the local backend, driven through the REST API and,
# in tests/deployment/test_browser.py, a headless Chromium.
test-deployment: install browser
	$(PYTEST) tests/deployment -q

# Debian's Chromium for the browser test (Playwright drives it; it downloads no browser). Needs root once.
browser:
	@test -x /usr/bin/chromium || { export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1 || \
		{ apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium >/dev/null; }; }

# Benchmarks against the existing tools (not part of `make test`); writes docs/benchmarks.md.
bench: install
	$(PY) benchmarks/run_all.py

# Re-pin after changing dependencies in pyproject.toml.
constraints: install
	$(PY) -m pip freeze --exclude-editable | grep -vi '^airflow-provider-raytpu\|^uv==' > constraints.txt

clean:
	rm -rf $(VENV) build *.egg-info
