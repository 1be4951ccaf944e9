"""The tracking API's own functions (``memkit/memory/recording.py``) where mutation testing (``python -m
bench.mutation recording``) found them unchecked: :func:`released` takes one tensor, a 0-dim one included, or any
iterable of them, as :func:`tag` does. Expected bytes are the tensors' own sizes."""

import torch

from memkit.memory import released, track
from memkit.memory.events import ALLOC, FREE


def rows(tl) -> list[tuple[int, int]]:
    return list(zip(tl.column("action").tolist(), tl.column("bytes").tolist(), strict=True))


def test_released_takes_one_tensor_or_an_iterable_of_them():
    with track() as tl:
        a, b = torch.ones(4), torch.ones(8)  # 16 B and 32 B
        scalar = torch.ones(())  # 4 B, 0-dim: nothing to iterate over
        released(t for t in (a, b))  # a generator: any iterable
        released(scalar)
    assert rows(tl) == [(ALLOC, 16), (ALLOC, 32), (ALLOC, 4), (FREE, 16), (FREE, 32), (FREE, 4)]
    assert tl.end_bytes == 0  # given back while the three storages live on
    del a, b, scalar
    assert len(tl) == 6  # and their dying later adds nothing


def test_released_with_no_tracker_running_is_a_no_op():
    a = torch.ones(4)
    released(a)
    released([a])
    with track() as tl:
        pass
    assert len(tl) == 0
