"""Which tp sizes a weight-only scheme allows: a row split must keep each rank's input range on
group boundaries (:func:`check_quantization`, before any weight is read)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tpengine.errors import UserError

if TYPE_CHECKING:
    from tpengine.quant.weights import QuantScheme


def _row_boundaries(plan: Any) -> dict[str, list[int]]:
    """Leaf name of each row-parallel layer -> every rank's input start and end under ``plan``."""
    hd = plan.head_dim
    return {"self_attn.o_proj": sorted({b * hd for r in plan.ranks for b in r.q_heads}),
            "mlp.down_proj": sorted({b for r in plan.ranks for b in r.intermediate})}


def check_quantization(hf_config: Any, tp_size: int, scheme: QuantScheme) -> None:
    """Refuse, before any weight is read, a grouped ``scheme`` (int4, grouped int8) whose groups
    the tp split would cut: every linear's input size (hidden for q/k/v and gate/up; the heads'
    and the intermediate size for o_proj and down_proj) must be a multiple of the group size,
    and each rank's input range of o_proj and down_proj (from :class:`tpengine.model.plan.ShardPlan`)
    must start on a group boundary; the hidden size must be a multiple of ``scheme.vocab``'s
    group size (the embedding / LM head). Per-channel int8 always fits.

    Raises:
        UserError: naming the layer, the group size, this tp and the valid tp sizes.
    """
    from tpengine.model.plan import ShardPlan

    d = ShardPlan.dims(hf_config)
    gv = None if scheme.vocab is None else scheme.vocab.group_size
    if gv is not None and d["hidden_size"] % gv:
        raise UserError(f"--quantization {scheme.name}: the embedding / LM head ({scheme.vocab.name}, group size "
                        f"{gv}) has {d['hidden_size']} input features, not a multiple of {gv}")
    if scheme.group_size is None:
        return
    g = scheme.group_size
    sizes = {"self_attn.q_proj/k_proj/v_proj, mlp.gate_proj/up_proj": d["hidden_size"],
             "self_attn.o_proj": d["num_heads"] * d["head_dim"], "mlp.down_proj": d["intermediate_size"]}
    for layer, n in sizes.items():
        if n % g:
            raise UserError(f"--quantization {scheme.name} (group size {g}): {layer} has {n} input features, "
                            f"not a multiple of {g}; this model cannot be quantized with group size {g} at any tp")

    def bad_layer(tp: int) -> tuple[str, int] | None:
        for layer, bounds in _row_boundaries(ShardPlan.build(hf_config, tp)).items():
            for b in bounds:
                if b % g:
                    return layer, b
        return None

    found = bad_layer(tp_size)
    if found is None:
        return
    layer, b = found
    valid = [t for t in ShardPlan.valid_tp_sizes(hf_config) if bad_layer(t) is None]
    raise UserError(f"--quantization {scheme.name} (group size {g}) at tp={tp_size}: the row-parallel layer "
                    f"{layer} splits its input at column {b}, not on a group boundary (a multiple of {g}); "
                    f"valid tp sizes: {', '.join(map(str, valid))}")
