"""What this process has used so far, as the OS counts it: peak resident memory and bytes handed to ``write``.

Neutral ground: the run summary (``callbacks/run_summary.py``), the strategies' per-rank traffic and the
parameter-server processes all report these, and none should import another layer's module to do it.
"""

from __future__ import annotations

import resource
from pathlib import Path


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def os_bytes_written() -> int:
    """Bytes this process handed to the kernel's write calls (Linux ``/proc/self/io`` ``wchar``; 0 elsewhere).

    gloo's TCP transport sends with ``writev``, so this counts the collective traffic that really leaves the
    process (plus its file writes) — per process, unlike the loopback interface's counter, which other jobs
    on the machine also move. ``bench/memory.py`` takes the difference of a long and a short run.
    """
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("wchar:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0
