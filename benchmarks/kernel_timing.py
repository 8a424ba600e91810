"""In-process timing of kernels side by side: every candidate in each round, the order reversed every other
round (so neither always runs on the caches, clocks and turbo state the other left), the best round kept."""

from __future__ import annotations

import math
from collections.abc import Callable


def best_interleaved(runs: dict[str, Callable[[], object]], rounds: int, reps: int,
                     clock: Callable[[], float]) -> dict[str, float]:
    """``{name: seconds}``: each ``runs[name]()`` timed ``reps`` times in a row per round by ``clock``
    (``time.perf_counter`` for wall time, ``time.process_time`` for this process's CPU time), ``rounds``
    rounds with the candidates in turn (reversed every other round), the fastest round's seconds per call.

    Raises:
        ValueError: ``rounds`` or ``reps`` below 1.
    """
    if rounds < 1 or reps < 1:
        raise ValueError(f"rounds={rounds}, reps={reps}: both must be >= 1")
    best = dict.fromkeys(runs, math.inf)
    for r in range(rounds):
        for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            fn = runs[name]
            t0 = clock()
            for _ in range(reps):
                fn()
            best[name] = min(best[name], (clock() - t0) / reps)
    return best
