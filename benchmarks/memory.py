"""Resident-memory probes of this process (Linux /proc), shared by the memory benchmarks (no torch)."""

from __future__ import annotations

from pathlib import Path


def rss() -> tuple[int, int]:
    """(current, peak) resident bytes of this process."""
    status = Path("/proc/self/status").read_text()

    def field(name):
        return int(status.split(name + ":")[1].split()[0]) * 1024

    return field("VmRSS"), field("VmHWM")


def reset_peak() -> None:
    """Start the peak (VmHWM) over from the current resident size."""
    Path("/proc/self/clear_refs").write_text("5")
