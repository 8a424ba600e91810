"""The device backend interface (as vLLM's ``platforms/``): everything the model and the engine ask
of a device, so that neither imports a device package nor branches on a device type for it.

:func:`tpengine.backends.get_platform` gives the platform of a device: the ``Platform`` subclass in
``tpengine/backends/<device type>/platform.py`` (the CPU's
:class:`tpengine.backends.cpu.platform.CPUPlatform`, CUDA's
:class:`tpengine.backends.cuda.platform.CUDAPlatform`), or this base class, the plain torch paths, for a
device without a package. A new device adds that one package and touches nothing else.

What a platform owns, in the order a rank uses it:

* :meth:`Platform.setup_process`: process-wide set-up before the model (threads, allocator, caches,
  kernel builds, collectives);
* :meth:`Platform.fused_ops`: the element-wise ops object every layer of a model holds;
* :meth:`Platform.choose_layouts` and :meth:`Platform.prepack`: the weight layouts, asked for before
  loading (packing happens while loading);
* :meth:`Platform.bind_model`: once loaded, what it measures (a :class:`ExecutionProfile`) and the
  binding of every layer to it (the linears' ``impl``, the LM head's greedy pick);
* :meth:`Platform.bind_attention`: once the KV cache is bound, the attention backend's measured
  choices (the CPU's paged kernel path), into the same profile;
* :meth:`Platform.release_free_memory` after loading, then :meth:`Platform.weights_to_huge_pages`;
  :meth:`Platform.kv_budget_bytes` (the KV
  cache's budget: the setting, or what a warm-up prefill leaves free) and
  :meth:`Platform.allocate_kv_cache`; :meth:`Platform.step_runner` (what replays a decode step: CUDA graphs).

The attention backend is :func:`tpengine.backends.get_backend`'s (``EngineConfig.attention_backend``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tpengine.backends.torch_ops import TorchOps
from tpengine.utils import GIB


@dataclass(frozen=True)
class ExecutionProfile:
    """What a platform measured and chose on this machine for this rank's model, handed to it when
    it binds the model (:meth:`Platform.bind_model`): the one place a measured choice lives. Empty
    for a platform that measures nothing; the CPU's is
    :class:`tpengine.backends.cpu.profile.CPUProfile`."""

    def describe(self, dtype: torch.dtype, head_shape: tuple[int, ...] | None) -> str | None:
        """The one line rank 0 logs about these choices, or None when nothing was measured."""
        return None


class Platform:
    """One device's backend; this base class is the plain torch one (no measurement, no set-up).
    Subclasses override what their device does differently. Stateless apart from what ``__init__``
    sets: one object per call of :func:`tpengine.backends.get_platform`."""

    #: the ``torch.device`` type this platform runs ("cpu", "cuda"; "torch" for the base class)
    name = "torch"
    #: whether it runs ``--quantization``'s weight-only int8 / int4 weights
    quantized_weights = False

    def setup_process(self, config, tp, plan) -> None:
        """Process-wide settings before the model is built (every rank, once; collective where the
        device's set-up is). ``config``: the :class:`~tpengine.config.EngineConfig`; ``tp``: this rank's
        :class:`~tpengine.distributed.TPInfo`; ``plan``: the :class:`~tpengine.model.plan.ShardPlan`."""

    def release_free_memory(self) -> None:
        """Give memory freed while loading back to the system, where the device can."""

    def fused_ops(self, cpu_kernels: bool) -> TorchOps:
        """The element-wise ops object every layer of a model holds (``cpu_kernels``:
        ``EngineConfig.cpu_kernels``, for a platform with kernels of its own)."""
        return TorchOps()

    def maps_weights(self) -> bool:
        """Whether a load may take a large whole weight (or its rows) in its checkpoint dtype as a mapping
        of the file's pages (:func:`tpengine.model.tensor_file.map_rows`) instead of reading it into memory
        of its own: nothing read or copied, at the cost of the file's alignment (8 bytes) and of pages
        that follow the file. Off here (a device's weights are copied onto it)."""
        return False

    def prepack(self, weight: torch.Tensor, layout: str = "packed") -> torch.Tensor | None:
        """``weight [out, in]`` in the platform's ``layout`` (a :meth:`choose_layouts` choice other than
        "plain"), or None (it keeps the plain one)."""
        return None

    def choose_layouts(self, shapes: dict[tuple[int, int], int], dtype: torch.dtype, setting: str,
                       cpu_kernels: bool, groups: dict[tuple[int, int], int] | None = None,
                       model: torch.nn.Module | None = None, tp_size: int = 1,
                       head: tuple[int, int] | None = None) -> dict[tuple[int, int], Any]:
        """Before loading: the layout of each linear weight shape ``(out, in)`` (``shapes``: how many
        layers have it), shape -> a choice with ``layout`` ("plain", "packed" or another the platform's
        :meth:`prepack` makes) and ``kernels``;
        ``setting``: ``EngineConfig.cpu_linear``; ``groups``: the mixture-of-experts expert shapes, each
        with the experts a token runs on this rank; ``model``: the model they belong to (built, not yet
        loaded), at tensor-parallel size ``tp_size``, where its form may change the choice; ``head``: a
        tied LM head's shape ``(vocab_local, hidden)`` whose rows stay in ``dtype`` (chosen by :meth:`bind_model`
        once loaded; a platform may time it first). {}: every weight stays plain."""
        return {}

    def bind_model(self, module: torch.nn.Module, layouts: dict, *, tie: bool, dtype: torch.dtype,
                   cpu_kernels: bool, cpu_linear: str, rank: int, pack: bool = True,
                   tp_size: int = 1) -> ExecutionProfile:
        """Once every weight is loaded: measure what the platform chooses by measurement, and bind every
        layer of ``module`` (the HF causal LM :func:`tpengine.model.surgery.build_model` built) to it.
        ``layouts``: :meth:`choose_layouts`'s (``pack``: whether layouts were asked for); ``tp_size``: the
        tensor-parallel world size ``module`` is a rank of. Returns the
        profile of those choices. This base binds every linear to its torch path."""
        for m in module.modules():
            if hasattr(m, "impl") and hasattr(m, "pack"):
                m.bind()
        return ExecutionProfile()

    def weights_to_huge_pages(self, module: torch.nn.Module) -> tuple[int, int]:
        """Once loaded, bound and trimmed (``EngineConfig.cpu_huge_pages``): move ``module``'s weights into
        huge pages where the platform does (the CPU's, a long job's), keeping every address. Returns
        ``(collapsed, regions)``, 2 MiB regions now in huge pages of those asked for; this base: ``(0, 0)``."""
        return 0, 0

    def bind_attention(self, backend, stack: torch.nn.Module, profile: ExecutionProfile) -> ExecutionProfile:
        """Once the KV cache is bound, before ``backend.bind_model``: measure what the attention
        ``backend`` needs measured on this device and set ``profile``'s choices on it. Returns the
        profile with those choices (this base: unchanged)."""
        return profile

    def kv_budget_bytes(self, config, device: torch.device, warmup) -> float:
        """The bytes this rank's KV cache may take when ``config.num_kv_blocks`` is unset: here
        ``config.kv_cache_gb`` GiB (``warmup``, a callable that runs one eager prefill as large as the
        scheduler may build, is for a device whose activations share the cache's memory)."""
        return config.kv_cache_gb * GIB

    def allocate_kv_cache(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The zero-filled KV cache tensor of ``shape`` (``[2, layers, blocks, block_size, kv_heads, head_dim]``).

        Raises:
            MemoryError, torch.OutOfMemoryError: it does not fit.
        """
        return torch.zeros(shape, dtype=dtype, device=device)

    def step_runner(self, model: torch.nn.Module, backend, config, hidden_size: int, dtype: torch.dtype,
                    device: torch.device):
        """What runs a decode step in place of the eager forward (CUDA: captured graphs), or None.
        Its interface is :class:`tpengine.backends.cuda.graphs.CUDAGraphRunner`'s ``can_run`` / ``run``."""
        return None
