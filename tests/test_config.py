"""EngineConfig validation and load_config: every bad value is a ValueError naming it."""

from __future__ import annotations

import pytest

from tpengine.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineConfig, load_config


@pytest.mark.parametrize("kw,message", [
    ({"kv_cache_gb": "1"}, "invalid kv_cache_gb='1': must be float or int"),
    ({"threads": "two"}, "invalid threads='two': must be int or unset"),
    ({"kv_cache_gb": float("nan")}, "invalid kv_cache_gb=nan: must be a finite number"),
    ({"enforce_eager": 1}, "invalid enforce_eager=1: must be bool"),
    ({"dtype": "fp8"}, "invalid dtype='fp8': must be one of auto, float32, bfloat16, float16"),
    ({"block_size": 0}, "invalid block_size=0: must be an integer >= 1"),
    ({"max_model_len": 100, "max_num_batched_tokens": 50, "enable_chunked_prefill": False},
     "invalid max_num_batched_tokens=50: must be >= max_model_len (100) without enable_chunked_prefill "
     "(a prompt is then prefilled in one step)"),
    ({"enable_prefix_caching": "yes"}, "invalid enable_prefix_caching='yes': must be bool"),
])
def test_bad_values_name_field_and_valid_range(kw, message):
    with pytest.raises(ValueError) as e:
        EngineConfig(**kw)
    assert str(e.value) == message


def test_defaults_follow_max_model_len():
    assert EngineConfig().max_model_len is None  # resolved from the model by LLMEngine
    assert EngineConfig().enable_prefix_caching and EngineConfig().enable_chunked_prefill
    # chunked prefill (default): a fixed step size, whatever max_model_len
    assert EngineConfig(max_model_len=100).max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS
    assert EngineConfig(max_model_len=32768).max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS
    assert EngineConfig(max_model_len=32768, max_num_batched_tokens=16).max_num_batched_tokens == 16
    # without it a whole prompt must fit one step
    whole = {"enable_chunked_prefill": False}
    assert EngineConfig(max_model_len=100, **whole).max_num_batched_tokens == 8192
    assert EngineConfig(max_model_len=32768, **whole).max_num_batched_tokens == 32768
    assert EngineConfig(**whole).replace(max_model_len=20000).max_num_batched_tokens == 20000


def test_load_config_file_and_overrides(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[engine]\nblock_size = 8\nkv_cache_gb = 0.5\n[sampling]\ntemperature = 0.0\n')
    c = load_config(p, block_size=32, max_num_seqs=None)
    assert (c.block_size, c.kv_cache_gb, c.max_num_seqs) == (32, 0.5, 64)
    p.write_text("[engine]\nblok_size = 8\n")
    with pytest.raises(ValueError, match=r"unknown engine setting\(s\) \['blok_size'\]"):
        load_config(p)
    p.write_text("[engine\n")
    with pytest.raises(ValueError, match="is not valid TOML"):
        load_config(p)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_config(tmp_path / "missing.toml")


def test_dtype_tables_and_torch_dtype():
    import torch

    from tpengine.config import DTYPE_BYTES, DTYPES, WEIGHT_DTYPES, torch_dtype

    assert DTYPES == ("auto", *WEIGHT_DTYPES) and set(DTYPE_BYTES) == set(WEIGHT_DTYPES)
    for name in WEIGHT_DTYPES:
        assert torch_dtype(name).itemsize == DTYPE_BYTES[name]
    assert torch_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError) as e:
        torch_dtype("int8")
    assert str(e.value) == "invalid dtype 'int8': must be one of float32, bfloat16, float16"
    with pytest.raises(ValueError, match=r"unknown engine setting\(s\) \['fault_inject'\]"):
        load_config(None, fault_inject="1:3")  # a test worker's patch now, not a setting
