"""Running a command while measuring what it costs: wall time, peak RSS of its whole process tree,
and the peak disk usage of a folder (to catch temp files)."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Optional

import psutil


def folder_bytes(path: str) -> int:
    total = 0
    for dirpath, _, filenames in os.walk(path):
        for f in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


@dataclass
class Measurement:
    seconds: float
    peak_rss: int  # bytes, summed over the process tree at the worst sample
    peak_disk: int  # bytes under the watched folder at the worst sample
    returncode: int


def run_measured(cmd, watch_dir: Optional[str] = None, env=None, interval: float = 0.02,
                 disk_interval: float = 0.25, cwd: Optional[str] = None) -> Measurement:
    # Give a cwd outside the source tree: `python -m pyckpt.convert` puts the cwd first on sys.path,
    # and from the repository root that would import the source folder (no native module) instead
    # of the installed package.
    peak = {"rss": 0, "disk": 0}
    stop = threading.Event()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def sample():
        try:
            root = psutil.Process(proc.pid)
        except psutil.NoSuchProcess:
            return
        last_disk = 0.0
        while not stop.is_set():
            rss = 0
            try:
                procs = [root] + root.children(recursive=True)
            except psutil.NoSuchProcess:
                break
            for p in procs:
                try:
                    rss += p.memory_info().rss
                except psutil.NoSuchProcess:
                    pass
            peak["rss"] = max(peak["rss"], rss)
            now = time.perf_counter()
            if watch_dir and now - last_disk >= disk_interval:
                peak["disk"] = max(peak["disk"], folder_bytes(watch_dir))
                last_disk = now
            time.sleep(interval)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    # Reaped here rather than by communicate(): wait4 reports the child's own peak RSS, which a run
    # shorter than one sampling interval (cp -r of a small folder) would otherwise not show at all.
    err_chunks = []
    reader = threading.Thread(target=lambda: err_chunks.append(proc.stderr.read()), daemon=True)
    reader.start()
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    reader.join()
    proc.stderr.close()
    err = b"".join(err_chunks)
    stop.set()
    th.join()
    # ru_maxrss (KiB) is the largest single process of the tree; the samples sum the tree
    peak["rss"] = max(peak["rss"], usage.ru_maxrss * 1024)
    if watch_dir:
        peak["disk"] = max(peak["disk"], folder_bytes(watch_dir))
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{err.decode()[-3000:]}")
    return Measurement(elapsed, peak["rss"], peak["disk"], proc.returncode)


# tmpfs pages another run left behind are memory the measured jobs do not have: 6.2 GB of old profiling
# tiers in /dev/shm on the 24 GB machine slowed every memory-tier step by 0.3-0.5 s (benchmarks/README.md).
SHM_WARN_BYTES = 1 << 30


def memory_headroom(shm: str = "/dev/shm") -> dict:
    """What the machine's memory holds before a run: bytes used in ``shm`` and MemAvailable. Warns on stderr
    when ``shm`` already holds more than SHM_WARN_BYTES (the figures would be taken under memory pressure)."""
    st = os.statvfs(shm)
    used = (st.f_blocks - st.f_bfree) * st.f_frsize
    available = psutil.virtual_memory().available
    if used > SHM_WARN_BYTES:
        import sys

        print(f"warning: {shm} already holds {used / 1e9:.1f} GB before this run (other runs' leftovers?): the "
              f"figures are taken with that much less memory; remove what is not needed first", file=sys.stderr,
              flush=True)
    return {"shm_used_bytes": used, "mem_available_bytes": available}
