"""Block memoization of estimates: a full-size timeline from a probe that keeps four blocks per block list.

A diffusion transformer is a few lists of identical blocks (Flux: 19 double-stream and 38 single-stream blocks),
and a fake step spends nearly all its time running them. The probe is the same model with each list cut to four
blocks, its first three and its last (a preset is built so, :func:`probe_builder`; a model from a callable is
built whole and :func:`cut`), run through the very same step under the tracker, which tags every event with the
block it happens in (:class:`memkit._memo_tagger.Tagger`):

- inside a block's forward (its module hooks; a checkpointed block's recompute included): that block;
- between two blocks of a list in the forward (the loop's own code, the next block's checkpoint bookkeeping):
  the block before, until a module outside the blocks runs; after that, outside the blocks;
- in the backward: the block whose forward made the autograd node that runs (``AccumulateGrad``: the block whose
  parameter it is);
- elsewhere (optimizer, ``zero_grad``): the block that owns the storage (a parameter's, its gradient's, its
  optimizer state's, or a storage an op made from one; a ``_foreach`` op's i-th output from its list's i-th
  element; a neighbour block's storage freed by the op that just ran for this block, in a per-parameter loop).

Why four: a middle block's events depend on its neighbours (the backward adds each block's gradient of an input
every block shares, such as the time embedding, into the sum the block after it began; the first block in the
backward, the last one, begins it). The third probe block has a middle block on both sides, in the forward and
going down in the backward (the second); it stands for every block but the first two and the last.
:mod:`memkit._splice` makes the full timeline from the tagged events.

Checkpointing some blocks and not others (``"every:N"``, ``"skip-every:N"``) makes the middle blocks of two kinds,
each one's events depending on its neighbours' kind: the probe keeps a period of N blocks where it kept one block
(the first block and two periods, a period and the last blocks: :func:`probe_length`), each block checkpointed as the
full block it is, and the splice repeats the period (:mod:`memkit._memo_period`).

Byte-equal to running every block (``estimate(..., memoize=False)``) on every preset and every supported setting
(``tests/test_memo.py``). Settings whose memory is not a sum over blocks, or whose blocks differ from one another,
run every block (:func:`unsupported` says why): offload (weights off the device), mixed precision (its cast cache of
every block freed at once), a host optimizer, checkpointing patterns whose blocks repeat in no period (a tuple of
blocks, as ``budget_bytes`` plans; a callable; ``"first:K"``, ``"last:K"``) or whose inputs wait off the device
(``provider="offload"``), a model without a list of identical middle blocks longer than its probe. FSDP is memoized:
the tagger's pre-hook runs before FSDP's, so a block's gather, reshard and the free of the gather before it are the
block's events, and FSDP's input wrapping is a node of the block; with ``cpu_offload`` (shards in host memory) it
runs every block.

An EMA is memoized in every mode (``"device"``, ``"offload"``, ``"cpu_only"``; foreach or not; any ``dtype``,
``update_every`` and ``chunk_mb``). Its shadows are per-parameter state: views of one buffer per dtype, on the
device or in host memory (each padded to 512 bytes in an estimate for ``"cuda"``), so a buffer's bytes are a sum
over parameters; the tagger gives each shadow its parameter's block, and the splice grows the buffer by what each middle
block's shadows take of the probe's (in the baseline, the allocator replay's baseline blocks and
``host_state_bytes``; :meth:`Tagger._mirror`). Its update allocates nothing but staging buffers (shadows in another
dtype than their parameters, or in host memory), filled chunk by chunk with the shadows of several blocks: no event
per chunk, only the buffers, whose size follows the staged elements' total; the probe's EMA weighs each shadow by
the blocks its block stands for (``EMAState.stands_for``), so its buffers are the full model's. Under FSDP each
shadow is a storage of its own, its block's. An estimate that also counts its ops (``count_ops``) gives each op of
the update the block of the shadow it writes (:meth:`Tagger.shadow_block`); what stays unmemoized with an EMA is
such an estimate of a staged or host update (``mode="offload"``, ``"cpu_only"`` or a ``dtype``): its copies write a
staging buffer of no block, or move several blocks' shadows at once. Where the probe's events do not fit the splice
(:class:`Unsupported`), the estimate runs every block and says why.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .memory.events import PHASE_CODE

PROBE = 4
"""Blocks the probe keeps of each list: the first three and the last. In the full model the first two and the
last are the probe's own, and every other block repeats the third, whose neighbours are middle blocks too. (A
checkpointing pattern that repeats with a period N keeps more: :func:`probe_length`.)"""

_FORWARD = PHASE_CODE["forward"]
_AGG = ("aggregate",)  # an op that reads storages of several blocks at once: its event belongs to none


class Unsupported(Exception):
    """The probe's events do not have the structure memoization relies on (the reason is the message)."""


def block_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """The ``nn.ModuleList``s of ``model`` longer than the probe whose middle elements (all but the first and the
    last) are identical blocks (same class, same parameter and buffer shapes and dtypes), outermost first, none
    inside another. The first and last block may differ (SD3's last block makes no text output).

    Example:
        >>> [(name, len(blocks)) for name, blocks in block_lists(flux)]
        [('transformer_blocks', 19), ('single_transformer_blocks', 38)]
    """
    found, inside = [], set()
    for name, module in model.named_modules():
        if id(module) in inside:
            continue
        if isinstance(module, nn.ModuleList) and len(module) > PROBE and _identical(module):
            found.append((name, module))
            inside.update(id(m) for m in module.modules())
    return found


def _signature(block: nn.Module) -> tuple:
    tensors = [*block.named_parameters(), *block.named_buffers()]
    return (type(block), tuple((n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in tensors))


def _identical(blocks: nn.ModuleList) -> bool:
    middle = _signature(blocks[1])
    return all(_signature(b) == middle for b in list(blocks)[1:-1])


def unsupported(
    optimizations: Sequence[Any], parallel: Any, step: Any = None, count_ops: bool = False, *, periodic: bool = True
) -> str | None:
    """Why an estimate with these settings runs every block, or None when it can be memoized (``count_ops``: an
    estimate that also counts its ops, or :func:`memkit.steptime.count_ops`; ``periodic=False``: a probe that cannot
    keep a checkpointing pattern's period, :func:`memkit.steptime.count_ops`' own)."""
    if step is not None and getattr(step, "mixed_precision", None) is not None:
        # autocast frees its cast cache (every block's weight copies) when the forward ends, outside the blocks
        return f"mixed_precision={step.mixed_precision!r} frees its cast cache of every block at once"
    if step is not None and getattr(step, "optimizer_on", "device") != "device":
        # one host optimizer per parameter, stepped after the backward in the order the gradients came (torchao's
        # queue), with host copies and state off the device: not a sum of identical blocks' events
        return f"optimizer_on={step.optimizer_on!r} steps one optimizer per parameter, in host memory"
    from .optimizations.checkpointing import Checkpointing
    from .optimizations.ema import EMA
    from .optimizations.feedforward import FFSplit
    from .optimizations.lora import LoRA
    from .optimizations.quantization import Quantize

    for o in optimizations:
        if isinstance(o, (FFSplit, LoRA)):  # the same adapters in every block of a list
            continue
        if isinstance(o, Quantize):  # the parameters themselves, bitsandbytes' quant states beside them in each block
            continue
        if isinstance(o, EMA):  # per-parameter shadows, their one buffer grown by the blocks left out (Tagger._mirror)
            if count_ops and (o.mode != "device" or o.dtype is not None):
                # the counter gives an op the block of the shadow it writes; a staged update writes a staging
                # buffer, an update across the host moves every shadow (or a chunk of several blocks') in one op
                return f"{o} (dtype={o.dtype}) is not memoized when ops are counted (a staged or host update)"
            continue
        if isinstance(o, Checkpointing):
            if o.provider == "offload":
                return f"{o} keeps checkpoint inputs off the device"
            from ._memo_period import period_of, why_not_periodic

            if period_of(o) is None:
                return why_not_periodic(o)
            if period_of(o) > 1 and not periodic:
                return f"{o} is counted from every block (a probe of one block more would shift its period's phase)"
            continue
        return f"{type(o).__name__} is not memoized (its state is not a sum over identical blocks)"
    return None


def cut(
    model: nn.Module, lengths: dict[str, int] | None = None, period: int = 1
) -> list[tuple[str, int, nn.ModuleList]]:
    """Cut each block list of ``model`` longer than its probe to the probe's blocks (:func:`kept`; ``period``: of
    the checkpointing pattern, :func:`memkit._memo_period.period`), in place; returns (name, full length, the list)
    for each. With ``lengths`` (from :func:`probe_builder`) the model is a probe already: its lists of those names
    stand for lists of those lengths."""
    if lengths is not None:
        lists = []
        for name, module in model.named_modules():
            if name in lengths:
                size = probe_length(lengths[name], period)
                if not isinstance(module, nn.ModuleList) or len(module) != size or not _identical(module):
                    raise Unsupported(f"the probe's {name!r} is not a list of {size} blocks")
                lists.append((name, lengths[name], module))
        return lists
    lists = [(name, len(b), b) for name, b in block_lists(model) if len(b) > probe_length(len(b), period)]
    keep = _CUT_WHOLE.get(type(model).__name__)
    if keep is not None:  # its other lists are not blocks (Chroma's approximator)
        lists = [entry for entry in lists if entry[0] in keep]
    for _, n, blocks in lists:
        del blocks[head(period) : n - (probe_length(n, period) - head(period))]
    return lists


def head(period: int = 1) -> int:
    """The first blocks of a list the probe keeps as they are: the first block and a period (the backward repeats
    that period), and with a checkpointing period of more than one block a period before it, which holds the lowest
    checkpointed block (the backward frees there what every checkpointed block keeps, an input all blocks share)."""
    return 2 if period == 1 else 2 * period + 1


def probe_length(n: int, period: int = 1) -> int:
    """Blocks the probe keeps of a list of ``n`` whose checkpointing repeats every ``period`` blocks: its
    :func:`head`, then a period (the forward repeats it) and the last blocks, as many as make the probe's length
    equal to ``n`` modulo ``period`` (each probe block is checkpointed as the full block it is, :func:`kept`: the
    probe's middle periods in the full model's phase). ``period=1``: :data:`PROBE`.

    Example:
        >>> probe_length(19, 2), probe_length(38, 2), probe_length(57, 1)
        (9, 8, 4)
    """
    size = head(period) + period + 1
    return size + (n - size) % period


def kept(n: int, size: int, period: int = 1) -> list[int]:
    """The full blocks a probe of ``size`` blocks (:func:`probe_length`) of a list of ``n`` is: its :func:`head`
    and its last ``size - head(period)``."""
    return [*range(head(period)), *range(n - (size - head(period)), n)]


def own(J: int, n: int, size: int, period: int = 1) -> int | None:
    """The probe block that full block ``J`` is (:func:`kept`), or None for a block the probe leaves out."""
    if J < head(period):
        return J
    if J >= n - (size - head(period)):
        return J - (n - size)
    return None


def stands_for(b: int, n: int, size: int, period: int = 1) -> int:
    """How many of the full list's ``n`` blocks probe block ``b`` stands for (as the forward repeats them: the
    period after the :func:`head`, :mod:`memkit._splice`), its own included; each block's ops and EMA shadows
    count so many times."""
    return 1 + (n - size) // period if head(period) <= b < head(period) + period else 1


# Which config key sets the length of each block list, per diffusers class: a preset's probe is built with at most
# PROBE blocks per list instead of being built whole and cut (building full Flux's 57 blocks alone takes ~0.5 s).
_LAYER_KEYS: dict[str, dict[str, str]] = {
    "FluxTransformer2DModel": {"transformer_blocks": "num_layers", "single_transformer_blocks": "num_single_layers"},
    "SD3Transformer2DModel": {"transformer_blocks": "num_layers"},
    "LTXVideoTransformer3DModel": {"transformer_blocks": "num_layers"},
    "LTX2VideoTransformer3DModel": {"transformer_blocks": "num_layers"},
    "WanTransformer3DModel": {"blocks": "num_layers"},
    "HunyuanVideoTransformer3DModel": {
        "transformer_blocks": "num_layers",
        "single_transformer_blocks": "num_single_layers",
    },
    "CogVideoXTransformer3DModel": {"transformer_blocks": "num_layers"},
    "PixArtTransformer2DModel": {"transformer_blocks": "num_layers"},
    "DiTTransformer2DModel": {"transformer_blocks": "num_layers"},
    "SanaTransformer2DModel": {"transformer_blocks": "num_layers"},
    "Flux2Transformer2DModel": {"transformer_blocks": "num_layers", "single_transformer_blocks": "num_single_layers"},
    "AuraFlowTransformer2DModel": {
        "joint_transformer_blocks": "num_mmdit_layers",
        "single_transformer_blocks": "num_single_dit_layers",
    },
    # the refiners before the joint layers (2 each, as released) are too short to cut
    "ZImageTransformer2DModel": {"layers": "n_layers"},
    "Lumina2Transformer2DModel": {"layers": "num_layers"},
}

# Config keys listing the layers of a block list built apart from the others, per diffusers class: SD3.5 Medium's
# first 13 of 24 blocks (MMDiT-X) attend over the image tokens a second time. The probe marks the blocks that stand
# for marked layers; a list whose middle layers are marked in part has no identical middle blocks.
_MARKED_LAYERS: dict[str, dict[str, str]] = {"SD3Transformer2DModel": {"num_layers": "dual_attention_layers"}}

# Models whose block lists are known but whose spliced timeline is not byte-equal to running every block; they run
# every block, and meta["memo"] says why.
_REFUSED: dict[str, str] = {
    "QwenImageTransformer2DModel": "Qwen-Image's last block computes a text stream the model drops; those tensors are "
    "freed after the blocks in an order the splice does not reproduce (the bytes agree, which free pairs with which "
    "allocation does not)",
    "CogView4Transformer2DModel": "in CogView4's forward, tensors of several sizes are freed together as a module "
    "returns, in an order the splice does not reproduce (the same bytes freed, in another order)",
    "MochiTransformer3DModel": "Mochi's last block is context_pre_only and returns its text stream untouched, so the "
    "text output of the block before it is freed after the blocks: a free the splice does not reproduce (outside the "
    "blocks, of a storage a middle block allocated)",
    "HunyuanVideo15Transformer3DModel": "in HunyuanVideo 1.5's forward, tensors of several sizes are freed together "
    "as a module returns, in an order the splice does not reproduce (the same bytes freed, in another order)",
}

# Models with a layer outside the blocks sized by the block counts: a probe built with four blocks per list would shrink
# it, so the whole model is built (on fake tensors, no memory) and these of its lists cut, as a model from a callable
# is. Chroma's modulation table has 3 rows per single block and 12 per double block, each through the approximator,
# whose own lists (5 layers, 5 norms) are not blocks to splice.
_CUT_WHOLE: dict[str, tuple[str, ...]] = {
    "ChromaTransformer2DModel": ("transformer_blocks", "single_transformer_blocks"),
}


def cut_whole(class_name: str) -> bool:
    """Whether a preset of ``class_name`` is probed by building it whole and cutting its block lists (see
    ``_CUT_WHOLE``) rather than building it with four blocks per list."""
    return class_name in _CUT_WHOLE


def refused(class_name: str) -> str | None:
    """Why a model of ``class_name`` is not memoized although its blocks are known, or None."""
    return _REFUSED.get(class_name)


def probe_builder(preset, size: str, dtype: torch.dtype, seed: int, period: int = 1):
    """``(build, lengths)`` for a preset: ``build()`` makes the preset at ``size`` with each block list longer than
    the probe built with the probe's blocks (:func:`probe_length`; the last of them is built as the last block, as SD3
    builds its own),
    ``lengths`` maps those lists' names to their full lengths. None when the preset's lists are not known, or when
    some of a list's middle blocks are built apart (:data:`_MARKED_LAYERS`)."""
    import dataclasses
    import inspect

    from .models import _build, diffusers_class

    keys = _LAYER_KEYS.get(preset.model_class)
    if keys is None:
        return None
    cls = diffusers_class(preset.model_class)
    defaults = inspect.signature(cls.__init__).parameters
    config = dict(preset.configs[size])
    marks = _MARKED_LAYERS.get(preset.model_class, {})
    lengths = {}
    for attr, key in keys.items():
        n = config.get(key, defaults[key].default if key in defaults else None)
        if isinstance(n, int) and n > probe_length(n, period):
            if key in marks:
                marked = set(config.get(marks[key], defaults[marks[key]].default) or ())
                middle = set(range(1, n - 1))
                if marked & middle and not middle <= marked:
                    return None
                probe = kept(n, probe_length(n, period), period)  # the full blocks the probe's are
                config[marks[key]] = tuple(i for i, layer in enumerate(probe) if layer in marked)
            lengths[attr] = n
            config[key] = probe_length(n, period)
    if not lengths:
        return None
    small = dataclasses.replace(preset, configs={**preset.configs, size: config})

    def build() -> nn.Module:
        return _build(small, size, dtype, seed, torch.device("cpu"))

    return build, lengths


def weights(p: torch.Tensor) -> int:
    """The weights a parameter stands for (a 4-bit one: its quant state's shape), as the estimate counts them."""
    shape = getattr(getattr(p, "quant_state", None), "shape", None)
    return int(math.prod(shape)) if shape is not None else p.numel()


def parameters(
    lists: list[tuple[str, int, nn.ModuleList]], probe_parameters: int, *, trainable: bool = False, nbytes: bool = False
) -> int:
    """The full model's parameter count from the probe's (``trainable``: of the parameters that require grad;
    ``nbytes``: their bytes, not their elements)."""
    extra = sum(
        (n - len(blocks))
        * sum(
            p.numel() * p.element_size() if nbytes else weights(p)
            for p in blocks[1].parameters()
            if p.requires_grad or not trainable
        )
        for _, n, blocks in lists
    )
    return probe_parameters + extra
