# Two commands for a fresh machine:
#   make demo   - set everything up (.venv) and run the demo
#   make test   - set everything up (.venv) and run the whole test suite
# The set-up prints one line per step, and pip's and setuptools' real warnings and errors;
# `make setup V=1` echoes the full commands and shows pip's output unfiltered.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
TORCH_VERSION = 2.13.0
TORCH   = torch==$(TORCH_VERSION)
REQS    = $(wildcard requirements/*.txt)
PLUGINS = $(wildcard backends/*/pyproject.toml)
# setup.py installs the DCPSTORE_DCP_ROUTING start-up hook (.pth) beside the package
PACKAGING = pyproject.toml setup.py dcpstore-dcp-routing.pth _dcpstore_dcp_routing.py

# pipefail: a pip that fails fails the step, though its output goes through a filter
SHELL := bash
.SHELLFLAGS := -o pipefail -c

V ?= 0
ifeq ($(V),0)
Q := @
# Two notes that say nothing about this project, filtered out (everything else shows):
# - pip, per project, for each file:// index or find-links folder of the machine's pip
#   config that lacks that project ("Location 'file:///.../simple/<name>/' is ignored:
#   it is neither a file nor a directory"): a miss in one index, as a 404 is on a remote
#   one, which pip does not print; ~190 lines on a machine with two such indexes;
# - setuptools, per editable install ("Editable installation. ... Please be careful with
#   folders in your working directory with the same name as your package"): an
#   InformationOnly warning it emits for every flat-layout project it installs with its
#   import finder (11 lines each; dcpstore's own folder is the one meant to be imported).
QUIET_PIP = PYTHONWARNINGS="ignore:Editable installation.:UserWarning"
PIP_FILTER = 2>&1 | sed -e "/^WARNING: Location '.*' is ignored: it is neither a file nor a directory\.$$/d"
else
Q :=
endif
PIP = $(QUIET_PIP) $(BIN)/python -m pip
STEP = @echo "==> setup:"

.PHONY: setup demo test test-matrix test-matrix-run matrix-venvs seed-venvs test-seeds test-seeds-run lint typecheck bench bench-quick bench-stall bench-stall-quick bench-curves bench-multihost test-gpu bench-gpu clean

setup: $(VENV)/.installed

# torch goes in first, alone and pinned, so no resolver ever pulls a CUDA build;
# everything else is pinned by requirements/constraints.txt (which pins torch too).
$(VENV)/.installed: $(PACKAGING) $(REQS) $(PLUGINS) backends/azure/install-azurite.sh \
		.ci/install-iproute2.sh
	$(STEP) '$(PYTHON) -m venv $(VENV)'
	$(Q)test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(STEP) 'pip install --upgrade pip'
	$(Q)$(PIP) install -q --upgrade pip $(PIP_FILTER)
	$(STEP) 'pip install $(TORCH) (CPU; alone and first, so nothing pulls a CUDA build)'
	$(Q)$(PIP) install -q $(TORCH) $(PIP_FILTER)
	$(STEP) 'pip install -r requirements/*.txt (pinned by requirements/constraints.txt)'
	$(Q)$(PIP) install -q -c requirements/constraints.txt \
	    $(foreach r,$(filter-out requirements/constraints.txt,$(REQS)),-r $(r)) $(PIP_FILTER)
	@# torchtitan's declared deps (datasets) cap fsspec below what s3fs/gcsfs need; its
	@# checkpoint component, which dcpstore.integrations.torchtitan uses, needs none of them
	$(STEP) 'pip install --no-deps torchtitan'
	$(Q)$(PIP) install -q -c requirements/constraints.txt --no-deps torchtitan $(PIP_FILTER)
	$(STEP) 'pip install -e . $(foreach p,$(PLUGINS),-e $(dir $(p)))'
	$(Q)$(PIP) install -q -c requirements/constraints.txt --no-build-isolation \
	    -e . $(foreach p,$(PLUGINS),-e $(dir $(p))) $(PIP_FILTER)
	@# no resolver may have replaced torch (a trainer or extra pulling a CUDA build)
	$(STEP) 'check that torch is still $(TORCH_VERSION) CPU (no resolver replaced it)'
	$(Q)$(BIN)/python -c "import sys, torch; v = torch.__version__; \
	    sys.exit(0 if v.split('+')[0] == '$(TORCH_VERSION)' and torch.version.cuda is None \
	    else 'pip replaced torch: found ' + v + ', want $(TORCH_VERSION) CPU')"
	$(STEP) 'npm install azurite (the Azure stand-in: backends/azure/install-azurite.sh)'
	$(Q)backends/azure/install-azurite.sh
	$(STEP) 'iproute2, where missing (the multi-host tests: .ci/install-iproute2.sh)'
	$(Q).ci/install-iproute2.sh
	$(Q)touch $@
	$(STEP) '$(VENV) is ready'

demo: setup
	$(BIN)/dcpstore demo

# `make test`: the whole suite on the development torch, then the torch matrix (the core
# suite on every other torch release dcpstore admits, each in its own venv); it fails if
# either failed. The matrix's venvs are made meanwhile, one after the other (mostly
# downloads and unpacking; their log is .venv-torch/setup.log, printed if one fails),
# so they are ready when the whole suite ends. Both stay
# under 60 minutes on 2 cores (docs/torch-matrix.md).
# make test's venvs (the torch matrix's CUDA builds, the seed systems) take ~33 GiB here,
# its servers and checkpoints a few more: a disk short of that fails tests with
# "No space left on device" (SeaweedFS: HTTP 500), so say so first.
TEST_DISK_GIB = 40
test: setup
	@free=$$(df -Pk . | awk 'NR==2 {print int($$4 / 1048576)}'); \
	if [ "$$free" -lt $(TEST_DISK_GIB) ]; then echo "warning: $$free GiB free on this" \
	    "disk; make test needs about $(TEST_DISK_GIB) GiB (venvs of the torch matrix and" \
	    "the seed systems, servers' data): tests may fail with 'No space left on device'"; fi
	@mkdir -p .venv-torch
	@$(MAKE) --no-print-directory matrix-venvs seed-venvs > .venv-torch/setup.log 2>&1 & venvs=$$!; \
	$(BIN)/python -m pytest -q --durations=20; main=$$?; \
	if ! wait $$venvs; then cat .venv-torch/setup.log; echo "torch matrix: a venv failed"; \
	    exit 1; fi; \
	$(MAKE) --no-print-directory test-matrix-run; matrix=$$?; \
	$(MAKE) --no-print-directory test-seeds-run; seeds=$$?; \
	exit $$(( main || matrix || seeds ))

# The torch matrix. The floor is dcpstore._version.TORCH_FLOOR (pyproject.toml says the
# same); 2.13.0 is the development venv's. Each release gets .venv-torch/<version>
# (.ci/torch-venv.sh: that torch first and alone, then the core's pins; nothing leaks
# between venvs). 2.14.1 is a CUDA build on local disk; 2.9.1, 2.10.0 and 2.15.0 come
# from the registry (CUDA builds, ~3 GB each with their libraries; they run on the CPU).
TORCH_MATRIX ?= $(shell sed -n 's/^torch==//p' requirements/matrix/torch.txt)
# The core suite: backends (local, S3 on SeaweedFS), writer and reader, the reshard
# matrix, commit protocol, corruption, crashes, Checkpointer modes, incremental,
# read-once, routing, CLI, the golden corpus, torch's own readers, torch's internals.
# The other plugins' code does not depend on the torch release: it runs in the
# development venv only.
MATRIX_STORES ?= local,seaweedfs
MATRIX_TESTS = tests/test_torch_internals.py tests/test_backend_local.py \
	tests/test_backend_s3.py tests/test_api.py tests/test_reshard_matrix.py \
	tests/test_read_path.py tests/test_commit_protocol.py tests/test_corruption.py \
	tests/test_crash.py tests/test_checkpointer_async.py tests/test_training.py \
	tests/test_incremental.py tests/test_read_once.py tests/integrations/test_dcp_routing.py \
	tests/test_cli.py tests/test_golden.py tests/test_compat_torch.py \
	tests/test_multiprocess_local.py tests/test_latest.py tests/test_local_tier.py \
	tests/test_overwrite.py tests/test_layout_auto.py

matrix-venvs: $(foreach v,$(TORCH_MATRIX),.venv-torch/$(v)/.installed)

.venv-torch/%/.installed: $(PACKAGING) requirements/constraints.txt requirements/core.txt \
		requirements/s3.txt requirements/matrix/torch.txt .ci/torch-venv.sh
	$(Q).ci/torch-venv.sh $*

test-matrix: setup matrix-venvs
	$(MAKE) --no-print-directory test-matrix-run

test-matrix-run:
	@TORCH_MATRIX="$(TORCH_MATRIX)" MATRIX_TESTS="$(MATRIX_TESTS)" \
	    MATRIX_STORES=$(MATRIX_STORES) DEV_PYTHON=$(BIN)/python .ci/torch-matrix.sh

# The systems dcpstore grew from (docs/integrations/README.md#the-seeds-own-systems), each
# installed from the registry at its current release in its own venv, .venv-seeds/<system>
# (.ci/seed-venv.sh, from requirements/seeds/<system>.txt), running its own checkpoint code
# on dcpstore URIs: save on 2 ranks to SeaweedFS, resume bit-exact, reshard
# (tests/seeds/test_<system>.py). SEED_SYSTEMS are the ones CI runs (make test).
SEED_SYSTEMS ?= physicsnemo megatron areal

seed-venvs: $(foreach s,$(SEED_SYSTEMS),.venv-seeds/$(s)/.installed)

.venv-seeds/%/.installed: $(PACKAGING) requirements/constraints.txt requirements/core.txt \
		requirements/s3.txt requirements/msc.txt requirements/seeds/%.txt .ci/seed-venv.sh
	$(Q).ci/seed-venv.sh $*

test-seeds: setup seed-venvs
	$(MAKE) --no-print-directory test-seeds-run

test-seeds-run:
	@status=0; for s in $(SEED_SYSTEMS); do \
	    echo "==> seed system $$s: .venv-seeds/$$s, tests/seeds/test_$$s.py"; \
	    DCPSTORE_SEED_SYSTEM=$$s .venv-seeds/$$s/bin/python -m pytest -q \
	        -p no:cacheprovider tests/seeds/test_$$s.py || status=1; \
	done; exit $$status

# The benchmark (docs/performance.md): the full run writes the committed results and the
# docs' chart: 2 ranks on local disk, SeaweedFS and fake-gcs-server, then moto in a single
# process at 256 MiB (its own target); both print their estimate. The default 512 MiB
# (256 MiB per rank) took 17.2 min on 2 cores for both at 6f53242 (20.4 at 246c8a8,
# before e668953 cut untimed work and two cases); BENCH_SIZE=1GiB takes ~25 min
# (docs/performance.md, "Duration"). The quick one is CI's smoke test. moto's limit is
# many single-PUT objects: moto assembles multipart uploads in Python, and its multipart
# variants (64MiBx8, 16MiBx16) saved 3-4x and loaded 6-20x slower in every committed
# run (--all-limits runs them all). dcpstore-msc (dcpstore through MSC's client) is back in
# the moto run: with read_chunk 64 MiB (was 16) each range is one ranged GET, where moto
# copies the object per request, and a 128 MiB load took 0.4 s, not ~0.9
# (benchmarks/results/msc-read-chunk/).
BENCH_SIZE ?= 512MiB
bench: setup
	$(BIN)/python -m benchmarks --stores local seaweedfs gcs --size $(BENCH_SIZE) \
	    --out benchmarks/results/latest --publish
	@# the first run's tail stays in the 1-minute load average: let it settle (3 min at most)
	@for i in $$(seq 36); do awk '{exit !($$1 >= 1.0)}' /proc/loadavg || break; sleep 5; done
	$(BIN)/python -m benchmarks --stores moto --world-size 1 --moto-size 256MiB \
	    --systems dcpstore-s3 dcpstore-msc torch-fsspec-s3 msc s3torchconnector limit-s3 \
	    --limit-s3 objects-16MiBx8 objects-8MiBx16 --out benchmarks/results/latest/moto-1rank

# The quick run, then the regression guard (benchmarks/regress.py): each case's MB/s as a
# fraction of the same run's limit against the committed full run's (latest/, with its
# moto-1rank/), so that neither the 32 MiB state nor the machine's speed counts. It prints
# every case more than 1.5x slower and fails only on 3x; the local store, the loads of
# fake-gcs-server and the limits themselves are left out (their reasons in regress.py).
bench-quick: setup
	$(BIN)/python -m benchmarks --quick --out benchmarks/results/tmp/quick
	$(BIN)/python -m benchmarks.regress benchmarks/results/tmp/quick

# The stall suite (issue 14; docs/performance.md "Stall"): full defaults take hours on 2
# cores (the script prints its estimate); the quick run is a smoke test.
bench-stall: setup
	$(BIN)/python -m benchmarks.stall --out benchmarks/results/stall

bench-stall-quick: setup
	$(BIN)/python -m benchmarks.stall --quick --out benchmarks/results/tmp/stall-quick

# The node-local tier across hosts (issue 32; docs/scale.md "Several hosts"): 3 hosts made of
# network namespaces (root, iproute2), 2 ranks each, 256 MiB per rank, SeaweedFS throttled to
# 200 MiB/s: restarts after losing a host from the tier's replicas against the root, the
# save's figures, and 20 kill runs. About 20 minutes on 2 cores.
bench-multihost: setup
	$(BIN)/python -m benchmarks.multihost --out benchmarks/results/multihost

# The scaling curves (docs/performance.md, "Scaling curves"): world size 1/2/4/8 and
# state size 1/4/8 GiB, local and SeaweedFS: ~25 min on 2 quiet cores (the estimate it
# prints first). Its largest point needs ~11.5 GiB free; a point that would not fit in
# the memory available when it starts is skipped and listed in results.md.
bench-curves: setup
	$(BIN)/python -m benchmarks --curves --out benchmarks/results/curves

# The GPU suite (tests/gpu; docs/gpu.md): one rank per GPU over NCCL, CUDA tensors. It
# needs a Python whose torch has CUDA (the venv's torch is a CPU build: there every test
# skips, "no CUDA device"). bench-gpu is the one prepared GPU check: the suite and the GPU
# stall benchmark (benchmarks.cuda_stall), results into benchmarks/results/gpu.
GPU_PYTHON ?= python3
test-gpu:
	PYTHONPATH=$(CURDIR) $(GPU_PYTHON) -m pytest -q -rs tests/gpu

bench-gpu:
	PYTHON=$(GPU_PYTHON) benchmarks/gpu_run.sh benchmarks/results/gpu

lint: setup
	$(BIN)/ruff check dcpstore backends tests benchmarks
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info backends/*/*.egg-info
