"""memkit.memory.sample_rss: the process's resident memory over a block."""

import pytest
import torch

from memkit.memory import rss_bytes, sample_rss


def test_a_touched_allocation_shows_in_the_peak():
    n = 64 * 2**20
    with sample_rss(interval=0.0005) as rss:
        x = torch.ones(n // 4)  # written: resident, and alive at the last sample (taken as the block ends)
    del x
    assert len(rss.times) == len(rss.bytes) >= 2 and rss.times == sorted(rss.times)
    assert rss.peak_bytes - rss.start_bytes >= 0.9 * n
    assert rss.start_bytes > 0 and rss_bytes() > 0


def test_interval_must_be_positive():
    with pytest.raises(ValueError, match="interval must be > 0 seconds, got 0"):
        with sample_rss(interval=0):
            pass
