"""Shared fixtures: tiny random-weight Hugging Face models written to disk (no network)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from launch import REPO

# Nothing is measured unless a test asks for it: a measuring budget of 0 s
# (tpengine.backends.cpu.measured.measure_budget_s) for the pytest process and, set before anything is
# launched, every launched process (launch.NO_MEASURING), so each choice without cached timings takes its
# default, the one a busy machine takes, the same at every load. The tests whose subject is a measured
# choice (the choosers' tests, test_engine's measured SmolLM2 jobs) take the ``measuring`` fixture or
# launch with launch.MEASURING: no budget. test_measured checks the budget itself.
os.environ.setdefault("TPENGINE_MEASURE_BUDGET_S", "0")

SMOLLM2_DIR = REPO / "models" / "smollm2-135m-instruct"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")

# Small enough to build, save and split in well under a second; intermediate 100 and vocab 1001
# split unevenly at tp 3 and tp 2/4.
TINY_DEFAULTS = {
    "hidden_size": 64,
    "intermediate_size": 100,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1001,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


# What each family's tiny model sets beyond TINY_DEFAULTS: token ids inside the tiny vocabulary, head
# sizes the defaults would make 256, and each family's own feature made to matter (a soft cap that
# bends random logits, Granite's multipliers as its released configs have them).
FAMILY_DEFAULTS = {
    "gemma": dict(head_dim=16, pad_token_id=0, eos_token_id=1, bos_token_id=2),
    "gemma2": dict(head_dim=16, query_pre_attn_scalar=24, final_logit_softcapping=0.5, attn_logit_softcapping=2.0,
                   sliding_window=8, pad_token_id=0, eos_token_id=1, bos_token_id=2),
    "gemma3_text": dict(head_dim=16, query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention"],
                        sliding_window=8, rope_local_base_freq=100.0, pad_token_id=0, eos_token_id=1,
                        bos_token_id=2),
    "phi3": dict(pad_token_id=0, eos_token_id=1, bos_token_id=2),
    "olmo2": dict(pad_token_id=0, eos_token_id=1, bos_token_id=2),
    "olmo3": dict(pad_token_id=0, eos_token_id=1, bos_token_id=2, sliding_window=8,
                  layer_types=["sliding_attention", "full_attention"]),
    "granite": dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125,
                    logits_scaling=8.0),
    # mixture of experts: 8 experts, top 2, each expert 32 wide (uneven at tp 3); Qwen3-MoE's layer 1 dense
    "mixtral": dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
    "qwen3_moe": dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1],
                      head_dim=16, norm_topk_prob=True),
    "qwen2_moe": dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1],
                      shared_expert_intermediate_size=48, norm_topk_prob=False),
}


def tiny_config(arch: str = "llama", **overrides):
    """A transformers config for a tiny ``arch`` model (llama, mistral, qwen2, qwen3, gemma, gemma2,
    gemma3_text, phi3, olmo2, olmo3, granite, mixtral, qwen3_moe, qwen2_moe) with :data:`TINY_DEFAULTS` and the family's
    :data:`FAMILY_DEFAULTS` updated by ``overrides``.

    Raises:
        ValueError: unknown ``arch``.
    """
    import transformers as T

    classes = {"llama": T.LlamaConfig, "mistral": T.MistralConfig, "qwen2": T.Qwen2Config, "qwen3": T.Qwen3Config,
               "gemma": T.GemmaConfig, "gemma2": T.Gemma2Config, "gemma3_text": T.Gemma3TextConfig,
               "phi3": T.Phi3Config, "olmo2": T.Olmo2Config, "olmo3": T.Olmo3Config, "granite": T.GraniteConfig,
               "mixtral": T.MixtralConfig, "qwen3_moe": T.Qwen3MoeConfig, "qwen2_moe": T.Qwen2MoeConfig}
    if arch not in classes:
        raise ValueError(f"unknown arch {arch!r}; valid: {', '.join(classes)}")
    return classes[arch](**{**TINY_DEFAULTS, **FAMILY_DEFAULTS.get(arch, {}), **overrides})


def make_tiny_model(
    tmp_path: Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    random_biases: bool = False,
    max_shard_size: str | int | None = None,
    name: str | None = None,
    **overrides,
) -> Path:
    """Write a random-weight float32 HF model folder under ``tmp_path`` and return its path.

    Weights are seeded (``torch.manual_seed(seed)``) so two calls give identical tensors.
    ``random_biases`` sets every bias and every norm weight (incl. Qwen3 q_norm/k_norm) to
    random non-zero values in [0.5, 1.5). ``max_shard_size`` makes a multi-file checkpoint
    with ``model.safetensors.index.json``. The SmolLM2 tokenizer files are copied in when
    ``models/smollm2-135m-instruct`` exists (its ids may exceed the tiny vocab). Config fields
    come from :data:`TINY_DEFAULTS` and ``overrides``.
    """
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if random_biases:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:  # biases and norm weights
                    p.copy_(torch.rand_like(p) + 0.5)
    out = Path(tmp_path) / (name or f"tiny-{arch}")
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size is not None else {}
    model.save_pretrained(out, **kwargs)
    model.generation_config.save_pretrained(out)
    if SMOLLM2_DIR.is_dir():
        for f in TOKENIZER_FILES:
            if (SMOLLM2_DIR / f).is_file():
                shutil.copy2(SMOLLM2_DIR / f, out / f)
    return out


class QuietContention:
    """A stand-in for :class:`tpengine.backends.cpu.measured.Contention` that sees a quiet machine: for
    tests of the choosing and caching around given timings, which must not depend on how busy the
    machine is (a busy window's timings are never cached)."""

    busy = False
    others_cores = 0.0

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __enter__(self) -> QuietContention:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.fixture
def measuring(monkeypatch) -> dict[str, str]:
    """For a test whose subject is a measured choice: no measuring budget (``inf``) in this process and
    in what it launches while it runs (conftest's default is 0: nothing measured); returns
    :data:`launch.MEASURING` for a launch's ``env``. A module of such tests takes it for every test:
    ``pytestmark = pytest.mark.usefixtures("measuring")``."""
    from launch import MEASURING

    for key, value in MEASURING.items():
        monkeypatch.setenv(key, value)
    return MEASURING


@pytest.fixture
def smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct folder (made by ``make model``)."""
    if not (SMOLLM2_DIR / "config.json").is_file():
        pytest.fail(f"{SMOLLM2_DIR} is missing: run `make model` first")
    return SMOLLM2_DIR


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Path:
    """The CLI tests' model, written once a session: tiny-llama (:func:`make_tiny_model`) with the
    SmolLM2 tokenizer, its vocab (49152) sized to it, and max_position_embeddings 512. Skips without
    the tokenizer (``make model``)."""
    if not (SMOLLM2_DIR / "tokenizer.json").is_file():
        pytest.skip("needs the SmolLM2 tokenizer (make model)")
    return make_tiny_model(tmp_path_factory.mktemp("cli"), vocab_size=49152, max_position_embeddings=512)


@pytest.fixture(scope="session")
def smollm2_server(tmp_path_factory):
    """The OpenAI-compatible server at tp=2 on SmolLM2 in float32 (:data:`serving.SETTINGS`), started
    once a session for ``test_server.py`` and ``test_server_clients.py`` (their tests leave it as they
    found it: no request running, no KV block held) and stopped with SIGTERM at the session's end.
    Skips without ``make model`` or the ``openai`` client."""
    pytest.importorskip("openai")
    if not (SMOLLM2_DIR / "config.json").is_file():
        pytest.skip("needs make model")
    from serving import Server

    server = Server(tmp_path_factory.mktemp("smollm2-server"))
    yield server
    server.stop()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """After the run: how many tests were skipped, grouped by reason, most first -- on a machine
    without a CPU feature (AVX2 only: no AVX-512-only kernels; no AMX; no GPU) the skips say which paths it did
    not test (docs/notes/avx2.md)."""
    counts: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        reason = reason.removeprefix("Skipped: ")
        counts[reason] = counts.get(reason, 0) + 1
    if not counts:
        return
    terminalreporter.write_sep("=", f"{sum(counts.values())} skipped, by reason")
    for reason, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        terminalreporter.write_line(f"{n:5d}  {reason}")


@pytest.fixture
def torch_threads():
    """``set(n)``: torch's intra-op threads for this test (a kernel test parametrized over thread counts), the
    count before it restored at teardown."""
    import torch

    old = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(old)
