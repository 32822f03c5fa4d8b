"""Facts about the host that several layers need: the CPU's name and sift's cache folder."""

from __future__ import annotations

import os
import platform


def cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_root() -> str:
    """`$SIFT_CACHE`, else `$XDG_CACHE_HOME/sift`, else `~/.cache/sift`."""
    env = os.environ.get("SIFT_CACHE")
    if env:
        return env
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "sift")
