"""Hugging Face's own greedy continuations, the oracle the engine tests compare with.

One left-padded batch through ``generate`` instead of one prompt at a time (the times, one by one and
batched, are in docs/notes/test-suite.md). Padded positions are masked out of attention (their
softmax weight is exactly 0) and positions are counted from each prompt's first real token, so every
row is computed as it would be alone up to the GEMMs' summation order, which a batch changes as the
engine's own kernels do: a float32 near-tie that this flipped would show as a token the engine and
HF disagree on, never as a pass. (Checked equal to the one-at-a-time tokens for test_engine's
prompts, float32, on an AVX-512 and an AVX2-capped Zen 4; a bfloat16 batch is not: its rounding
flips near-ties, so bfloat16 references stay one prompt at a time.)
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch


@lru_cache(maxsize=4)
def _model(model_dir: str, dtype: torch.dtype, attn: str | None):
    from transformers import AutoModelForCausalLM

    kwargs = {"attn_implementation": attn} if attn else {}
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kwargs).eval()


def greedy(model_dir: str | Path, prompts: list[list[int]], max_new: int, *, dtype: torch.dtype = torch.float32,
           stop_at_eos: bool = True, attn: str | None = None, batched: bool = True) -> list[list[int]]:
    """HF ``generate(do_sample=False)`` of each prompt (token ids), ``max_new`` new tokens at most.

    ``stop_at_eos``: stop at the generation config's EOS ids, the EOS kept (``generate``'s own
    behaviour); False: exactly ``max_new`` tokens, EOS or not (the oracle for ``ignore_eos``).
    ``attn``: transformers' ``attn_implementation`` (None: its default). ``batched`` False runs one
    prompt at a time (what :func:`greedy` is checked against). Everything else the model folder's
    ``generation_config.json`` sets (a repetition penalty, say) applies, as in ``generate``.
    Returns one list of new token ids per prompt, in order.
    """
    m = _model(str(model_dir), dtype, attn)
    eos = m.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    kw = {"max_new_tokens": max_new, "do_sample": False}
    if not stop_at_eos:
        kw.update(eos_token_id=None)
    with torch.inference_mode():
        if not batched:
            return [m.generate(torch.tensor([p]), **kw)[0, len(p):].tolist() for p in prompts]
        pad = 0
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = m.generate(ids, attention_mask=mask, pad_token_id=pad, **kw)[:, width:].tolist()
    if not stop_at_eos:
        return out
    cut = []
    for row in out:  # after a row's EOS, generate pads it while the others go on
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        cut.append(row[:end])
    return cut
