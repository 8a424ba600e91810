"""The on-disk format of quantized checkpoints (docs/design.md, "Quantized weights"):
``quantization.json``, the stored parts of a quantized weight, how tensor parallelism slices
them, and building the in-memory :class:`~tpengine.model.quant.weights.QuantizedWeight` from them.

A quantized 2-D weight ``P.weight [out, in]`` is stored instead as

* int8: ``P.qweight`` int8 ``[out, in]``, ``P.scales`` float32 ``[out, in // g]`` (per output
  channel: ``[out, 1]``), ``w = q * scale``;
* int4: ``P.qweight`` uint8 ``[out, in // 2]`` (element ``2j`` in the low nibble of byte ``j``,
  ``2j + 1`` in the high one, values 0..15), ``P.scales`` and ``P.zeros`` float32
  ``[out, in // g]``, ``w = (q - 8) * scale + zero``; with ``"zeros": "int8"`` in the table entry
  (``--quantization int4``'s coded zeros) ``P.zeros`` is int8 ``[out, in // g]`` codes and
  ``zero = code * scale / 16`` (:func:`tpengine.model.quant.arith.quantize_int4_coded`).

A full folder lists its quantized weights in ``quantization.json``; a split folder
(``tpengine-shard split``) records the same object under the manifest's ``"quantization"`` key
and holds each rank's slices of the parts under the same names. Tensor parallelism: a column
split (q/k/v, gate/up, vocabulary) takes rows of every part; a row split (o_proj, down_proj)
takes input columns ``[a, b)``: qweight columns ``[a, b)`` (int8) or ``[a/2, b/2)`` (int4),
scales/zeros columns ``[a/g, b/g)``, while a per-output-channel int8 scale is kept whole.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tpengine.errors import UserError
from tpengine.model import plan as P
from tpengine.model.checkpoint import read_json_file

QUANT_FILE = "quantization.json"
QUANT_METHOD = "tpengine"
QUANT_FORMAT_VERSION = 1
SCHEMES = ("int8", "int4")
#: The stored parts of a quantized weight of each scheme, in file order.
PARTS = {"int8": ("qweight", "scales"), "int4": ("qweight", "scales", "zeros")}
#: Storage dtype of each part on disk that is not a float32 scale (see :func:`part_dtype`).
PART_DTYPES = {("int8", "qweight"): torch.int8, ("int4", "qweight"): torch.uint8}
SCALE_DTYPE = torch.float32
#: Partition kinds of the column/row-parallel linears (what ``--quantization`` quantizes).
LINEAR_KINDS = (P.Q, P.K, P.V, P.COLUMN, P.ROW_HEADS, P.ROW)


@dataclass(frozen=True)
class QuantEntry:
    """How one weight is stored: ``scheme`` "int8" or "int4", ``group_size`` input columns per
    scale (and zero); None for int8 per output channel (the spec's ``g = in``); ``zero_codes``
    (int4 only): the zeros stored as int8 codes (``"zeros": "int8"`` in JSON), else float32."""

    scheme: str
    group_size: int | None
    zero_codes: bool = False

    @classmethod
    def of_scheme(cls, scheme) -> QuantEntry:
        """The entry storing a :class:`~tpengine.model.quant.weights.QuantScheme`'s weights."""
        return cls(scheme.name, scheme.group_size, scheme.zero_codes)

    def per_channel(self, in_full: int) -> bool:
        """True for one scale per output row (int8 with no group size, or one as wide as the
        full input ``in_full``)."""
        return self.group_size is None or self.group_size == in_full

    def describe(self) -> str:
        """e.g. "int4, group size 32" or "int8, per output channel"."""
        return f"{self.scheme}, " + ("per output channel" if self.group_size is None
                                     else f"group size {self.group_size}") + (", int8 zero codes" * self.zero_codes)

    def to_json(self) -> dict[str, Any]:
        return {"scheme": self.scheme, "group_size": self.group_size, **({"zeros": "int8"} if self.zero_codes else {})}


def part_dtype(entry: QuantEntry, part: str) -> torch.dtype | None:
    """The stored dtype of ``part`` under ``entry``: int8 / uint8 for a qweight, int8 for coded
    zeros, None for a float scale or zero (float32 on disk; any float dtype is read)."""
    if part == "zeros" and entry.zero_codes:
        return torch.int8
    return PART_DTYPES.get((entry.scheme, part))


def table_json(weights: dict[str, QuantEntry]) -> dict[str, Any]:
    """The ``quantization.json`` object for ``weights`` (weight name -> entry), names sorted."""
    return {"quant_method": QUANT_METHOD, "format_version": QUANT_FORMAT_VERSION,
            "weights": {n: weights[n].to_json() for n in sorted(weights)}}


def parse_table(data: Any, where: str) -> dict[str, QuantEntry]:
    """The weights table of a ``quantization.json`` object ``data`` (``where`` names its file in
    messages): weight name (ending in ``.weight``) -> :class:`QuantEntry`.

    Raises:
        UserError: another ``quant_method`` or ``format_version``, no ``weights`` object, or an
            entry with an unknown scheme or a bad group size, naming ``where`` and the weight.
    """
    if not isinstance(data, dict):
        raise UserError(f"{where}: the quantization table is not a JSON object")
    if data.get("quant_method") != QUANT_METHOD or data.get("format_version") != QUANT_FORMAT_VERSION:
        raise UserError(f"{where}: quant_method={data.get('quant_method')!r}, format_version="
                        f"{data.get('format_version')!r} is not supported (expected {QUANT_METHOD!r}, "
                        f"{QUANT_FORMAT_VERSION})")
    weights = data.get("weights")
    if not isinstance(weights, dict):
        raise UserError(f"{where}: key 'weights' is missing or not a JSON object")
    out: dict[str, QuantEntry] = {}
    for name, e in weights.items():
        scheme = e.get("scheme") if isinstance(e, dict) else None
        g = e.get("group_size") if isinstance(e, dict) else None
        zeros = e.get("zeros") if isinstance(e, dict) else None
        if not name.endswith(".weight") or scheme not in SCHEMES:
            raise UserError(f"{where}: weight {name!r}: scheme {scheme!r} is invalid (must be one of "
                            f"{', '.join(SCHEMES)}, for a name ending in .weight)")
        if (g is None and scheme == "int4") or not (g is None or (isinstance(g, int) and not isinstance(g, bool)
                                                                   and g > 0 and g % 2 == 0)):
            raise UserError(f"{where}: weight {name!r}: group_size {g!r} is invalid (an even positive "
                            "integer; null only for int8 per output channel)")
        if zeros not in (None, "int8") or (zeros is not None and scheme != "int4"):
            raise UserError(f"{where}: weight {name!r}: zeros {zeros!r} is invalid (\"int8\" for int4 coded "
                            "zeros, or absent for float32 zeros)")
        out[name] = QuantEntry(scheme, g, zeros == "int8")
    return out


def read_table(model_dir: str | Path) -> dict[str, QuantEntry] | None:
    """The quantized weights of the folder ``model_dir``: a split folder's manifest
    ``"quantization"`` or a full folder's ``quantization.json``; None for a float folder.

    Raises:
        UserError: see :func:`parse_table` and :func:`tpengine.model.checkpoint.read_json_file`.
    """
    from tpengine.model.checkpoint import MANIFEST, is_shard_folder, read_manifest

    model_dir = Path(model_dir)
    if is_shard_folder(model_dir):
        m = read_manifest(model_dir)
        if m.get("quantization") is None:
            return None
        return parse_table(m["quantization"], f"shard manifest {str(model_dir / MANIFEST)!r}")
    path = model_dir / QUANT_FILE
    if not path.is_file():
        return None
    return parse_table(read_json_file(path, "quantization table"), f"quantization table {str(path)!r}")


def write_table(model_dir: str | Path, weights: dict[str, QuantEntry]) -> None:
    """Write ``model_dir/quantization.json`` for ``weights``."""
    (Path(model_dir) / QUANT_FILE).write_text(json.dumps(table_json(weights), indent=1) + "\n")


def is_linear_weight(name: str, ndim: int) -> bool:
    """True for the weight of a column/row-parallel linear (q/k/v/o_proj, gate/up/down_proj):
    the tensors ``--quantization`` and ``split --quantize`` quantize."""
    from tpengine.model.surgery import LAYER_KINDS

    parts = name.split(".")
    return name.endswith(".weight") and ndim == 2 and len(parts) >= 2 and LAYER_KINDS.get(parts[-2]) in LINEAR_KINDS


def is_vocab_weight(name: str, ndim: int) -> bool:
    """True for the embedding's or the LM head's weight (``embed_tokens``, ``lm_head``), which
    ``--quantization`` and ``split --quantize`` store by the scheme's ``vocab``."""
    from tpengine.model.surgery import LAYER_KINDS

    parts = name.split(".")
    return name.endswith(".weight") and ndim == 2 and len(parts) >= 2 and LAYER_KINDS.get(parts[-2]) == P.VOCAB


def part_of(name: str) -> tuple[str, str] | None:
    """``(weight name, part)`` of a stored part's name (``x.q_proj.qweight`` ->
    ``("x.q_proj.weight", "qweight")``), or None for any other tensor name."""
    base, _, part = name.rpartition(".")
    if part in PARTS["int4"] and base:
        return f"{base}.weight", part
    return None


def part_name(weight: str, part: str) -> str:
    """The stored name of ``part`` of the weight ``weight`` (``x.weight`` -> ``x.<part>``)."""
    return f"{weight.removesuffix('.weight')}.{part}"


def weight_shape(plan: P.ShardPlan, kind: str) -> tuple[int, int]:
    """The full ``[out, in]`` shape of a ``kind`` weight (the vocabulary's unpadded)."""
    hd, h = plan.head_dim, plan.hidden_size
    return {P.Q: (plan.num_heads * hd, h), P.K: (plan.num_kv_heads * hd, h), P.V: (plan.num_kv_heads * hd, h),
            P.COLUMN: (plan.intermediate_size, h), P.ROW_HEADS: (h, plan.num_heads * hd),
            P.ROW: (h, plan.intermediate_size), P.VOCAB: (plan.vocab_size, h),
            P.EXPERT_COLUMN: (plan.moe_intermediate_size, h), P.EXPERT_ROW: (h, plan.moe_intermediate_size),
            P.SHARED_COLUMN: (plan.shared_expert_intermediate_size, h),
            P.SHARED_ROW: (h, plan.shared_expert_intermediate_size)}[kind]


def stored_shapes(entry: QuantEntry, out: int, k: int, in_full: int | None = None) -> dict[str, tuple]:
    """Part -> ``(dtype, shape)`` of a stored ``[out, k]`` weight (``k`` this slice's input
    columns, ``in_full`` the full weight's, default ``k``): see the module docstring.

    Raises:
        UserError: ``k`` not a multiple of the group size (or odd, for int4).
    """
    in_full = k if in_full is None else in_full
    g = in_full if entry.per_channel(in_full) else entry.group_size
    if (not entry.per_channel(in_full) and k % g) or (entry.scheme == "int4" and k % 2):
        raise UserError(f"a {out} x {k} weight cannot be stored as {entry.describe()}: {k} input columns are "
                        f"not a multiple of {g}")
    groups = 1 if entry.per_channel(in_full) else k // g
    q = (torch.int8, (out, k)) if entry.scheme == "int8" else (torch.uint8, (out, k // 2))
    return {"qweight": q, **{p: (part_dtype(entry, p) or SCALE_DTYPE, (out, groups)) for p in PARTS[entry.scheme][1:]}}


def part_slice(plan: P.ShardPlan, kind: str, entry: QuantEntry, part: str,
               rank: int) -> tuple[tuple[int, int, int] | None, int | None]:
    """Where rank ``rank``'s slice of ``part`` of a stored ``kind`` weight lies:
    ``((dim, start, end), full size along dim)``, or ``(None, None)`` for the whole part (a
    per-output-channel scale of a row split). Vocabulary ranges may run into the padding.

    Raises:
        UserError: a row split that does not fall on group boundaries (the message names the
            weight's group size and the column).
    """
    dim, a, b = plan.slice_spec(kind, False, rank)
    out, in_full = weight_shape(plan, kind)
    if dim == 0:
        return (0, a, b), plan.full_size(kind)
    if part == "qweight":
        div = 2 if entry.scheme == "int4" else 1
        return (1, a // div, b // div), in_full // div
    if entry.per_channel(in_full):
        return None, None
    g = entry.group_size
    if a % g or b % g:
        raise UserError(f"rank {rank}'s input columns [{a}, {b}) of a {kind} weight stored as {entry.describe()} "
                        f"do not fall on group boundaries (multiples of {g})")
    return (1, a // g, b // g), in_full // g


def local_shapes(plan: P.ShardPlan, kind: str, entry: QuantEntry, rank: int) -> dict[str, tuple]:
    """Part -> ``(dtype, shape)`` of rank ``rank``'s slices of a stored ``kind`` weight.

    Raises:
        UserError: see :func:`part_slice`.
    """
    out, in_full = weight_shape(plan, kind)
    full = stored_shapes(entry, out, in_full)
    shapes = {}
    for part, (dtype, shape) in full.items():
        spec, _ = part_slice(plan, kind, entry, part, rank)
        shape = list(shape)
        if spec is not None:
            shape[spec[0]] = spec[2] - spec[1]
        shapes[part] = (dtype, tuple(shape))
    return shapes


def slice_part(plan: P.ShardPlan, kind: str, entry: QuantEntry, part: str, t: torch.Tensor,
               rank: int) -> torch.Tensor:
    """Rank ``rank``'s slice of the full stored ``part`` tensor ``t`` (a new contiguous tensor;
    vocabulary padding rows are zero).

    Raises:
        UserError: see :func:`part_slice`.
    """
    spec, full = part_slice(plan, kind, entry, part, rank)
    if spec is None:
        return t.contiguous().clone()
    dim, start, end = spec
    shape = list(t.shape)
    shape[dim] = end - start
    out = t.new_zeros(shape)
    keep = max(0, min(end, full) - start)
    if keep:
        out.narrow(dim, 0, keep).copy_(t.narrow(dim, start, keep))
    return out


# -------------------------------------------------------------------------- values
def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """``q [out, in]`` (0..15, any integer dtype, ``in`` even) as uint8 ``[out, in // 2]``: element
    ``2j`` in the low nibble of byte ``j``, ``2j + 1`` in the high one."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(b: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: uint8 ``[out, k]`` -> int32 ``[out, 2k]`` in 0..15."""
    return torch.stack([b & 15, b >> 4], dim=-1).reshape(b.shape[0], -1).to(torch.int32)


def quantize_parts(w: torch.Tensor, entry: QuantEntry) -> dict[str, torch.Tensor]:
    """The stored parts of ``w [out, in]`` (the full weight) under ``entry``, with
    :func:`tpengine.model.quant.arith.quantize_int8` / ``quantize_int4`` and float32 scales, so
    they equal ``--quantization``'s on-the-fly result at float32 activations bit for bit.

    Raises:
        UserError: grouped int8 (``--quantization`` has per-channel int8 only), or ``in`` not
            a multiple of the group size.
    """
    from tpengine.model.quant.arith import quantize_int4, quantize_int4_coded, quantize_int8

    out, k = w.shape
    if entry.scheme == "int8":
        if not entry.per_channel(k):
            raise UserError(f"int8 with group size {entry.group_size}: tpengine quantizes int8 per output channel only")
        q, s = quantize_int8(w, SCALE_DTYPE)
        return {"qweight": q, "scales": s[:, None].contiguous()}
    stored_shapes(entry, out, k)  # UserError: in not a multiple of the group size
    if entry.zero_codes:
        q, scales, codes = quantize_int4_coded(w, entry.group_size, SCALE_DTYPE)
        return {"qweight": pack_nibbles(q), "scales": scales.T.contiguous(), "zeros": codes.T.contiguous()}
    q, sz = quantize_int4(w, entry.group_size, SCALE_DTYPE)
    return {"qweight": pack_nibbles(q), "scales": sz[..., 0].T.contiguous(), "zeros": sz[..., 1].T.contiguous()}


def build_weight(entry: QuantEntry, parts: dict[str, torch.Tensor]):
    """The in-memory :class:`~tpengine.model.quant.weights.QuantizedWeight` of one layer's stored
    parts (this rank's, merged parts stacked by rows; scales/zeros already in the activation
    dtype): int8 ``Int8Weight(qweight, scales [out])`` per output channel (one scale column),
    else ``Int8Weight(qweight, scales [out, in // g], group_size=g)``; int4 ``Int4Weight`` of the
    unpacked 0..15 values (transient) and ``[in // g, out, 2]`` scales and zeros, or with coded zeros
    ``Int4CodedWeight`` of them and ``[in // g, out]`` scales and codes."""
    from tpengine.model.quant.weights import Int4CodedWeight, Int4Weight, Int8Weight

    if entry.scheme == "int8":
        q, s = parts["qweight"], parts["scales"]
        if s.shape[1] == 1:
            return Int8Weight(q, s[:, 0])
        return Int8Weight(q, s, group_size=entry.group_size)  # grouped int8: branch qhead's Int8Weight
    if entry.zero_codes:
        return Int4CodedWeight(unpack_nibbles(parts["qweight"]), parts["scales"].T.contiguous(),
                               parts["zeros"].T.contiguous(), entry.group_size)
    sz = torch.stack([parts["scales"], parts["zeros"]], dim=-1).transpose(0, 1).contiguous()
    return Int4Weight(unpack_nibbles(parts["qweight"]), sz, entry.group_size)


def describe_table(weights: dict[str, QuantEntry]) -> str:
    """One line summing a table up, e.g. "int4, group size 32: 14 weights; int8, per output
    channel: 1 weight"."""
    counts: dict[str, int] = {}
    for e in weights.values():
        counts[e.describe()] = counts.get(e.describe(), 0) + 1
    return "; ".join(f"{d}: {n} weight{'s' if n != 1 else ''}" for d, n in sorted(counts.items()))
