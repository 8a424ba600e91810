"""Small arithmetic helpers shared across tpengine (one definition each)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division of integers: the least ``q`` with ``q * b >= a`` for ``b > 0``
    (e.g. KV blocks for ``a`` tokens in blocks of ``b``: ``cdiv(17, 16) == 2``)."""
    return -(-a // b)


GIB = 1 << 30  # bytes in a GiB (memory budgets, kv_cache_gb, reports)
