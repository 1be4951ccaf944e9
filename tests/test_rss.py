"""memkit.memory.sample_rss: the process's resident memory over a block."""

import os
import subprocess
import sys

import pytest

from memkit.memory import rss_bytes, sample_rss

_TOUCHED = """
import torch
from memkit.memory import rss_bytes, sample_rss
n = 64 * 2**20
with sample_rss(interval=0.0005) as rss:
    x = torch.ones(n // 4)  # written: resident, and alive at the last sample (taken as the block ends)
del x
assert len(rss.times) == len(rss.bytes) >= 2 and rss.times == sorted(rss.times)
assert rss.peak_bytes - rss.start_bytes >= 0.9 * n, (rss.start_bytes, rss.peak_bytes)
assert rss.start_bytes > 0 and rss_bytes() > 0
"""


def test_a_touched_allocation_shows_in_the_peak():
    # In a fresh process: in a test worker, memory freed by earlier tests stays resident in the C allocator's heap
    # and is handed out again without a page fault, so the block's rise in RSS is smaller than what it allocates
    # (CI, 2026-11-26: +52 MiB for a 64 MiB tensor).
    run = subprocess.run([sys.executable, "-c", _TOUCHED], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


def test_interval_must_be_positive():
    with pytest.raises(ValueError, match="interval must be > 0 seconds, got 0"):
        with sample_rss(interval=0):
            pass


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="no /proc/self/statm (not Linux): psutil is used")
def test_rss_is_read_from_proc_on_linux_without_psutil(monkeypatch):
    monkeypatch.setitem(sys.modules, "psutil", None)  # the fallback would fail: the number must come from /proc
    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/statm") as f:
        before = int(f.read().split()[1]) * page
    now = rss_bytes()
    with open("/proc/self/statm") as f:
        after = int(f.read().split()[1]) * page
    assert now % page == 0 and min(before, after) - 64 * page <= now <= max(before, after) + 64 * page
