"""Names imported on first use: the module-level ``__getattr__`` and ``__dir__`` that memkit's packages share.

``import memkit`` (or ``memkit.memory``, ``memkit.widgets``) loads no torch, diffusers or ipywidgets; a name is
imported when it is first read and then kept in the package, so later look-ups skip the hook.

Example:
    >>> __getattr__, __dir__ = lazy_exports(__name__, {"Timeline": ".timeline"}, __all__)
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, str], public: Iterable[str], submodules: Iterable[str] = ()
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``(__getattr__, __dir__)`` pair for ``package``: ``exports`` maps a public name to the module (relative
    to ``package``) that defines it, ``submodules`` are imported as attributes, ``public`` is ``__all__``."""
    module, submodules, public = sys.modules[package], frozenset(submodules), tuple(public)

    def __getattr__(name: str) -> Any:
        if name in exports:
            value = getattr(importlib.import_module(exports[name], package), name)
        elif name in submodules:
            value = importlib.import_module(f".{name}", package)
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(module, name, value)  # later look-ups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(module), *public})

    return __getattr__, __dir__


# Loggers whose import-time lines do not concern memkit on a CPU build with torchao installed: torchao's CUDA
# kernels do not load, torch notes two Enums torchao registers, diffusers misses Tensor classes torchao 0.16 renamed.
_IMPORT_NOISE = ("torchao", "torch.utils._pytree", "diffusers.quantizers.torchao.torchao_quantizer")


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """Import inside without the warnings the loggers of :data:`_IMPORT_NOISE` log while torchao is first imported
    (by memkit's CPU optimizer, or by diffusers when a model class is first read); errors still show.

    Example:
        >>> with quiet_imports():
        ...     cls = getattr(diffusers, "FluxTransformer2DModel")
    """
    loggers = [logging.getLogger(n) for n in _IMPORT_NOISE]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
