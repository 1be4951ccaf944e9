"""EMA of the weights: a shadow copy that follows the model slowly, updated after every optimizer step.

The shadows cost one more copy of the parameters (category ``ema``): on the device (``mode="device"``), or in
CPU memory (``"offload"``: streamed through a bounded device buffer for the update, pinned and non-blocking
when CUDA is available; ``"cpu_only"``: parameters are copied down and the update runs on the CPU). The
update is one in-place ``torch._foreach_lerp_`` (no full temporary copy, unlike diffusers' ``EMAModel``);
tensors whose dtype or device differ from their shadow's go through a buffer of at most ``chunk_mb``.
``update_every=N`` updates on every Nth step with the decay raised to N, so the averaging horizon in steps
stays the same (the "EMA weights on CPU" write-up; diffusers PR #7685).

``EMA`` is the config (what ``compare``, ``estimate`` and the CLI take); ``EMA.apply(model)`` builds an
:class:`EMAState` (the averager, a drop-in for diffusers' ``EMAModel``) reachable as ``handle.ema``.

Example:
    >>> handle = memkit.EMA(decay=0.999).apply(model)
    >>> memkit.Step(optimizer="adamw").bind(model, handle).run(inputs)   # one step, then the EMA update
    >>> with handle.ema.swapped_into(model): validate(model)
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

import torch

from ..handle import Handle
from ..memory.placement import note_host_memory, noted_in_host, planned_device
from ..memory.tracker import phase
from ._common import warn_once as _warn_once
from .offload import onloaded

__all__ = ["EMA", "EMAState", "diffusers_check"]

_MODES = ("device", "offload", "cpu_only")
_SCHEDULES = ("diffusers", "constant")


@dataclass(frozen=True, kw_only=True)
class EMA:
    """An exponential moving average of a model's weights, updated after each step.

    Costs one copy of the parameters (in ``dtype``) and one pass over memory per update; saves nothing: it is
    what ``mode`` moves off the accelerator that matters (``"offload"``/``"cpu_only"`` keep the whole EMA in
    CPU memory). ``str(config)`` is ``"ema:<mode>"`` (plus ``":every=N"``), what :meth:`parse` reads.

    Example:
        >>> handle = memkit.EMA(decay=0.999, mode="cpu_only", update_every=4).apply(model)
        >>> for _ in range(8): runner.run(inputs)      # runner = memkit.Step(...).bind(model, handle)
        >>> handle.ema.copy_to(model)
    """

    decay: float = 0.9999
    """The largest decay (diffusers' ``decay``); with ``schedule="constant"`` the decay of every update."""
    mode: Literal["device", "offload", "cpu_only"] = "device"
    """Where the shadows live and where the update runs: ``"device"`` (beside the parameters), ``"offload"``
    (CPU memory, streamed through a device buffer of ``chunk_mb``), ``"cpu_only"`` (CPU memory, the update on
    the CPU). On a CPU-only machine all three keep the shadows in CPU memory and compute alike."""
    foreach: bool = True
    """``torch._foreach_lerp_`` over all tensors (fewer kernel launches); False: a per-tensor loop. Same shadows."""
    update_every: int = 1
    """Update on every Nth step only, with the decay raised to the Nth power (the same horizon in steps)."""
    schedule: Literal["diffusers", "constant"] = "diffusers"
    """``"diffusers"``: diffusers ``EMAModel``'s ``min(decay, (1+t)/(10+t))`` (or its warmup), clamped below by
    ``min_decay``; ``"constant"``: exactly ``decay`` on every update after ``update_after_step``."""
    min_decay: float = 0.0
    """The smallest decay of the diffusers schedule."""
    update_after_step: int = 0
    """Steps before averaging starts; until then the shadows copy the parameters."""
    use_ema_warmup: bool = False
    """diffusers' warmup: ``1 - (1 + t / inv_gamma) ** -power`` instead of ``(1+t)/(10+t)``."""
    inv_gamma: float = 1.0
    """Warmup: inverse multiplicative factor (diffusers' default 1)."""
    power: float = 2 / 3
    """Warmup: exponent (diffusers' default 2/3)."""
    dtype: torch.dtype | None = None
    """Shadow dtype for floating parameters; None: each parameter's own (e.g. ``torch.float32`` for a bf16 model)."""
    chunk_mb: float = 32.0
    """Bound of the staging buffer (MiB) for tensors whose dtype or device differs from their shadow's; the
    buffer is also at most 1/64 of those shadows' bytes (at least 64 Ki elements)."""

    def __post_init__(self) -> None:
        if not isinstance(self.decay, (int, float)) or not 0.0 <= self.decay <= 1.0:
            raise ValueError(f"decay must be in [0, 1], got {self.decay!r}")
        if self.mode not in _MODES:
            raise ValueError(f"mode must be one of {list(_MODES)}, got {self.mode!r}")
        if not isinstance(self.update_every, int) or isinstance(self.update_every, bool) or self.update_every < 1:
            raise ValueError(f"update_every must be an int >= 1, got {self.update_every!r}")
        if self.schedule not in _SCHEDULES:
            raise ValueError(f"schedule must be one of {list(_SCHEDULES)}, got {self.schedule!r}")
        if not 0.0 <= self.min_decay <= 1.0:
            raise ValueError(f"min_decay must be in [0, 1], got {self.min_decay!r}")
        if not isinstance(self.update_after_step, int) or self.update_after_step < 0:
            raise ValueError(f"update_after_step must be an int >= 0, got {self.update_after_step!r}")
        if self.foreach not in (True, False):
            raise ValueError(f"foreach must be True or False, got {self.foreach!r}")
        if self.dtype is not None and not (isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point):
            raise ValueError(f"dtype must be a floating torch.dtype or None, got {self.dtype!r}")
        if not self.chunk_mb > 0:
            raise ValueError(f"chunk_mb must be > 0, got {self.chunk_mb!r}")

    def build(self, parameters: torch.nn.Module | Iterable[torch.Tensor]) -> EMAState:
        """The averager for ``parameters`` (or a model's), shadows created now; no handle, no hooks.

        Example:
            >>> ema = memkit.EMA(decay=0.999).build(model)
            >>> ema.step(model, step=1)
        """
        return EMAState(parameters, config=self)

    def apply(self, model: torch.nn.Module) -> Handle:
        """Create the shadows; the handle updates them after each step and owns them (category ``ema``).

        The model itself is not changed; ``remove()`` drops the shadows. ``handle.ema`` is the :class:`EMAState`.

        Example:
            >>> with memkit.EMA(mode="offload").apply(model) as handle:
            ...     memkit.Step(optimizer="adamw").bind(model, handle).run(inputs)
            >>> handle.ema.shadow_params   # still readable after remove()
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        state = self.build(model)
        handle = Handle(
            lambda: None,
            name=str(self),
            owned=lambda: {"ema": state.shadow_params},
            after_step=lambda: state.step(model),
        )
        handle.ema = state
        return handle

    @classmethod
    def parse(cls, value: str) -> EMA:
        """The config a command-line or widget value names: ``"<mode>"`` or ``"<mode>:every=N"``.

        Example:
            >>> memkit.EMA.parse("cpu_only:every=4")
            EMA(decay=0.9999, mode='cpu_only', ..., update_every=4, ...)
        """
        mode, _, rest = value.partition(":")
        if not rest:
            return cls(mode=mode)
        key, _, number = rest.partition("=")
        if key != "every" or not number.isdigit():
            raise ValueError(f"ema value must be '<mode>' or '<mode>:every=N' (N an int >= 1), got {value!r}")
        return cls(mode=mode, update_every=int(number))

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, *, model: torch.nn.Module | None = None, **overrides: Any
    ) -> EMAState:
        """An averager read from a folder written by :meth:`EMAState.save_pretrained` (or diffusers'
        ``EMAModel.save_pretrained``): shadows from the safetensors weights, settings from ``config.json``.

        ``model`` gives the parameters' order (their names); a folder memkit wrote records it, one diffusers
        wrote does not (its weights file also holds buffers), so pass the model for those.

        Example:
            >>> ema = memkit.EMA.from_pretrained("out/ema")
            >>> ema = memkit.EMA.from_pretrained("diffusers-ema", model=transformer)
            >>> ema.copy_to(model)
        """
        from safetensors.torch import load_file

        path = os.fspath(path)
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"path {path!r} holds no .safetensors file")
        tensors: dict[str, torch.Tensor] = {}
        for name in files:
            tensors.update(load_file(os.path.join(path, name)))
        if model is not None:
            names = [n for n, _ in model.named_parameters()]
        elif "_memkit_parameter_names" in config:
            names = config["_memkit_parameter_names"]
        else:
            raise ValueError(
                f"path {path!r} does not record the parameters' order (not written by memkit): pass model=, "
                "the model whose parameters the shadows follow"
            )
        missing = [n for n in names if n not in tensors]
        if missing:
            raise ValueError(
                f"path {path!r} holds no weights for {missing[:5]} ({len(missing)} missing): another model"
            )
        settings = {f.name: config[f.name] for f in fields(cls) if f.name in config and f.name not in ("dtype",)}
        state = EMAState([tensors[n] for n in names], config=cls(**{**settings, **overrides}))
        state.names = list(names)
        state.optimization_step = int(config.get("optimization_step", 0))
        return state

    def __str__(self) -> str:
        return f"ema:{self.mode}" + (f":every={self.update_every}" if self.update_every != 1 else "")


class EMAState:
    """The averager: shadows of a model's parameters and the update, a drop-in for diffusers' ``EMAModel``.

    The same schedule, ``shadow_params`` list and ``state_dict()`` keys as ``EMAModel``; ``step(model,
    step=global_step)`` can take the training step so the decay never silently restarts at step 0.

    Args:
        parameters: a model or its parameters, all on one device.
        config: the :class:`EMA` settings; or pass them as keywords (``decay=0.999, ...``).

    Example:
        >>> ema = EMAState(model.parameters(), decay=0.999)     # like diffusers' EMAModel(...)
        >>> ema.step(model.parameters())
        >>> with ema.swapped_into(model): evaluate(model)
    """

    def __init__(
        self,
        parameters: torch.nn.Module | Iterable[torch.Tensor],
        *,
        config: EMA | None = None,
        **settings: Any,
    ) -> None:
        self.config = replace(config or EMA(), **settings) if settings else (config or EMA())
        self.names: list[str] | None = None
        self._model_config: dict[str, Any] | None = None  # a diffusers model's config.json, for save_pretrained
        self._buffers: dict[str, torch.Tensor] = {}  # its persistent buffers (references), for save_pretrained
        if isinstance(parameters, torch.nn.Module):
            self.names = [n for n, _ in parameters.named_parameters()]
            if callable(getattr(parameters, "save_config", None)) and hasattr(parameters, "config"):
                self._model_config = _diffusers_config(parameters)
                names = set(self.names)
                self._buffers = {n: b for n, b in parameters.state_dict(keep_vars=True).items() if n not in names}
            parameters = parameters.parameters()
        originals = list(parameters)
        params = [p.detach() for p in originals]
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(
                f"parameters must all be on one device, got {sorted(map(str, devices))}; apply one EMA per device"
            )
        self.device = devices.pop() if devices else torch.device("cpu")
        cfg = self.config
        # In an estimate for "cuda" the fake CPU parameters stand for device ones and the shadows for host memory
        planned = self.device.type == "cpu" and planned_device() == "cuda"
        # parameters an estimate noted in host memory (FSDP's CPU-offloaded shards) are CPU tensors on the GPU
        # machine too: the EMA is what it is on CPU parameters, its shadows beside them in host memory
        beside_host = planned and noted_in_host(originals)
        planned = planned and not beside_host
        host = cfg.mode != "device" and (self.device.type != "cpu" or planned)
        self._pin = host and cfg.mode == "offload" and torch.cuda.is_available() and self.device.type == "cuda"
        self._stream = host and cfg.mode == "offload"  # every update streams the shadows through a device buffer
        if cfg.mode != "device" and not self._pin and not planned:
            _warn_once(
                f"EMA mode={cfg.mode!r}: shadows in CPU memory, unpinned"
                + (" (parameters are on the CPU already)" if self.device.type == "cpu" else " (pinning needs CUDA)")
            )
        with torch.no_grad(), onloaded(originals):  # an offloaded model's real weights, not its placeholders
            self.shadow_params: list[torch.Tensor] = [
                self._shadow_of(p.detach(), host and not planned) for p in originals
            ]
        if host or beside_host:
            note_host_memory("ema", self.shadow_params)  # only in an estimate for "cuda"
        self.optimization_step = 0
        self.cur_decay_value: float | None = None
        self.temp_stored_params: list[torch.Tensor] | None = None
        self._calls = 0

    def _shadow_of(self, p: torch.Tensor, host: bool) -> torch.Tensor:
        dtype = self.config.dtype if (self.config.dtype is not None and p.is_floating_point()) else p.dtype
        s = p.to(device="cpu" if host else p.device, dtype=dtype, copy=True)
        return s.pin_memory() if self._pin else s

    # -- the schedule ---------------------------------------------------------------------------------
    def get_decay(self, optimization_step: int) -> float:
        """The decay of the update at ``optimization_step`` (diffusers' ``EMAModel.get_decay``, or constant).

        Example:
            >>> EMAState(model, decay=0.999).get_decay(1)   # 0.0: the first update copies the parameters
        """
        cfg = self.config
        step = max(0, optimization_step - cfg.update_after_step - 1)
        if cfg.schedule == "constant":
            return cfg.decay if optimization_step > cfg.update_after_step else 0.0
        if step <= 0:
            return 0.0
        if cfg.use_ema_warmup:
            value = 1 - (1 + step / cfg.inv_gamma) ** -cfg.power
        else:
            value = (1 + step) / (10 + step)
        return max(min(value, cfg.decay), cfg.min_decay)

    # -- the update ------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, parameters: torch.nn.Module | Iterable[torch.Tensor], *, step: int | None = None) -> bool:
        """Count one training step and, on every ``update_every``-th, move the shadows towards ``parameters``.

        ``step``: the training step this update follows, counted from 1 (diffusers' ``optimization_step``
        after its ``step()``); None counts calls. Returns True when the shadows were updated.

        Example:
            >>> for global_step in range(1, 101):
            ...     train(); ema.step(model, step=global_step)
        """
        if step is not None:
            if not isinstance(step, int) or step < 0:
                raise ValueError(f"step must be an int >= 0, got {step!r}")
            self.optimization_step = step
        else:
            self.optimization_step += 1
        n = self.config.update_every
        if self.optimization_step % n:
            return False
        params = self._params(parameters)
        decay = self.get_decay(self.optimization_step)
        self.cur_decay_value = decay = decay**n
        with phase("ema"), onloaded(params):
            _lerp(self.shadow_params, params, 1.0 - decay, self._compute_device(), self.config, self._pin, self._stream)
        return True

    def _compute_device(self) -> torch.device:
        return torch.device("cpu") if self.config.mode == "cpu_only" else self.device

    def _params(self, parameters: torch.nn.Module | Iterable[torch.Tensor]) -> list[torch.Tensor]:
        if isinstance(parameters, torch.nn.Module):
            parameters = parameters.parameters()
        params = list(parameters)
        if len(params) != len(self.shadow_params):
            raise ValueError(f"parameters has {len(params)} tensors, the EMA was built for {len(self.shadow_params)}")
        return params

    # -- using the average -----------------------------------------------------------------------------
    @torch.no_grad()
    def copy_to(self, parameters: torch.nn.Module | Iterable[torch.Tensor]) -> None:
        """Write the averaged weights into ``parameters`` (a model or its parameters).

        Example:
            >>> ema.copy_to(model); model.save_pretrained("out/ema-weights")
        """
        params = self._params(parameters)
        with onloaded(params, writes=True):
            for p, s in zip(params, self.shadow_params, strict=True):
                p.data.copy_(s, non_blocking=self._pin)

    @torch.no_grad()
    def store(self, parameters: torch.nn.Module | Iterable[torch.Tensor]) -> None:
        """Keep a CPU copy of ``parameters`` for :meth:`restore` (which then drops it: no copy stays alive).

        Example:
            >>> ema.store(model); ema.copy_to(model); validate(model); ema.restore(model)
        """
        self.temp_stored_params = [p.detach().to("cpu", copy=True) for p in self._params(parameters)]

    @torch.no_grad()
    def restore(self, parameters: torch.nn.Module | Iterable[torch.Tensor]) -> None:
        """Put back what :meth:`store` kept, and free it.

        Example:
            >>> ema.restore(model)
        """
        if self.temp_stored_params is None:
            raise RuntimeError("restore() needs a store() first: nothing is stored")
        for p, c in zip(self._params(parameters), self.temp_stored_params, strict=True):
            p.data.copy_(c)
        self.temp_stored_params = None

    @contextlib.contextmanager
    def swapped_into(self, model: torch.nn.Module | Iterable[torch.Tensor]) -> Iterator[None]:
        """Run the block with the averaged weights in ``model``; the training weights come back after.

        Example:
            >>> with ema.swapped_into(model):
            ...     images = pipeline(prompt)
        """
        params = self._params(model)
        self.store(params)
        try:
            self.copy_to(params)
            yield
        finally:
            self.restore(params)

    # -- saving and loading ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """diffusers ``EMAModel.state_dict()``'s keys (references to the shadows, not copies), plus memkit's
        settings under their own keys.

        Example:
            >>> torch.save(ema.state_dict(), "ema.pt")
        """
        cfg = self.config
        return {
            "decay": cfg.decay,
            "min_decay": cfg.min_decay,
            "optimization_step": self.optimization_step,
            "update_after_step": cfg.update_after_step,
            "use_ema_warmup": cfg.use_ema_warmup,
            "inv_gamma": cfg.inv_gamma,
            "power": cfg.power,
            "shadow_params": self.shadow_params,
            "schedule": cfg.schedule,
            "update_every": cfg.update_every,
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` or diffusers' ``EMAModel.state_dict()`` (copied into
        the existing shadows, which keep their device and dtype).

        Example:
            >>> ema.load_state_dict(torch.load("ema.pt"))
        """
        shadows = state_dict.get("shadow_params")
        if shadows is not None:
            if len(shadows) != len(self.shadow_params):
                raise ValueError(
                    f"state_dict['shadow_params'] has {len(shadows)} tensors, this EMA has "
                    f"{len(self.shadow_params)}: a state dict of another model"
                )
            for i, (s, t) in enumerate(zip(self.shadow_params, shadows, strict=True)):
                if tuple(s.shape) != tuple(t.shape):
                    raise ValueError(
                        f"state_dict['shadow_params'][{i}] has shape {tuple(t.shape)}, this EMA's is "
                        f"{tuple(s.shape)}: a state dict of another model"
                    )
        keys = ("decay", "min_decay", "update_after_step", "use_ema_warmup", "inv_gamma", "power", "schedule")
        settings = {k: state_dict[k] for k in keys + ("update_every",) if k in state_dict}
        self.config = replace(self.config, **settings)
        self.optimization_step = int(state_dict.get("optimization_step", self.optimization_step))
        if shadows is not None:
            for s, t in zip(self.shadow_params, shadows, strict=True):
                s.copy_(t)

    def save_pretrained(self, path: str | os.PathLike, *, max_shard_size: int | str = "10GB") -> None:
        """Write the shadows as safetensors shards (at most ``max_shard_size`` each) and the settings to
        ``config.json``. Built from a diffusers model, the folder is what diffusers' ``EMAModel.save_pretrained``
        writes (the model's config with the EMA settings, its weights with the shadows for the parameters and
        its persistent buffers), so ``EMAModel.from_pretrained(path, model_cls=...)`` and the model class's own
        ``from_pretrained`` load it; :meth:`EMA.from_pretrained` loads any folder this writes.

        Example:
            >>> ema.save_pretrained("out/ema", max_shard_size="2GB")
            >>> memkit.EMA.from_pretrained("out/ema")
        """
        from huggingface_hub import split_torch_state_dict_into_shards
        from safetensors.torch import save_file

        path = os.fspath(path)
        os.makedirs(path, exist_ok=True)
        names = self.names or [f"shadow_params.{i}" for i in range(len(self.shadow_params))]
        tensors = {n: s.detach().to("cpu").contiguous() for n, s in zip(names, self.shadow_params, strict=True)}
        tensors.update({n: b.detach().to("cpu").contiguous() for n, b in self._buffers.items()})
        split = split_torch_state_dict_into_shards(
            tensors, filename_pattern="diffusion_pytorch_model{suffix}.safetensors", max_shard_size=max_shard_size
        )
        for filename, keys in split.filename_to_tensors.items():
            save_file({k: tensors[k] for k in keys}, os.path.join(path, filename), metadata={"format": "pt"})
        if split.is_sharded:
            index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
            with open(os.path.join(path, "diffusion_pytorch_model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2)
        config = dict(self._model_config or {})
        config.update({k: v for k, v in self.state_dict().items() if k != "shadow_params"})
        config.update(mode=self.config.mode, foreach=self.config.foreach, chunk_mb=self.config.chunk_mb)
        config["_memkit_parameter_names"] = names
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f, indent=2)

    def __repr__(self) -> str:
        return f"EMAState({self.config}, tensors={len(self.shadow_params)}, step={self.optimization_step})"


def _diffusers_config(model: torch.nn.Module) -> dict[str, Any]:
    """A diffusers model's ``config.json`` content (``model.to_json_string()`` would add keys to its config)."""
    from diffusers import __version__

    config = {k: v for k, v in dict(model.config).items() if not k.startswith("_")}
    config = json.loads(json.dumps(config, default=lambda v: v.tolist() if hasattr(v, "tolist") else str(v)))
    return {"_class_name": type(model).__name__, "_diffusers_version": __version__, **config}


def _lerp(
    shadows: list[torch.Tensor],
    params: list[torch.Tensor],
    weight: float,
    compute: torch.device,
    cfg: EMA,
    non_blocking: bool,
    stream: bool = False,
) -> None:
    """shadow += weight * (param - shadow) for every pair, in place; frozen parameters are copied (as diffusers).

    Pairs whose shadow and parameter share device and dtype on ``compute`` are lerped directly (one foreach
    op, no temporary), unless ``stream`` (offload: the shadows stand for host memory). The others go through
    staging buffers of at most ``chunk_mb`` each, in flat slices.
    """
    direct_s, direct_p, staged = [], [], []
    for s, p in zip(shadows, params, strict=True):
        if not p.requires_grad or not s.is_floating_point():  # frozen or integer: copied, as diffusers does
            s.copy_(p, non_blocking=non_blocking)
        elif s.device == p.device == compute and s.dtype == p.dtype and not stream:
            direct_s.append(s)
            direct_p.append(p.detach())
        else:
            staged.append((s, p.detach()))
    if direct_s:
        if cfg.foreach:
            torch._foreach_lerp_(direct_s, direct_p, weight)
        else:
            for s, p in zip(direct_s, direct_p, strict=True):
                s.lerp_(p, weight)
    if staged:
        _lerp_staged(staged, weight, compute, cfg, non_blocking, stream)


def _lerp_staged(pairs, weight: float, compute: torch.device, cfg: EMA, non_blocking: bool, stream: bool) -> None:
    dtype = pairs[0][0].dtype
    chunk = max(1, int(cfg.chunk_mb * 2**20) // torch.empty((), dtype=dtype).element_size())
    total = sum(s.numel() for s, _ in pairs)
    size = min(chunk, max(total // 64, 2**16))  # the extra peak stays under ~1.6% of the staged shadows
    stage_s = stream or any(s.device != compute for s, _ in pairs)
    pbuf = torch.empty(size, dtype=dtype, device=compute)
    sbuf = torch.empty(size, dtype=dtype, device=compute) if stage_s else None

    def flush(group):
        if not group:
            return
        pv, sv, dst = [], [], []
        offset = 0
        for s, _ in group:
            n = s.numel()
            pv.append(pbuf[offset : offset + n])
            sv.append(sbuf[offset : offset + n] if sbuf is not None else s)
            dst.append(s)
            offset += n
        srcs = [p for _, p in group]
        if cfg.foreach:
            torch._foreach_copy_(pv, srcs, non_blocking=non_blocking)
            if sbuf is not None:
                torch._foreach_copy_(sv, dst, non_blocking=non_blocking)
            torch._foreach_lerp_(sv, pv, weight)
            if sbuf is not None:
                torch._foreach_copy_(dst, sv, non_blocking=non_blocking)
        else:
            for a, b in zip(pv, srcs, strict=True):
                a.copy_(b, non_blocking=non_blocking)
            for a, b, s in zip(sv, pv, dst, strict=True):
                if sbuf is not None:
                    a.copy_(s, non_blocking=non_blocking)
                a.lerp_(b, weight)
                if sbuf is not None:
                    s.copy_(a, non_blocking=non_blocking)

    group, used = [], 0
    for s, p in pairs:
        if s.dtype != dtype or not (s.is_contiguous() and p.is_contiguous()) or s.numel() > size:
            if s.is_contiguous() and p.is_contiguous() and s.dtype == dtype:
                flat_s, flat_p = s.view(-1), p.reshape(-1)
                for start in range(0, s.numel(), size):
                    flush([(flat_s[start : start + size], flat_p[start : start + size])])
            else:  # odd layouts or dtypes: one tensor, one temporary of its size
                s.lerp_(p.to(device=s.device, dtype=s.dtype), weight)
            continue
        if used + s.numel() > size:
            flush(group)
            group, used = [], 0
        group.append((s.view(-1), p.reshape(-1)))
        used += s.numel()
    flush(group)
    if non_blocking and compute.type == "cuda":
        torch.cuda.current_stream(compute).synchronize()  # the host copies must land before anyone reads them


def diffusers_check(
    initial: Callable[[], torch.nn.Module], **settings: Any
) -> Callable[[torch.nn.Module, Handle], dict[str, float]]:
    """A :class:`memkit.Variant` check: the variant's shadows against diffusers' ``EMAModel(**settings)`` built
    from ``initial()``'s weights and stepped once on the model after the compared step (what ``compare`` runs).

    Two columns: ``max |Δema|``, and ``Δema / Δparam``, the same difference over how far the step moved the
    parameters (one optimizer step moves them by about its learning rate, so the raw difference can never
    exceed that, right or wrong; the ratio is ~1 for an EMA that ignores its schedule, 0 for a correct one).

    Example:
        >>> check = diffusers_check(lambda: memkit.load_model("flux"), decay=0.9)
        >>> memkit.Variant(optimizations=[memkit.EMA(decay=0.9)], check=check)   # column "max |Δema|"
    """
    from diffusers.training_utils import EMAModel

    def check(model: torch.nn.Module, handle: Handle) -> dict[str, float]:
        start = initial()
        moved = max(
            (
                float((a.float() - b.float()).abs().max())
                for a, b in zip(model.parameters(), start.parameters(), strict=True)
            ),
            default=0.0,
        )
        ref = EMAModel(start.parameters(), **settings)
        ref.step(model.parameters())
        shadows = handle.owned()["ema"]
        diffs = [float((a.float() - b.float()).abs().max()) for a, b in zip(shadows, ref.shadow_params, strict=True)]
        worst = max(diffs, default=0.0)
        return {"max |Δema|": worst, "Δema / Δparam": worst / moved if moved > 0 else worst}

    return check
