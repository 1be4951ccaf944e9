import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic_threads():
    """Tests run with the machine's thread count restored after each test."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _own_workspace_cache(tmp_path_factory, monkeypatch):
    """Each test has its own file of learned kernel buffers (memkit/memory/workspace/learned.py): what one test
    learned is not on disk for the next, which may be about learning itself (a failing worker, say)."""
    from memkit.memory.workspace import learned

    monkeypatch.setenv("MEMKIT_CACHE_DIR", str(tmp_path_factory.mktemp("workspace-cache")))
    monkeypatch.setattr(learned, "_disk", None)
