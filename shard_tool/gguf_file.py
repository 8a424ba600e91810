"""A GGUF file's metadata and tensor table, read straight from its bytes (GGUF v2 / v3, little-endian).

gguf-py's ``GGUFReader`` builds a numpy view per element of every metadata array, which for a real
vocabulary (tens to hundreds of thousands of tokens and merges) costs seconds to minutes per open;
convert needs none of those strings (transformers reads the tokenizer itself), so this reader walks
string arrays without keeping them. Tensors are memory-mapped: a tensor's ``data`` is a uint8 view of
its rows, in the layout ``gguf.dequantize`` and :mod:`shard_tool.gguf_quant` take.

Layout (ggml's docs/gguf.md): magic ``GGUF``, u32 version, u64 tensor count, u64 metadata count;
each metadata entry a string key, u32 value type, value; each tensor entry a string name, u32 number
of dimensions, u64 dimensions (fastest-moving first), u32 ggml type, u64 offset into the data
section, which starts at the next multiple of ``general.alignment`` (default 32) after the table.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import numpy as np

from tpengine.errors import UserError

# value type -> struct format of the scalars (uint8 .. float64, bool); 8 is string, 9 array
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: ``shape`` in torch order (rows first), ``qtype`` its ``gguf.GGMLQuantizationType``,
    ``data`` uint8 ``[*shape[:-1], bytes per row]`` (a memory-mapped view)."""

    name: str
    shape: tuple[int, ...]
    qtype: Any
    data: np.ndarray

    @property
    def type_name(self) -> str:
        """The ggml type's name: ``F32``, ``Q4_1``, ..."""
        return self.qtype.name


class GGUFFile:
    """The metadata (``metadata``: key -> int / float / bool / str / list of numbers; a string array
    is its length) and tensors (``tensors``: name -> :class:`GGUFTensor`, in file order) of ``path``.

    Raises:
        UserError: the file is not GGUF v2 / v3, is truncated, or holds a tensor of a type gguf-py
            does not know.
    """

    def __init__(self, path: str | Path) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = str(path)
        try:
            blob = np.memmap(self.path, mode="r", dtype=np.uint8)
        except ValueError as e:  # numpy cannot map an empty file
            raise UserError(f"{self.path!r} is not a GGUF file (it is empty)") from e
        try:
            if bytes(blob[:4]) != b"GGUF":
                raise UserError(f"{self.path!r} is not a GGUF file (it does not start with 'GGUF')")
            version, n_tensors, n_kv = struct.unpack_from("<IQQ", blob, 4)
            if version not in (2, 3):
                raise UserError(f"{self.path!r} is GGUF version {version}; convert reads versions 2 and 3")
            pos, self.metadata = 24, {}
            for _ in range(n_kv):
                key, pos = _string(blob, pos)
                (vtype,) = struct.unpack_from("<I", blob, pos)
                self.metadata[key], pos = _value(blob, pos + 4, vtype)
            entries = []
            for _ in range(n_tensors):
                name, pos = _string(blob, pos)
                (ndim,) = struct.unpack_from("<I", blob, pos)
                dims = struct.unpack_from(f"<{ndim}Q", blob, pos + 4)
                qtype, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * ndim)
                pos += 4 + 8 * ndim + 12
                entries.append((name, tuple(int(d) for d in reversed(dims)), qtype, offset))
        except struct.error as e:
            raise UserError(f"{self.path!r} is truncated or not a GGUF file ({e})") from e
        align = int(self.metadata.get("general.alignment", 32))
        start = (pos + align - 1) // align * align
        self.tensors: dict[str, GGUFTensor] = {}
        for name, shape, qtype, offset in entries:
            try:
                qt = GGMLQuantizationType(qtype)
            except ValueError as e:
                raise UserError(f"GGUF tensor {name!r} in {self.path!r} has unknown ggml type {qtype}") from e
            block, size = GGML_QUANT_SIZES[qt]
            row = shape[-1] // block * size
            nbytes = prod(shape[:-1]) * row
            a = start + offset
            if a + nbytes > blob.shape[0]:
                raise UserError(f"{self.path!r} is truncated: tensor {name!r} ends past the end of the file")
            self.tensors[name] = GGUFTensor(name, shape, qt, blob[a:a + nbytes].reshape(*shape[:-1], row))

    @property
    def architecture(self) -> str:
        """``general.architecture`` ("" when missing)."""
        return str(self.metadata.get("general.architecture", ""))


def _string(blob: np.ndarray, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", blob, pos)
    return bytes(blob[pos + 8:pos + 8 + n]).decode("utf-8"), pos + 8 + n


def _value(blob: np.ndarray, pos: int, vtype: int) -> tuple[Any, int]:
    """One metadata value at ``pos`` and the position after it; a string array becomes its length."""
    if vtype in _SCALAR:
        fmt = _SCALAR[vtype]
        return struct.unpack_from(fmt, blob, pos)[0], pos + struct.calcsize(fmt)
    if vtype == _STRING:
        return _string(blob, pos)
    if vtype == _ARRAY:
        etype, count = struct.unpack_from("<IQ", blob, pos)
        pos += 12
        if etype in _SCALAR:
            fmt = _SCALAR[etype]
            return list(struct.unpack_from(f"<{count}{fmt[1]}", blob, pos)), pos + count * struct.calcsize(fmt)
        if etype == _STRING:  # walked, not kept: a vocabulary or merge table
            for _ in range(count):
                (n,) = struct.unpack_from("<Q", blob, pos)
                pos += 8 + n
            return count, pos
        raise UserError(f"GGUF metadata holds an array of value type {etype}, which convert cannot read")
    raise UserError(f"GGUF metadata holds a value of type {vtype}, which convert cannot read")
