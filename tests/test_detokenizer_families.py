"""The incremental detokenizer against a full decode for every tokenizer family (issue 38 B): the
text of a sample is what decoding prompt + output adds to decoding the prompt (vLLM's), for
byte-level BPE, Metaspace (Unigram; prepend scheme always, first, never) and byte-fallback
vocabularies (Llama-2's decoder with Strip; Mistral's Metaspace pre-tokenizer), with
``skip_special_tokens`` on and off, random token sequences with multi-byte UTF-8 and special
tokens; stop strings, stop tokens and ``include_stop_str_in_output`` as vLLM treats them. The
tokenizers are trained in-process with the ``tokenizers`` library (no files)."""

from __future__ import annotations

import random
import zlib

import pytest
from test_detokenizer import run

from tpengine.engine.detokenizer import IncrementalDetokenizer

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France.",
    "héllo wörld, ça va? naïve café crème — «quotes» and ‘single’ ones",
    "日本語のテキスト、絵文字 🙂🙂 👩‍👩‍👧 и кириллица; ∑ ≠ ∞",
    "def f(x):\n    return x ** 2  # 🐍\n\n\tend   of  line",
    "  leading spaces, trailing spaces   and\nnew lines\n",
]
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_end|>"]


def wrap(tk) -> PreTrainedTokenizerFast:
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.add_tokens(["<tool>"])  # an added token that is not special (never skipped)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    return tok


def byte_level_bpe():
    tk = tokenizers.Tokenizer(models.BPE(unk_token=None))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(CORPUS * 3, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return wrap(tk)


def metaspace_unigram(scheme: str):
    tk = tokenizers.Tokenizer(models.Unigram())
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme)
    tk.decoder = decoders.Metaspace(replacement="▁", prepend_scheme=scheme)
    tk.train_from_iterator(CORPUS * 3, trainers.UnigramTrainer(
        vocab_size=300, special_tokens=SPECIALS, unk_token="<unk>"))
    return wrap(tk)


def byte_fallback_bpe(style: str):
    """A BPE trained on the ASCII text only, so every other character falls back to <0xNN> bytes;
    ``style`` "llama2": normalizer Prepend + Replace, decoder Replace, ByteFallback, Fuse, Strip;
    "mistral": Metaspace pre-tokenizer (prepend first, no split) and decoder Replace, ByteFallback,
    Fuse, Strip."""
    ascii_text = ["".join(c for c in t if ord(c) < 128) for t in CORPUS]
    base = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    base.normalizer = normalizers.Replace(" ", "▁")
    base.train_from_iterator(ascii_text * 3, trainers.BpeTrainer(vocab_size=200, special_tokens=SPECIALS))
    vocab = base.get_vocab()
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) if not isinstance(m, str) else tuple(m.split(" "))
              for m in __import__("json").loads(base.to_str())["model"]["merges"]]
    tk = tokenizers.Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    for s in SPECIALS:
        tk.add_special_tokens([tokenizers.AddedToken(s, special=True, normalized=False)])
    if style == "llama2":
        tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    return wrap(tk)


FAMILIES = {
    "byte-level-bpe": byte_level_bpe,
    "metaspace-always": lambda: metaspace_unigram("always"),
    "metaspace-first": lambda: metaspace_unigram("first"),
    "metaspace-never": lambda: metaspace_unigram("never"),
    "byte-fallback-llama2": lambda: byte_fallback_bpe("llama2"),
    "byte-fallback-mistral": lambda: byte_fallback_bpe("mistral"),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    return request.param, FAMILIES[request.param]()


def decode(tok, ids, skip):
    return tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def expected(tok, prompt, out, skip):
    """vLLM's text of a sample: what decoding prompt + output adds to decoding the prompt."""
    return decode(tok, prompt + out, skip)[len(decode(tok, prompt, skip)):]




def random_ids(tok, rng, n):
    """Ids of real text cut anywhere (mid-character too), or arbitrary ids with special and added
    tokens among them."""
    if rng.random() < 0.5:
        src = tok(" ".join(rng.sample(CORPUS, 2)), add_special_tokens=False).input_ids
        a = rng.randrange(len(src))
        return src[a: a + n]
    specials = [tok.convert_tokens_to_ids(t) for t in ("<s>", "</s>", "<|im_end|>", "<tool>")]
    return [rng.choice(specials) if rng.random() < 0.15 else rng.randrange(len(tok)) for _ in range(n)]


def test_the_tokenizer_is_what_its_family_says(family):
    name, tok = family
    ids = tok("日本 café 🙂", add_special_tokens=False).input_ids
    pieces = tok.convert_ids_to_tokens(ids)
    assert decode(tok, ids, True) == "日本 café 🙂"
    if name.startswith("byte-fallback"):
        assert "<0xE6>" in pieces  # 日 falls back to its bytes
    if name.startswith("metaspace") or name.startswith("byte-fallback"):
        assert any(p.startswith("▁") for p in pieces)


@pytest.mark.parametrize("skip", [True, False])
def test_random_prompts_and_outputs_equal_the_full_decode(family, skip):
    name, tok = family
    rng = random.Random(zlib.crc32(name.encode()) + skip)
    for trial in range(60):
        prompt = random_ids(tok, rng, rng.randint(0, 30))
        out = random_ids(tok, rng, rng.randint(1, 25))
        deltas, d = run(tok, out, skip=skip, prompt_token_ids=prompt)
        assert "".join(deltas) == d.text
        if not decode(tok, prompt + out, skip).startswith(decode(tok, prompt, skip)):
            # the output rewrote the prompt's own text: a run of byte-fallback tokens at the prompt's
            # end that the output's bytes make invalid UTF-8 (every byte of the run becomes U+FFFD)
            continue
        assert d.text == expected(tok, prompt, out, skip), (name, trial, prompt, out)


@pytest.mark.parametrize("skip", [True, False])
def test_the_first_output_word_keeps_its_space_after_a_prompt(family, skip):
    """A Metaspace decoder strips the first decoded token's space: the output's first word after a
    prompt must keep it (decoding the output alone would drop it)."""
    name, tok = family
    ids = tok("<s>The capital of France is Paris.</s>", add_special_tokens=False).input_ids
    k = next(k for k in range(len(ids)) if "P" in decode(tok, ids[: k + 1], True))  # the token of "P"
    prompt, out = ids[:k], ids[k:]
    assert prompt[0] == tok.bos_token_id and decode(tok, prompt, True).rstrip() == "The capital of France is"
    text = "".join(run(tok, out, skip=skip, prompt_token_ids=prompt)[0])
    assert text == expected(tok, prompt, out, skip)
    assert decode(tok, prompt, skip) + text == decode(tok, ids, skip)
    assert text.startswith(" Paris.") or decode(tok, prompt, True).endswith(" "), (name, text)


def test_stop_strings_after_a_prompt(family):
    name, tok = family
    prompt = tok("Say it:", add_special_tokens=False).input_ids
    out = tok(" the café 日本 and more", add_special_tokens=False).input_ids
    full = expected(tok, prompt, out, True)
    for stop in (" the", "é 日", "本 a", "more"):
        cut = full.find(stop)
        assert cut >= 0, (name, full, stop)
        for include in (False, True):
            deltas, d = run(tok, out, stop=[stop], prompt_token_ids=prompt, include_stop_str_in_output=include)
            want = full[: cut + len(stop)] if include else full[:cut]
            assert d.stopped and d.text == want == "".join(deltas), (name, stop, include)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_is_in_the_text_only_with_include_stop_str_in_output(family, skip, include):
    """vLLM: the token that ends a sample (EOS, a ``stop_token_ids`` id) is detokenized only with
    ``include_stop_str_in_output``, then as any token (a special one still skipped with
    ``skip_special_tokens``), and no stop string is looked for in its text."""
    name, tok = family
    prompt = tok("Q:", add_special_tokens=False).input_ids
    out = tok(" yes", add_special_tokens=False).input_ids
    for stop_id in (tok.eos_token_id, tok(".", add_special_tokens=False).input_ids[-1]):
        d = IncrementalDetokenizer(tok, stop=["."], skip_special_tokens=skip, include_stop_str_in_output=include,
                                   prompt_token_ids=prompt)
        text = "".join(d.append(i) for i in out)
        text += d.append_stop_token(stop_id) + d.finish()
        want = expected(tok, prompt, out + ([stop_id] if include else []), skip)
        assert text == d.text == want and not d.stopped, (name, stop_id)
        assert d.token_ids == [*out, stop_id]


@pytest.mark.parametrize("include", [False, True])
def test_the_output_processor_decodes_after_the_prompt_and_a_stop_token_as_vllm(include):
    """Through the engine's OutputProcessor: a sample's text is decoded after its prompt (the
    Metaspace space kept), and its stop token's text is in it only with include_stop_str_in_output."""
    from tpengine.engine.output_processor import OutputProcessor
    from tpengine.engine.sequence import Sequence, SequenceStatus
    from tpengine.sampling_params import SamplingParams

    tok = FAMILIES["metaspace-first"]()
    dot = tok(".", add_special_tokens=False).input_ids[-1]
    prompt = tok("The capital of France is", add_special_tokens=False).input_ids
    out = tok(" Paris", add_special_tokens=False).input_ids
    seq = Sequence(0, "r", prompt, SamplingParams(max_tokens=8, stop_token_ids=[dot], skip_special_tokens=False,
                                                 include_stop_str_in_output=include))
    op = OutputProcessor(tok, lambda s, t: t in s.params.stop_token_ids)
    op.add(seq)
    for t in [*out, dot]:
        assert op.detokenize(seq, t) is False
        seq.token_ids.append(t)
    seq.status = SequenceStatus.FINISHED
    text = op.finish_sample(seq).outputs[0].text
    assert text == expected(tok, prompt, out + ([dot] if include else []), False)
    assert text == (" Paris." if include else " Paris")
