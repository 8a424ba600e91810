"""The CPU platform's process set-up (tpengine/backends/cpu/process.py): oneDNN's primitive caches are
bounded unless the user set them."""

import os

from tpengine.backends.cpu import process


def test_bound_onednn_caches_sets_both_capacities(monkeypatch):
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        monkeypatch.delenv(name, raising=False)
    process.bound_onednn_caches()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(process.ONEDNN_CACHE_CAPACITY)
    assert os.environ["LRU_CACHE_CAPACITY"] == str(process.ONEDNN_CACHE_CAPACITY)


def test_bound_onednn_caches_keeps_the_users_setting(monkeypatch):
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "2048")
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    process.bound_onednn_caches()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "2048"
    assert os.environ["LRU_CACHE_CAPACITY"] == str(process.ONEDNN_CACHE_CAPACITY)
