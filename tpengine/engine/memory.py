"""Peak resident memory of each rank, for the run summary and benchmarks."""

from __future__ import annotations

import resource
import sys

from tpengine.distributed import gather_control


def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes: ``VmHWM`` from ``/proc/self/status``
    (Linux), else ``getrusage``'s ``ru_maxrss`` (KiB on Linux, bytes on macOS)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # "VmHWM:   123456 kB"
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def gather_peak_rss() -> list[int] | None:
    """Collective (every rank of the launch calls it): every rank's :func:`peak_rss_bytes`, in global
    rank order, on global rank 0; None on the other ranks. One gather on the world's gloo group,
    bounded by the process-group timeout (``dist_timeout_s``); ``[peak_rss_bytes()]`` at size 1."""
    return gather_control(peak_rss_bytes(), world=True)


def format_peak_rss(peaks: list[int]) -> str:
    """``"0: 1.23 GiB, 1: 1.20 GiB"`` for per-rank byte counts."""
    return ", ".join(f"{rank}: {b / 2**30:.2f} GiB" for rank, b in enumerate(peaks))
