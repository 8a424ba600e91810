"""Settings that fit the command line but not the model (its own length, the KV budget) are found
after the job starts, and are still a user's mistake: one line, exit 2, no traceback."""

import pytest
from conftest import SMOLLM2_DIR, make_tiny_model
from test_cli import cli, write_jsonl


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """tiny-llama with the SmolLM2 tokenizer and max_position 512."""
    if not (SMOLLM2_DIR / "tokenizer.json").is_file():
        pytest.skip("needs the SmolLM2 tokenizer (make model)")
    return make_tiny_model(tmp_path_factory.mktemp("settings"), vocab_size=49152, max_position_embeddings=512)


def test_settings_that_do_not_fit_the_model_are_one_line_and_exit_2(tiny, tmp_path):
    """Found only once the model's length (max_position_embeddings 512) or the KV budget is known:
    still a user's mistake, one line naming the values, exit 2, no traceback."""
    prompts = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "Hello", "max_tokens": 2}])
    p = cli(["--prompts", prompts, "--model", tiny, "--no-enable-chunked-prefill", "--max-num-batched-tokens", 256],
            check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert ("invalid max_num_batched_tokens=256: must be >= max_model_len (512) without enable_chunked_prefill "
            "(a prompt is then prefilled in one step) (max_model_len taken from the model's "
            "max_position_embeddings; pass --max-model-len to choose it)") in p.stderr
    p = cli(["--prompts", prompts, "--model", tiny, "--kv-cache-gb", 0.0001], check=False)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert "failed: UserError: KV cache budget gives" in p.stderr and "max_model_len=512" in p.stderr
