"""Reading and writing safetensors files tensor by tensor, without mapping them.

The safetensors format (https://github.com/huggingface/safetensors, "Format"): an 8-byte
little-endian header length ``n``, ``n`` bytes of JSON (``{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {...}}``), then the tensors' bytes, row-major, at
``8 + n + begin``. The ``safetensors`` library maps a whole file and hands out tensors backed by
(or copied from) the mapping, so every page a rank reads stays resident while the file is open.
This module instead reads exactly the byte ranges a rank needs, with ``preadv``, straight into
the tensor that keeps them (:func:`read_rows`), and writes a file one tensor at a time
(:class:`TensorFileWriter`), so neither loading nor splitting ever holds a second copy of a model.
:func:`map_rows` maps exactly one tensor's rows instead (their pages, private and copy-on-write): the
tensor is then the page cache's copy itself, nothing read, zeroed or copied, as long as it lives.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

# safetensors dtype codes <-> torch dtypes
DTYPE_CODES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
CODE_OF: dict[torch.dtype, str] = {v: k for k, v in DTYPE_CODES.items()}
CHUNK_BYTES = 64 << 20  # staging buffer for reads that convert dtype
MAX_HEADER = 100 << 20
#: The smallest tensor worth a mapping of its own (:func:`map_rows`; a smaller one is read).
MAP_MIN_BYTES = 1 << 20


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies in a safetensors file: ``dtype``, ``shape`` and its absolute byte
    ``offset`` in the file (``nbytes`` long)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def read_header(path: str | Path) -> dict[str, TensorInfo]:
    """The tensors of the safetensors file at ``path``, in file order.

    Raises:
        ValueError: not a safetensors file (bad header length or JSON, an unknown dtype, offsets
            past the end of the file), naming the file.
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{str(path)!r} is not a safetensors file: {size} bytes, no header")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER, size - 8):
            raise ValueError(f"{str(path)!r} is not a safetensors file: header length {n} in a {size}-byte file")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{str(path)!r} is not a safetensors file: its header is not JSON ({e})") from None
    out: dict[str, TensorInfo] = {}
    base = 8 + n
    for name, entry in sorted(((k, v) for k, v in header.items() if k != "__metadata__"),
                              key=lambda kv: kv[1]["data_offsets"][0]):
        code, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        if code not in DTYPE_CODES:
            raise ValueError(f"{str(path)!r}: tensor {name!r} has dtype {code!r}; supported: {', '.join(DTYPE_CODES)}")
        dtype = DTYPE_CODES[code]
        if end - begin != math.prod(shape) * dtype.itemsize or base + end > size:
            raise ValueError(f"{str(path)!r}: tensor {name!r} ({code} {list(shape)}) has byte range "
                             f"[{begin}, {end}) that does not fit its shape or the {size}-byte file (truncated?)")
        out[name] = TensorInfo(name, dtype, shape, base + begin, end - begin)
    return out


#: At most this many buffers per ``preadv`` call (Linux's ``IOV_MAX``).
IOV_MAX = 1024


def _preadv_all(fd: int, bufs: list[memoryview], offset: int) -> None:
    """Fill the byte buffers ``bufs``, in order, from the file's consecutive bytes at ``offset``:
    ``preadv`` calls of at most :data:`IOV_MAX` buffers, resumed after a short read. Raises OSError on
    a read that returns nothing (the file ended)."""
    i, skip = 0, 0  # the next buffer, and the bytes of it already filled
    while i < len(bufs):
        batch = [bufs[i][skip:]] + bufs[i + 1:i + IOV_MAX]
        want = sum(len(b) for b in batch)
        got = os.preadv(fd, batch, offset) if want else 0
        if want and got <= 0:
            raise OSError(f"unexpected end of file at byte {offset}")
        offset += got
        if got == want:
            i, skip = i + len(batch), 0
            continue
        for b in batch:  # a short read: find where it stopped
            if got < len(b):
                skip += got
                break
            got -= len(b)
            i, skip = i + 1, 0


def _pread_into(fd: int, buf: torch.Tensor, offset: int) -> None:
    """Fill the contiguous tensor ``buf`` with the file's bytes at ``offset``. Raises OSError on a
    short read (the file ended)."""
    view = memoryview(buf.view(-1).view(torch.uint8).numpy())
    _preadv_all(fd, [view[i:i + (1 << 30)] for i in range(0, len(view), 1 << 30)], offset)


def _pread_columns(fd: int, dest: torch.Tensor, offset: int, cols: int, start: int) -> None:
    """Fill the contiguous ``[rows, width]`` tensor ``dest`` with columns ``[start, start + width)`` of
    the file's row-major ``[rows, cols]`` tensor (of ``dest``'s dtype) at byte ``offset``: one
    ``preadv`` list per batch of rows, each row's slice read straight into its row of ``dest`` and the
    columns between two slices into one small scratch buffer (reused, so they never reach memory
    the rank keeps), so the slice is read without a staging copy of the rows."""
    rows, width = dest.shape
    item = dest.element_size()
    view = memoryview(dest.view(-1).view(torch.uint8).numpy())
    gap = memoryview(bytearray((cols - width) * item))
    bufs: list[memoryview] = []
    for r in range(rows):
        if r:
            bufs.append(gap)
        bufs.append(view[r * width * item:(r + 1) * width * item])
    _preadv_all(fd, bufs, offset + start * item)


def read_rows(fd: int, info: TensorInfo, dest: torch.Tensor, dim: int = 0, start: int = 0) -> None:
    """Copy ``info``'s slice ``[start, start + dest.shape[dim])`` along ``dim`` (0 or 1) into
    ``dest`` (any dtype: values are cast, as ``Tensor.copy_`` does), reading only what it needs:
    a slice along dim 0 is one byte range; along dim 1 (all columns: the same one range) each row's
    slice lands in its row of ``dest`` (:func:`_pread_columns`; the columns between slices pass
    through a small scratch buffer). A dtype cast goes through a staging buffer of at most
    :data:`CHUNK_BYTES`. ``dest`` must be contiguous, on the CPU, of ``info.shape`` but for ``dim``.

    Raises:
        ValueError: a shape or range mismatch, naming the tensor.
        OSError: the file is shorter than its header says.
    """
    shape = info.shape
    want = list(shape)
    if shape and dest.dim() == len(shape):
        want[dim] = dest.shape[dim]
    if (list(dest.shape) != want or not dest.is_contiguous() or dest.device.type != "cpu"
            or (shape and (start < 0 or start + dest.shape[dim] > shape[dim]))):
        raise ValueError(f"cannot read rows {start}:{start + (dest.shape[dim] if shape else 0)} along dim {dim} "
                         f"of tensor {info.name!r} {list(shape)} into a {list(dest.shape)} tensor (must be "
                         "contiguous, on the CPU, and of the tensor's shape but along that dim)")
    if dest.numel() == 0:
        return
    item = info.dtype.itemsize
    row = math.prod(shape[1:])
    if dim == 1 and len(shape) == 2 and dest.shape[1] == shape[1]:
        dim = 0  # every column: the same bytes as all rows along dim 0
    if dim == 0 or len(shape) <= 1:
        offset = info.offset + start * row * item
        if dest.dtype == info.dtype:
            _pread_into(fd, dest, offset)
            return
        flat = dest.view(-1)
        step = max(1, CHUNK_BYTES // item)
        buf = torch.empty(min(step, flat.numel()), dtype=info.dtype)
        for i in range(0, flat.numel(), step):
            part = buf[: min(step, flat.numel() - i)]
            _pread_into(fd, part, offset + i * item)
            flat[i:i + part.numel()].copy_(part)
        return
    if dim != 1 or len(shape) != 2:
        raise ValueError(f"tensor {info.name!r}: slicing along dim {dim} of a {len(shape)}-D tensor is not supported")
    rows, cols = shape
    width = dest.shape[1]
    if dest.dtype == info.dtype:
        _pread_columns(fd, dest, info.offset, cols, start)
        return
    step = max(1, CHUNK_BYTES // max(1, width * item))
    buf = torch.empty(min(step, rows), width, dtype=info.dtype)
    for r in range(0, rows, step):
        part = buf[: min(step, rows - r)]
        _pread_columns(fd, part, info.offset + r * cols * item, cols, start)
        dest[r:r + part.shape[0]].copy_(part)


def map_rows(fd: int, info: TensorInfo, rows: int, start: int = 0) -> torch.Tensor:
    """Rows ``[start, start + rows)`` of ``info``'s tensor (``[rows, *info.shape[1:]]``, ``info.dtype``,
    on the CPU) backed by a private, copy-on-write mapping of the pages that hold them and no others
    (``mmap`` from the page below their first byte; the tensor keeps the mapping alive, a write copies
    only the page written). Nothing is read, zeroed or copied: a page comes from the page cache when
    first touched, as transformers' ``from_pretrained`` takes a tensor from the safetensors library's
    mapping. The data keeps the file's alignment (safetensors: 8 bytes). The file must not be changed
    while the tensor lives (a private mapping's unwritten pages follow the file).

    Raises:
        ValueError: a row range outside the tensor, naming it.
        OSError: the mapping cannot be made.
    """
    shape = info.shape
    if not shape or start < 0 or rows < 1 or start + rows > shape[0]:
        raise ValueError(f"cannot map rows {start}:{start + rows} of tensor {info.name!r} {list(shape)}")
    row = math.prod(shape[1:]) * info.dtype.itemsize
    begin = info.offset + start * row
    base = begin - begin % mmap.ALLOCATIONGRANULARITY
    pages = mmap.mmap(fd, begin - base + rows * row, flags=mmap.MAP_PRIVATE,
                      prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=base)
    flat = torch.frombuffer(pages, dtype=info.dtype, count=rows * row // info.dtype.itemsize, offset=begin - base)
    return flat.view(rows, *shape[1:])


class TensorFileWriter:
    """Write a safetensors file tensor by tensor: the names, dtypes and shapes are given up front
    (the header comes first in the format), then :meth:`write` each tensor in that order.

    Args:
        path: the file to create.
        entries: ``[(name, dtype, shape), ...]`` in file order.
        metadata: ``__metadata__`` strings.

    Raises:
        ValueError: from :meth:`write`, a tensor out of order or of another dtype or shape; from
            :meth:`close`, tensors never written.
    """

    def __init__(self, path: str | Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        header: dict = {"__metadata__": dict(metadata or {})}
        offset = 0
        self._order = []
        for name, dtype, shape in entries:
            n = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": CODE_OF[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            self._order.append((name, dtype, tuple(shape)))
            offset += n
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned, as the library writes it
        self._f = open(path, "wb")  # noqa: SIM115 (closed by close())
        self._f.write(struct.pack("<Q", len(blob)) + blob)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append ``tensor`` (CPU) as the next entry, which must be ``name``."""
        want = self._order[self._next] if self._next < len(self._order) else None
        if want is None or want != (name, tensor.dtype, tuple(tensor.shape)):
            raise ValueError(f"write of {name!r} {tensor.dtype} {list(tensor.shape)}; expected {want}")
        t = tensor.contiguous()
        if t.numel():
            self._f.write(memoryview(t.view(-1).view(torch.uint8).numpy()))
        self._next += 1

    def close(self) -> None:
        """Flush and close; raises ValueError if some declared tensor was never written."""
        self._f.close()
        if self._next != len(self._order):
            raise ValueError(f"{len(self._order) - self._next} declared tensor(s) never written, "
                             f"first {self._order[self._next][0]!r}")
