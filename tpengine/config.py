"""EngineConfig: the one frozen engine configuration, validated once.

Loaded from ``configs/*.toml`` (an ``[engine]`` table, or top-level keys) plus CLI overrides:
``load_config(path, overrides)``. Values discovered at run time (number of KV blocks chosen from
memory, world size) are not stored here.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

DEFAULT_MODEL_DIR = "models/smollm2-135m-instruct"
DTYPES = ("auto", "float32", "bfloat16", "float16")
BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings.

    Units: ``kv_cache_gb`` GiB of KV cache per rank (CPU); ``gpu_memory_utilization`` a
    fraction of free GPU memory; ``dist_timeout_s`` seconds for every collective;
    ``max_model_len`` tokens (prompt + output).

    Raises:
        ValueError: a value out of range, naming the field, the value and what is valid.
    """

    model: str = DEFAULT_MODEL_DIR
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU (see torch_dtype)
    max_model_len: int = 2048
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    kv_cache_gb: float = 1.0
    num_kv_blocks: int | None = None  # force the block count (tests); else from memory
    gpu_memory_utilization: float = 0.85
    attention_backend: str = "auto"  # auto: triton on CUDA, torch reference on CPU
    enforce_eager: bool = False  # GPU: disable CUDA graphs
    dist_timeout_s: float = 60.0
    threads: int | None = None  # intra-op threads per rank; default cores // tp
    seed: int = 0
    # test hook: raise on this rank at this decode step, "RANK:STEP" (case C07)
    fault_inject: str | None = None

    def __post_init__(self) -> None:
        def bad(name: str, valid: str) -> ValueError:
            return ValueError(f"invalid {name}={getattr(self, name)!r}: must be {valid}")

        if self.dtype not in DTYPES:
            raise bad("dtype", f"one of {', '.join(DTYPES)}")
        if self.attention_backend not in BACKENDS:
            raise bad("attention_backend", f"one of {', '.join(BACKENDS)}")
        for name in ("max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise bad(name, "an integer >= 1")
        if self.max_num_batched_tokens < self.max_model_len:
            raise bad("max_num_batched_tokens", f">= max_model_len ({self.max_model_len})")
        if self.kv_cache_gb <= 0:
            raise bad("kv_cache_gb", "> 0")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise bad("num_kv_blocks", "an integer >= 1 or unset")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise bad("gpu_memory_utilization", "in (0, 1]")
        if self.dist_timeout_s <= 0:
            raise bad("dist_timeout_s", "> 0 seconds")
        if self.threads is not None and self.threads < 1:
            raise bad("threads", "an integer >= 1 or unset")

    def torch_dtype(self, device: Any) -> Any:
        """The model/KV-cache ``torch.dtype`` on ``device`` (the one place "auto" is resolved):
        "auto" is bfloat16 on CUDA and float32 elsewhere; other names map to themselves."""
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
        return getattr(torch, self.dtype)

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)


def load_config(path: str | os.PathLike | None = None, **overrides: Any) -> EngineConfig:
    """Read ``path`` (TOML; keys of an ``[engine]`` table or top level), then apply the
    ``overrides`` whose value is not None (CLI flags).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: an unknown key (naming it and the valid keys) or an invalid value.
    """
    values: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"config file {str(p)!r} does not exist")
        data = tomllib.loads(p.read_text())
        values.update(data.get("engine", {k: v for k, v in data.items() if not isinstance(v, dict)}))
    values.update({k: v for k, v in overrides.items() if v is not None})
    known = {f.name for f in fields(EngineConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown engine setting(s) {unknown}; valid: {', '.join(sorted(known))}")
    return EngineConfig(**values)
