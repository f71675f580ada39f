# Set-up and checks. `make test` and `make demo` work on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.ettr-installed

.PHONY: install bytecode test test-fast demo lint typecheck bench clean chromium postgres slurm mpi

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch first, pinned to the CPU wheel; torchrec without its deps (they would pull CUDA fbgemm). DeepSpeed, for
# the test of its launcher under `ettr run` only, goes into a directory of its own that the test puts on
# PYTHONPATH (on the venv's path transformers and accelerate would take it up): its sdist builds no ops
# (DS_BUILD_OPS=0) and imports torch to build (no build isolation); its other requirements (psutil, pydantic,
# tqdm, numpy, packaging) are the venv's.
$(STAMP): $(PY) pyproject.toml Makefile
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q fbgemm-gpu-cpu==1.8.0
	$(PIP) install -q --no-deps torchrec==1.8.0
	$(PIP) install -q -e '.[rec,io,fast,dev,postgres,export,fleet,frameworks]'
	DS_BUILD_OPS=0 $(PIP) install -q --upgrade --no-deps --no-build-isolation --target $(VENV)/deepspeed \
		deepspeed==0.19.8 einops==0.8.2 hjson==3.1.0 msgpack==1.2.4 ninja==1.13.2 py-cpuinfo==9.0.0
	touch $(STAMP)

install: $(STAMP) bytecode

# ettr's own modules compiled to bytecode, as a wheel's install compiles them: the install above is editable
# (src/), and with PYTHONDONTWRITEBYTECODE set (this machine sets it) every process compiled the ettr modules it
# imported from source, each `ettr run`, zygote and rank (0.1-0.25 s of CPU per process start, measured).
# compileall skips what is up to date; a module edited later is compiled in memory again until the next run.
bytecode: $(STAMP)
	@$(PY) -m compileall -q -j 0 src/ettr examples >/dev/null

# Two pytest-xdist workers: the slow tests run one at a time on one worker, the benchmarks' quick modes on one,
# the small tests fill in (tests/conftest.py groups them); on this 2-core machine that halves the idle time of
# a suite whose real jobs mostly wait.
test: install chromium postgres slurm mpi
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup

# The HTML report's browser test renders the page in headless Chromium: install Debian's when it is missing
# and we may (root with apt-get, as in CI). Elsewhere that test is skipped.
chromium:
	@if ! command -v chromium >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
			chromium fonts-dejavu-core; \
	fi

# The shared-ledger tests start a throwaway PostgreSQL server (tests/conftest.py) from the server binaries:
# install Debian's when they are missing and we may (root with apt-get, as in CI). Elsewhere those tests are
# skipped with a message, except under CI=true, where they fail.
postgres:
	@if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && ! command -v initdb >/dev/null 2>&1 \
		&& [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
			postgresql; \
	fi

# The Slurm tests start a throwaway single-node cluster (tests/slurm_cluster.py, tests/conftest.py) from Debian's
# daemons: install them when they are missing and we may (root with apt-get, as in CI). Elsewhere those tests
# are skipped with a message, except under CI=true, where they fail.
slurm:
	@if ! command -v slurmctld >/dev/null 2>&1 && ! test -x /usr/sbin/slurmctld \
		&& [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
			slurmctld slurmd slurm-client munge; \
	fi

# The MPI launcher test runs `mpirun -np 2 python ...` under `ettr run` (tests/test_spawned_ranks.py): install
# Open MPI when it is missing and we may (root with apt-get, as in CI). Elsewhere that test is skipped with a
# message, except under CI=true, where it fails.
mpi:
	@if ! command -v mpirun >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
			openmpi-bin; \
	fi

demo: install
	$(VENV)/bin/ettr demo

lint: install typecheck
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples

# mypy on src/ettr, configured in pyproject.toml ([tool.mypy]); installed here (the `typecheck` extra) if missing.
.PHONY: typecheck test-fast
typecheck: install
	@$(PY) -c "import mypy" 2>/dev/null || $(PIP) install -q 'mypy>=1.10'
	$(PY) -m mypy

# The inner loop: every test not marked slow (no multi-process trials, no compile-heavy runs).
test-fast: install
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow"

bench: install
	for b in benchmarks/*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) build src/*.egg-info
