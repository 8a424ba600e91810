"""The copy-heavy prompts of ``make bench-spec`` (issue 39): rewrite a given code file or document with
small edits, the work where prompt-lookup speculation pays (most output tokens are already in the
prompt). Fixed texts, so every run measures the same work.
"""

from __future__ import annotations

CODE = '''\
"""Interval helpers."""


def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals; returns a new sorted list."""
    if not intervals:
        return []
    ordered = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(ordered[0])]
    for start, end in ordered[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return merged


def total_length(intervals):
    """The length covered by the intervals, overlaps counted once."""
    return sum(end - start for start, end in merge_intervals(intervals))


def contains(intervals, point):
    """Whether any interval holds the point."""
    for start, end in merge_intervals(intervals):
        if start <= point <= end:
            return True
    return False


def gaps(intervals):
    """The uncovered stretches between the merged intervals."""
    merged = merge_intervals(intervals)
    return [[a[1], b[0]] for a, b in zip(merged, merged[1:])]
'''

DOC = '''\
The scheduler runs in three phases. First it admits waiting requests while there is room in the
batch and in the key-value cache. Second it builds the step: every running sequence gets one new
token, and a long prompt gets the next chunk of its prefill. Third it records what the step gave
back: each sequence appends its token, and the ones that reached a stop condition finish and give
their cache blocks back. A request that cannot get a block waits; a running sequence that cannot
grow is preempted, and it is computed again from its tokens when there is room.
'''

#: (name, user message) of each copy-heavy request, through the model's chat template.
TASKS = [
    ("rename", "Rewrite this Python file with the function merge_intervals renamed to merge_ranges. "
               "Change nothing else and output the whole file.\n\n" + CODE),
    ("docstrings", "Copy this Python file, but end every docstring with a full stop if it lacks one. "
                   "Output the whole file.\n\n" + CODE),
    ("document", "Repeat this text word for word, but write 'KV cache' instead of 'key-value cache':\n\n" + DOC),
]
