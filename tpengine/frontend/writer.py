"""The output file of a job: the append-and-flush writer and what ``--resume`` finds already done."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, BinaryIO

from typing_extensions import Self

from tpengine.frontend.output import is_validation_error, record_id


class OutputWriter:
    """Writes one JSON line per finished request and flushes it at once, so a crash loses no
    finished work. ``path`` None writes to this process's stdout (rank 0's).

    ``append``: keep existing lines (``--resume``); otherwise the file is truncated.

    Raises:
        OSError: the file cannot be opened.
    """

    def __init__(self, path: str | os.PathLike | None, append: bool = False) -> None:
        self.path = path
        self.count = 0
        mode = "ab" if append else "wb"
        self._fh: BinaryIO = sys.stdout.buffer if path is None else open(path, mode)  # noqa: SIM115

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` as one line (UTF-8 JSON; all-ASCII with ``\\u`` escapes if it holds a lone
        surrogate, which UTF-8 cannot encode) and flush."""
        try:
            data = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate (e.g. an id given as "\ud800"): keep its JSON escape
            data = (json.dumps(record) + "\n").encode("ascii")
        self._fh.write(data)
        self._fh.flush()
        self.count += 1

    def close(self) -> None:
        """Flush; close the file (stdout stays open)."""
        self._fh.flush()
        if self.path is not None:
            self._fh.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_done(path: str | os.PathLike, repair: bool = True) -> tuple[set[str], set[int]]:
    """What an output file already holds, for ``--resume``: (ids of requests that ran or failed
    at run time, line numbers of invalid-line error records).

    Invalid-line records do not count as done ids, so a valid request that shares an id with a
    rejected duplicate line still runs. A missing file gives empty sets. A truncated last line
    (no trailing newline: a write cut by a crash) is ignored and, with ``repair``, cut off the
    file so new lines append cleanly. Complete lines that are not JSON objects are skipped.
    """
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        return set(), set()
    end = data.rfind(b"\n") + 1
    if repair and end < len(data):
        with open(path, "r+b") as fh:
            fh.truncate(end)
    done, bad_lines = set(), set()
    for line in data[:end].split(b"\n"):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict):
            continue
        if (n := is_validation_error(rec)) is not None:
            bad_lines.add(n)
        elif (rid := record_id(rec)) is not None:
            done.add(rid)
    return done, bad_lines
