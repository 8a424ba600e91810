"""GGUF Q4_1 / Q8_0 blocks -> tpengine's quantized checkpoint tensors, without going through float.

``tpengine-shard convert --keep-quant`` writes the GGUF's quantized weights in the on-disk format
of docs/notes/quant-format.md (``P.qweight`` / ``P.scales`` / ``P.zeros`` instead of ``P.weight``, and
``quantization.json``), so the engine runs the very weights llama.cpp runs.

Block layouts (ggml-common.h, ``block_q4_1`` / ``block_q8_0``; gguf-py's ``quants.py``), 32
weights a block along the input dimension:

- Q4_1, 20 bytes: fp16 ``d``, fp16 ``m``, 16 bytes of nibbles (weight ``i`` in the low nibble of
  byte ``i`` for i < 16, weight ``16 + i`` in its high nibble); ``w = d * q + m``, q in 0..15.
  As int4 ("mid" convention ``w = (q - 8) * scale + zero``): ``scale = d``, ``zero = m + 8 * d``,
  q unchanged, repacked two a byte (weight ``2j`` low, ``2j + 1`` high).
- Q8_0, 34 bytes: fp16 ``d``, 32 int8 ``q``; ``w = d * q``. As grouped int8: g = 32, ``scales = d``.

Names and row order are those transformers' GGUF loader gives the dequantised tensors
(``get_gguf_hf_weights_map`` and the architecture's ``TensorProcessor``, e.g. Llama's reversal of
llama.cpp's Q/K row permutation): the processor is run on a tensor of block indices, so the same
rearrangement moves whole blocks, and anything other than a permutation of whole rows is refused.
A MoE layer's stacked ``ffn_*_exps`` tensors are cut into HF's per-expert weights first
(:func:`shard_tool.gguf_families.moe_parts`): each expert's rows are whole blocks, so each expert
is a 2-D weight of its own, kept quantized per expert. A --keep-quant folder, tpengine's format,
names every tensor as tpengine does (:func:`tpengine.model.families.checkpoint_name`: Mixtral's
``block_sparse_moe.experts.E.w1`` as ``mlp.experts.E.gate_proj``), its quantization.json too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tpengine.errors import UserError

#: Weights a GGUF Q4_1 / Q8_0 block holds (QK4_1 = QK8_0 = 32).
GROUP_SIZE = 32
#: Float GGUF tensor types, written as float32 tensors (as the dequantising convert does).
FLOAT_TYPES = ("F32", "F16", "BF16")
#: Quantized GGUF tensor types --keep-quant imports, and the tpengine scheme each becomes.
SCHEMES = {"Q4_1": "int4", "Q8_0": "int8"}
QUANT_FILE = "quantization.json"


@dataclass(frozen=True)
class QuantTensors:
    """One quantized weight in the on-disk format: ``qweight`` uint8 [out, in // 2] (int4, two
    weights a byte) or int8 [out, in]; ``scales`` (and for int4 ``zeros``) float32 [out, in // 32]."""

    scheme: str
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None = None

    def rows(self, perm: np.ndarray) -> QuantTensors:
        """The same weight with its output rows reordered: row ``r`` of the result is row ``perm[r]``."""
        idx = torch.from_numpy(np.ascontiguousarray(perm, dtype=np.int64))
        zeros = None if self.zeros is None else self.zeros[idx].contiguous()
        return QuantTensors(self.scheme, self.qweight[idx].contiguous(), self.scales[idx].contiguous(), zeros)

    def named(self, weight_name: str) -> dict[str, torch.Tensor]:
        """The tensors stored for HF weight ``weight_name``: ``P.weight`` -> ``P.qweight``,
        ``P.scales`` (and ``P.zeros``)."""
        base = weight_name.removesuffix(".weight")
        out = {f"{base}.qweight": self.qweight, f"{base}.scales": self.scales}
        if self.zeros is not None:
            out[f"{base}.zeros"] = self.zeros
        return out


def _blocks(data: np.ndarray, block_bytes: int) -> np.ndarray:
    """GGUF row bytes uint8 [rows, n_blocks * block_bytes] -> [rows, n_blocks, block_bytes]."""
    rows, nbytes = data.shape
    return np.ascontiguousarray(data).reshape(rows, nbytes // block_bytes, block_bytes)


def q4_1_to_int4(data: np.ndarray) -> QuantTensors:
    """Q4_1 blocks uint8 [out, (in / 32) * 20] -> int4: qweight uint8 [out, in / 2], scales = d and
    zeros = m + 8 d, float32 [out, in / 32]. Integer repacking only; ``m + 8 d`` is the one float
    operation (8 d is exact; the sum of two fp16 values is exact in float32 unless their exponents
    lie more than 13 apart)."""
    b = _blocks(data, 20)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = b[..., 4:20]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [out, nb, 32]: weights 0..15, then 16..31
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).reshape(b.shape[0], -1)  # weight 2j low, 2j+1 high
    zeros = m + np.float32(8) * d
    return QuantTensors("int4", torch.from_numpy(packed), torch.from_numpy(d), torch.from_numpy(zeros))


def q8_0_to_int8(data: np.ndarray) -> QuantTensors:
    """Q8_0 blocks uint8 [out, (in / 32) * 34] -> grouped int8: qweight int8 [out, in], scales = d
    float32 [out, in / 32]. No float arithmetic (fp16 -> float32 is exact)."""
    b = _blocks(data, 34)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = b[..., 2:34].copy().view(np.int8).reshape(b.shape[0], -1)
    return QuantTensors("int8", torch.from_numpy(q), torch.from_numpy(d))


def block_row_permutation(processor, gguf_name: str, rows: int, n_blocks: int, **kwargs) -> np.ndarray | None:
    """The row permutation transformers' ``processor`` applies to GGUF tensor ``gguf_name``
    ([rows, n_blocks * 32] once dequantised): ``None`` when it leaves the rows alone, else
    ``perm`` with result row ``r`` = GGUF row ``perm[r]``. Found by processing a [rows, n_blocks]
    array of block indices in place of the weights.

    Raises:
        UserError: the processor renames the tensor or rearranges anything but whole rows.
    """
    idx = np.arange(rows * n_blocks, dtype=np.int64).reshape(rows, n_blocks)
    res = processor.process(weights=idx, name=gguf_name, **kwargs)
    out = None if res is None else np.asarray(res.weights)
    if res is None or res.name != gguf_name or out.shape != idx.shape:
        raise UserError(f"--keep-quant cannot import {gguf_name!r}: transformers' {type(processor).__name__} "
                        "reshapes or renames it; convert without --keep-quant")
    perm = out[:, 0] // n_blocks
    if not np.array_equal(out, idx[perm]):
        raise UserError(f"--keep-quant cannot import {gguf_name!r}: transformers' {type(processor).__name__} "
                        "rearranges it within rows; convert without --keep-quant")
    return None if np.array_equal(perm, np.arange(rows)) else perm


def _check_type(name: str, hf_name: str, type_name: str, shape: tuple[int, ...]) -> None:
    """Raise a UserError for a GGUF tensor --keep-quant cannot import."""
    if type_name in FLOAT_TYPES:
        return
    if type_name not in SCHEMES:
        raise UserError(
            f"GGUF tensor {name!r} ({hf_name}) is {type_name}: --keep-quant imports Q4_1 and Q8_0 blocks "
            f"(and {', '.join(FLOAT_TYPES)} tensors as float32); convert without --keep-quant to dequantize "
            "it to float32")
    if len(shape) != 2 or not hf_name.endswith(".weight"):
        raise UserError(f"GGUF tensor {name!r} ({hf_name}) is {type_name} with shape {list(shape)}: --keep-quant "
                        "imports quantized 2-D weights only; convert without --keep-quant")


def _num_experts(config) -> int:
    """A MoE config's experts per layer (Mixtral's ``num_local_experts``, Qwen's ``num_experts``); 0 if dense."""
    return int(getattr(config, "num_local_experts", 0) or getattr(config, "num_experts", 0) or 0)


def write_keep_quant_weights(gguf_file: Path, model, folder: Path, processor=None) -> dict[str, dict]:
    """Write ``folder/model.safetensors`` and ``folder/quantization.json`` from ``gguf_file``:
    Q4_1 / Q8_0 weights as int4 / int8 (group 32), float tensors as float32, under the HF names of
    ``model`` (a transformers model, e.g. on the meta device, built from the GGUF's config).
    The tied LM head (no ``output.weight`` in the GGUF) is not written, as ``save_pretrained``
    does not write it. ``processor``: the transformers ``TensorProcessor`` that undoes llama.cpp's
    changes to the tensors (default: transformers' own for the file's architecture). Returns the
    ``weights`` table of quantization.json.

    Raises:
        UserError: a tensor of another quantized type (Q4_K, Q6_K, ...), a quantized tensor that
            is not a 2-D weight, a processor that rearranges more than rows, or an HF weight the
            GGUF lacks.
    """
    return write_gguf_weights(gguf_file, model, folder, processor=processor, keep_quant=True)


def write_gguf_weights(gguf_file: Path, model, folder: Path, *, processor=None, keep_quant: bool = False
                       ) -> dict[str, dict]:
    """Write ``folder/model.safetensors`` from ``gguf_file`` under the HF names of ``model`` (see
    :func:`write_keep_quant_weights`). With ``keep_quant`` as that function does (and
    quantization.json); without, every tensor dequantised (any type gguf-py reads) to float32, each
    tensor through ``processor`` (default: transformers' own for the file's architecture). Returns
    the quantized weights' table (empty without ``keep_quant``).

    Raises:
        UserError: as :func:`write_keep_quant_weights` (the type checks only with ``keep_quant``).
    """
    from gguf import dequantize
    from safetensors.torch import save_file
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    from shard_tool.gguf_families import checkpoint_names, moe_parts
    from shard_tool.gguf_file import GGUFFile
    from tpengine.model.families import checkpoint_name

    gguf = GGUFFile(gguf_file)
    architecture = gguf.architecture
    # model.config is what AutoConfig made of the GGUF's parsed config (the processor's input in
    # load_gguf_checkpoint), under the same HF keys (num_attention_heads, num_key_value_heads, ...).
    parsed = {"config": model.config.to_dict(), "tensors": {}}
    if processor is None:
        processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed["config"])
    # the file's architecture names its tensors (a Mixtral file is "llama"; gemma3 is gemma3_text's)
    name_map = get_gguf_hf_weights_map(model, processor, model_type=architecture)
    kwargs = {"tensor_key_mapping": name_map, "parsed_parameters": parsed}
    model_type, experts = model.config.model_type, _num_experts(model.config)

    # (HF name, tensor, whether the processor sees it): a MoE layer's experts and router are cut
    # into HF's per-expert checkpoint tensors as they are (llama.cpp permutes none of them)
    # (a --keep-quant folder is tpengine's format: tpengine's names, Mixtral's w1/w3/w2 as gate/up/down_proj)
    named = (lambda n: checkpoint_name(n, model.config)) if keep_quant else (lambda n: n)
    mapped = []
    for t in gguf.tensors.values():
        parts = moe_parts(model_type, t, experts)
        if parts is not None:
            mapped += [(named(hf_name), part, False) for hf_name, part in parts]
        elif t.name in name_map:
            mapped.append((named(name_map[t.name]), t, True))
    for hf_name, t, _ in mapped if keep_quant else ():
        _check_type(t.name, hf_name, t.type_name, t.shape)
    tensors: dict[str, torch.Tensor] = {}
    weights: dict[str, dict] = {}
    for hf_name, t, processed in mapped:
        type_name = t.type_name
        if type_name in FLOAT_TYPES or not keep_quant:
            w = dequantize(t.data, t.qtype)
            if processed:
                w = processor.process(weights=w, name=t.name, **kwargs).weights
            tensors[hf_name] = torch.from_numpy(np.copy(w)).to(torch.float32)
            continue
        quant = q4_1_to_int4(t.data) if type_name == "Q4_1" else q8_0_to_int8(t.data)
        perm = None if not processed else block_row_permutation(processor, t.name, quant.scales.shape[0],
                                                                 quant.scales.shape[1], **kwargs)
        if perm is not None:
            quant = quant.rows(perm)
        tensors.update(quant.named(hf_name))
        weights[hf_name] = {"scheme": quant.scheme, "group_size": GROUP_SIZE}

    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    written = {n.removesuffix(".qweight") + ".weight" if n.endswith(".qweight") else n for n in tensors}
    expected = [named(n) for n in checkpoint_names(model_type, list(model.state_dict()), experts)]
    missing = [n for n in expected if n not in written and not (tied and n == "lm_head.weight")]
    if missing:
        raise UserError(f"GGUF file {str(gguf_file)!r} has no tensor for {', '.join(missing)}; "
                        "convert writes only what the file holds")
    save_file(tensors, str(Path(folder) / "model.safetensors"), metadata={"format": "pt"})
    if keep_quant:
        table = {"quant_method": "tpengine", "format_version": 1, "weights": weights}
        (Path(folder) / QUANT_FILE).write_text(json.dumps(table, indent=2) + "\n")
    return weights
