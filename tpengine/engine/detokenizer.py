"""Incremental detokenization with stop strings (rank 0 only).

The engine calls :meth:`IncrementalDetokenizer.append` once per generated token and gets back
the text that is now safe to show: never a broken UTF-8 character, never a repeat, never a
piece that could still turn out to be the start of a stop string.

The text of a sample is vLLM's: what decoding prompt + output adds to decoding the prompt,
``decode(prompt + out)[len(decode(prompt)):]`` (``skip_special_tokens`` as the request sets it,
``clean_up_tokenization_spaces=False``). The prompt matters: a Metaspace (SentencePiece) decoder
drops the leading space of the first token of what it decodes, so ``"▁Paris"`` right after a
prompt is ``" Paris"`` while decoding it alone gives ``"Paris"``; a prompt may also end inside a
multi-byte character. As vLLM does, the decoding context is a short suffix of the prompt
(:func:`prompt_context`), not the whole prompt.

Decoding uses the prefix-offset / read-offset window of HF TGI and vLLM
(``detokenize_incrementally``, ``tokenizers.decoders.DecodeStream``): only the few most recent
tokens are decoded per step, and the new text is the difference between decoding ``ids[prefix:]``
and ``ids[prefix:read]``. The window starts at the prompt context, so the first output token is
decoded after it. Without a prompt the text is ``decode(out)``.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

REPLACEMENT = "\ufffd"
CONTEXT_MIN, CONTEXT_MAX = 4, 24  # the prompt suffix searched for a decoding context (vLLM's bounds)


def _rust_decoder(tokenizer):
    """The ``tokenizers.Tokenizer`` whose ``decode(ids, skip_special_tokens=...)`` is exactly what
    ``tokenizer.decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`` returns: a
    transformers fast tokenizer that keeps the library's own ``_decode`` (which then only calls it);
    None for any other tokenizer. Skips transformers' per-call argument conversion, twice a token."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    if isinstance(tokenizer, TokenizersBackend) and type(tokenizer)._decode is TokenizersBackend._decode:
        return tokenizer.backend_tokenizer
    return None


_BYTE_TOKENS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> byte_tokens()


def byte_tokens(tokenizer) -> tuple[frozenset[int], frozenset[int]]:
    """(the ids of ``tokenizer``'s byte-fallback tokens ``<0x00>`` .. ``<0xFF>``, the ids that
    ``skip_special_tokens`` leaves out of a decode); both empty for a vocabulary without byte
    tokens (SentencePiece's ``byte_fallback``: Llama-2, Mistral). Cached per tokenizer.

    A ByteFallback decoder turns a run of byte tokens into text as a whole, and a run that is not
    valid UTF-8 becomes one U+FFFD per byte, the valid bytes of the run included: a ``<0x0A>``
    (newline) followed by a stray ``<0xB7>`` decodes as two U+FFFD. A skipped special token
    between two byte tokens does not end the run (it is removed before the decoder). So the text
    of a run of byte tokens is final only once a token that is neither ends it."""
    try:
        return _BYTE_TOKENS[tokenizer]
    except (KeyError, TypeError):
        pass
    names = [f"<0x{b:02X}>" for b in range(256)]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        ids = frozenset(i for i in map(backend.token_to_id, names) if i is not None)
        special = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
    else:
        try:
            found = tokenizer.convert_tokens_to_ids(names)
            ids = frozenset(i for n, i in zip(names, found, strict=True)
                            if i is not None and tokenizer.convert_ids_to_tokens(i) == n)
            special = frozenset(tokenizer.all_special_ids)
        except (AttributeError, TypeError, ValueError):  # not a Hugging Face tokenizer: decode only
            ids = special = frozenset()
    result = (ids, special if ids else frozenset())
    try:
        _BYTE_TOKENS[tokenizer] = result
    except TypeError:  # not weak-referenceable: computed per detokenizer
        pass
    return result


def prompt_context(decode, prompt_token_ids: Sequence[int], byte_ids: frozenset[int] = frozenset(),
                   skipped: frozenset[int] = frozenset()) -> list[int]:
    """The prompt suffix the first output tokens are decoded after (vLLM's choice, made stricter):
    the whole prompt when it has at most ``CONTEXT_MIN`` tokens, else the shortest suffix of
    ``CONTEXT_MIN`` to ``CONTEXT_MAX - 1`` tokens whose text (``decode(ids) -> str``) is non-empty
    and holds no U+FFFD, so it neither ends inside a character the output completes nor is only
    skipped special tokens (which would leave a Metaspace decoder to strip the first output
    token's space), and that does not start inside a run of byte-fallback tokens ``byte_ids``
    (``skipped``: the ids the decode leaves out; see :func:`byte_tokens`); when none is, the whole
    prompt."""
    ids = list(prompt_token_ids)
    if len(ids) <= CONTEXT_MIN:
        return ids

    def starts_a_run(s: int) -> bool:  # ids[s:] does not start inside a run of byte tokens
        while s < len(ids) and ids[s] in skipped:
            s += 1
        if s == len(ids) or ids[s] not in byte_ids:
            return True
        j = s - 1
        while j >= 0 and ids[j] in skipped:
            j -= 1
        return j < 0 or ids[j] not in byte_ids

    for k in range(CONTEXT_MIN, min(len(ids) + 1, CONTEXT_MAX)):
        if not starts_a_run(len(ids) - k):
            continue
        text = decode(ids[-k:])
        if text and REPLACEMENT not in text:
            return ids[-k:]
    return ids


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas, one token at a time.

    Args:
        tokenizer: a Hugging Face tokenizer (``decode`` is the only method used).
        stop: stop strings (non-empty). The first occurrence of any of them anywhere in the
            generated text ends generation; the stop string and everything after it are dropped.
        skip_special_tokens: passed to ``tokenizer.decode``.
        include_stop_str_in_output: keep the matched stop string at the end of the text (vLLM's
            ``include_stop_str_in_output``); what follows it is still dropped.
        min_tokens: stop strings are looked for only once more than this many tokens are appended
            (vLLM's rule: no stop before ``min_tokens``).
        prompt_token_ids: the request's prompt; the output is decoded after its last few tokens
            (:func:`prompt_context`), so the text is what decoding prompt + output adds to
            decoding the prompt. Empty: the text is ``decode(output)``.

    Attributes:
        stopped: True once a stop string matched; ``append`` must not be called after that.
        token_ids: the output ids appended so far (with :meth:`append_stop_token`'s).

    Raises:
        ValueError: an empty stop string.
    """

    def __init__(
        self,
        tokenizer,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
        prompt_token_ids: Sequence[int] = (),
    ) -> None:
        if isinstance(stop, str):
            stop = (stop,)
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.skip_special_tokens = skip_special_tokens
        self.include_stop = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.token_ids: list[int] = []
        self.stopped = False
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self._backend = _rust_decoder(tokenizer)
        self._byte_ids, special = byte_tokens(tokenizer)
        self._skipped = special if skip_special_tokens else frozenset()
        # _ids: the prompt context, then the output ids that went through the window
        self._ids: list[int] = prompt_context(self._decode, prompt_token_ids, self._byte_ids, self._skipped) \
            if len(prompt_token_ids) else []
        self._prefix = 0  # window start: text of _ids[_prefix:_read] is already in _text (or the context's)
        self._read = len(self._ids)  # ids before this are decoded (the context: only as context)
        self._text = ""  # confirmed decoded text (cut at the stop string once stopped)
        self._emitted = 0  # chars of _text already returned to the caller

    @property
    def text(self) -> str:
        """Full output text so far (including any held-back tail); after a stop string matched,
        the text right before its first occurrence."""
        return self._text

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _window_delta(self, force: bool) -> str:
        """Newly decoded text of the window; '' while it still ends in a broken character or in a
        byte-fallback token (:func:`byte_tokens`), unless ``force``. Advances the window when
        text is taken."""
        if self._read == len(self._ids) or (not force and self._in_byte_run()):
            return ""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or (new_text.endswith(REPLACEMENT) and not force):
            return ""  # a skipped special token, or an incomplete multi-byte character
        self._prefix, self._read = self._read, len(self._ids)
        # the text past the context's length: the context's text is a prefix of new_text unless the
        # context ends in a broken character (prompt_context avoids that when it can)
        return new_text[len(prefix_text) :]

    def _in_byte_run(self) -> bool:
        """The window ends in a run of byte-fallback tokens (skipped special tokens after it aside)."""
        if not self._byte_ids:
            return False
        for i in reversed(self._ids):
            if i not in self._skipped:
                return i in self._byte_ids
        return False

    def _consume(self, delta: str, check_stop: bool = True) -> str:
        """Add ``delta`` to the text, look for stop strings (with ``check_stop``), return what is
        safe to emit."""
        if delta:
            old_len = len(self._text)
            self._text += delta
            if check_stop and self.stop and len(self.token_ids) > self.min_tokens:
                start = max(0, old_len - self._max_stop + 1)
                hits = [(i, -len(s)) for s in self.stop if (i := self._text.find(s, start)) >= 0]
                if hits:
                    i, neg_len = min(hits)  # the first match; at one place the longest stop string
                    self._text = self._text[: i - neg_len if self.include_stop else i]
                    self.stopped = True
        hold = 0 if self.stopped else self._held_tail()
        end = max(self._emitted, len(self._text) - hold)
        out = self._text[self._emitted : end]
        self._emitted = end
        return out

    def _held_tail(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self._text)), best, -1):
                if self._text.endswith(s[:k]):
                    best = k
                    break
        return best

    def append(self, token_id: int) -> str:
        """Add one generated token; return the text delta that is now safe to emit (may be '').

        Raises:
            RuntimeError: called after a stop string matched (``stopped``).
        """
        if self.stopped:
            raise RuntimeError("append() called after a stop string matched")
        self.token_ids.append(int(token_id))
        self._ids.append(int(token_id))
        return self._consume(self._window_delta(force=False))

    def append_stop_token(self, token_id: int) -> str:
        """Add the token that ends the sample as EOS or one of ``stop_token_ids``, as vLLM does:
        with ``include_stop_str_in_output`` its text joins the output (``skip_special_tokens``
        still applies, so a special EOS adds nothing unless it is off) and no stop string is
        looked for in it; without, it is only recorded in ``token_ids``. Returns the text now safe
        to emit; :meth:`finish` follows.

        Raises:
            RuntimeError: called after a stop string matched (``stopped``).
        """
        if self.stopped:
            raise RuntimeError("append_stop_token() called after a stop string matched")
        self.token_ids.append(int(token_id))
        if not self.include_stop:
            return ""
        self._ids.append(int(token_id))
        return self._consume(self._window_delta(force=False), check_stop=False)

    def finish(self) -> str:
        """End of generation for a reason other than a stop string: decode any pending tokens
        (an incomplete character becomes U+FFFD, as ``tokenizer.decode`` would), check stop
        strings once more and return all remaining held-back text ('' once stopped)."""
        if self.stopped:
            return ""
        delta = self._window_delta(force=True)
        out = self._consume(delta)
        if self.stopped:
            return out
        rest = self._text[self._emitted :]
        self._emitted = len(self._text)
        return out + rest
