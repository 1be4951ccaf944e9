"""FSDP2 on one machine: the memory of rank 0 of an N-GPU fully sharded run, with torch's own engine.

``memkit.FSDP(world_size=8)`` shards the model with ``torch.distributed.fsdp.fully_shard`` (each transformer
block, then the root) over a *fake* process group: collectives do nothing, every rank's shapes are real. On
fake tensors (``memkit.estimate(..., parallel=memkit.FSDP(...))``, or among its ``optimizations``) that is the
per-GPU timeline of a full-size model in seconds; on real tensors (``FSDP(...).apply(model)``, then
``memkit.Step`` under ``memkit.track``) the same step runs for real on CPU, so an estimate is checkable against
real storages. Values are rank 0's shard; the other ranks' data is never there, so outputs and gradients are not
those of the unsharded model (memory is).

What the categories mean under FSDP2 (see ``memkit/memory/fsdp.py`` for how the tracker knows them):
``parameter``, ``gradient`` and ``optimizer_state`` are rank 0's shards (1/N of the model each, plus padding
to a multiple of N rows); ``unsharded_parameter`` is the full parameters of the blocks all-gathered at the
moment; ``collective`` the all-gather and reduce-scatter buffers in flight. With ``cpu_offload=True`` in an
estimate for ``"cuda"`` the three sharded categories are in host memory (``timeline.meta["host_bytes"]``), and
``collective`` also holds the shards copied to the GPU for each all-gather.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from . import _torch_compat as _compat
from .handle import Handle

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = ["FSDP", "fake_process_group", "on_local_shards", "refuse_group_offload", "sharded_order", "split_parallel"]


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[Any]:
    """A CPU ``DeviceMesh`` of ``world_size`` ranks on torch's ``"fake"`` backend, this process rank 0.

    Starts the process group only if none is running (and then destroys it on exit, error or not); a running
    one must have ``world_size`` ranks. Create the mesh before entering ``FakeTensorMode``: inside, building it
    fails (``DataDependentOutputException``).

    Example:
        >>> with fake_process_group(8) as mesh:
        ...     fully_shard(model, mesh=mesh)
    """
    _compat.register_fake_backend()  # needs torch >= 2.11: a RuntimeError naming it, before anything starts
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    started = False
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise ValueError(
                f"world_size is {world_size}, but a process group of {dist.get_world_size()} ranks is already "
                "running: destroy it first or ask for its size"
            )
    else:
        dist.init_process_group("fake", rank=0, world_size=world_size, store=dist.HashStore())
        started = True
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        if started and dist.is_initialized():
            dist.destroy_process_group()


@dataclass(frozen=True, kw_only=True)
class FSDP:
    """Fully sharded data parallel (torch's FSDP2, ``fully_shard``) over ``world_size`` GPUs, seen from rank 0.

    Saves: parameters, gradients and optimizer state are split N ways (AdamW on fp32: 16 bytes per parameter
    become 16/N). Costs: each block's full parameters are all-gathered before its forward and again before its
    backward (``unsharded_parameter``, one or two blocks at a time, plus the all-gather and reduce-scatter
    buffers, ``collective``), and communication time, which memkit does not model. Does nothing for the
    activations: those are per-GPU already (checkpointing cuts them). At ``world_size=1`` it only adds the
    unsharded copies and buffers: use it to see the layout, not to save memory.

    ``cpu_offload=True`` (FSDP2's ``CPUOffloadPolicy``) moves the shards themselves to host memory: parameters,
    gradients and optimizer state leave the GPU (the optimizer steps on the CPU), which pays in PCIe traffic
    (each shard copied to the GPU before every all-gather, each gradient shard back after its reduce-scatter)
    and a CPU optimizer step. It is the offload that composes with FSDP (``memkit.Offload`` does not).

    It is the registry's ``fsdp`` entry (``memkit estimate --fsdp 8,cpu-offload``, the Playground's fsdp panel).
    In :func:`memkit.estimate` pass it as ``parallel=`` or among the ``optimizations`` (the same estimate): it is
    applied after checkpointing and the FF split (they change the blocks FSDP wraps) and before an EMA (whose
    shadows then live on the shards); on real tensors :func:`sharded_order` puts it there. It is estimate-only:
    ``compare`` (and the Playground's Run) refuses it, since rank 0 holds only its shard of the values, so
    outputs and gradients cannot be compared with the unsharded model's.

    Example:
        >>> tl = memkit.estimate("flux", optimizer="adamw", parallel=memkit.FSDP(world_size=8))
        >>> tl.peak_by_category()["parameter"]          # rank 0's shard of the weights
        >>> memkit.estimate("flux", optimizations=[memkit.FSDP.parse("8,bf16")])   # the same as parallel=
        >>> with memkit.FSDP(world_size=2).apply(model) as h, memkit.track(model) as real:
        ...     memkit.Step().bind(model, h).run(inputs)          # the same, for real on CPU
    """

    world_size: int = 8
    """GPUs the model is sharded over (rank 0's memory is measured). 1 is allowed (no sharding, FSDP's
    buffers only)."""
    reshard_after_forward: bool = True
    """Free each block's unsharded parameters after its forward and all-gather them again for its backward
    (FSDP2's default, ZeRO-3). False keeps them from forward to backward (ZeRO-2: more memory, fewer
    all-gathers). The root module keeps its own parameters unsharded until backward either way."""
    mixed_precision: torch.dtype | MixedPrecisionPolicy | None = None
    """Dtype of the unsharded parameters (all-gathered and computed in it, e.g. ``torch.bfloat16`` with fp32
    shards), with gradients reduced in float32: FSDP2's ``MixedPrecisionPolicy(param_dtype=...,
    reduce_dtype=torch.float32)``. Or a ``torch.distributed.fsdp.MixedPrecisionPolicy``, passed to
    ``fully_shard`` as given (``reduce_dtype=torch.bfloat16`` halves the reduce-scatter buffers of fp32
    gradients). None: the parameters' own dtype throughout."""
    cpu_offload: bool = False
    """Keep rank 0's parameter shards, gradient shards and optimizer state in host memory (FSDP2's
    ``CPUOffloadPolicy``): in ``estimate(device="cuda")`` they leave the GPU's timeline for
    ``timeline.meta["host_bytes"]``; the all-gathered parameters and activations stay on the GPU, an EMA's
    shadows sit beside the shards (``host_bytes["ema"]``). Host memory is
    pinned on a GPU (``pin_memory=True``); the fake process group's mesh is a CPU one, where pinning needs an
    accelerator, so it is off there (the same bytes either way). On a CPU run (``device="cpu"``, or real
    tensors) host memory is the device's: nothing moves, and FSDP only takes its offload code path."""

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or isinstance(self.world_size, bool) or self.world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {self.world_size!r}")
        if not isinstance(self.reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward must be True or False, got {self.reshard_after_forward!r}")
        if not isinstance(self.cpu_offload, bool):
            raise ValueError(f"cpu_offload must be True or False, got {self.cpu_offload!r}")
        mp = self.mixed_precision
        if (
            mp is not None
            and not isinstance(mp, _mp_policy_class())
            and (not isinstance(mp, torch.dtype) or not mp.is_floating_point)
        ):
            raise ValueError(
                "mixed_precision must be None, a floating torch.dtype (torch.bfloat16, torch.float16, "
                f"torch.float32) or a torch.distributed.fsdp.MixedPrecisionPolicy, got {mp!r}"
            )

    @classmethod
    def parse(cls, value: str) -> FSDP:
        """The config a command-line or widget value names, as ``str()`` writes it after ``fsdp:``: the world
        size, then any of ``keep-unsharded``, a dtype (mixed precision: ``bfloat16`` or ``bf16``, ``float16`` or
        ``fp16``, ``float32`` or ``fp32``; or ``param=DTYPE,reduce=DTYPE``, a policy) and ``cpu-offload``,
        comma-separated.

        Example:
            >>> memkit.FSDP.parse("8,bf16,cpu-offload")
            FSDP(world_size=8, reshard_after_forward=True, mixed_precision=torch.bfloat16, cpu_offload=True)
        """
        head, *options = (part.strip() for part in value.split(","))
        try:
            world_size = int(head)
        except ValueError:
            raise ValueError(
                f"world_size, the first part of the fsdp value N[,keep-unsharded][,DTYPE][,cpu-offload], must be a "
                f"whole number of GPUs, got {head!r} in {value!r}"
            ) from None
        kwargs: dict[str, Any] = {"world_size": world_size}
        policy: dict[str, torch.dtype | None] = {}
        for option in options:
            key, _, name = option.partition("=")
            if option == "keep-unsharded":
                kwargs["reshard_after_forward"] = False
            elif option == "cpu-offload":
                kwargs["cpu_offload"] = True
            elif option in _DTYPES:
                kwargs["mixed_precision"] = _DTYPES[option]
            elif key in ("param", "reduce") and (name in _DTYPES or name == "same"):
                policy[f"{key}_dtype"] = _DTYPES.get(name)
            else:
                raise ValueError(
                    f"fsdp value {value!r}: unknown option {option!r}; after the world size: keep-unsharded, a dtype "
                    f"({', '.join(_DTYPES)}), param=DTYPE,reduce=DTYPE, cpu-offload"
                )
        if policy:
            kwargs["mixed_precision"] = _mp_policy_class()(**policy)
        return cls(**kwargs)

    def process_group(self) -> contextlib.AbstractContextManager:
        """:func:`fake_process_group` of ``world_size`` ranks; yields the mesh :meth:`apply` takes."""
        return fake_process_group(self.world_size)

    def apply(self, model: torch.nn.Module, *, mesh: Any = None) -> Handle:
        """Shard ``model`` (each block, then the root); the handle's ``remove()`` puts back the module
        classes, hooks and original parameters, so the model is as before (the shards' updates are dropped).

        Without ``mesh`` a fake process group is started here (if none runs) and ended by ``remove()``.
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        _compat.require_torch(_compat.FSDP_MIN, "memkit.FSDP")
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        from .optimizations.offload import _owner

        if any(_owner(p) is not None for p in model.parameters()):
            raise ValueError(f"model: {_GROUP_OFFLOAD}")
        session = contextlib.ExitStack()
        if mesh is None:
            mesh = session.enter_context(self.process_group())
        saved = {m: (m.__class__, _shallow_dict(m)) for m in model.modules()}
        mp = self.mixed_precision
        if mp is None:
            mp = MixedPrecisionPolicy()
        elif isinstance(mp, torch.dtype):
            mp = MixedPrecisionPolicy(param_dtype=mp, reduce_dtype=torch.float32)
        offload = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu") if self.cpu_offload else OffloadPolicy()
        kwargs = {
            "mesh": mesh,
            "reshard_after_forward": self.reshard_after_forward,
            "mp_policy": mp,
            "offload_policy": offload,
        }
        hooks: list = []
        try:
            for path in _CALLED_OUTSIDE.get(type(model).__name__, ()):
                with contextlib.suppress(AttributeError):  # a config without it (Transformer2DModel's other norms)
                    fully_shard(model.get_submodule(path), **kwargs)
            for block in _blocks(model):
                fully_shard(block, **kwargs)
            fully_shard(model, **kwargs)
            if self.cpu_offload:
                hooks = _offload_to_host(model)
        except BaseException:
            _restore(saved)
            session.close()
            raise

        def undo() -> None:
            try:
                for h in hooks:
                    h.remove()
                _restore(saved)
            finally:
                session.close()

        return Handle(undo, name=str(self))

    def __str__(self) -> str:
        extra = "" if self.reshard_after_forward else ",keep-unsharded"
        mp = self.mixed_precision
        if isinstance(mp, torch.dtype):
            extra += f",{_dtype_name(mp)}"
        elif mp is not None:
            extra += f",param={_dtype_name(mp.param_dtype)},reduce={_dtype_name(mp.reduce_dtype)}"
        if self.cpu_offload:
            extra += ",cpu-offload"
        return f"fsdp:{self.world_size}{extra}"


_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}
"""Mixed-precision dtypes by the names :meth:`FSDP.parse` takes: torch's, and the command line's ``--dtype``'s."""


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "same" if dtype is None else str(dtype).replace("torch.", "")


def _mp_policy_class() -> type:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy


_GROUP_OFFLOAD = (
    "memkit.Offload (group offloading) and memkit.FSDP do not compose: Offload moves whole blocks' parameters on "
    "and off the device, FSDP2 replaces them by shards it gathers itself. Use FSDP's own CPU offload, "
    "parallel=memkit.FSDP(..., cpu_offload=True): the shards, their gradients and the optimizer state in host memory"
)


def refuse_group_offload(optimizations) -> None:
    """Raise the error that says why ``memkit.Offload`` or ``memkit.Quantize`` among ``optimizations`` cannot go with
    ``memkit.FSDP``."""
    from .optimizations.offload import Offload

    if any(isinstance(o, Offload) for o in optimizations):
        raise ValueError(f"optimizations: {_GROUP_OFFLOAD}")
    quantized = [o for o in optimizations if type(o).__name__ == "Quantize"]
    if quantized:
        raise ValueError(
            f"optimizations: {quantized[0]} cannot go with memkit.FSDP: FSDP2 shards each parameter as a plain "
            "DTensor, which drops bitsandbytes' quant state (and torchao's and layerwise casting's own tensors and "
            "hooks); estimate the quantized base on one GPU"
        )


def _offload_to_host(model: torch.nn.Module) -> list:
    """With CPU offload, note rank 0's shards as host memory for an estimate for ``"cuda"`` (nothing elsewhere),
    and hook each shard so that its gradient, which FSDP2 copies to the host after the reduce-scatter (a no-op
    on a CPU mesh), is a host copy while a tracker holds the shard in host memory."""
    from .memory.placement import note_host_memory
    from .memory.tracker import host_state, in_host_state

    params = [fp for m in model.modules() for fp in _fsdp_params(m)]
    note_host_memory("parameter", [fp._sharded_param_data for fp in params])  # only in an estimate for "cuda"

    def to_host(param: torch.Tensor) -> None:
        grad = param.grad
        local = _compat.local_tensor(grad)
        if local is not None and in_host_state(param) and not in_host_state(local):
            with host_state():  # the device copy (FSDP's reduce-scatter output) dies with its last view
                _compat.set_local_tensor(grad, local.clone())

    # FSDP2 runs a shard's post-accumulate-grad hooks itself once its gradient is set; these come before a
    # tracker's (registered when tracking starts), so the tracker sees the host copy. A frozen shard (a LoRA run's
    # base) gets no gradient, and torch refuses a gradient hook on it
    trainable = [fp.sharded_param for fp in params if fp.sharded_param.requires_grad]
    return [p.register_post_accumulate_grad_hook(to_host) for p in trainable]


_fsdp_params = _compat.fsdp_params


@dataclass(frozen=True)
class _Sharding:
    """``fsdp`` applied on a mesh made beforehand (an estimate makes it before entering fake mode)."""

    fsdp: FSDP
    mesh: Any

    def apply(self, model: torch.nn.Module) -> Handle:
        return self.fsdp.apply(model, mesh=self.mesh)

    def __str__(self) -> str:
        return str(self.fsdp)


def split_parallel(optimizations, parallel: FSDP | None = None) -> tuple[list, FSDP | None]:
    """``optimizations`` without the :class:`FSDP` among them, and the step's one FSDP: that one, or ``parallel``.
    A model is sharded once: two FSDPs (among the optimizations, or there and as ``parallel``) are a ValueError.

    Example:
        >>> split_parallel([memkit.Checkpointing(), memkit.FSDP(world_size=8)])
        ([Checkpointing(pattern='all', ...)], FSDP(world_size=8, ...))
    """
    rest = [o for o in optimizations if not isinstance(o, FSDP)]
    found = [o for o in optimizations if isinstance(o, FSDP)] + ([parallel] if parallel is not None else [])
    if len(found) > 1:
        raise ValueError(
            f"optimizations: a model is sharded once, got {', '.join(map(str, found))}; give one memkit.FSDP, "
            "as parallel= or among the optimizations"
        )
    return rest, (found[0] if found else None)


def sharded_order(optimizations, fsdp: FSDP, mesh: Any = None) -> list:
    """``optimizations`` with ``fsdp`` inserted where it belongs: after those that change the blocks
    (checkpointing, FF split), before an EMA (so its shadows are shards, as the optimizer's state is).

    Example:
        >>> apply_all(model, sharded_order([memkit.Checkpointing(), memkit.EMA()], memkit.FSDP(world_size=2)))
    """
    from .optimizations.ema import EMA

    optimizations = list(optimizations)
    refuse_group_offload(optimizations)
    first_ema = next((i for i, o in enumerate(optimizations) if isinstance(o, EMA)), len(optimizations))
    sharding = _Sharding(fsdp, mesh) if mesh is not None else fsdp
    return [*optimizations[:first_ema], sharding, *optimizations[first_ema:]]


def on_local_shards(optimizer: torch.optim.Optimizer | None) -> torch.optim.Optimizer | None:
    """The same optimizer over the local shards of its DTensor parameters: the ops, shapes and storages of
    the DTensor step, without DTensor's dispatch, whose sharding propagation of a foreach op over N tensors
    costs O(N²) in torch 2.13 (~80 s of a full Flux AdamW step on fake tensors, ~1 s here). FSDP2's shards
    are ``Shard(0)`` and the update is elementwise, so each DTensor op is exactly its local op
    (``tests/test_fsdp.py`` checks estimates made this way against real runs of the DTensor optimizer, to the
    byte). The shards' gradients are handed over before each step; ``zero_grad`` clears the DTensors' own.

    Example:
        >>> runner.optimizer = on_local_shards(runner.optimizer)
    """
    if optimizer is None:
        return None
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not any(isinstance(p, DTensor) for p in params):
        return optimizer
    local = {p: _compat.local_tensor(p) if isinstance(p, DTensor) else p for p in params}
    groups = [{**g, "params": [local[p] for p in g["params"]]} for g in optimizer.param_groups]
    shards = type(optimizer)(groups)  # each group carries every hyperparameter

    def hand_over(*_):
        for p, t in local.items():
            if t is not p:
                t.grad = _compat.local_tensor(p.grad) if p.grad is not None else None

    def zero_grad(set_to_none: bool = True) -> None:
        for p, t in local.items():
            if t is not p:
                t.grad = None
        optimizer.zero_grad(set_to_none=set_to_none)

    shards.register_step_pre_hook(hand_over)
    shards.zero_grad = zero_grad  # type: ignore[method-assign]
    return shards


# Submodules of a block that the model's own forward also calls outside that block: diffusers' DiT and
# Transformer2DModel take the output's conditioning from the first block's ``norm1.emb`` after every block has run
# (and resharded). Each gets its own ``fully_shard``, so it is gathered wherever it is called, as an FSDP2 user of
# these models must do (sharded with its block only, the call fails: "got mixed torch.Tensor and DTensor").
_CALLED_OUTSIDE: dict[str, tuple[str, ...]] = {
    "DiTTransformer2DModel": ("transformer_blocks.0.norm1.emb",),
    "Transformer2DModel": ("transformer_blocks.0.norm1.emb",),
}


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that get their own ``fully_shard``: the blocks checkpointing chooses from."""
    from .blocks import find_blocks

    return [b for _, b in find_blocks(model, required=False)]  # no block list: the root alone is sharded


def _shallow_dict(module: torch.nn.Module) -> dict[str, Any]:
    # The dicts FSDP changes in place (parameters, hooks) are copied; the objects they hold are not.
    return {k: (type(v)(v) if type(v) in (dict, OrderedDict) else v) for k, v in module.__dict__.items()}


def _restore(saved: dict[torch.nn.Module, tuple[type, dict[str, Any]]]) -> None:
    for module, (cls, attrs) in saved.items():
        module.__dict__.clear()
        module.__dict__.update(attrs)
        module.__class__ = cls
        _compat.forget_fsdp_state(module)
