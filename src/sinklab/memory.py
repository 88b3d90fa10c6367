"""Resident memory of this process, as the streaming loops sample it."""

from __future__ import annotations

import os
import resource

#: tokens (or targets) between two samples of the resident set, and between two progress
#: reports, in every streaming loop (the step loop, the oracle, generation)
SAMPLE_EVERY = 16


def rss_mb() -> float:
    """Current resident set size in MiB (Linux ``/proc``; peak RSS elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
