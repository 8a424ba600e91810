"""One peer engine under benchmark, in its own process, driven by :mod:`benchmarks.bench_peers`.

    python -m benchmarks.peer_worker --peer ctranslate2 --model CT2_DIR --compute-type int8 --threads 2
    python -m benchmarks.peer_worker --peer llama-cpp --model FILE.gguf --threads 2 --n-ctx 264
    python -m benchmarks.peer_worker --peer ctranslate2 --convert-from HF_DIR --model CT2_DIR

The driver runs it with the peer's install folder first on ``PYTHONPATH`` (``pip install --target``),
so ``ctranslate2`` / ``llama_cpp`` import from there and everything else from the project's venv.
It never imports torch, except ``--convert-from``, which runs CTranslate2's ``TransformersConverter``
(transformers + torch) in a process of its own and exits.

It speaks :mod:`benchmarks.bench_worker`'s protocol: once loaded and warmed up it says ``@@bench
{"ready": true, "threads": [n], "weight_bytes": null, "load_s", "version"}``, then answers one JSON
command per stdin line with one ``@@bench {json}`` stdout line:

* ``{"cmd": "throughput", "prompts": [[ids...], ...], "tokens": [[str...], ...], "output_len": n}``
  -> ``{"elapsed_s", "output_tokens", "prompt_tokens"}``. CTranslate2: one ``generate_batch`` of
  every prompt (static batch, ``tokens`` = the prompts' token strings); llama.cpp: the requests one
  after the other (llama-cpp-python's ``Llama`` decodes one sequence at a time).
* ``{"cmd": "latency", "prompt": [ids...], "tokens": [str...], "output_len": n}`` -> ``{"ttft_s",
  "latency_s"}``: one request, TTFT = start to the first new token.
* ``{"cmd": "quit"}`` (or end of stdin).

Every request is greedy and makes exactly ``output_len`` tokens: CTranslate2 with ``min_length`` =
``max_length`` = n and ``include_prompt_in_result=False`` (the prompt prefilled at once, EOS
forbidden before n); llama.cpp by stopping ``Llama.generate`` (which never stops by itself, EOS or
not) after the n-th token, so the n-th token is sampled and not evaluated, as in the engine.
Token ids are checked against the peer's own vocabulary before any timing (a mismatch is a
ValueError, the worker exits 1).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

MARK = "@@bench "  # benchmarks.bench_worker.MARK (not imported: that module imports torch)
#: The warm-up requests (2 tokens each) before ``ready``: benchmarks.hf_system.WARMUP_PROMPTS.
WARMUP_PROMPTS = [[3, 4, 5, 6], [7, 8, 9, 10]]


def _say(obj: dict) -> None:
    print(MARK + json.dumps(obj), flush=True)


def check_ids(prompts: list[list[int]], vocab_size: int, tokens: list[list[str]] | None = None,
              vocabulary: list[str] | None = None) -> None:
    """Check ``prompts`` (token ids) against a peer's vocabulary of ``vocab_size`` entries and,
    with ``tokens`` and ``vocabulary`` (the peer's id -> token string list), that each token string
    is the peer's own for that id.

    Raises:
        ValueError: an id outside ``[0, vocab_size)``, or a token string that differs from
            ``vocabulary[id]`` (naming the prompt, position, id and both strings).
    """
    for i, p in enumerate(prompts):
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i}: token id {bad[0]} is outside the peer's vocabulary of {vocab_size}")
        if tokens is not None and vocabulary is not None:
            if len(tokens[i]) != len(p):
                raise ValueError(f"prompt {i}: {len(p)} ids but {len(tokens[i])} token strings")
            for j, (t, s) in enumerate(zip(p, tokens[i])):
                if vocabulary[t] != s:
                    raise ValueError(f"prompt {i} position {j}: id {t} is {vocabulary[t]!r} in the peer's "
                                     f"vocabulary, not {s!r}")


class CT2System:
    """A CTranslate2 ``Generator`` of a converted model folder on CPU with ``compute_type``
    (float32, int8, ...) and ``threads`` OpenMP threads (``intra_threads``; one generation at a
    time, ``inter_threads=1``)."""

    def __init__(self, model: str, compute_type: str, threads: int):
        import ctranslate2

        self.version = ctranslate2.__version__
        self.generator = ctranslate2.Generator(model, device="cpu", compute_type=compute_type, inter_threads=1,
                                               intra_threads=threads)
        with open(f"{model}/vocabulary.json") as f:
            self.vocabulary = json.load(f)
        self.threads = [threads]

    def _generate(self, tokens: list[list[str]], n: int, callback=None):
        res = self.generator.generate_batch(tokens, max_length=n, min_length=n, include_prompt_in_result=False,
                                            sampling_topk=1, beam_size=1, callback=callback)
        got = [len(r.sequences_ids[0]) for r in res]
        assert got == [n] * len(tokens), f"CTranslate2 made {got} tokens, not {n} each"
        return res

    def throughput(self, prompts: list[list[int]], tokens: list[list[str]], n: int) -> dict:
        """Every prompt in one ``generate_batch``, ``n`` tokens each: elapsed_s and token counts."""
        check_ids(prompts, len(self.vocabulary), tokens, self.vocabulary)
        t0 = time.perf_counter()
        res = self._generate(tokens, n)
        return {"elapsed_s": time.perf_counter() - t0, "output_tokens": sum(len(r.sequences_ids[0]) for r in res),
                "prompt_tokens": sum(map(len, prompts))}

    def latency(self, prompt: list[int], tokens: list[str], n: int) -> dict:
        """One request of ``n`` tokens: ttft_s (the first step's callback) and latency_s."""
        check_ids([prompt], len(self.vocabulary), [tokens], self.vocabulary)
        first: list[float] = []

        def on_token(step) -> bool:  # called for each generated token (greedy); False: go on
            if not first:
                first.append(time.perf_counter())
            return False

        t0 = time.perf_counter()
        self._generate([tokens], n, callback=on_token)
        return {"ttft_s": first[0] - t0, "latency_s": time.perf_counter() - t0}


class LlamaCppSystem:
    """llama.cpp through llama-cpp-python's ``Llama`` on a GGUF file: ``threads`` for decode and
    prompt batches, a context of ``n_ctx`` tokens, a prompt prefilled in one batch."""

    def __init__(self, gguf: str, threads: int, n_ctx: int, vocab_size: int):
        import llama_cpp

        self.version = llama_cpp.__version__
        self.llm = llama_cpp.Llama(model_path=gguf, n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads,
                                   n_threads_batch=threads, seed=0, verbose=False)
        if self.llm.n_vocab() != vocab_size:
            raise ValueError(f"{gguf}: its vocabulary has {self.llm.n_vocab()} tokens, the HF model's {vocab_size}")
        self.threads = [threads]

    def _one(self, prompt: list[int], n: int) -> tuple[float, float]:
        """One request from an empty context: (seconds to the first token, seconds to the n-th)."""
        self.llm.reset()  # no prefix of an earlier request is reused (Llama.generate would)
        t0, first, made = time.perf_counter(), None, 0
        for _ in self.llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
            made += 1
            if made == 1:
                first = time.perf_counter()
            if made == n:
                break
        return first - t0, time.perf_counter() - t0

    def throughput(self, prompts: list[list[int]], tokens, n: int) -> dict:
        """The prompts one after the other, ``n`` tokens each: elapsed_s and token counts."""
        check_ids(prompts, self.llm.n_vocab())
        t0 = time.perf_counter()
        for p in prompts:
            self._one(p, n)
        return {"elapsed_s": time.perf_counter() - t0, "output_tokens": n * len(prompts),
                "prompt_tokens": sum(map(len, prompts))}

    def latency(self, prompt: list[int], tokens, n: int) -> dict:
        """One request of ``n`` tokens: ttft_s and latency_s."""
        check_ids([prompt], self.llm.n_vocab())
        ttft, latency = self._one(prompt, n)
        return {"ttft_s": ttft, "latency_s": latency}


def convert_ct2(hf_dir: str, out: str) -> None:
    """CTranslate2's ``TransformersConverter`` of the HF folder ``hf_dir`` into ``out`` (float32
    weights as in the checkpoint; the compute type is chosen at load)."""
    from ctranslate2.converters import TransformersConverter

    TransformersConverter(hf_dir).convert(out, force=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="a peer engine under benchmark (benchmarks.bench_peers)")
    ap.add_argument("--peer", required=True, choices=["ctranslate2", "llama-cpp"])
    ap.add_argument("--model", required=True, help="CTranslate2 model folder, or the GGUF file")
    ap.add_argument("--compute-type", default="float32", help="CTranslate2's compute_type")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n-ctx", type=int, default=512, help="llama.cpp context tokens")
    ap.add_argument("--vocab-size", type=int, default=0, help="llama.cpp: the expected vocabulary size")
    ap.add_argument("--convert-from", default="", help="CTranslate2: convert this HF folder into --model, exit")
    a = ap.parse_args(argv)
    if a.convert_from:
        convert_ct2(a.convert_from, a.model)
        return 0
    t0 = time.perf_counter()
    if a.peer == "ctranslate2":
        system = CT2System(a.model, a.compute_type, a.threads)
        warm_tokens = [[system.vocabulary[t] for t in p] for p in WARMUP_PROMPTS]
    else:
        system = LlamaCppSystem(a.model, a.threads, a.n_ctx, a.vocab_size)
        warm_tokens = None
    system.throughput(WARMUP_PROMPTS, warm_tokens, 2)
    _say({"ready": True, "threads": system.threads, "weight_bytes": None, "load_s": time.perf_counter() - t0,
          "version": system.version})
    for line in sys.stdin:
        if not line.strip():
            break
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        if cmd["cmd"] == "throughput":
            _say(system.throughput(cmd["prompts"], cmd.get("tokens"), cmd["output_len"]))
        elif cmd["cmd"] == "latency":
            _say(system.latency(cmd["prompt"], cmd.get("tokens"), cmd["output_len"]))
        else:
            raise ValueError(f"unknown command {cmd['cmd']!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
