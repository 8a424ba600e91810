"""Surgery: the name -> layer-kind table, and swapping modules of a meta-device HF model.

The table maps the leaf module name of every weight to its partition kind (see
:mod:`tpengine.plan`). The shard tool and the loader both use :func:`kind_of`, so a weight is
sliced the same way offline and online.
"""

from __future__ import annotations

from tpengine import plan as P

# leaf module name -> partition kind
LAYER_KINDS: dict[str, str] = {
    "q_proj": P.Q,
    "k_proj": P.K,
    "v_proj": P.V,
    "o_proj": P.ROW_HEADS,
    "gate_proj": P.COLUMN,
    "up_proj": P.COLUMN,
    "down_proj": P.ROW,
    "embed_tokens": P.VOCAB,
    "lm_head": P.VOCAB,
}


def kind_of(param_name: str, ndim: int) -> str:
    """Partition kind of checkpoint tensor ``param_name`` (e.g.
    ``model.layers.0.self_attn.q_proj.weight``) with ``ndim`` dimensions.

    1-D tensors not in the table (norm weights, q_norm/k_norm) are replicated.

    Raises:
        ValueError: a 2-D or larger tensor whose module is not in the table; it would otherwise
            be silently replicated.
    """
    parts = param_name.split(".")
    leaf = parts[-2] if len(parts) >= 2 else parts[-1]
    if leaf in LAYER_KINDS:
        return LAYER_KINDS[leaf]
    if ndim <= 1:
        return P.REPLICATED
    raise ValueError(
        f"tensor {param_name!r} ({ndim}-D) belongs to module {leaf!r}, which tpengine's layer table "
        f"does not cover (known: {', '.join(sorted(LAYER_KINDS))}); refusing to replicate it silently"
    )
