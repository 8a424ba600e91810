"""The CPU platform's profile: every choice it measured on this machine for this rank's model, in one
typed place, made when it binds the model (:meth:`tpengine.backends.cpu.platform.CPUPlatform.bind_model`)
and completed when it binds the attention backend (:meth:`~tpengine.backends.cpu.platform.CPUPlatform.bind_attention`).
Each choice came from :mod:`tpengine.backends.cpu.measured` (measured, cached, or a busy machine's
default)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tpengine.backends.cpu import linear_layout, qgemv_choice
from tpengine.backends.platform import ExecutionProfile


@dataclass(frozen=True)
class CPUProfile(ExecutionProfile):
    """What the CPU platform measured and chose: ``linear_layouts`` (weight shape ->
    :class:`~tpengine.backends.cpu.linear_layout.LayoutChoice`), ``head_layout`` (a tied LM head's paths
    per row bucket, or None), ``quant_kernels`` (quantized weight group ->
    :func:`tpengine.backends.cpu.qgemv_choice.choose`'s entry), ``row_max_choice`` (the greedy pick's: a
    torch block or the C row argmax, :func:`tpengine.backends.cpu.greedy.choose_row_max_block`),
    ``greedy_choice`` (a half-precision head's greedy path), ``gemm_choices`` (half dtype -> whether its
    products run in float32, :func:`tpengine.backends.cpu.cpu_widen.gemm_choice`), ``paged_choice`` (the
    paged decode kernel's AMX path, :func:`tpengine.backends.cpu.cpu_paged.choose_amx`) and
    ``amx_min_batch`` (the batch from which that path runs; 0: never)."""

    linear_layouts: dict = field(default_factory=dict)
    head_layout: Any = None
    quant_kernels: dict = field(default_factory=dict)
    row_max_choice: Any = None
    greedy_choice: Any = None
    gemm_choices: dict = field(default_factory=dict)
    paged_choice: Any = None
    amx_min_batch: int = 0

    def gemm_dtypes(self) -> dict[torch.dtype, torch.dtype]:
        """Half dtype -> the dtype its products run in on this machine (float32 where widened)."""
        return {d: torch.float32 if c.name == "float32" else d for d, c in self.gemm_choices.items()}

    def describe(self, dtype: torch.dtype, head_shape: tuple[int, ...] | None) -> str | None:
        """The one line rank 0 logs about the model's choices, or None when no layout was chosen (the
        attention backend's paged path has a line of its own)."""
        if not self.linear_layouts:
            return None
        line = linear_layout.summary(self.linear_layouts, dtype)
        if self.quant_kernels:  # quantized weights: which kernel each shape takes at few rows
            line += "; quantized weights: " + qgemv_choice.summary(self.quant_kernels)
        if self.head_layout is not None and self.head_layout.times_us and head_shape is not None:
            line += "; tied LM head " + self.head_layout.describe(head_shape)
        if self.row_max_choice is not None:
            line += "; greedy row max " + self.row_max_choice.describe()
        if self.greedy_choice is not None:
            line += "; greedy logits " + self.greedy_choice.describe()
        if self.gemm_choices:
            line += "; half GEMM " + ", ".join(f"{str(d).removeprefix('torch.')} {c.describe()}"
                                               for d, c in self.gemm_choices.items())
        return line
