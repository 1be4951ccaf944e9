"""The EMA averager (:class:`EMAState`): the shadows, the schedule, the update and the diffusers-compatible
state (``state_dict``, ``save_pretrained``); :class:`memkit.EMA` is its config.

Example:
    >>> ema = EMAState(model.parameters(), decay=0.999)     # like diffusers' EMAModel(...)
    >>> ema.step(model.parameters())
    >>> with ema.swapped_into(model): evaluate(model)
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from ..memory.placement import note_host_memory, noted_in_host, planned_device
from ..memory.recording import phase
from ._common import warn_once as _warn_once
from ._ema_update import _lerp, _local
from .offload import onloaded

if TYPE_CHECKING:
    from .ema import EMA

__all__ = ["EMAState"]


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
        from .ema import EMA  # the config's module imports this one

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
        on_host = host and not planned
        # an accelerator's allocator rounds each block to 512 bytes: each shadow's view starts on such a boundary,
        # so the one buffer takes the bytes separate shadows took (on the CPU nothing is rounded, nothing padded)
        align = 512 if not host and (self.device.type == "cuda" or planned) else 1
        with torch.no_grad(), onloaded(originals):  # an offloaded model's real weights, not its placeholders
            self.shadow_params: list[torch.Tensor] = _flat_shadows(
                [p.detach() for p in originals], on_host, cfg.dtype, self._pin, align
            )
        if host or beside_host:
            note_host_memory("ema", self.shadow_params)  # only in an estimate for "cuda"
        self.optimization_step = 0
        self.cur_decay_value: float | None = None
        self.temp_stored_params: list[torch.Tensor] | None = None
        self._calls = 0
        self._local: tuple[list[torch.Tensor], torch.device, list[bool | None]] | None = None
        # per shadow, how many of the model's tensors it stands for (None: one each): the staging buffers are sized
        # by the staged elements' total, and a memoized estimate's probe (memkit._memo), whose third block stands for
        # every middle block of the full model, sets it so that its buffers are the full model's
        self.stands_for: list[int] | None = None

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
        compute = self._compute_device()
        shadows = self.shadow_params
        if self._local is None or self._local[0] is not shadows or self._local[1] != compute:
            self._local = (shadows, compute, _local(shadows, compute, self._stream))  # once per shadows and device
        with phase("ema"), onloaded(params):
            _lerp(
                shadows, params, 1.0 - decay, compute, self.config, self._pin, self._stream, self._local[2],
                self.stands_for,
            )  # fmt: skip
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
        split = split_torch_state_dict_into_shards(  # sized on meta stand-ins: views of one buffer count apart
            {k: t.to("meta") for k, t in tensors.items()},
            filename_pattern="diffusion_pytorch_model{suffix}.safetensors",
            max_shard_size=max_shard_size,
        )
        for filename, keys in split.filename_to_tensors.items():
            # safetensors refuses tensors that share a storage: a shard's views of the flat shadows are copied
            shard = {k: tensors[k] if _alone(tensors[k]) else tensors[k].clone() for k in keys}
            save_file(shard, os.path.join(path, filename), metadata={"format": "pt"})
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


def _alone(t: torch.Tensor) -> bool:
    """Whether ``t`` is all of its storage (not a view into a larger buffer, such as the flat shadows)."""
    return t.untyped_storage().nbytes() == t.nbytes


def _flat_shadows(
    params: list[torch.Tensor], host: bool, dtype: torch.dtype | None, pin: bool, align_bytes: int = 1
) -> list[torch.Tensor]:
    """Copies of ``params`` (on the CPU if ``host``; floating ones in ``dtype`` if given) as views of one
    contiguous buffer per device and dtype: the update then walks one allocation (a few % faster on a CPU than
    ~140 separate ones, measured in ``bench/ema.py``), pinned once where ``pin``. Each view starts at a multiple
    of ``align_bytes`` (the padding, < ``align_bytes`` per shadow, is counted with them). A tensor subclass
    (FSDP's DTensor shards) keeps a shadow of its own kind, as a copy of it."""
    from torch._subclasses.fake_tensor import FakeTensor

    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    out: list[torch.Tensor] = [None] * len(params)  # type: ignore[list-item]  (each set below)
    for i, p in enumerate(params):
        to = dtype if (dtype is not None and p.is_floating_point()) else p.dtype
        device = torch.device("cpu") if host else p.device
        if type(p) is torch.Tensor or type(p) is FakeTensor:
            groups.setdefault((device, to), []).append(i)
        else:
            s = p.to(device=device, dtype=to, copy=True)
            out[i] = s.pin_memory() if pin else s
    for (device, to), members in groups.items():
        step = max(1, align_bytes // torch.empty((), dtype=to).element_size())
        starts, end = [], 0
        for i in members:
            starts.append(end)
            end += -(-params[i].numel() // step) * step
        flat = torch.empty(end, dtype=to, device=device, pin_memory=pin)
        for i, start in zip(members, starts, strict=True):
            view = flat[start : start + params[i].numel()].view(params[i].shape)
            view.copy_(params[i])
            out[i] = view
    return out
