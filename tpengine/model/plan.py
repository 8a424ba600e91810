"""ShardPlan: the one source of partition truth for tensor parallelism.

Pure partition math for one Hugging Face decoder config and one TP size. Both the offline shard
tool (`tpengine-shard split`) and the runtime loader slice weights only through
:meth:`ShardPlan.shard`, so offline and online sharding cannot drift apart.

Layout (see docs/design.md):

* query heads: contiguous ranges whose sizes differ by at most one (9 heads at tp=2 -> 5 + 4);
* KV heads: each rank holds exactly the KV heads its query heads use (query head ``h`` uses KV
  head ``h // (num_heads // num_kv_heads)``); a KV head whose query heads straddle two ranks, or
  ``num_kv_heads < tp``, is held by both. With even splits this is Megatron-LM's layout
  (Shoeybi et al., 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using
  Model Parallelism");
* MLP intermediate: contiguous, as even as possible;
* vocabulary: padded up to a multiple of tp and split evenly; padded rows are zero;
* routed experts (a mixture-of-experts model, :class:`tpengine.model.families.MoE`): under tensor
  parallelism (the default) every rank holds every expert, each expert's intermediate split as the
  dense MLP's (``expert_intermediate``, contiguous, as even as possible); under expert parallelism
  (``enable_expert_parallel``, vLLM's flag) each rank holds whole experts, a contiguous range as even
  as possible (8 experts on 3 ranks -> 3, 3, 2: ``experts``); a shared expert (Qwen2-MoE) is split as
  a dense MLP under both (``shared_expert_intermediate``). Either way a rank's experts give a
  partial sum of the layer's output and one all-reduce per layer combines them; the router
  (``mlp.gate``) is replicated, attention stays split by heads;
* pipeline stages (``pipeline_parallel_size``, vLLM's): the decoder layers split into contiguous ranges,
  as even as possible with the extra layers on the stages before the last (the last one holds the final
  norm and the LM head: vLLM's ``get_pp_indices`` rule), or as a given partition (``"8,8,6"``); every
  stage is split over the same ``tp_size`` ranks the same way (``ranks``).

This module must not import torch.distributed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from tpengine.errors import UserError
from tpengine.utils import cdiv

# Partition kinds of a weight. The name -> kind table lives in tpengine/model/surgery.py.
Q, K, V = "q", "k", "v"  # column-parallel by query heads / KV heads
COLUMN = "column"  # column-parallel by MLP intermediate (gate_proj, up_proj)
ROW_HEADS = "row_heads"  # row-parallel by query heads (o_proj)
ROW = "row"  # row-parallel by MLP intermediate (down_proj)
VOCAB = "vocab"  # rows split by padded vocabulary (embed_tokens, lm_head)
REPLICATED = "replicated"  # norms, a MoE router and anything else held whole
EXPERT_COLUMN = "expert_column"  # a routed expert's gate_proj/up_proj: rows by its intermediate (TP), whole (EP)
EXPERT_ROW = "expert_row"  # a routed expert's down_proj: columns by its intermediate (TP), whole (EP)
SHARED_COLUMN = "shared_column"  # a shared expert's gate_proj/up_proj (Qwen2-MoE): rows by its intermediate
SHARED_ROW = "shared_row"  # a shared expert's down_proj: columns by its intermediate
KINDS = (Q, K, V, COLUMN, ROW_HEADS, ROW, VOCAB, REPLICATED, EXPERT_COLUMN, EXPERT_ROW, SHARED_COLUMN, SHARED_ROW)
EXPERT_KINDS = (EXPERT_COLUMN, EXPERT_ROW)


def split_even(n: int, parts: int) -> list[tuple[int, int]]:
    """Split ``range(n)`` into ``parts`` contiguous ``[start, end)`` ranges whose sizes differ by
    at most one, larger ones first (9 into 2 -> (0, 5), (5, 9))."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for r in range(parts):
        size = base + (1 if r < extra else 0)
        out.append((start, start + size))
        start += size
    return out


@dataclass(frozen=True)
class RankPlan:
    """What one rank holds. All ranges are half-open ``[start, end)`` in global indices.

    ``q_to_kv[i]`` is the local KV head index used by local query head ``i``.
    ``vocab`` is a range in the padded vocabulary; rows ``>= vocab_size`` are padding.
    ``experts``: the routed experts this rank holds (all of them under tensor parallelism, its own
    range under expert parallelism; ``(0, 0)`` for a dense model); ``expert_intermediate``: the part of
    each held expert's intermediate (its slice under tensor parallelism, the whole under expert
    parallelism); ``shared_expert_intermediate``: its slice of a shared expert's intermediate (Qwen2-MoE's
    ``shared_expert``, split as a dense MLP under either layout).
    """

    rank: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    q_to_kv: tuple[int, ...]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    experts: tuple[int, int] = (0, 0)
    expert_intermediate: tuple[int, int] = (0, 0)
    shared_expert_intermediate: tuple[int, int] = (0, 0)

    @property
    def num_experts(self) -> int:
        return self.experts[1] - self.experts[0]

    @property
    def expert_intermediate_size(self) -> int:
        return self.expert_intermediate[1] - self.expert_intermediate[0]

    @property
    def num_q_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def intermediate_size(self) -> int:
        return self.intermediate[1] - self.intermediate[0]

    @property
    def vocab_size(self) -> int:
        return self.vocab[1] - self.vocab[0]


@dataclass(frozen=True)
class ShardPlan:
    """Partition of one decoder model over ``tp_size`` ranks.

    Build with :meth:`build`; serialise with :meth:`to_dict` / :meth:`from_dict` (the shard
    manifest stores it). ``ranks[r]`` is rank ``r``'s :class:`RankPlan`. A mixture-of-experts model
    has ``num_experts`` routed experts per sparse layer of ``moe_intermediate_size`` each, ``top_k`` of
    them per token (``num_experts_per_tok``), laid out by ``expert_parallel`` (see the module
    docstring; 0, 0, False, 0 for a dense model), and a shared expert of
    ``shared_expert_intermediate_size`` (0: none) split as a dense MLP; which tensors are an expert's
    and whose: :func:`tpengine.model.surgery.kind_of`, :func:`tpengine.model.surgery.expert_of`,
    :func:`tpengine.model.surgery.holds`, :meth:`holds_expert`.
    """

    tp_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    padded_vocab_size: int
    ranks: tuple[RankPlan, ...]
    num_experts: int = 0
    moe_intermediate_size: int = 0
    expert_parallel: bool = False
    top_k: int = 0
    shared_expert_intermediate_size: int = 0
    #: each pipeline stage's decoder layers ``[start, end)``; empty: one stage holding every layer
    stages: tuple[tuple[int, int], ...] = ()

    @property
    def pp_size(self) -> int:
        """The pipeline stages (1 without pipeline parallelism)."""
        return max(1, len(self.stages))

    def stage_layers(self, stage: int, num_layers: int) -> tuple[int, int]:
        """Stage ``stage``'s decoder layers ``[start, end)`` of a model of ``num_layers`` layers."""
        return self.stages[stage] if self.stages else (0, num_layers)

    @staticmethod
    def split_layers(num_layers: int, pp_size: int, partition: list[int] | None = None) -> tuple[tuple[int, int], ...]:
        """``num_layers`` decoder layers over ``pp_size`` stages, ``[start, end)`` each: ``partition``'s counts,
        or as even as possible with the remainder one each on the stages before the last, from the
        second-to-last back (the last stage also runs the final norm and the LM head; vLLM's rule):
        22 over 3 -> 7, 8, 7; 10 over 4 -> 2, 3, 3, 2. Empty for one stage.

        Raises:
            tpengine.errors.UserError: more stages than layers, or a partition that does not sum to
                ``num_layers``, naming the numbers.
        """
        if pp_size == 1 and partition is None:
            return ()
        if pp_size > num_layers:
            raise UserError(f"pipeline_parallel_size={pp_size} is more stages than the model's {num_layers} layers; "
                            f"use at most {num_layers}")
        if partition is None:
            partition = [num_layers // pp_size] * pp_size
            for i in range(num_layers % pp_size):
                partition[-2 - i] += 1
        if sum(partition) != num_layers:
            raise UserError(f"pp_layer_partition={','.join(map(str, partition))!r} holds {sum(partition)} layers, "
                            f"but the model has {num_layers}; the counts must sum to {num_layers}")
        bounds = [0]
        for c in partition:
            bounds.append(bounds[-1] + c)
        return tuple(zip(bounds, bounds[1:])) if pp_size > 1 else ()

    @staticmethod
    def dims(hf_config: Any) -> dict[str, int]:
        """Read the partitioned dimensions from a transformers config (``head_dim`` explicit,
        as in Qwen3, or ``hidden_size // num_attention_heads``).

        Raises:
            UserError: the config lacks one of them (a decoder of another family, e.g. GPT-2),
                naming its ``model_type`` and the fields missing.
        """
        need = ("num_attention_heads", "hidden_size", "intermediate_size", "vocab_size")
        from tpengine.model.families import supported_names

        missing = [f for f in need if getattr(hf_config, f, None) is None]
        if missing:
            raise UserError(f"model_type {getattr(hf_config, 'model_type', '?')!r}: the config has no "
                            f"{', '.join(missing)}; tpengine runs {supported_names()} decoders")
        num_heads = int(hf_config.num_attention_heads)
        num_kv = getattr(hf_config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        return dict(
            num_heads=num_heads,
            num_kv_heads=int(num_kv),
            head_dim=int(head_dim),
            hidden_size=int(hf_config.hidden_size),
            intermediate_size=int(hf_config.intermediate_size),
            vocab_size=int(hf_config.vocab_size),
        )

    @staticmethod
    def expert_dims(hf_config: Any) -> tuple[int, int]:
        """``(routed experts, each expert's intermediate size)`` of a mixture-of-experts config (its
        family's :class:`tpengine.model.families.MoE` names the fields), ``(0, 0)`` for a dense one."""
        from tpengine.model.families import FAMILIES

        family = FAMILIES.get(getattr(hf_config, "model_type", None))
        if family is None or family.moe is None:
            return 0, 0
        return family.moe.num_experts(hf_config), family.moe.expert_intermediate(hf_config)

    @classmethod
    def valid_tp_sizes(cls, hf_config: Any, expert_parallel: bool | None = None) -> list[int]:
        """Every TP size this model can run at: ``1 .. num_attention_heads``; for a mixture-of-experts
        model only those its experts' layout takes: ``expert_parallel`` True at most one rank per expert,
        False at most one rank per column of an expert's intermediate, None either."""
        sizes = range(1, cls.dims(hf_config)["num_heads"] + 1)
        experts, inter = cls.expert_dims(hf_config)
        if experts:
            most = {True: experts, False: inter, None: max(experts, inter)}[expert_parallel]
            sizes = [t for t in sizes if t <= most]
        return list(sizes)

    @classmethod
    def build(cls, hf_config: Any, tp_size: int, expert_parallel: bool = False, pp_size: int = 1,
              layer_partition: list[int] | None = None) -> ShardPlan:
        """Partition ``hf_config`` over ``tp_size`` ranks; a mixture-of-experts model's routed experts
        split by their intermediate (default) or, with ``expert_parallel``, as whole experts per rank
        (a dense model ignores it, as vLLM does); its decoder layers over ``pp_size`` pipeline stages
        (:meth:`split_layers`, ``layer_partition`` the count per stage or None).

        Raises:
            ValueError: ``tp_size`` not an integer.
            tpengine.errors.UserError: ``tp_size`` outside ``1..num_attention_heads``, or
                num_attention_heads not a multiple of num_key_value_heads; a MoE model whose experts
                (``expert_parallel``) or expert intermediate (tensor parallel) are fewer than the
                ranks; more stages than layers or a partition of another layer count
                (:meth:`split_layers`); the message names the values.
        """
        d = cls.dims(hf_config)
        nh, nkv = d["num_heads"], d["num_kv_heads"]
        if not isinstance(tp_size, int) or isinstance(tp_size, bool):
            raise ValueError(f"tp_size must be an integer, got {tp_size!r}")
        if nkv < 1 or nh % nkv != 0:
            raise UserError(
                f"num_attention_heads={nh} is not a multiple of num_key_value_heads={nkv}; "
                "grouped-query attention needs every KV head to serve the same number of query heads"
            )
        if not 1 <= tp_size <= nh:
            raise UserError(
                f"tp_size={tp_size} is invalid for this model: it has num_attention_heads={nh}, "
                f"so tp_size must be between 1 and {nh}"
            )
        group = nh // nkv
        padded_vocab = cdiv(d["vocab_size"], tp_size) * tp_size
        per_rank_vocab = padded_vocab // tp_size
        num_experts, moe_inter = cls.expert_dims(hf_config)
        experts, expert_inter = _expert_layout(num_experts, moe_inter, tp_size, expert_parallel,
                                               getattr(hf_config, "model_type", "?"))
        shared = int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0) if num_experts else 0
        ranks = []
        for r, ((q0, q1), (i0, i1)) in enumerate(
            zip(split_even(nh, tp_size), split_even(d["intermediate_size"], tp_size))
        ):
            kv0, kv1 = q0 // group, (q1 - 1) // group + 1
            q_to_kv = tuple(h // group - kv0 for h in range(q0, q1))
            ranks.append(
                RankPlan(
                    rank=r,
                    q_heads=(q0, q1),
                    kv_heads=(kv0, kv1),
                    q_to_kv=q_to_kv,
                    intermediate=(i0, i1),
                    vocab=(r * per_rank_vocab, (r + 1) * per_rank_vocab),
                    experts=experts[r],
                    expert_intermediate=expert_inter[r],
                    shared_expert_intermediate=split_even(shared, tp_size)[r] if shared else (0, 0),
                )
            )
        return cls(tp_size=tp_size, padded_vocab_size=padded_vocab, ranks=tuple(ranks), num_experts=num_experts,
                   moe_intermediate_size=moe_inter, expert_parallel=bool(expert_parallel and num_experts),
                   top_k=int(getattr(hf_config, "num_experts_per_tok", 0) or 0) if num_experts else 0,
                   shared_expert_intermediate_size=shared,
                   stages=cls.split_layers(int(getattr(hf_config, "num_hidden_layers", 0) or 0), pp_size,
                                           layer_partition), **d)

    def holds_expert(self, expert: int, rank: int) -> bool:
        """Whether rank ``rank`` holds routed expert ``expert`` (every rank does under tensor parallelism)."""
        lo, hi = self.ranks[rank].experts
        return lo <= expert < hi

    def expert_owner(self, expert: int) -> int:
        """The first rank that holds routed expert ``expert`` (its only one under expert parallelism).

        Raises:
            ValueError: ``expert`` outside ``0..num_experts-1``.
        """
        for rp in self.ranks:
            if rp.experts[0] <= expert < rp.experts[1]:
                return rp.rank
        raise ValueError(f"expert {expert} is outside 0..{self.num_experts - 1} for this plan")

    # ------------------------------------------------------------------ slicing
    def slice_spec(self, kind: str, is_bias: bool, rank: int) -> tuple[int, int, int] | None:
        """Where rank ``rank``'s shard of a ``kind`` tensor lies: ``(dim, start, end)`` in the
        full tensor, or None when it is held whole (replicated, and row-parallel biases, which
        are added once after the all-reduce). Vocabulary ranges may run past ``vocab_size``
        into padding.

        Raises:
            ValueError: unknown ``kind`` or ``rank`` outside ``0..tp_size-1``.
        """
        if kind not in KINDS:
            raise ValueError(f"unknown partition kind {kind!r}; valid kinds: {', '.join(KINDS)}")
        if not 0 <= rank < self.tp_size:
            raise ValueError(f"rank={rank} is outside 0..{self.tp_size - 1} for tp_size={self.tp_size}")
        rp, hd = self.ranks[rank], self.head_dim
        if kind == Q:
            return (0, rp.q_heads[0] * hd, rp.q_heads[1] * hd)
        if kind in (K, V):
            return (0, rp.kv_heads[0] * hd, rp.kv_heads[1] * hd)
        if kind == COLUMN:
            return (0, *rp.intermediate)
        if kind == VOCAB:
            return (0, *rp.vocab)
        if kind == EXPERT_COLUMN:
            return (0, *rp.expert_intermediate)
        if kind == EXPERT_ROW and not is_bias:
            return (1, *rp.expert_intermediate)
        if kind == SHARED_COLUMN:
            return (0, *rp.shared_expert_intermediate)
        if kind == SHARED_ROW and not is_bias:
            return (1, *rp.shared_expert_intermediate)
        if is_bias or kind == REPLICATED:
            return None
        if kind == ROW_HEADS:
            return (1, rp.q_heads[0] * hd, rp.q_heads[1] * hd)
        return (1, *rp.intermediate)  # ROW

    def shard_shape(self, kind: str, is_bias: bool, shape: tuple[int, ...], rank: int) -> tuple[int, ...]:
        """The shape of rank ``rank``'s shard of a full ``kind`` tensor of ``shape`` (what
        :meth:`shard` returns, without reading it)."""
        spec = self.slice_spec(kind, is_bias, rank)
        if spec is None:
            return tuple(shape)
        dim, start, end = spec
        out = list(shape)
        out[dim] = end - start
        return tuple(out)

    def shard(self, kind: str, is_bias: bool, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """Return rank ``rank``'s shard of the full ``tensor`` (a new contiguous tensor).

        Shapes: q/k/v/column weights ``[out, in] -> [out_local, in]``; row weights
        ``[out, in] -> [out, in_local]``; vocab ``[vocab_size, hidden] -> [padded/tp, hidden]``
        with zero rows for padding ids. Replicated tensors and row biases come back whole.

        Raises:
            ValueError: unknown kind/rank, or a tensor whose size along the split dimension does
                not match the plan.
        """
        spec = self.slice_spec(kind, is_bias, rank)
        if spec is None:
            return tensor.contiguous().clone()
        dim, start, end = spec
        full = self.full_size(kind)
        if tensor.dim() <= dim or tensor.shape[dim] != full:
            raise ValueError(
                f"cannot shard a {kind} {'bias' if is_bias else 'weight'} of shape {tuple(tensor.shape)}: "
                f"expected size {full} along dim {dim} for this plan"
            )
        piece = tensor.narrow(dim, start, max(0, min(end, full) - start)) if start < full else None
        if kind == VOCAB and end > full:
            shape = list(tensor.shape)
            shape[dim] = end - start
            out = torch.zeros(shape, dtype=tensor.dtype)
            if piece is not None:
                out.narrow(dim, 0, piece.shape[dim]).copy_(piece)
            return out
        return piece.contiguous().clone()

    def full_size(self, kind: str) -> int:
        """The unsplit size of a ``kind`` weight along the dimension the plan splits (vocabulary:
        the real ``vocab_size``, not the padded one). Raises KeyError for REPLICATED."""
        hd = self.head_dim
        return {
            VOCAB: self.vocab_size,
            Q: self.num_heads * hd,
            K: self.num_kv_heads * hd,
            V: self.num_kv_heads * hd,
            ROW_HEADS: self.num_heads * hd,
            COLUMN: self.intermediate_size,
            ROW: self.intermediate_size,
            EXPERT_COLUMN: self.moe_intermediate_size,
            EXPERT_ROW: self.moe_intermediate_size,
            SHARED_COLUMN: self.shared_expert_intermediate_size,
            SHARED_ROW: self.shared_expert_intermediate_size,
        }[kind]

    # ------------------------------------------------------------- serialise
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (lists for tuples); inverse of :meth:`from_dict`."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ShardPlan:
        """Rebuild a plan stored by :meth:`to_dict` (e.g. from a shard manifest; one written before
        experts were planned reads as a dense model's)."""
        d = dict(d)
        ranks = tuple(
            RankPlan(
                rank=r["rank"],
                q_heads=tuple(r["q_heads"]),
                kv_heads=tuple(r["kv_heads"]),
                q_to_kv=tuple(r["q_to_kv"]),
                intermediate=tuple(r["intermediate"]),
                vocab=tuple(r["vocab"]),
                experts=tuple(r.get("experts", (0, 0))),
                expert_intermediate=tuple(r.get("expert_intermediate", (0, 0))),
                shared_expert_intermediate=tuple(r.get("shared_expert_intermediate", (0, 0))),
            )
            for r in d.pop("ranks")
        )
        d["stages"] = tuple(tuple(s) for s in d.get("stages", ()))
        return cls(ranks=ranks, **d)


def _expert_layout(num_experts: int, moe_inter: int, tp_size: int, expert_parallel: bool, model_type: str
                   ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Per rank, ``(experts held, part of each expert's intermediate)`` (see :class:`RankPlan`).

    Raises:
        tpengine.errors.UserError: more ranks than experts under expert parallelism, or than the expert
            intermediate's columns under tensor parallelism, naming both numbers and the other layout.
    """
    if not num_experts:
        return [(0, 0)] * tp_size, [(0, 0)] * tp_size
    if expert_parallel:
        if num_experts < tp_size:
            raise UserError(f"model_type {model_type!r}: enable_expert_parallel puts whole experts on each of the "
                            f"{tp_size} ranks, but the model has {num_experts} experts per layer; use at most "
                            f"{num_experts} ranks, or tensor parallelism for the experts (without "
                            "--enable-expert-parallel)")
        return split_even(num_experts, tp_size), [(0, moe_inter)] * tp_size
    if moe_inter < tp_size:
        raise UserError(f"model_type {model_type!r}: each expert's intermediate size {moe_inter} cannot be split "
                        f"over {tp_size} ranks; use at most {moe_inter} ranks, or --enable-expert-parallel")
    return [(0, num_experts)] * tp_size, split_even(moe_inter, tp_size)
