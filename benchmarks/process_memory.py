"""Resident memory of other processes, read from /proc (Linux), and the peak of what a run holds."""

import os
import threading


def rss_mib(pids: list[int]) -> float:
    """Summed RSS of these processes; ones that have exited count zero."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as status:
                total += next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            pass
    return total / 1024


def _stat_fields() -> dict[int, list[str]]:
    """Every process's /proc/PID/stat fields after the command name (which may hold spaces)."""
    fields = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields[int(entry)] = stat.read().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                pass
    return fields


def process_group(pgid: int) -> list[int]:
    """Every process of a process group (vLLM's API server, engine core and workers)."""
    return [pid for pid, fields in _stat_fields().items() if int(fields[2]) == pgid]  # field 5: the group


def process_tree(pid: int) -> list[int]:
    """A process and all its descendants (the server and the workers it spawned)."""
    children: dict[int, list[int]] = {}
    for child, fields in _stat_fields().items():
        children.setdefault(int(fields[1]), []).append(child)  # field 4: the parent
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo += children.get(current, [])
    return tree


class PeakMemory:
    """Memory in use, sampled every 200 ms: the GPU's (every process) or the RSS of some process trees."""

    def __init__(self, device: str, pids=lambda: []):
        self.device, self.pids, self.peak = device, pids, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def read(self) -> float:
        if self.device.startswith("cuda"):
            import torch

            free, total = torch.cuda.mem_get_info(0)
            return (total - free) / 2**30
        return rss_mib(self.pids()) / 1024

    def _run(self):
        while not self._stop.wait(0.2):
            self.peak = max(self.peak, self.read())

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
