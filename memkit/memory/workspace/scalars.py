"""Python numbers passed where an op takes a Tensor (``x / 2.0``): the 0-dim "wrapped number" tensors.

The argument parser allocates one before dispatch (the dispatch mode never sees it: the mode gets the Python
number back), the call below the mode allocates another, and the kernel may cast it to the computation dtype.
The last two die when the op returns. The first dies then too, unless autograd saves it for backward: the
formulas in torch's ``tools/autograd/derivatives.yaml`` that name the number keep it in the backward node
(``DivBackward0._saved_other`` for ``x / 2.0``, ``MulBackward0._saved_other`` for ``x * 2.0`` and for
``2.0 / x``, which is ``x.reciprocal() * 2.0``) until the node releases its variables: after the node runs in a
backward without ``retain_graph``, else when the graph is freed. Saved-tensor hooks never see it (autograd
skips them for wrapped numbers), so checkpointing and offloading hooks leave it in the node too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_WRAPPED_DTYPE = {bool: torch.bool, int: torch.int64, float: torch.float64, complex: torch.complex128}


def _wrapped_scalars(slots: tuple[int, ...], args) -> int:
    # Bytes of the wrapped numbers that live only while the op runs: the parser's and the one allocated below
    # the mode, and the kernel's cast. When autograd saves the parser's, SavedScalarsFn counts it on from there.
    n = 0
    for i in slots:
        if i < len(args) and type(args[i]) in _WRAPPED_DTYPE:
            wrapped = _WRAPPED_DTYPE[type(args[i])]
            n += 2 * wrapped.itemsize
            tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if tensor is not None:
                common = torch.result_type(tensor, args[i])
                if common != wrapped:
                    n += common.itemsize
    return n


# Arguments of type Tensor that a backward formula of another argument uses (so autograd saves them when that
# other argument requires grad), per op and overload, from derivatives.yaml of torch 2.13. In-place variants
# (``mul_.Tensor``) save the same. Which ones a given call saves is read from its node afterwards.
_SAVED_ARGS: dict[tuple[str, str], tuple[str, ...]] = {
    ("mul", "Tensor"): ("self", "other"),
    ("div", "Tensor"): ("self", "other"),
    ("div", "Tensor_mode"): ("self", "other"),
    ("pow", "Tensor_Tensor"): ("self", "exponent"),
    ("atan2", ""): ("self", "other"),
    ("fmod", "Tensor"): ("self",),
    ("remainder", "Tensor"): ("self",),
    ("clamp_min", "Tensor"): ("self", "min"),
    ("clamp_max", "Tensor"): ("self", "max"),
    ("maximum", ""): ("self", "other"),
    ("minimum", ""): ("self", "other"),
    ("fmax", ""): ("self", "other"),
    ("fmin", ""): ("self", "other"),
    ("xlogy", "Tensor"): ("self", "other"),
    ("special_xlog1py", ""): ("self", "other"),
    ("special_zeta", ""): ("self",),
    ("logaddexp", ""): ("self", "other"),
    ("logaddexp2", ""): ("self", "other"),
    ("lerp", "Tensor"): ("self", "end", "weight"),
    ("igamma", ""): ("self",),
    ("igammac", ""): ("self",),
    ("ldexp", "Tensor"): ("other",),
    ("nextafter", ""): ("other",),
    ("dist", ""): ("self", "other"),
    ("mse_loss", ""): ("self", "target"),
    ("smooth_l1_loss", ""): ("self", "target"),
    ("huber_loss", ""): ("self", "target"),
    ("binary_cross_entropy", ""): ("self", "target"),
    ("binary_cross_entropy_with_logits", ""): ("self", "target"),
}

SavedScalarsFn = Callable[[tuple], tuple[tuple[str, int, object], ...]]


def saved_scalars_fn(func, device: str | None = None) -> SavedScalarsFn | None:
    """For an op whose backward may save a wrapped number, ``fn(args)`` giving ``(node attribute, bytes,
    number)`` for each Python number in ``args`` that autograd will save if it records this call (grad mode on
    and a tensor argument requiring grad); ``()`` otherwise. None for every other op (decided once per op).

    The caller confirms each one on the output's ``grad_fn`` (``getattr(out.grad_fn, attribute)``), whose
    storage then lives exactly as long as the node keeps it.
    """
    if device is not None and not device.startswith("cpu"):
        return None
    name = func._schema.name.split("::")[-1]
    if name.endswith("_") and not name.endswith("__"):
        name = name[:-1]
    names = _SAVED_ARGS.get((name, func._schema.overload_name))
    if names is None:
        return None
    slots = tuple(
        (i, "_saved_" + a.name)
        for i, a in enumerate(func._schema.arguments)
        if a.name in names and str(a.type) == "Tensor" and not a.kwarg_only
    )

    def fn(args) -> tuple[tuple[str, int, object], ...]:
        found = tuple(
            (attr, _WRAPPED_DTYPE[type(args[i])].itemsize, args[i])
            for i, attr in slots
            if i < len(args) and type(args[i]) in _WRAPPED_DTYPE
        )
        if not found or not torch.is_grad_enabled():
            return ()
        if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return ()
        return found

    return fn


def reused_bytes(slots: tuple[int, ...], args, saved: list[tuple[int, object]]) -> int:
    """Bytes :func:`_wrapped_scalars` counted for ``args`` that were no new allocation: in the backward of a node
    that saved wrapped numbers (``saved``: (storage key, number) pairs), the numbers its formula passes to an op
    (``grad / other``) are those saved tensors, which the dispatch mode receives as Python numbers again. Only
    the copy below the mode (and the cast) is new."""
    n = 0
    for i in slots:
        if i < len(args):
            a = args[i]
            dtype = _WRAPPED_DTYPE.get(type(a))
            if dtype is not None and any(type(v) is type(a) and v == a for _, v in saved):
                n += dtype.itemsize
    return n
