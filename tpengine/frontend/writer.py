"""The output file of a job: the locked append-and-flush writer and what ``--resume`` finds already done."""

from __future__ import annotations

import fcntl
import json
import os
import sys
from typing import Any, BinaryIO

from typing_extensions import Self

from tpengine.errors import UserError
from tpengine.frontend.output import is_validation_error, record_id


class OutputWriter:
    """Writes one JSON line per finished request and flushes it at once, so a crash loses no
    finished work. ``path`` None writes to this process's stdout (rank 0's).

    The file is opened without truncating, locked for the writer's lifetime (``fcntl.flock``
    ``LOCK_EX | LOCK_NB``: a second job on the same file fails at once instead of interleaving
    lines), and only then truncated, unless ``append`` (``--resume``: keep existing lines). The
    lock is released by :meth:`close` or when the process exits.

    Raises:
        UserError: one line naming the file: another process holds its lock (a second job on the
            same ``--out``), or it cannot be opened for writing (permission, a folder, no such
            folder, ...).
    """

    def __init__(self, path: str | os.PathLike | None, append: bool = False) -> None:
        self.path = path
        self.count = 0
        if path is None:
            self._fh: BinaryIO = sys.stdout.buffer
            return
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else 0), 0o666)
        except OSError as e:
            raise UserError(f"cannot write --out {str(path)!r}: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UserError(f"--out {str(path)!r} is locked by another job writing to it; wait for that job "
                            "to finish or choose another --out") from None
        except OSError as e:  # a file system without locks
            os.close(fd)
            raise UserError(f"cannot lock --out {str(path)!r}: {e.strerror or e}") from None
        if not append:
            os.ftruncate(fd, 0)
        self._fh = os.fdopen(fd, "ab" if append else "wb")

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
        """Flush; close the file and release its lock (stdout stays open). Idempotent."""
        if self._fh.closed:
            return
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
