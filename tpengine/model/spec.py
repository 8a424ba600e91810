"""The model a launch runs: its folder, its HF config and this tp size's ``ShardPlan``, read once.

Every entry point reads the folder once (the batch job, the server and ``LLM`` via
:class:`tpengine.engine.llm_engine.LLMEngine`, which reads the config with
:meth:`ModelSpec.read_config` before the process groups exist and makes the spec with
:meth:`ModelSpec.from_config` after; ``tpengine-shard`` through the plan), and the engine, the process
set-up and the loader take the same object, so no one reads ``config.json`` or builds the plan a
second time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tpengine.distributed import TPInfo
from tpengine.model.checkpoint import check_model_folder, is_shard_folder
from tpengine.model.plan import ShardPlan
from tpengine.model.shard_folder import check_manifest


@dataclass(frozen=True)
class ModelSpec:
    """``folder``: a full HF folder or a shard folder; ``hf_config``: its ``transformers`` config;
    ``shard_plan``: the partition of this config over ``tp`` ranks (a shard folder's, checked against the
    launch); ``sharded``: whether ``folder`` holds per-rank files (``tpengine-shard split``)."""

    folder: Path
    hf_config: Any
    shard_plan: ShardPlan
    sharded: bool

    @staticmethod
    def read_config(folder: str | Path) -> Any:
        """Check ``folder`` and read its ``transformers`` config (``AutoConfig``); what
        :meth:`read` reads before it knows the tp size, so a caller that needs the config earlier
        (e.g. to check ``max_model_len`` before :func:`tpengine.distributed.init_distributed`)
        reads it once and passes it to :meth:`from_config`.

        Raises:
            tpengine.errors.UserError: no folder, a missing or broken ``config.json`` or
                ``manifest.json`` (:func:`tpengine.model.checkpoint.check_model_folder`).
        """
        from transformers import AutoConfig

        check_model_folder(folder)
        return AutoConfig.from_pretrained(folder)

    @classmethod
    def from_config(cls, folder: str | Path, hf_config: Any, tp: TPInfo, expert_parallel: bool = False,
                    layer_partition: list[int] | None = None) -> ModelSpec:
        """The spec of ``folder`` whose config :meth:`read_config` has read as ``hf_config``, for the
        launch ``tp``: a shard folder's manifest checked against it (:func:`check_manifest`), a full
        folder's plan built (:meth:`ShardPlan.build`; ``expert_parallel``: a MoE model's experts whole per
        rank, ``EngineConfig.enable_expert_parallel``; ``tp.pp_size`` pipeline stages of
        ``layer_partition``'s layer counts, or as even as possible).

        Raises:
            tpengine.model.shard_folder.CheckpointMismatchError: a shard folder made for another tp
                or config, or a rank file that differs from its manifest.
            tpengine.errors.UserError: a config that does not split over ``tp.size`` ranks
                (:meth:`ShardPlan.build`: ``tp.size`` beyond ``num_attention_heads``, more ranks than experts
                under expert parallelism, ...).
        """
        folder = Path(folder)
        sharded = is_shard_folder(folder)
        plan = (check_manifest(folder, hf_config, tp, expert_parallel, layer_partition) if sharded
                else ShardPlan.build(hf_config, tp.size, expert_parallel, tp.pp_size, layer_partition))
        if sharded and tp.pp_size > 1 and not plan.stages:  # a TP split run in stages: each reads its layers
            stages = ShardPlan.split_layers(int(hf_config.num_hidden_layers), tp.pp_size, layer_partition)
            plan = dataclasses.replace(plan, stages=stages)
        return cls(folder, hf_config, plan, sharded)

    @classmethod
    def read(cls, folder: str | Path, tp: TPInfo) -> ModelSpec:
        """Check ``folder`` and read its config and plan for the launch ``tp``
        (:meth:`read_config`, then :meth:`from_config`).

        Raises:
            tpengine.errors.UserError: no folder, a missing or broken ``config.json`` or
                ``manifest.json`` (:func:`tpengine.model.checkpoint.check_model_folder`).
            tpengine.model.shard_folder.CheckpointMismatchError: a shard folder made for another tp
                or config, or a rank file that differs from its manifest.
        """
        return cls.from_config(folder, cls.read_config(folder), tp)
