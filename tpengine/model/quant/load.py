"""Loading a quantized folder's stored parts (:mod:`tpengine.model.quant.checkpoint`): the launch checks
(:func:`check_stored_quantization`) and the per-layer buffers the loader reads the parts into
(:class:`QuantParts`)."""

from __future__ import annotations

from pathlib import Path

import torch

from tpengine.distributed import TPInfo
from tpengine.errors import UserError
from tpengine.model.layers.embedding import VocabParallelEmbedding
from tpengine.model.quant.checkpoint import QuantEntry, build_weight, describe_table, part_dtype
from tpengine.model.quant.weights import QuantScheme, check_quantization
from tpengine.model.tensor_file import TensorInfo


class QuantParts:
    """This rank's stored parts of quantized layers while they load: part -> buffer ``[rows of the
    layer, stored columns]`` per layer (qweight in its stored dtype, scales/zeros in the
    activation dtype, coded zeros int8), allocated on a layer's first part; :meth:`finish` builds the layer's
    :class:`~tpengine.model.quant.weights.QuantizedWeight` and frees them."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.bufs: dict[int, dict[str, torch.Tensor]] = {}

    def dest(self, module: torch.nn.Module, part: str, entry: QuantEntry, info: TensorInfo,
             cols: int) -> torch.Tensor:
        """The buffer of ``part`` of ``module`` (``cols`` stored columns for this rank), for the
        checkpoint tensor ``info``.

        Raises:
            ValueError: ``info`` of another dtype than the format's, or a merged layer whose
                parts disagree in columns, naming the tensor.
        """
        want = part_dtype(entry, part)
        if (want is not None and info.dtype != want) or (want is None and not info.dtype.is_floating_point):
            raise ValueError(f"checkpoint tensor {info.name!r} has dtype {info.dtype}; the {entry.scheme} format "
                             f"stores {part} as {want or 'float32'}")
        bufs = self.bufs.setdefault(id(module), {})
        if part not in bufs:
            bufs[part] = torch.zeros(module.weight.shape[0], cols, dtype=want or self.dtype)  # vocab padding rows: 0
        if bufs[part].shape[1] != cols:
            raise ValueError(f"checkpoint tensor {info.name!r} has {cols} columns for this rank, the other "
                             f"parts of its merged layer {bufs[part].shape[1]}")
        return bufs[part]

    def finish(self, module: torch.nn.Module, name: str, entry: QuantEntry) -> None:
        """Set ``module.quant`` from its parts (``weight`` becomes None; an embedding's rows
        lookup prepared).

        Raises:
            ValueError: parts whose shapes do not fit the layer's ``[out, in]`` under ``entry``.
        """
        bufs = self.bufs.pop(id(module))
        out, k = module.weight.shape
        groups = bufs["scales"].shape[1]
        q_cols = k if entry.scheme == "int8" else k // 2
        per_channel = entry.scheme == "int8" and groups == 1
        if bufs["qweight"].shape[1] != q_cols or not (per_channel or groups * (entry.group_size or 0) == k):
            raise ValueError(f"{name!r} ({entry.describe()}): stored qweight {list(bufs['qweight'].shape)} and "
                             f"scales {list(bufs['scales'].shape)} do not fit this rank's [{out}, {k}] weight")
        module.quant = build_weight(entry, bufs)
        module.weight = None
        if isinstance(module, VocabParallelEmbedding):
            module.quant.prepare_rows()  # at load, not in the first step (as quantize_linear)


def check_stored_quantization(model_dir: Path, table: dict[str, QuantEntry], quantization: str | None,
                              linears: list[str], hf_config, tp: TPInfo, expert_parallel: bool = False) -> None:
    """Check a quantized folder's ``table`` against the launch before any weight is read: the
    CPU (torch's kernels), no ``--quantization`` that says otherwise than the folder, and, for
    a full folder sliced on the fly, row splits on group boundaries. ``linears``: the checkpoint
    names of the model's column/row-parallel linear weights; ``expert_parallel``: a MoE model's experts
    are whole on each rank (the launch's plan), so no expert's input is split.

    Raises:
        UserError: ``quantization`` given and some column/row-parallel linear of the folder not
            stored in exactly that scheme (naming both), a device other than the CPU, or a tp
            that cuts a group (check_quantization's message, after the folder).
    """
    where = f"the quantized folder {str(model_dir)!r} ({describe_table(table)})"
    if quantization is not None:
        want = QuantScheme.of(quantization)
        if any(table.get(n) != QuantEntry.of_scheme(want) for n in linears):
            flag = QuantEntry.of_scheme(want).describe()
            raise UserError(f"--quantization {quantization} ({flag}) disagrees with {where}; drop --quantization "
                            "to run the folder's weights as stored, or pass a float folder to quantize on the fly")
    if tp.device.type != "cpu":
        raise UserError(f"{where} runs on the CPU only in this version, not on {tp.device}")
    for e in sorted({e for e in table.values() if e.group_size is not None}, key=lambda e: (e.scheme, e.group_size)):
        try:
            check_quantization(hf_config, tp.size, QuantScheme(e.scheme, e.group_size), expert_parallel)
        except UserError as err:
            raise UserError(f"{where} cannot run at tp={tp.size}: {err}") from None
