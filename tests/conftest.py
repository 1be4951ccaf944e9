import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic_threads():
    """Tests run with the machine's thread count restored after each test."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def pytest_configure(config):
    # The learned kernel buffers' cache file (memkit/memory/workspace/learned.py) in a folder of this run: a test
    # that learns does so here, whatever an earlier run left in the user's cache.
    import os
    import tempfile

    if "MEMKIT_CACHE_DIR" not in os.environ:
        os.environ["MEMKIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="memkit-test-cache-")
