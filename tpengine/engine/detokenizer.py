"""Incremental detokenization with stop strings (rank 0 only).

The engine calls :meth:`IncrementalDetokenizer.append` once per generated token and gets back
the text that is now safe to show: never a broken UTF-8 character, never a repeat, never a
piece that could still turn out to be the start of a stop string.

Decoding uses the prefix-offset / read-offset window of HF TGI and vLLM
(``detokenize_incrementally``): only the few most recent tokens are decoded per step, and the
new text is the difference between decoding ``ids[prefix:]`` and ``ids[prefix:read]``. The
window starts at the first generated token (the prompt is not used as decoding context), so the
final text equals ``tokenizer.decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=
False)`` of the appended ids, cut before the first stop string.
"""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT = "\ufffd"


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

    Attributes:
        stopped: True once a stop string matched; ``append`` must not be called after that.
        token_ids: the ids appended so far.

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
        self._prefix = 0  # window start: text of ids[_prefix:_read] is already in _text
        self._read = 0  # ids before this are decoded into _text
        self._text = ""  # confirmed decoded text (cut at the stop string once stopped)
        self._emitted = 0  # chars of _text already returned to the caller
        self._backend = _rust_decoder(tokenizer)

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
        """Newly decoded text of the window; '' while it still ends in a broken character
        (unless ``force``). Advances the window when text is taken."""
        if self._read == len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self._prefix : self._read])
        new_text = self._decode(self.token_ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or (new_text.endswith(REPLACEMENT) and not force):
            return ""  # a skipped special token, or an incomplete multi-byte character
        self._prefix, self._read = self._read, len(self.token_ids)
        return new_text[len(prefix_text) :]

    def _consume(self, delta: str) -> str:
        """Add ``delta`` to the text, look for stop strings, return what is safe to emit."""
        if delta:
            old_len = len(self._text)
            self._text += delta
            if self.stop and len(self.token_ids) > self.min_tokens:
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
        return self._consume(self._window_delta(force=False))

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
