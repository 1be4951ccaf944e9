"""FakeDispatchCache gives the outputs fake dispatch gives, so estimates are byte-equal with it on and off."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensor, FakeTensorMode

import memkit
import memkit.estimation as estimation
from memkit.memory import _fake_dispatch
from memkit.memory._fake_dispatch import FakeDispatchCache

# `make test-fast` keeps these cases (tests/conftest.py); every preset runs in `make test` and CI
FAST_CASES = {"test_estimates_are_byte_equal_with_and_without_it": {"flux-0", "wan-3"}}

aten = torch.ops.aten


def _meta(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device, t.untyped_storage().nbytes())


@pytest.fixture
def store(monkeypatch):
    """An empty process-wide store (what a fresh process has)."""
    monkeypatch.setattr(_fake_dispatch, "_ENTRIES", {})


@pytest.fixture
def fake(store):
    with FakeTensorMode() as mode:
        yield mode


def test_new_tensors_match_fake_dispatch_and_are_fresh(fake):
    cache = FakeDispatchCache()
    a, b = torch.empty(8, 16), torch.empty(16, 4).t().contiguous().t()  # b: column-major
    first = cache(aten.mm.default, (a, b), {})
    again = cache(aten.mm.default, (a, b), {})
    assert cache.hits == 1
    assert isinstance(again, FakeTensor) and _meta(again) == _meta(first) == _meta(aten.mm.default(a, b))
    assert again.untyped_storage()._cdata != first.untyped_storage()._cdata


def test_views_share_their_base_storage(fake):
    cache = FakeDispatchCache()
    x = torch.empty(6, 10)
    cache(aten.slice.Tensor, (x, 1, 2, 8), {})
    view = cache(aten.slice.Tensor, (x, 1, 2, 8), {})
    assert cache.hits == 1
    assert view.untyped_storage()._cdata == x.untyped_storage()._cdata
    assert _meta(view) == _meta(x[:, 2:8])
    parts = cache(aten.split.Tensor, (x, 3), {}), cache(aten.split.Tensor, (x, 3), {})
    assert [_meta(p) for p in parts[1]] == [_meta(p) for p in x.split(3)]


def test_in_place_ops_return_their_argument(fake):
    cache = FakeDispatchCache()
    x, y = torch.empty(4), torch.empty(4)
    assert cache(aten.add_.Tensor, (x, y), {}) is x
    assert cache(aten.add_.Tensor, (x, y), {}) is x and cache.hits == 1
    xs = [torch.empty(3), torch.empty(5)]
    assert cache(aten._foreach_mul_.Scalar, (xs, 0.5), {}) is None
    assert cache(aten._foreach_mul_.Scalar, (xs, 0.5), {}) is None and cache.hits == 2


def test_scalars_are_keyed_by_type(fake):
    # an int tensor times 2 stays int, times 2.0 becomes float: the key must tell 2 from 2.0
    cache = FakeDispatchCache()
    n = torch.empty(3, dtype=torch.int64)
    assert cache(aten.mul.Scalar, (n, 2), {}).dtype == torch.int64
    assert cache(aten.mul.Scalar, (n, 2.0), {}).dtype == torch.float32


def test_unsafe_view_and_constants_always_dispatch(fake):
    cache = FakeDispatchCache()
    x = torch.empty(4, 6)
    for _ in range(2):
        out = cache(aten._unsafe_view.default, (x, [24]), {})
        assert out.untyped_storage()._cdata == x.untyped_storage()._cdata  # what fake dispatch returns: a view
    c = torch.tensor(3.0)  # a constant: fake tensors propagate its value for .item()
    for _ in range(2):
        assert cache(aten.mul.Tensor, (c, c), {}).constant is not None
    assert cache.hits == 0
    assert cache(aten._local_scalar_dense.default, (torch.tensor(2.5),), {}) == 2.5


SETTINGS = [
    ("flux", dict(optimizations=[memkit.Checkpointing()])),
    ("flux", dict(optimizations=[memkit.Checkpointing(provider="selective")], mode="training", steps=3)),
    ("ltx-video", dict(optimizations=[memkit.FFSplit(splits=2)])),
    ("wan", dict(optimizations=[memkit.EMA()])),
    ("wan", dict(optimizations=[memkit.Offload(group="block")])),
    ("pixart", dict(mode="inference")),
    ("sd3", dict(device="cpu", dtype=torch.float32, optimizer="sgd")),
    ("unet", {}),
    ("dit", dict(optimizer=None)),
]


# Flux with selective checkpointing over 3 steps: no allocating op the other settings do not meet (checked on
# 2026-11-25), at the cost of three steps; `make test` only
SLOW = {1}


@pytest.mark.parametrize(
    "preset, kwargs",
    [
        pytest.param(p, k, marks=pytest.mark.slow if i in SLOW else (), id=f"{p}-{i}")
        for i, (p, k) in enumerate(SETTINGS)
    ],
)
def test_estimates_are_byte_equal_with_and_without_it(preset, kwargs, monkeypatch):
    on = memkit.estimate(preset, size="tiny", progress=False, memoize=False, **kwargs)
    estimation.clear_cache()  # else the second estimate is the first's cached copy
    monkeypatch.setattr(estimation, "FakeDispatchCache", lambda: None)  # every op through FakeTensorMode
    off = memkit.estimate(preset, size="tiny", progress=False, memoize=False, **kwargs)
    assert len(on) == len(off)
    for name in ("action", "bytes", "category", "phase", "device", "op"):
        assert np.array_equal(on.column(name), off.column(name)), name
    assert on.baseline_by_category == off.baseline_by_category
    assert on.meta["host_bytes"] == off.meta["host_bytes"]
    assert off.meta["cached"] is False


def test_what_one_estimate_learns_the_next_starts_with(store):
    # a widget's next setting: a new estimate (new FakeTensorMode, new cache) replays what the last one learned,
    # in its own mode
    with FakeTensorMode():
        FakeDispatchCache()(aten.mm.default, (torch.empty(8, 16), torch.empty(16, 4)), {})
    with FakeTensorMode() as mode:
        later = FakeDispatchCache()
        a, b = torch.empty(8, 16), torch.empty(16, 4)
        first = later(aten.mm.default, (a, b), {})  # learns the mode from a fake tensor an op gives
        again = later(aten.mm.default, (a, b), {})
    assert later.hits == 1 and later.mode is mode
    assert again.fake_mode is mode and _meta(again) == _meta(first)


# ---- what the cache keys, replays and refuses (found unchecked by `python -m bench.mutation fake_dispatch`) -------


def test_the_key_holds_strides_and_offsets_and_dtypes(fake):
    cache = FakeDispatchCache()
    x = torch.empty(6, 4)
    for arg in (x, x.t(), x.double()):  # clone keeps its argument's strides and dtype
        for _ in range(2):
            assert _meta(cache(aten.clone.default, (arg,), {})) == _meta(aten.clone.default(arg))
    top, bottom = x[0:4], x[2:6]  # the same shape and strides, offsets 0 and 8
    for base in (top, bottom):
        for _ in range(2):
            view = cache(aten.slice.Tensor, (base, 1, 1, 3), {})
            assert view.storage_offset() == base.storage_offset() + 1
            assert view.untyped_storage()._cdata == x.untyped_storage()._cdata
    assert cache.hits == 5


def test_outputs_in_a_tuple_or_a_list_come_back_in_the_same_container(fake):
    cache = FakeDispatchCache()
    x = torch.empty(8)
    for _ in range(2):
        values, indices = out = cache(aten.sort.default, (x,), {})
        assert type(out) is tuple and (values.dtype, indices.dtype) == (torch.float32, torch.int64)
        summed = cache(aten._foreach_add.Scalar, ([x, x[:3]], 1.0), {})
        assert type(summed) is list and [tuple(t.shape) for t in summed] == [(8,), (3,)]
        assert len({t.untyped_storage()._cdata for t in [*out, *summed, x]}) == 5  # fresh storages each
    assert cache.hits == 2


def test_ops_whose_outputs_are_their_arguments_memory_always_dispatch(fake):
    # unsafe_split returns views of its argument its schema does not declare: they must share its storage
    cache = FakeDispatchCache()
    u = torch.empty(6, 2)
    for _ in range(2):
        parts = cache(aten.unsafe_split.Tensor, (u, 3), {})
        assert [p.untyped_storage()._cdata for p in parts] == [u.untyped_storage()._cdata] * 2
        assert [p.storage_offset() for p in parts] == [0, 6]
    assert cache.hits == 0


def test_in_place_views_and_random_ops_always_dispatch(fake):
    cache = FakeDispatchCache()
    x = torch.empty(2, 3)
    cache(aten.t_.default, (x,), {})
    cache(aten.t_.default, (x,), {})  # run again: transposed back
    assert tuple(x.shape) == (2, 3)
    p = torch.empty(4)
    cache(aten.bernoulli.default, (p,), {})
    cache(aten.bernoulli.default, (p,), {})
    assert cache.hits == 0


def test_the_device_of_a_fake_tensor_is_answered_without_dispatch():
    # prim.device: asked by autograd for every op
    with FakeTensorMode():
        x = torch.empty(3)
    cache = FakeDispatchCache()
    assert cache(torch.ops.prim.device.default, (x,), {}) == torch.device("cpu")
    assert cache(torch.ops.prim.device.default, (torch.empty(2),), {}) == torch.device("cpu")  # a real tensor too


def test_real_tensors_and_unknown_arguments_go_straight_to_the_op(store):
    cache = FakeDispatchCache()
    a = torch.ones(2, 3)
    out = cache(aten.mul.Tensor, (a, a), {})
    assert torch.equal(out, torch.ones(2, 3)) and not isinstance(out, FakeTensor)
    summed = cache(aten.sum.dim_IntList, (a, [1]), {"dtype": torch.float64})
    assert summed.tolist() == [3.0, 3.0] and summed.dtype == torch.float64
    assert cache(aten._local_scalar_dense.default, (torch.tensor(1.5),), {}) == 1.5
    assert _fake_dispatch._ENTRIES == {} and cache.mode is None


def test_an_in_place_entry_replays_before_the_cache_has_a_mode(fake):
    x, y = torch.empty(4), torch.empty(4)
    FakeDispatchCache()(aten.add_.Tensor, (x, y), {})
    fresh = FakeDispatchCache()  # the next estimate's: no mode yet, the in-place entry needs none
    assert fresh(aten.add_.Tensor, (x, y), {}) is x and fresh.hits == 1 and fresh.mode is None
    fresh(aten.mm.default, (torch.empty(2, 2), torch.empty(2, 2)), {})
    assert fresh.mode is fake


def test_another_modes_tensors_teach_the_cache_nothing(store):
    with FakeTensorMode() as first:
        cache = FakeDispatchCache()
        cache(aten.mm.default, (torch.empty(2, 3), torch.empty(3, 2)), {})
    assert cache.mode is first
    with FakeTensorMode() as other:
        a, b = torch.empty(5, 3), torch.empty(3, 5)
        out = cache(aten.mm.default, (a, b), {})
        again = cache(aten.mm.default, (a, b), {})
    assert out.fake_mode is other and again.fake_mode is other and cache.hits == 0
    assert len(_fake_dispatch._ENTRIES) == 1


def test_the_store_starts_again_when_full(fake, monkeypatch):
    monkeypatch.setattr(_fake_dispatch, "_ENTRIES_KEPT", 2)
    cache = FakeDispatchCache()
    for n in (2, 3):
        cache(aten.mm.default, (torch.empty(n, 4), torch.empty(4, 4)), {})
    assert len(_fake_dispatch._ENTRIES) == 2
    cache(aten.mm.default, (torch.empty(5, 4), torch.empty(4, 4)), {})
    assert len(_fake_dispatch._ENTRIES) == 1  # cleared, then the new signature
    cache(aten.mm.default, (torch.empty(2, 4), torch.empty(4, 4)), {})
    assert cache.hits == 0


def test_extent_is_the_elements_a_shape_and_stride_reach():
    assert _fake_dispatch.extent((2, 3), (3, 1)) == 6
    assert _fake_dispatch.extent((3, 2), (1, 3)) == 6  # transposed
    assert _fake_dispatch.extent((4,), (2,)) == 7  # every other element
    assert _fake_dispatch.extent((2, 0), (1, 1)) == 0 and _fake_dispatch.extent((), ()) == 1


def test_keyword_arguments_reach_the_op_and_the_key(fake):
    cache = FakeDispatchCache()
    x = torch.empty(4, 3)
    for dtype in (torch.float64, torch.float16, torch.float64):
        assert cache(aten.sum.dim_IntList, (x, [1]), {"dtype": dtype}).dtype == dtype
    assert cache.hits == 1


def test_an_op_that_returns_no_tensor_gives_its_value(fake):
    cache = FakeDispatchCache()
    x = torch.empty(8, 2)
    assert [cache(aten.size.int, (x, d), {}) for d in (0, 1, 0)] == [8, 2, 8]


def test_the_cache_learns_its_mode_from_an_op_that_returns_a_list(fake):
    cache = FakeDispatchCache()
    x = torch.empty(8)
    for _ in range(2):
        (only,) = cache(aten._foreach_add.Scalar, ([x], 1.0), {})  # one tensor in a list
        assert tuple(only.shape) == (8,)
    assert cache.mode is fake and cache.hits == 1


def test_an_out_variant_named_like_an_in_place_op_returns_its_out(fake):
    # __lshift__.Scalar_out ends in "_" but writes `out`, not its first argument: it is never replayed as in place
    cache = FakeDispatchCache()
    x = torch.empty(4, dtype=torch.int64)
    for _ in range(2):
        out = torch.empty(4, dtype=torch.int64)
        assert cache(aten.__lshift__.Scalar_out, (x, 1), {"out": out}) is out


def test_an_output_that_is_its_arguments_whole_storage_always_dispatches(fake):
    cache = FakeDispatchCache()
    u = torch.empty(6, 2)
    for _ in range(2):
        (whole,) = cache(aten.unsafe_chunk.default, (u, 1), {})  # one chunk: u's storage from offset 0
        assert whole.untyped_storage()._cdata == u.untyped_storage()._cdata
    assert cache.hits == 0


def test_replays_keep_dtype_and_requires_grad(fake):
    # called above autograd (as here) an op's output requires grad when its input does: so does its replay
    cache = FakeDispatchCache()
    w = torch.empty(3, 3, requires_grad=True)
    n = torch.empty(5, 4, dtype=torch.int64)
    for _ in range(2):
        assert cache(aten.mm.default, (w, w), {}).requires_grad
        assert cache(aten.slice.Tensor, (n, 1, 0, 2), {}).dtype == torch.int64
        assert cache(aten.mul.Tensor, (n, n), {}).dtype == torch.int64
    assert cache.hits == 3


def test_multi_output_views_are_replayed_and_conjugate_or_negative_views_are_not(fake):
    cache = FakeDispatchCache()
    x = torch.empty(6, 4)
    for _ in range(2):
        assert [tuple(p.shape) for p in cache(aten.split.Tensor, (x, 4), {})] == [(4, 4), (2, 4)]
    assert cache.hits == 1
    z = torch.empty(3, dtype=torch.complex64)
    for _ in range(2):
        assert cache(aten._conj.default, (z,), {}).is_conj()
        assert cache(aten._neg_view.default, (z,), {}).is_neg()
    assert cache.hits == 1


def test_ops_are_keyed_by_the_op_too(fake):
    cache = FakeDispatchCache()
    a = torch.empty(3, 3)
    assert cache(aten.mm.default, (a, a), {}).dtype == torch.float32
    assert cache(aten.eq.Tensor, (a, a), {}).dtype == torch.bool  # the same arguments, another op


def test_ops_that_always_dispatch_get_their_keyword_arguments(fake):
    cache = FakeDispatchCache()
    x, out = torch.empty(4), torch.empty(4)
    assert cache(aten.add.out, (x, x), {"out": out}) is out  # an out= variant


def test_the_device_of_a_constant_is_its_device_not_its_value(fake):
    c = torch.tensor(3.0)  # a constant: its value is known
    assert FakeDispatchCache()(torch.ops.prim.device.default, (c,), {}) == torch.device("cpu")


def test_the_value_of_a_tensor_whose_value_is_unknown_is_refused_as_fake_dispatch_refuses_it(fake):
    with pytest.raises(DataDependentOutputException):
        FakeDispatchCache()(aten._local_scalar_dense.default, (torch.empty(()),), {})
