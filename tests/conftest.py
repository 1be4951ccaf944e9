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


@pytest.fixture(autouse=True, scope="session")
def _nothing_written_to_the_users_cache_at_exit():
    """What fake dispatch learned in the tests is written at exit (memkit/memory/_fake_dispatch.py), when each test's
    MEMKIT_CACHE_DIR is gone and the user's cache folder is the default: marked written instead."""
    yield
    from memkit.memory import _fake_dispatch

    _fake_dispatch._disk["saved"] = len(_fake_dispatch._ENTRIES)
