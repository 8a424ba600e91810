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
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
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
