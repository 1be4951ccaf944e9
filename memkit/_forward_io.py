"""What goes into a model's forward and what comes out: `check_inputs` (its keyword arguments against the
signature) and `model_output` (the prediction tensor in whatever a diffusers forward returns; `_predictions`: every
prediction of a model that denoises two streams). `memkit.step` re-exports both."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch


def model_output(out: Any) -> torch.Tensor:
    """The prediction tensor in whatever a diffusers forward returned: a tensor, ``.sample``, or a tuple; a batch
    returned as a list of per-sample tensors (Z-Image) is stacked, as its training script does
    (diffusers' ``train_dreambooth_lora_z_image.py``: ``torch.stack(model_pred_list, dim=0)``).

    Example:
        >>> out = model(**make_inputs(model))
        >>> model_output(out).shape
    """
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping) and "sample" in out:
        sample = out["sample"]
        return torch.stack(sample) if isinstance(sample, list) else sample
    if isinstance(getattr(out, "sample", None), torch.Tensor):
        return out.sample
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], list) and out[0]:
        if all(isinstance(t, torch.Tensor) for t in out[0]):
            return torch.stack(out[0])
    raise TypeError(f"cannot find the output tensor in a {type(out).__name__}")


def _predictions(out: Any) -> list[torch.Tensor]:
    """`model_output`'s tensor, then the other tensors of a tuple or an output object: the second stream's prediction
    of a model that denoises two at once (LTX-2's audio, ``audio_sample``). Every other preset returns one."""
    first = model_output(out)
    if isinstance(out, Mapping):  # diffusers' BaseOutput is an OrderedDict
        rest = list(out.values())
    elif isinstance(out, (tuple, list)):
        rest = list(out)
    else:
        rest = []
    return [first, *(t for t in rest if isinstance(t, torch.Tensor) and t is not first)]


def check_inputs(model: torch.nn.Module, inputs: Any) -> None:
    """Raise a ValueError naming ``inputs`` when its keys don't fit ``model.forward`` (unknown or missing).

    Shapes are checked by the model itself; build inputs with :func:`make_inputs` to get them right.

    Example:
        >>> check_inputs(model, {"hidden_states": x})   # ValueError: inputs is missing 'timestep', ...
    """
    if not isinstance(inputs, Mapping):
        raise TypeError(f"inputs must be a mapping of forward keyword arguments, got {type(inputs).__name__}")
    params = inspect.signature(model.forward).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    unknown = sorted(set(inputs) - set(params))
    if unknown:
        raise ValueError(
            f"inputs has keys that {type(model).__name__}.forward does not take: {unknown}; it takes {sorted(params)}"
        )
    missing = sorted(
        n
        for n, p in params.items()
        if p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        and n not in inputs
    )
    if missing:
        raise ValueError(f"inputs is missing {missing} for {type(model).__name__}.forward; see memkit.make_inputs")
