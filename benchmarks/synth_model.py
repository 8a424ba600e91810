"""Random-weight Llama checkpoints of named shapes, for memory and speed at scale (``make bench-scale``).

:func:`build_synth_model` writes ``<models_dir>/synth-<name>/``: ``config.json`` (a
``LlamaConfig``), ``generation_config.json`` and the tokenizer files copied from the default model,
and bfloat16 safetensors files with ``model.safetensors.index.json``. Weights are generated and
saved one file at a time (the embedding, then groups of decoder layers, then the final norm and
LM head), so the build never holds more than the largest file in memory. Linear and embedding
weights are normal(0, 0.02), norm weights ones (HF's own ``initializer_range`` init).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tpengine.utils import GIB

DTYPE = torch.bfloat16
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


@dataclass(frozen=True)
class SynthShape:
    """A Llama shape: sizes as in ``transformers.LlamaConfig``; ``head_dim`` = hidden / heads."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def layer_tensors(self, i: int) -> dict[str, tuple[int, ...]]:
        """``{HF name: shape}`` of decoder layer ``i``."""
        h, inter, d = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        p = f"model.layers.{i}."
        return {p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q), p + "post_attention_layernorm.weight": (h,),
                p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter)}

    def tensors(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's ``{HF name: shape}`` (untied LM head), in file order."""
        out = {"model.embed_tokens.weight": (self.vocab_size, self.hidden_size)}
        for i in range(self.num_hidden_layers):
            out.update(self.layer_tensors(i))
        out["model.norm.weight"] = (self.hidden_size,)
        out["lm_head.weight"] = (self.vocab_size, self.hidden_size)
        return out

    def num_params(self) -> int:
        return sum(math.prod(s) for s in self.tensors().values())

    def weight_bytes(self) -> int:
        """Checkpoint size in bytes (bfloat16)."""
        return self.num_params() * DTYPE.itemsize

    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers, bytes (bfloat16)."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * DTYPE.itemsize


#: The shapes ``--shapes`` accepts. "tiny" is for the tests (it builds in well under a second).
SHAPES: dict[str, SynthShape] = {
    "tinyllama-1.1b": SynthShape(2048, 5632, 22, 32, 4, 49152, 2048),
    "llama-2-7b": SynthShape(4096, 11008, 32, 32, 32, 49152, 4096),
    "tiny": SynthShape(64, 128, 2, 4, 2, 1024, 512),
}


def shape_named(name: str) -> SynthShape:
    """The :data:`SHAPES` entry ``name``. Raises ValueError naming the valid shapes."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; valid: {', '.join(SHAPES)}")
    return SHAPES[name]


def file_groups(shape: SynthShape, layers_per_file: int) -> list[list[str]]:
    """Tensor names per safetensors file: the embedding alone, ``layers_per_file`` decoder
    layers per file, then the final norm with the LM head. Raises ValueError if
    ``layers_per_file`` < 1."""
    if layers_per_file < 1:
        raise ValueError(f"layers_per_file={layers_per_file} must be >= 1")
    groups = [["model.embed_tokens.weight"]]
    for start in range(0, shape.num_hidden_layers, layers_per_file):
        stop = min(start + layers_per_file, shape.num_hidden_layers)
        groups.append([n for i in range(start, stop) for n in shape.layer_tensors(i)])
    groups.append(["model.norm.weight", "lm_head.weight"])
    return groups


def auto_layers_per_file(shape: SynthShape, max_file_bytes: int) -> int:
    """The most decoder layers whose bfloat16 weights fit in ``max_file_bytes`` (at least 1)."""
    layer = sum(math.prod(s) for s in shape.layer_tensors(0).values()) * DTYPE.itemsize
    return max(1, max_file_bytes // layer)


def hf_config(shape: SynthShape):
    """The ``transformers.LlamaConfig`` of ``shape`` (bfloat16, untied, SmolLM2's special ids)."""
    from transformers import LlamaConfig

    return LlamaConfig(**asdict(shape), head_dim=shape.head_dim, tie_word_embeddings=False, rms_norm_eps=1e-5,
                       bos_token_id=1, eos_token_id=2, pad_token_id=2, dtype="bfloat16",
                       architectures=["LlamaForCausalLM"])


def is_built(path: Path) -> bool:
    """Whether ``path`` holds a finished build (the index is written last)."""
    return (path / "config.json").is_file() and (path / "model.safetensors.index.json").is_file()


def build_synth_model(name: str, models_dir: Path, tokenizer_dir: Path, *, layers_per_file: int = 0,
                      max_file_bytes: int = GIB, seed: int = 0) -> dict:
    """Build ``<models_dir>/synth-<name>`` unless it is already there.

    Writes into ``synth-<name>.partial`` and renames it when complete, so an interrupted build
    is never mistaken for a finished one. ``layers_per_file`` = 0 picks it from
    ``max_file_bytes`` (:func:`auto_layers_per_file`).

    Returns:
        ``{"path", "built" (False if it was there), "build_s", "files", "largest_file_bytes"
        (on disk), "weight_bytes" (tensor data), "params"}``.

    Raises:
        ValueError: unknown ``name``. FileNotFoundError: ``tokenizer_dir`` has no tokenizer.json.
        FileExistsError: the folder exists without a finished build.
        OSError: not enough free disk for the checkpoint.
    """
    from safetensors.torch import save_file

    shape = shape_named(name)
    path = Path(models_dir) / f"synth-{name}"
    info = {"path": str(path), "weight_bytes": shape.weight_bytes(), "params": shape.num_params()}
    if is_built(path):
        index = json.loads((path / "model.safetensors.index.json").read_text())
        sizes = [f.stat().st_size for f in path.glob("*.safetensors")]
        return {**info, "built": False, "build_s": 0.0, "files": len(set(index["weight_map"].values())),
                "largest_file_bytes": max(sizes)}
    if path.exists():
        raise FileExistsError(f"{path} exists but holds no finished build (no model.safetensors.index.json); "
                              "remove it to rebuild")
    if not (Path(tokenizer_dir) / "tokenizer.json").is_file():
        raise FileNotFoundError(f"tokenizer_dir {str(tokenizer_dir)!r} has no tokenizer.json (run make model)")
    Path(models_dir).mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(models_dir).free
    if free < shape.weight_bytes() * 1.05:
        raise OSError(f"synth-{name} needs {shape.weight_bytes() / GIB:.1f} GiB of disk, "
                      f"{free / GIB:.1f} GiB free under {models_dir}")
    t0 = time.perf_counter()
    tmp = path.with_name(path.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    hf_config(shape).save_pretrained(tmp)
    for f in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / f).is_file():
            shutil.copy(Path(tokenizer_dir) / f, tmp / f)
    shapes = shape.tensors()
    groups = file_groups(shape, layers_per_file or auto_layers_per_file(shape, max_file_bytes))
    gen = torch.Generator().manual_seed(seed)
    weight_map = {}
    for k, names in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for n in names:
            if n.endswith("norm.weight"):
                tensors[n] = torch.ones(shapes[n], dtype=DTYPE)
            else:
                tensors[n] = torch.empty(shapes[n], dtype=DTYPE).normal_(0.0, 0.02, generator=gen)
        save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
        os.chmod(tmp / fname, 0o644)  # safetensors writes 0600; the folder may be shared
        del tensors
        weight_map.update(dict.fromkeys(names, fname))
    index = {"metadata": {"total_size": shape.weight_bytes()}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    largest = max(f.stat().st_size for f in tmp.glob("*.safetensors"))
    os.replace(tmp, path)
    return {**info, "built": True, "build_s": round(time.perf_counter() - t0, 2), "files": len(groups),
            "largest_file_bytes": largest}
