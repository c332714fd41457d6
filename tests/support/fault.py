"""The fault tier's shared settings and measurements (tests/fault's conftest and tests import them here)."""

from pathlib import Path

GAP_SECONDS = 2
"""The fault server's --seq-gap-timeout: short, so that the gaps a campaign leaves close quickly."""


def rss_mib(pid: int) -> float:
    """Resident memory of a process."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise LookupError(f"no VmRSS for pid {pid}")
