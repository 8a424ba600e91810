"""Process set-up before a rank builds its model: the device's platform does it
(:meth:`tpengine.backends.platform.Platform.setup_process`; on the CPU threads, malloc behaviour,
oneDNN's caches, the C kernels' build and the shared-memory collectives,
:mod:`tpengine.backends.cpu.process`). Made once by :class:`tpengine.engine.llm_engine.LLMEngine`,
never per step."""

from __future__ import annotations

from tpengine.backends import get_platform
from tpengine.config import EngineConfig
from tpengine.distributed import TPInfo
from tpengine.model.plan import ShardPlan


def setup_process(config: EngineConfig, tp: TPInfo, plan: ShardPlan) -> None:
    """Collective where the device's set-up is (every rank calls it, after
    :func:`tpengine.distributed.init_distributed`): ``tp.device``'s platform's process set-up."""
    get_platform(tp.device).setup_process(config, tp, plan)
