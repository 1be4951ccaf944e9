"""FSDP2 seen from rank 0: estimates on fake tensors against real runs, and the categories against first principles.

Every expected number below comes from the model's parameter shapes and FSDP2's layout: each parameter is
split along dim 0 into ``world_size`` shards of ``ceil(rows / N)`` rows (the last padded), its unsharded
copy has ``N`` such shards, and AdamW keeps two fp32 tensors per shard plus one 4-byte ``step``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _cpu_estimate import estimate_cpu

import memkit
from memkit import _torch_compat
from memkit.handle import apply_all
from memkit.memory.recording import track
from memkit.parallel import _blocks, sharded_order
from memkit.step import Step, model_output

# `make test-fast` keeps these cases (tests/conftest.py); every world size runs in `make test` and CI
FAST_CASES = {
    "test_estimate_equals_the_real_run_at_each_world_size": {"2"},
    "test_the_local_shard_optimizer_is_the_dtensor_optimizer_byte_for_byte": set(),
}

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module .* returned a view tensor")
if _torch_compat.torch_version() < _torch_compat.FSDP_MIN:  # tests/test_torch_compat.py checks the refusal there
    pytest.skip("memkit.FSDP needs torch >= 2.11", allow_module_level=True)

PRESET = "flux"
WORLD_SIZES = (1, 2, 4, 8)
_cache: dict = {}


def _fake(n: int, *, steps: int = 2, optimizations=(), **kwargs) -> memkit.Timeline:
    key = ("fake", n, steps, tuple(str(o) for o in optimizations), tuple(sorted(kwargs.items())))
    if key not in _cache:
        fsdp = memkit.FSDP(world_size=n, **kwargs)
        _cache[key] = estimate_cpu(
            PRESET, size="tiny", optimizer="adamw", steps=steps, optimizations=optimizations, parallel=fsdp
        )
    return _cache[key]


def _real(n: int, *, steps: int = 2, optimizations=(), **kwargs) -> memkit.Timeline:
    key = ("real", n, steps, tuple(str(o) for o in optimizations), tuple(sorted(kwargs.items())))
    if key not in _cache:
        model = memkit.load_model(PRESET, size="tiny")
        inputs = memkit.make_inputs(model)
        with apply_all(model, sharded_order(optimizations, memkit.FSDP(world_size=n, **kwargs))) as handle:
            runner = Step(optimizer="adamw").bind(model, handle)
            for _ in range(steps - 1):
                runner.run(inputs)
            with track(inputs=inputs, **runner.tracked_objects()) as tl:
                runner.run(inputs)
        _cache[key] = tl
    return _cache[key]


def _tiny() -> torch.nn.Module:
    return memkit.load_model(PRESET, size="tiny")


def _shard_bytes(params, n: int) -> int:
    """Rank 0's shards: ceil(rows / n) rows of each parameter."""
    return sum(math.ceil(p.shape[0] / n) * (p.numel() // p.shape[0]) * p.element_size() for p in params)


def _padded_bytes(params, n: int) -> int:
    """The unsharded (all-gathered) copies: n shards each, padding included."""
    return n * _shard_bytes(params, n)


def _live_max(tl: memkit.Timeline, category: str) -> int:
    return int(tl.live_by_category()[category].max())


def _end(tl: memkit.Timeline) -> dict[str, int]:
    return tl.bytes_by_category_at(len(tl) - 1)


# ---- the config ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, "world_size must be an int >= 1, got 0"),
        ({"world_size": True}, "world_size must be an int >= 1"),
        ({"world_size": "8"}, "world_size must be an int >= 1"),
        ({"reshard_after_forward": 1}, "reshard_after_forward must be True or False"),
        ({"mixed_precision": torch.int8}, "mixed_precision must be None, a floating torch.dtype"),
        ({"mixed_precision": "bf16"}, "mixed_precision must be None, a floating torch.dtype"),
        ({"cpu_offload": 1}, "cpu_offload must be True or False, got 1"),
    ],
)
def test_fsdp_refuses_bad_arguments_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        memkit.FSDP(**kwargs)


def test_fsdp_is_keyword_only_frozen_and_named():
    with pytest.raises(TypeError):
        memkit.FSDP(8)  # type: ignore[misc]
    f = memkit.FSDP(world_size=4, reshard_after_forward=False, mixed_precision=torch.bfloat16)
    with pytest.raises(AttributeError):
        f.world_size = 2  # type: ignore[misc]
    assert str(f) == "fsdp:4,keep-unsharded,bfloat16"
    assert str(memkit.FSDP(world_size=2, cpu_offload=True)) == "fsdp:2,cpu-offload"
    assert "FSDP" in memkit.__all__ and memkit.FSDP is memkit.parallel.FSDP


@pytest.mark.parametrize(
    ("value", "config"),
    [
        ("8", memkit.FSDP()),
        (
            "2,keep-unsharded,bf16,cpu-offload",
            memkit.FSDP(world_size=2, reshard_after_forward=False, mixed_precision=torch.bfloat16, cpu_offload=True),
        ),
        (" 4 , float16 ", memkit.FSDP(world_size=4, mixed_precision=torch.float16)),
    ],
)
def test_parse_reads_what_str_writes(value, config):
    assert memkit.FSDP.parse(value) == config
    assert memkit.FSDP.parse(str(config).removeprefix("fsdp:")) == config
    assert memkit.optimizations.parse(str(config)) == config


def test_parse_round_trips_a_mixed_precision_policy():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    config = memkit.FSDP(world_size=2, mixed_precision=MixedPrecisionPolicy(reduce_dtype=torch.float32))
    assert str(config) == "fsdp:2,param=same,reduce=float32"
    assert memkit.FSDP.parse("2,param=same,reduce=float32") == config


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0", "world_size must be an int >= 1, got 0"),
        ("-2", "world_size must be an int >= 1, got -2"),
        ("two", "world_size, the first part of the fsdp value .* must be a whole number of GPUs, got 'two'"),
        ("2.5", "world_size.* must be a whole number of GPUs, got '2.5'"),
        ("", "world_size.* got ''"),
        ("8,fast", "unknown option 'fast'; after the world size: keep-unsharded, a dtype"),
        ("8,int8", "unknown option 'int8'"),
    ],
)
def test_parse_refuses_bad_values_naming_the_argument(value, message):
    with pytest.raises(ValueError, match=message):
        memkit.FSDP.parse(value)


@pytest.mark.slow  # several seconds: `make test` and CI run it, the edit-test loop (make test-fast) leaves it out
def test_fsdp_among_the_optimizations_is_the_parallel_estimate_byte_for_byte():
    fsdp = memkit.FSDP(world_size=2)
    kwargs = dict(size="tiny", optimizer="adamw", steps=2, memoize=False)
    by_parallel = estimate_cpu(PRESET, optimizations=[memkit.Checkpointing()], parallel=fsdp, **kwargs)
    memkit.estimation.clear_cache()  # else the second estimate is the first's cached copy
    listed = estimate_cpu(PRESET, optimizations=[fsdp, memkit.Checkpointing()], **kwargs)
    assert listed.meta["cached"] is False and len(listed) == len(by_parallel) > 0
    for name in ("action", "bytes", "category", "phase", "device", "op"):
        assert np.array_equal(listed.column(name), by_parallel.column(name)), name
    assert listed.baseline_by_category == by_parallel.baseline_by_category
    for key in ("optimizations", "parallel", "host_bytes", "first_step_peak_bytes", "steady_peak_bytes"):
        assert listed.meta[key] == by_parallel.meta[key], key
    assert listed.meta["parallel"] == "fsdp:2" and listed.meta["optimizations"] == ["checkpointing:all"]


def test_estimate_refuses_two_fsdps_and_a_parallel_that_is_not_one():
    with pytest.raises(ValueError, match="a model is sharded once, got fsdp:2, fsdp:4"):
        estimate_cpu(PRESET, size="tiny", optimizations=[memkit.FSDP(world_size=2)], parallel=memkit.FSDP(world_size=4))
    with pytest.raises(ValueError, match="sharded once"):
        estimate_cpu(PRESET, size="tiny", optimizations=[memkit.FSDP(world_size=2), memkit.FSDP(world_size=2)])
    with pytest.raises(TypeError, match="parallel must be a memkit.FSDP"):
        estimate_cpu(PRESET, size="tiny", parallel=2)


def test_compare_refuses_fsdp_saying_why_and_what_to_use():
    with pytest.raises(
        ValueError, match=r"variants\['sharded'\]: fsdp:2 is estimate-only.*rank 0 holds only its shard"
    ):
        memkit.compare(PRESET, {"sharded": [memkit.FSDP(world_size=2)]}, progress=False)
    assert not dist.is_initialized()  # refused before anything ran


# ---- world size 1 is today's estimate ---------------------------------------------------------------------------
def test_world_size_1_equals_the_unsharded_estimate():
    # AdamW's step is the peak of a first step here: only shards (= the whole model at N=1), their gradients and
    # the new optimizer state are alive then, exactly as without FSDP, so the two peaks agree to the byte.
    plain = estimate_cpu(PRESET, size="tiny", optimizer="adamw")
    one = estimate_cpu(PRESET, size="tiny", optimizer="adamw", parallel=memkit.FSDP(world_size=1))
    assert one.peak_phase == plain.peak_phase == "optimizer"
    assert one.peak_bytes == plain.peak_bytes
    assert one.peak_by_category() == plain.peak_by_category()
    assert one.baseline_by_category == plain.baseline_by_category
    assert one.meta["parallel"] == "fsdp:1" and plain.meta["parallel"] is None


def test_world_size_1_adds_only_fsdp_buffers_in_forward_and_backward():
    # With the optimizer state already there (2nd step) the peak moves into backward, where FSDP at N=1 holds an
    # unsharded copy of the blocks it works on and its flat buffers besides the shards: never less than without.
    plain = estimate_cpu(PRESET, size="tiny", optimizer="adamw", steps=2)
    one = _fake(1)
    assert one.baseline_by_category == plain.baseline_by_category
    assert one.peak_bytes >= plain.peak_bytes
    extra = one.peak_by_category()
    assert one.peak_bytes - plain.peak_bytes <= extra["unsharded_parameter"] + extra["collective"]


# ---- fake = real ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_estimate_equals_the_real_run_at_each_world_size(n):
    fake, real = _fake(n), _real(n)
    assert fake.peak_bytes == real.peak_bytes
    assert fake.peak_by_category() == real.peak_by_category()
    assert fake.baseline_by_category == real.baseline_by_category
    assert len(fake) == len(real)


# ---- the categories from first principles -----------------------------------------------------------------------
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_sharded_categories_are_rank_0s_shards(n):
    params = list(_tiny().parameters())
    shard = _shard_bytes(params, n)
    tl = _fake(n)
    base = tl.baseline_by_category
    assert base["parameter"] == shard
    assert base["optimizer_state"] == 2 * shard + 4 * len(params)  # exp_avg, exp_avg_sq, and a 0-dim fp32 step
    assert _live_max(tl, "gradient") == shard  # every gradient shard, once backward is done
    assert base["unsharded_parameter"] == base["collective"] == base["gradient"] == 0
    assert _end(tl) == base  # everything FSDP gathered or communicated is freed again


def test_sharded_categories_scale_as_one_over_the_world_size():
    params = list(_tiny().parameters())
    whole = sum(p.numel() * p.element_size() for p in params)
    for n in WORLD_SIZES:
        base = _fake(n).baseline_by_category
        padding = sum((n - 1) * (p.numel() // p.shape[0]) * p.element_size() for p in params)  # < 1 row per shard
        assert whole <= n * base["parameter"] <= whole + padding
        assert whole <= n * _live_max(_fake(n), "gradient") <= whole + padding


def test_sharded_categories_scale_within_cuda_rounding():
    # Planned for a GPU, every storage is a multiple of 512 bytes: each shard rounds up by less than a block.
    params = list(_tiny().parameters())
    n = 4
    tl = estimate_cpu(
        PRESET, size="tiny", optimizer="adamw", steps=2, device="cuda", parallel=memkit.FSDP(world_size=n)
    )
    shard = _shard_bytes(params, n)
    assert shard <= tl.baseline_by_category["parameter"] < shard + 512 * len(params)
    assert tl.baseline_by_category["parameter"] % 512 == 0


def test_unsharded_parameters_are_the_root_and_at_most_two_blocks():
    model = _tiny()
    n = 2
    blocks = [list(b.parameters()) for b in _blocks(model)]
    in_blocks = {id(p) for ps in blocks for p in ps}
    root = _padded_bytes([p for p in model.parameters() if id(p) not in in_blocks], n)
    biggest = max(_padded_bytes(ps, n) for ps in blocks)
    gathered = _live_max(_fake(n), "unsharded_parameter")
    # the root's own parameters stay gathered through backward; each block's only while it runs, and backward
    # prefetches the next block's all-gather
    assert root + biggest <= gathered <= root + 2 * biggest
    # without resharding after forward, every block's copy is still there when backward starts
    assert _live_max(_fake(n, reshard_after_forward=False), "unsharded_parameter") == _padded_bytes(
        list(model.parameters()), n
    )


def test_collective_buffers_exist_only_in_flight():
    n = 4
    tl = _fake(n)
    assert _live_max(tl, "collective") > 0
    assert _end(tl)["collective"] == 0
    allocated = tl.to_pandas().query("category == 'collective' and action == 'alloc'")
    assert set(allocated["phase"]) == {"forward", "backward"}  # all-gathers, then reduce-scatters too


@pytest.mark.slow  # several seconds: `make test` and CI run it, the edit-test loop (make test-fast) leaves it out
def test_mixed_precision_gathers_in_bf16():
    model = _tiny()
    n = 2
    tl = _fake(n, mixed_precision=torch.bfloat16)
    params = list(model.parameters())
    assert tl.baseline_by_category["parameter"] == _shard_bytes(params, n)  # fp32 shards
    bf16 = [torch.empty(p.shape, dtype=torch.bfloat16) for p in params]
    blocks = [list(b.parameters()) for b in _blocks(model)]
    in_blocks = {id(p) for ps in blocks for p in ps}
    root = _padded_bytes([b for p, b in zip(params, bf16, strict=True) if id(p) not in in_blocks], n)
    assert _live_max(tl, "unsharded_parameter") >= root  # bf16 copies: half the fp32 gathered bytes
    assert _live_max(tl, "unsharded_parameter") <= _padded_bytes(bf16, n)


def test_a_mixed_precision_policy_is_passed_as_given():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    fsdp = memkit.FSDP(world_size=2, mixed_precision=policy)
    assert str(fsdp) == "fsdp:2,param=bfloat16,reduce=bfloat16"
    model = _tiny()
    with fsdp.apply(model):
        assert model._get_fsdp_state()._mp_policy == policy
        assert all(b._get_fsdp_state()._mp_policy == policy for b in _blocks(model))
    # gradients reduced in bf16: the reduce-scatter buffers shrink; the gradient shards are fp32 all the same
    n = 2
    bf16, fp32 = _fake(n, mixed_precision=policy), _fake(n, mixed_precision=torch.bfloat16)
    assert _live_max(bf16, "gradient") == _live_max(fp32, "gradient") == _shard_bytes(list(model.parameters()), n)
    assert _live_max(bf16, "collective") < _live_max(fp32, "collective")


# ---- composition ------------------------------------------------------------------------------------------------
def test_checkpointing_composes_with_fsdp():
    n = 2
    ckpt = [memkit.Checkpointing(pattern="all")]
    fake, real = _fake(n, optimizations=ckpt), _real(n, optimizations=ckpt)
    assert fake.peak_bytes == real.peak_bytes and fake.peak_by_category() == real.peak_by_category()
    # checkpointing keeps only the blocks' inputs for backward: fewer activations, the same shards
    assert _live_max(fake, "activation") < _live_max(_fake(n), "activation")
    assert fake.baseline_by_category == _fake(n).baseline_by_category


@pytest.mark.slow  # several seconds: `make test` and CI run it, the edit-test loop (make test-fast) leaves it out
def test_ema_after_fsdp_lives_on_the_shards():
    n = 4
    ema = [memkit.EMA()]
    tl = _fake(n, optimizations=ema)
    assert tl.baseline_by_category["ema"] == _shard_bytes(list(_tiny().parameters()), n)
    assert tl.peak_bytes == _real(n, optimizations=ema).peak_bytes


@pytest.mark.slow  # several seconds: `make test` and CI run it, the edit-test loop (make test-fast) leaves it out
def test_ff_split_composes_with_fsdp():
    n = 2
    split = [memkit.FFSplit(splits=2)]
    fake, real = _fake(n, optimizations=split), _real(n, optimizations=split)
    assert fake.peak_bytes == real.peak_bytes
    assert fake.baseline_by_category["parameter"] == _shard_bytes(list(_tiny().parameters()), n)


# ---- FSDP's own CPU offload ------------------------------------------------------------------------------------
def _gpu_bytes(nbytes: int) -> int:
    """A storage on the GPU: the caching allocator hands out multiples of 512 bytes."""
    return -(-nbytes // 512) * 512


def _cuda_plan(n: int, *, real: bool = False, **kwargs) -> memkit.Timeline:
    """Rank 0 planned for a GPU, AdamW with foreach as on CUDA; ``real``: the same on real CPU tensors, under the
    plan an estimate makes (its fake CPU tensors stand for GPU ones, so do these)."""
    from memkit.memory.placement import planning

    key = ("cuda", real, n, tuple(sorted(kwargs.items())))
    if key in _cache:
        return _cache[key]
    fsdp = memkit.FSDP(world_size=n, **kwargs)
    # AdamW as torch runs it: foreach on the GPU; with CPU offload on CPU tensors, where torch loops (as estimate does)
    step = Step(optimizer="adamw", steps=2, foreach=None if fsdp.cpu_offload else True)
    if not real:
        _cache[key] = estimate_cpu(PRESET, size="tiny", step=step, device="cuda", parallel=fsdp)
        return _cache[key]
    with planning("cuda") as plan:
        host = plan.host
        model = _tiny()
        inputs = memkit.make_inputs(model)
        with fsdp.apply(model) as handle:
            runner = step.bind(model, handle)
            runner.run(inputs)
            objects = runner.tracked_objects()
            with track(inputs=inputs, alloc_granularity=512, device="cuda", host=host, **objects) as tl:
                runner.run(inputs)
    _cache[key] = tl
    return tl


@pytest.mark.slow  # several seconds: `make test` and CI run it, the edit-test loop (make test-fast) leaves it out
def test_cpu_offload_on_a_cpu_estimate_equals_the_real_run_and_moves_nothing():
    # On a CPU, host memory is the device's: FSDP takes its offload path, the shards stay in the timeline.
    n = 1
    fake, real = _fake(n, cpu_offload=True), _real(n, cpu_offload=True)
    assert fake.peak_bytes == real.peak_bytes
    assert fake.peak_by_category() == real.peak_by_category()
    assert fake.baseline_by_category == real.baseline_by_category and len(fake) == len(real)
    params = list(_tiny().parameters())
    assert fake.baseline_by_category["parameter"] == _shard_bytes(params, n)
    assert fake.meta["host_bytes"] == {} and fake.meta["parallel"] == "fsdp:1,cpu-offload"


@pytest.mark.slow  # several seconds: `make test` and CI run it, the edit-test loop (make test-fast) leaves it out
def test_cpu_offload_planned_for_a_gpu_equals_the_real_run():
    fake, real = _cuda_plan(2, cpu_offload=True), _cuda_plan(2, cpu_offload=True, real=True)
    assert fake.peak_bytes == real.peak_bytes
    assert fake.peak_by_category() == real.peak_by_category()
    assert fake.baseline_by_category == real.baseline_by_category and len(fake) == len(real)
    assert fake.meta["host_bytes"] == real.meta["host_state_bytes"]


@pytest.mark.slow  # several seconds: `make test` and CI run it, the edit-test loop (make test-fast) leaves it out
def test_cpu_offload_keeps_rank_0s_shards_in_host_memory_and_off_the_gpu_peak():
    n = 2
    params = list(_tiny().parameters())
    shards = [_shard_bytes([p], n) for p in params]
    on_gpu, offloaded = _cuda_plan(n), _cuda_plan(n, cpu_offload=True)
    host = offloaded.meta["host_bytes"]
    # in host memory, unrounded: the parameter shards, every gradient shard once backward is done, AdamW's state
    assert host["parameter"] == host["gradient"] == sum(shards)
    assert host["optimizer_state"] == 2 * sum(shards) + 4 * len(params)
    for category in ("parameter", "gradient", "optimizer_state"):
        assert _live_max(offloaded, category) == 0 and offloaded.baseline_by_category[category] == 0
    # without offload the GPU holds them, each storage rounded to 512 bytes (AdamW's 0-dim step too)
    assert on_gpu.baseline_by_category["parameter"] == sum(_gpu_bytes(s) for s in shards)
    assert on_gpu.baseline_by_category["optimizer_state"] == sum(2 * _gpu_bytes(s) + 512 for s in shards)
    assert on_gpu.meta["host_bytes"] == {}
    # so the GPU peak drops by at least the parameter and optimizer-state shards (and the gradients there then)
    states = sum(3 * _gpu_bytes(s) + 512 for s in shards)
    assert on_gpu.peak_bytes - offloaded.peak_bytes >= states
    # what FSDP gathers and what the step computes stay on the GPU
    for category in ("unsharded_parameter", "activation"):
        assert _live_max(offloaded, category) == _live_max(on_gpu, category)


@pytest.mark.slow  # several seconds: `make test` and CI run it, the edit-test loop (make test-fast) leaves it out
def test_cpu_offload_of_a_lora_run_keeps_the_frozen_base_shards_on_the_host_without_gradients():
    """A LoRA run's base is frozen: its shards get no gradient, and torch refuses a gradient hook on them (memkit
    hooked every shard until this test: RuntimeError "cannot register a hook on a tensor that doesn't require
    gradient"). The shards of every parameter live in host memory, the gradients and AdamW's state only the
    adapters'."""
    n, lora = 2, memkit.LoRA(rank=4)
    fake, real = _fake(n, optimizations=[lora], cpu_offload=True), _real(n, optimizations=[lora], cpu_offload=True)
    assert fake.peak_bytes == real.peak_bytes and fake.peak_by_category() == real.peak_by_category()
    model = _tiny()
    with lora.apply(model):
        params = list(model.parameters())
        trainable = [p for p in params if p.requires_grad]
    assert 0 < len(trainable) < len(params)
    fsdp = memkit.FSDP(world_size=n, cpu_offload=True)
    tl = memkit.estimate(PRESET, size="tiny", optimizations=[lora], parallel=fsdp, optimizer="adamw", device="cuda",
                         dtype=torch.float32, progress=False)  # fmt: skip
    host = tl.meta["host_bytes"]
    assert host["parameter"] == _shard_bytes(params, n)
    assert host["gradient"] == _shard_bytes(trainable, n)
    assert host["optimizer_state"] == 2 * _shard_bytes(trainable, n) + 4 * len(trainable)


@pytest.mark.slow  # several seconds: `make test` and CI run it, the edit-test loop (make test-fast) leaves it out
def test_cpu_offload_copies_each_shard_to_the_gpu_for_its_all_gather():
    # A GPU's FSDP copies the host shard to the device before each all-gather (on a CPU mesh ``.to`` is a no-op, so
    # memkit makes that copy): in forward every parameter is gathered once, so once each padded shard.
    n = 2
    params = list(_tiny().parameters())
    rows = _cuda_plan(n, cpu_offload=True).to_pandas().query("category == 'collective' and action == 'alloc'")
    copies = rows[rows["op"].str.contains("clone")]
    assert copies["bytes"][copies["phase"] == "forward"].sum() == sum(_gpu_bytes(_shard_bytes([p], n)) for p in params)
    rows = _cuda_plan(n).to_pandas().query("category == 'collective' and action == 'alloc'")
    assert not rows["op"].str.contains("clone").any()  # shards already on the GPU: no copy


@pytest.mark.slow  # several seconds: `make test` and CI run it, the edit-test loop (make test-fast) leaves it out
def test_an_ema_of_cpu_offloaded_shards_lives_beside_them_in_host_memory():
    n = 2
    tl = estimate_cpu(
        PRESET,
        size="tiny",
        optimizer="adamw",
        device="cuda",
        optimizations=[memkit.EMA()],
        parallel=memkit.FSDP(world_size=n, cpu_offload=True),
    )
    assert tl.meta["host_bytes"]["ema"] == _shard_bytes(list(_tiny().parameters()), n)
    assert _live_max(tl, "ema") == 0 and tl.baseline_by_category["ema"] == 0


@pytest.mark.slow  # several seconds: `make test` and CI run it, the edit-test loop (make test-fast) leaves it out
def test_an_offloaded_ema_of_the_shards_stages_their_local_shards_through_the_gpu():
    """EMA(mode="offload") under FSDP: host shadows of rank 0's shards, each update staged through device buffers by
    the shards' local tensors (torch refused the DTensor shards beside the plain buffers: "got mixed torch.Tensor and
    DTensor", until this test). The device holds the staging buffers only, at most 1/64 of the shadows each."""
    n = 2
    tl = estimate_cpu(PRESET, size="tiny", optimizer="adamw", device="cuda", optimizations=[memkit.EMA(mode="offload")],
                      parallel=memkit.FSDP(world_size=n))  # fmt: skip
    shards = _shard_bytes(list(_tiny().parameters()), n)
    assert tl.meta["host_bytes"]["ema"] == shards and tl.baseline_by_category["ema"] == 0
    staged = tl.to_pandas().query("phase == 'ema' and action == 'alloc' and device == 'cuda'")
    assert len(staged) > 0 and staged["bytes"].max() <= _gpu_bytes(max(shards // 64, 4 * 2**16))


def test_group_offload_is_refused_with_fsdp_pointing_to_its_cpu_offload(tmp_path):
    fsdp = memkit.FSDP(world_size=2)
    offload = memkit.Offload(to="disk", path=tmp_path)
    with pytest.raises(ValueError, match=r"optimizations: memkit\.Offload .*cpu_offload=True"):
        estimate_cpu(PRESET, size="tiny", optimizations=[offload], parallel=fsdp)
    with pytest.raises(ValueError, match=r"optimizations: memkit\.Offload .*cpu_offload=True"):
        sharded_order([memkit.Checkpointing(), offload], fsdp)
    model = _tiny()
    with offload.apply(model), pytest.raises(ValueError, match=r"model: memkit\.Offload .*cpu_offload=True"):
        fsdp.apply(model)
    assert not dist.is_initialized()


# ---- process group and model lifecycle --------------------------------------------------------------------------
def test_the_process_group_is_gone_after_an_estimate_even_one_that_fails():
    estimate_cpu(PRESET, size="tiny", parallel=memkit.FSDP(world_size=2))
    assert not dist.is_initialized()

    def broken(model):
        raise RuntimeError("no inputs today")

    with pytest.raises(RuntimeError, match="no inputs today"):
        estimate_cpu(PRESET, broken, size="tiny", parallel=memkit.FSDP(world_size=2))
    assert not dist.is_initialized()


@pytest.mark.slow  # several seconds: `make test` and CI run it, the edit-test loop (make test-fast) leaves it out
def test_a_running_process_group_is_used_and_kept():
    dist.init_process_group("fake", rank=0, world_size=2, store=dist.HashStore())
    try:
        with pytest.raises(ValueError, match="world_size is 4, but a process group of 2 ranks"):
            estimate_cpu(PRESET, size="tiny", parallel=memkit.FSDP(world_size=4))
        tl = estimate_cpu(PRESET, size="tiny", optimizer="adamw", steps=2, parallel=memkit.FSDP(world_size=2))
        assert dist.is_initialized() and dist.get_world_size() == 2
        assert tl.peak_bytes == _fake(2).peak_bytes
    finally:
        dist.destroy_process_group()


def test_remove_restores_the_model_bit_for_bit():
    model = _tiny()
    inputs = memkit.make_inputs(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    classes = {name: type(m) for name, m in model.named_modules()}
    with torch.no_grad():
        out = model_output(model(**inputs))
    handle = memkit.FSDP(world_size=2).apply(model)
    assert dist.is_initialized() and type(model).__name__.startswith("FSDP")
    Step(optimizer="adamw").bind(model, handle).run(inputs)  # changes the shards, never the originals
    handle.remove()
    assert not dist.is_initialized()
    assert {name: type(m) for name, m in model.named_modules()} == classes
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model_output(model(**inputs)), out)
    memkit.FSDP(world_size=2).apply(model).remove()  # FSDP accepts the model again


# ---- torch's FSDPMemTracker -------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2])
def test_agrees_with_torch_fsdp_mem_tracker(n):
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    model = _tiny()
    inputs = memkit.make_inputs(model)
    with memkit.FSDP(world_size=n).apply(model) as handle:
        runner = Step(optimizer="adamw").bind(model, handle)
        runner.run(inputs)
        fmt = FSDPMemTracker(model, runner.optimizer)
        fmt.track_inputs(tuple(inputs.values()))
        with fmt, track(inputs=inputs, **runner.tracked_objects()) as tl:  # both watch the very same step
            runner.run(inputs)
        cpu = torch.device("cpu")
        theirs = {str(k).split(".")[-1]: v for k, v in fmt.get_tracker_snapshot("peak")[cpu].items()}
        end = {str(k).split(".")[-1]: v for k, v in fmt.get_tracker_snapshot("current")[cpu].items()}
    ours = tl.peak_by_category()
    # the persistent shards, to the byte, at the peak and after the step
    assert ours["parameter"] == theirs.get("SHARDED_PARAM", 0)
    assert ours["gradient"] == theirs.get("SHARDED_GRAD", 0)
    assert ours["optimizer_state"] == theirs.get("OPT", 0)
    assert ours["unsharded_parameter"] == theirs.get("UNSHARDED_PARAM", 0)
    assert _end(tl)["parameter"] == end["SHARDED_PARAM"] and _end(tl)["optimizer_state"] == end["OPT"]
    assert tl.end_bytes == end["Total"]
    if n > 1:  # FSDPMemTracker names buffers by the collective they feed; at N=1 FSDP issues none (its TEMP)
        assert ours["collective"] == theirs.get("ALL_GATHER", 0) + theirs.get("REDUCE_SCATTER", 0)
    # the transient rest, and so the peak (no kernel-internal buffers on these fp32 CPU ops for memkit to add)
    rest = ours["activation"] + ours["temporary"] + (0 if n > 1 else ours["collective"])
    assert rest == theirs.get("ACT", 0) + theirs.get("TEMP", 0)
    assert tl.peak_bytes == theirs["Total"]


@pytest.mark.parametrize("n", [2, 8])
def test_the_local_shard_optimizer_is_the_dtensor_optimizer_byte_for_byte(n):
    # An estimate steps the optimizer on the local shards (DTensor's foreach dispatch is O(N^2) in torch 2.13);
    # the real run below steps torch's AdamW on the DTensors, foreach as on CUDA: the same timeline.
    step = Step(optimizer="adamw", steps=2, foreach=True)
    fake = estimate_cpu(PRESET, size="tiny", step=step, parallel=memkit.FSDP(world_size=n))
    model = _tiny()
    inputs = memkit.make_inputs(model)
    with memkit.FSDP(world_size=n).apply(model) as handle:
        runner = step.bind(model, handle)
        assert all(
            isinstance(p, torch.distributed.tensor.DTensor) for g in runner.optimizer.param_groups for p in g["params"]
        )
        runner.run(inputs)
        with track(inputs=inputs, **runner.tracked_objects()) as real:
            runner.run(inputs)
    assert fake.peak_bytes == real.peak_bytes
    assert fake.peak_by_category() == real.peak_by_category()
    assert len(fake) == len(real)
    optimizer = real.to_pandas().query("phase == 'optimizer'")
    assert optimizer["op"].str.contains("_foreach_").any()  # the foreach path ran


# ---- what the tracker learned for FSDP, on its own -------------------------------------------------------------
def test_a_storage_resized_in_place_is_a_free_then_an_allocation_in_its_category():
    x = torch.zeros(1000)
    with track(inputs={"x": x}) as tl:
        x.untyped_storage().resize_(0)  # how FSDP frees an unsharded parameter
        x.untyped_storage().resize_(4000)  # and gathers it again
    live = tl.live_by_category()["input"]
    assert tl.baseline_by_category["input"] == 4000
    assert list(live) == [0, 4000]  # one free, one allocation, both "input"


def test_a_dtensor_counts_its_local_shard_and_its_ops_their_local_outputs():
    from torch.distributed.tensor import Shard, distribute_tensor

    with memkit.parallel.fake_process_group(4) as mesh:
        dt = distribute_tensor(torch.zeros(64, 8), mesh, [Shard(0)])
        with track(inputs={"dt": dt}) as tl:
            y = dt * 2
        assert tl.baseline_by_category["input"] == 16 * 8 * 4  # rank 0's 16 rows, not the global 64
        allocated = tl.to_pandas().query("action == 'alloc'")["bytes"]
        assert allocated.max() == 16 * 8 * 4  # the local product (beside it, at most the CPU kernel's scratch)
        del y
    assert not dist.is_initialized()


@pytest.mark.slow
def test_a_checkpointing_budget_is_planned_for_the_sharded_step():
    fsdp = memkit.FSDP(world_size=2)

    def peak(pattern: str) -> int:
        ckpt = [memkit.Checkpointing(pattern=pattern)]
        return estimate_cpu(PRESET, size="tiny", optimizations=ckpt, parallel=fsdp).peak_bytes

    none, every = peak("none"), peak("all")
    assert every < none
    budget = (none + every) // 2
    tl = estimate_cpu(PRESET, size="tiny", optimizations=[memkit.Checkpointing(budget_bytes=budget)], parallel=fsdp)
    assert tl.peak_bytes <= budget and tl.meta["parallel"] == "fsdp:2"
    assert tl.meta["checkpoint_plans"]


def test_the_gathered_tensors_of_a_group_include_a_subclass_parameter_s_inner_tensors():
    """FSDP2 keeps a gathered parameter in ``all_gather_outputs`` and, for a tensor-subclass parameter with its own
    all-gather hooks (float8 training), the subclass's inner tensors in ``_unsharded_inner_tensors``: both are
    the unsharded memory memkit tags. (Read from torch 2.13's FSDPParam; a stand-in group, as the CPU build has no
    such subclass to shard.)"""
    from types import SimpleNamespace

    from memkit.memory import fsdp as fsdp_module

    a, b, c, d = (torch.zeros(2) for _ in range(4))
    plain = SimpleNamespace(all_gather_outputs=[a])  # a plain parameter: no inner tensors attribute at all
    subclass = SimpleNamespace(all_gather_outputs=[b], _unsharded_inner_tensors=[c, d])
    got = fsdp_module._unsharded_tensors(SimpleNamespace(fsdp_params=[plain, subclass]))
    assert [id(t) for t in got] == [id(t) for t in (a, b, c, d)]


def test_instrument_wraps_fsdp2_s_internals_restores_them_and_warns_where_torch_has_none(monkeypatch):
    import builtins
    import warnings

    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from memkit.memory import fsdp as fsdp_module

    # every allocator FSDP2 may get its all-gather and reduce-scatter buffers from: the default one (the fake CPU
    # group's), a process group's own (NCCL's) and symmetric memory's
    mixins = [getattr(collectives, n) for n in ("DefaultAllocMixin", "ProcessGroupAllocMixin", "SymmMemAllocMixin")]
    places = [(FSDPParam, "all_gather_inputs"), (FSDPParamGroup, "wait_for_unshard")]
    places += [(cls, "allocate") for cls in mixins]
    originals = [vars(cls)[name] for cls, name in places]
    fsdp_module.instrument(True)
    try:
        assert all(vars(cls)[name] is not original for (cls, name), original in zip(places, originals, strict=True))
    finally:
        fsdp_module.instrument(False)
    assert all(vars(cls)[name] is original for (cls, name), original in zip(places, originals, strict=True))

    real_import = builtins.__import__

    def no_fsdp2(name, *args, **kwargs):  # a torch without FSDP2's private modules
        if name.startswith("torch.distributed.fsdp._fully_shard"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_fsdp2)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        fsdp_module.instrument(True)
    monkeypatch.undo()
    assert not fsdp_module._saved  # nothing wrapped
    # pointed at the caller (under mutation testing, mutmut's trampoline calls it)
    assert len(said) == 1 and (said[0].filename == __file__ or "/mutmut/" in said[0].filename)
    assert "FSDP2's buffers cannot be categorized with this torch" in str(said[0].message)
    assert "_fully_shard" in str(said[0].message)  # the import error, named


@pytest.mark.slow  # several seconds: `make test` and CI run it, the edit-test loop (make test-fast) leaves it out
def test_dit_shards_the_embedding_its_forward_calls_after_the_blocks():
    # DiT takes the output's conditioning from transformer_blocks[0].norm1.emb after every block ran: sharded with
    # block 0 alone, that call fails ("got mixed torch.Tensor and DTensor"); as its own unit it is gathered there
    one, two = (memkit.estimate("dit", size="tiny", progress=False, parallel=memkit.FSDP(world_size=n)) for n in (1, 2))
    params = [tl.baseline_by_category["parameter"] for tl in (one, two)]
    assert params[1] < params[0] < 2 * params[1] + 4096  # halved, up to each unit's 512-byte rounding
    assert two.peak_bytes < one.peak_bytes
