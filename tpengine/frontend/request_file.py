"""A request file of any length: validated in one streaming pass, read again lazily to run."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

from tpengine.frontend.requests import ParsedRequest, RequestError, iter_requests


class RequestFile:
    """The valid requests of a JSONL request file, without holding them.

    Construction reads the whole file once, line by line, and validates every line (as
    :func:`tpengine.frontend.requests.parse_lines`), keeping only the ids of the valid requests
    (``ids``) and the problems of the invalid lines (``errors``). Iterating reads the file again
    and yields the valid requests in file order, one at a time, so neither a list of every request
    nor their token ids is ever held. ``len()`` is the number of valid requests; ``max_new_tokens``
    the most tokens they generate (their ``max_tokens`` times ``n``, summed; None where one is unbounded).

    Args:
        path: the file (UTF-8 JSON lines, see ``tpengine.frontend.requests``).
        defaults: SamplingParams keyword arguments for fields a line leaves out.

    Raises:
        OSError: the file cannot be read (construction or iteration).
    """

    def __init__(self, path: str | os.PathLike, defaults: Mapping[str, Any] | None = None) -> None:
        self.path, self.defaults = path, dict(defaults or {})
        self.ids: set[str] = set()
        self.errors: list[RequestError] = []
        self.max_new_tokens: int | None = 0  # the most tokens the valid requests generate; None: unbounded
        for _, req, errors in self._parse():
            if req is not None:
                self.ids.add(req.id)
                most = req.params.max_tokens
                self.max_new_tokens = (None if most is None or self.max_new_tokens is None
                                       else self.max_new_tokens + most * req.params.n)
            self.errors.extend(errors)

    def _parse(self) -> Iterator[tuple[int, ParsedRequest | None, list[RequestError]]]:
        with open(self.path, "rb") as fh:
            yield from iter_requests(fh, self.defaults)

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self) -> Iterator[ParsedRequest]:
        for _, req, _ in self._parse():
            if req is not None:
                yield req
