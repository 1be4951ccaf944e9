import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic_threads():
    """Tests run with the machine's thread count restored after each test."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
