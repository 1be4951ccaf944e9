"""The optimizations, one file each, and the one registry that the command line, the report and the widgets
are built from.

An optimization is a keyword-only frozen dataclass (its fields are the settings, each with a docstring) whose
``apply(model)`` returns a :class:`memkit.Handle`. The registry maps its name to a :class:`Spec`: the class,
one line on what it saves and costs, the values a user picks from (``"all"``, ``"every:2"``...) and how such a
string becomes a config. Strings are parsed only at the boundary (CLI flags, widget menus, ``parse``); the
library passes config objects around.

A new optimization goes in ``memkit/optimizations/<name>.py`` with one ``register(Spec(...))`` line below; the
CLI flag ``--<name>``, the Playground's panel, the ``memkit report`` variants and the shared tests (apply, step,
remove: the model is bit-identical) then pick it up. Sharding is an entry too (``fsdp``: :class:`memkit.FSDP`, in
``memkit/parallel.py``), one that only estimates take (``Spec.estimate_only``).

Example:
    >>> from memkit.optimizations import REGISTRY, parse
    >>> list(REGISTRY)      # ['quantize', 'lora', 'checkpointing', 'ff-split', 'fsdp', 'ema', 'offload']
    >>> parse("checkpointing:all")          # Checkpointing(pattern='all')
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from types import MappingProxyType
from typing import Literal

from ..handle import Optimization
from .checkpointing import PROVIDERS, Checkpointing

__all__ = ["REGISTRY", "Checkpointing", "LoRA", "Quantize", "Spec", "parse", "register", "spec_of"]


@dataclass(frozen=True, kw_only=True)
class Spec:
    """How the rest of memkit knows one optimization: its name, class, trade-off and the values to pick from.

    Example:
        >>> spec = memkit.optimizations.REGISTRY["checkpointing"]
        >>> spec.summary, spec.choices, spec.parse("all")
    """

    name: str
    """One name everywhere: the CLI flag ``--<name>``, the prefix of ``str(config)`` (``"checkpointing:all"``),
    the handle's name and the widget panel's title."""
    config: type
    """The config dataclass; ``config.parse(value)`` builds one from a value string."""
    summary: str
    """One line: what it saves and what it costs (CLI help, widget tooltip, report)."""
    metavar: str
    """What the value is called in ``--help`` (``"PATTERN"``)."""
    choices: tuple[str, ...]
    """Values a menu offers, the default first; ``parse`` may accept more (e.g. any ``every:N``)."""
    report: tuple[str, ...] = ()
    """Values ``memkit report`` compares against the baseline, one variant each."""
    panel: tuple[str, ...] = ()
    """The config's fields a widget panel shows, in this order (the others keep their defaults); empty: every
    field whose type a panel can edit (``bool``, ``int``, ``float``, ``str``, ``Literal[...]``, a dtype, each
    optionally ``| None``)."""
    field_choices: Mapping[str, tuple] = field(default_factory=dict, hash=False)
    """Values a panel offers for a field whose type does not list them: a menu for a plain ``str`` field
    (``provider``), suggestions beside free text for a field that takes more than its string forms
    (``pattern``: ``"every:3"`` or a tuple of indices)."""
    section: Literal["optimizations", "fine-tuning"] = "optimizations"
    """Where the Playground lays out its panel: with the memory optimizations, or in the "Fine-tuning" section
    beside the training recipe (optimizer, grad accum, mixed precision, fused backward): what changes what is
    trained (LoRA) rather than how the same training is run."""
    estimate_only: str = ""
    """Why only estimates take it (:func:`memkit.estimate`, the Playground's Estimate), when they alone do:
    :func:`memkit.compare` and the Playground's Run refuse it with this reason, and its panel says so. Empty: real
    runs take it too."""

    def __post_init__(self) -> None:
        if self.section not in ("optimizations", "fine-tuning"):
            raise ValueError(f"section must be 'optimizations' or 'fine-tuning', got {self.section!r}")
        choices = MappingProxyType({k: tuple(v) for k, v in self.field_choices.items()})
        object.__setattr__(self, "field_choices", choices)

    def parse(self, value: str) -> Optimization:
        """The config ``value`` names; a ValueError names the value and what is allowed."""
        if not isinstance(value, str) or not value:
            raise ValueError(f"{self.name} needs a value, one of {list(self.choices)}, got {value!r}")
        return self.config.parse(value)

    @property
    def default(self) -> Optimization:
        """The config of the default choice."""
        return self.parse(self.choices[0])


_REGISTRY: dict[str, Spec] = {}
REGISTRY: Mapping[str, Spec] = MappingProxyType(_REGISTRY)
"""Name -> :class:`Spec`, in the order optimizations compose when several are applied."""


def register(spec: Spec) -> Spec:
    """Add an optimization to the registry (its name must be new and a lowercase word with dashes).

    Example:
        >>> register(Spec(name="freeze", config=Freeze, summary="...", metavar="WHICH", choices=("all",)))
    """
    if not isinstance(spec, Spec):
        raise TypeError(f"spec must be a memkit.optimizations.Spec, got {type(spec).__name__}")
    if not spec.name or not spec.name.replace("-", "").isalpha() or not spec.name.islower():
        raise ValueError(f"spec.name must be a lowercase word (dashes allowed), got {spec.name!r}")
    if spec.name in _REGISTRY:
        raise ValueError(f"an optimization named {spec.name!r} is registered already")
    if not spec.choices:
        raise ValueError(f"spec.choices must name at least one value for {spec.name!r}")
    if spec.estimate_only and spec.report:
        raise ValueError(f"spec.report must be empty for {spec.name!r}: memkit report compares real runs")
    if is_dataclass(spec.config):
        names = [f.name for f in fields(spec.config)]
        for what, listed in (("panel", spec.panel), ("field_choices", tuple(spec.field_choices))):
            unknown = [n for n in listed if n not in names]
            if unknown:
                raise ValueError(f"spec.{what} names {unknown}, not fields of {spec.config.__name__}: {names}")
    _REGISTRY[spec.name] = spec
    return spec


def spec_of(optimization: object) -> Spec | None:
    """The registry entry whose config ``optimization`` is, or None.

    Example:
        >>> spec_of(memkit.FSDP(world_size=8)).estimate_only    # why compare refuses it
    """
    return next((s for s in _REGISTRY.values() if isinstance(optimization, s.config)), None)


def parse(text: str) -> Optimization:
    """The optimization a string names: ``"name:value"``, or ``"name"`` for its default.

    Example:
        >>> parse("checkpointing:all")
        Checkpointing(pattern='all')
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a string such as 'checkpointing:all', got {type(text).__name__}")
    name, _, value = text.partition(":")
    spec = _REGISTRY.get(name)
    if spec is None:
        raise ValueError(f"unknown optimization {name!r}; registered: {', '.join(_REGISTRY)}")
    return spec.parse(value) if value else spec.default


from .quantization import Quantize  # noqa: E402

register(
    Spec(
        name="quantize",
        config=Quantize,
        summary="store the frozen base's linear weights quantized with the library that does it (bitsandbytes "
        "nf4/fp4 4-bit: ~0.56 bytes per weight, nf4-dq ~0.51; LLM.int8; diffusers' fp8 layerwise casting: 1 byte) "
        "for a dequantizing cast per layer in every forward and backward; the weights stop training: add --lora "
        "(QLoRA)",
        metavar="METHOD[:compute=DTYPE][:e5m2]",
        choices=("nf4", "nf4-dq", "fp4", "int8", "int8wo", "float8wo", "fp8-storage"),
        panel=("method", "compute_dtype", "fp8"),
        section="fine-tuning",
    )
)

from .lora import LoRA  # noqa: E402

register(
    Spec(
        name="lora",
        config=LoRA,
        summary="freeze the base model and train peft's low-rank adapters beside the attention (and, per family, "
        "feed-forward) projections: the base keeps no gradients and no optimizer state (AdamW fp32: 12 of 16 "
        "bytes per parameter gone), the adapters' are small; activations stay; 'dora' adds a weight-sized "
        "temporary per adapted layer",
        metavar="RANK[:alpha=A][:targets=a,b,c][:dora]",
        choices=("16", "4", "64", "16:dora"),
        report=("16",),
        panel=("rank", "alpha", "dropout", "init", "dora", "dtype"),
        section="fine-tuning",
    )
)

register(
    Spec(
        name="checkpointing",
        config=Checkpointing,
        summary="recompute chosen blocks' activations in the backward instead of storing them: 'all' drops "
        "activation memory to about one block's worth for ~20-35% more step time, 'every:N' trades part of it; "
        "'@selective' keeps matmul/attention outputs, '@offload' keeps the blocks' inputs in CPU memory; nothing in "
        "inference",
        metavar="PATTERN[@PROVIDER]",
        choices=("all", "every:2", "every:4", "skip-every:4", "all@selective", "all@offload", "none"),
        report=("all", "every:2"),
        panel=("pattern", "provider", "budget_bytes"),
        field_choices={
            "pattern": ("all", "none", "every:2", "every:4", "skip-every:2", "first:1", "last:1"),
            "provider": PROVIDERS,
        },
    )
)

from .feedforward import FFSplit  # noqa: E402

register(
    Spec(
        name="ff-split",
        config=FFSplit,
        summary="run each feed-forward layer's inner dimension in N sequential chunks: its 4x-8x intermediate "
        "drops ~N-fold (inference; training via recompute, +17-22% of the layer's FLOPs); weights untouched",
        metavar="SPLITS[:MODE]",
        choices=("4", "2", "8"),
        report=("4",),
        panel=("splits", "mode", "recompute"),
    )
)

from ..parallel import FSDP  # noqa: E402

register(
    Spec(
        name="fsdp",
        config=FSDP,
        summary="shard parameters, gradients and optimizer state over N GPUs (torch's FSDP2 on a fake process "
        "group: the memory of rank 0): AdamW on fp32 drops from 16 to 16/N bytes per parameter, plus the gathered "
        "parameters of the blocks running and the communication buffers; 'cpu-offload' moves the shards to CPU "
        "memory; activations untouched; estimates only",
        metavar="N[,keep-unsharded][,DTYPE][,cpu-offload]",
        choices=("8", "2", "4", "8,bfloat16", "8,keep-unsharded", "8,cpu-offload"),
        panel=("world_size", "reshard_after_forward", "mixed_precision", "cpu_offload"),
        estimate_only="rank 0 holds only its shard of the values, so outputs and gradients cannot be compared "
        "with the unsharded model's (its memory is the estimate's)",
    )
)

from .ema import EMA  # noqa: E402

register(
    Spec(
        name="ema",
        config=EMA,
        summary="keep an exponential moving average of the weights: one more copy of the parameters (category "
        "ema) on the device, or in CPU memory with offload/cpu_only; one in-place pass over memory per update",
        metavar="MODE[:every=N]",
        choices=("device", "offload", "cpu_only"),
        report=("device", "cpu_only"),
        panel=("mode", "foreach", "update_every", "decay", "dtype"),
    )
)

from .offload import Offload  # noqa: E402

register(
    Spec(
        name="offload",
        config=Offload,
        summary="keep the weights on disk ('disk', a safetensors file per group) or in CPU memory ('cpu', for a "
        "model on CUDA) except the groups in use and those prefetched: block weights drop to ~(1 + prefetch)/N of "
        "N blocks, for one read of every group per forward (and backward); the optimizer step onloads all",
        metavar="TO[:GROUP][:blocks=N][:prefetch=N]",
        choices=("disk", "cpu", "disk:leaf", "disk:prefetch=0", "disk:blocks=2"),
        report=("disk",),
        panel=("to", "group", "blocks_per_group", "prefetch"),
    )
)
