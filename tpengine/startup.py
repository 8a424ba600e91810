"""A process's start without Python's cyclic garbage collector.

Importing torch and transformers, building the model and loading its weights make hundreds of
thousands of tracked Python objects that live as long as the process; next to none of them is garbage.
The cyclic collector still runs a pass every 700 new objects and a full pass each time the old objects
grow by a quarter, over all of them: a fifth of an import of the engine's modules and a tenth of a
one-prompt job's start went to those passes (docs/notes/test-suite.md, "The collector at start-up"). CPython's
own advice for such a start is to turn the collector off while it runs (``gc.disable`` /
``gc.freeze``; Instagram's and other servers' practice).

:func:`collector_paused` turns it off for a ``with`` block and back to how it was after, also when
the block raises; blocks nest. The entry points wrap their imports in it, and ``LLMEngine`` its
set-up (the one every entry point takes), so a program that imports tpengine as a library keeps its
collector on outside those blocks.

:func:`run_main` runs an entry point as the process's main program and leaves without the
interpreter's teardown (its full collections over those objects as it clears every module: seconds
with torch and transformers loaded), once the program has finished its work.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """Run the ``with`` block with the cyclic garbage collector off (``gc.disable()``) and leave it
    as it was before the block (on again if it was on), whatever the block raises. Reference
    counting still frees every object without a cycle; cycles made in the block wait for the next
    collection after it."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def run_main(main: Callable[[], object]) -> None:
    """Run ``main()`` (a command line program that ends by raising SystemExit, as a typer app does) and
    leave the process with its exit code through ``os._exit``, after what a normal exit does first: the
    other non-daemon threads joined, the ``atexit`` functions run, stdout and stderr flushed. Skipped is
    only the interpreter's teardown (clearing every module, with full collections: seconds with torch
    and transformers loaded, after every output file was written and closed). A ``main`` that raises
    anything else propagates it (the usual traceback and teardown), and so does every exit under a
    profiler or tracer (``python -m cProfile``, coverage: they write their files after ``main``
    returns; then ``main``'s exit is the usual one). For ``python -m`` shims only: a program that
    imports tpengine keeps its own exit."""
    if sys.getprofile() is not None or sys.gettrace() is not None:
        main()  # a profiler's or tracer's own exit
        return
    try:
        main()
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:  # sys.exit("message"): printed, exit 1, as Python does
            print(e.code, file=sys.stderr)
            code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # what a normal exit does first
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code & 0xFF)
