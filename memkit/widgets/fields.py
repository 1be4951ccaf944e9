"""What a panel edits, read from an optimization's registry entry and its config dataclass, and the values it
holds (:class:`OptimizationSettings`): no widgets here.

Each editable field of the config becomes a :class:`Field`: its kind (checkbox, menu, number, text), its
default, the values a menu offers (from a ``Literal[...]``, ``bool | None``, a dtype (alone or beside types no
widget edits), or the entry's ``field_choices``) and its docstring (the tooltip). The app turns each kind into
one ipywidget, so an optimization registered with :func:`memkit.optimizations.register` gets its panel with no
change to the app.

Example:
    >>> from memkit.optimizations import REGISTRY
    >>> [f.name for f in panel_fields(REGISTRY["ema"])]     # ['mode', 'foreach', 'update_every', ...]
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import functools
import inspect
import re
import sys
import textwrap
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

from ..units import parse_bytes

__all__ = ["Field", "FieldKind", "OptimizationSettings", "panel_fields", "type_hints"]

FieldKind = Literal["bool", "choice", "int", "float", "text"]
_DTYPE_NAMES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Field:
    """One setting of an optimization's config, as a panel shows it.

    ``kind`` picks the widget: ``"bool"`` a checkbox, ``"choice"`` a menu of ``choices`` (labelled
    ``labels``), ``"int"``/``"float"`` a number box, ``"text"`` a text box (with ``choices`` as suggestions).
    An ``optional`` number is typed as text, empty meaning None. :meth:`parse` turns what the widget holds
    into the config's value; :meth:`widget_value` is the reverse.

    Example:
        >>> f = Field("update_every", "int", 1, "Update on every Nth step only...")
        >>> f.parse(4)
        4
    """

    name: str
    """The config field's name (the widget's label)."""
    kind: FieldKind
    """Which widget edits it."""
    default: Any
    """The field's default, as the config holds it."""
    doc: str = ""
    """The field's docstring, plain text (the tooltip)."""
    choices: tuple[Any, ...] = ()
    """A menu's values (``"choice"``), or suggestions for free text (``"text"``)."""
    labels: tuple[str, ...] = ()
    """How a menu shows each of ``choices``."""
    optional: bool = False
    """None is allowed: an empty text box for numbers and text."""

    def parse(self, value: Any) -> Any:
        """The config value of what the widget holds; a ValueError names the field."""
        if self.kind in ("bool", "choice"):
            return value
        if isinstance(value, str):
            text = value.strip()
            if not text:
                if self.optional:
                    return None
                if self.kind == "text":
                    return self.default
                raise ValueError(f"{self.name} needs a value")
            if self.kind == "int":
                if self.name.endswith("_bytes"):  # sizes as people type them: "8 GiB"
                    try:
                        return parse_bytes(text)
                    except ValueError as e:
                        raise ValueError(f"{self.name}: {e}") from None
                try:
                    return int(text)
                except ValueError:
                    raise ValueError(f"{self.name} must be a whole number, got {text!r}") from None
            if self.kind == "float":
                try:
                    return float(text)
                except ValueError:
                    raise ValueError(f"{self.name} must be a number, got {text!r}") from None
            return text
        return value

    def widget_value(self, value: Any) -> Any:
        """What the widget shows for the config value ``value`` (text boxes get a string)."""
        if self.kind in ("bool", "choice"):
            return value
        if self.optional or self.kind == "text":
            if value is None:
                return ""
            if isinstance(value, (tuple, list)):
                return ",".join(map(str, value))
            return str(value)
        return value

    @property
    def widget_default(self) -> Any:
        """What the widget shows before anyone touches it."""
        return self.widget_value(self.default)


def panel_fields(spec: Any) -> list[Field]:
    """The fields a panel shows for a registry entry (:class:`memkit.optimizations.Spec`): ``spec.panel`` in
    its order, or every field a widget can edit. A field listed in ``spec.panel`` that no widget can edit is a
    TypeError naming it.

    Example:
        >>> [f.kind for f in panel_fields(REGISTRY["ff-split"])]
        ['int', 'choice', 'choice']
    """
    config = spec.config
    if not dataclasses.is_dataclass(config):
        raise TypeError(f"{spec.name}: spec.config must be a dataclass to get a panel, got {config!r}")
    hints = type_hints(config)
    docs = _field_docs(config)
    by_name = {f.name: f for f in dataclasses.fields(config) if f.init}
    extra = getattr(spec, "field_choices", {}) or {}
    wanted = list(getattr(spec, "panel", ()) or by_name)
    out = []
    for name in wanted:
        if name not in by_name:
            raise ValueError(f"{spec.name}: spec.panel names {name!r}, not a field of {config.__name__}")
        field = _field_of(by_name[name], hints.get(name, Any), docs.get(name, ""), tuple(extra.get(name, ())))
        if field is None:
            if getattr(spec, "panel", ()):
                raise TypeError(
                    f"{spec.name}: no widget edits field {name!r} of type {hints.get(name)!r}; "
                    "leave it out of spec.panel (it keeps its default)"
                )
            continue
        out.append(field)
    return out


def type_hints(cls: type) -> dict[str, Any]:
    """``typing.get_type_hints(cls)``, where a name only type checkers see (imported under ``TYPE_CHECKING``, as
    ``memkit.FSDP`` does with FSDP2's ``MixedPrecisionPolicy``) stands for a type of its own that no widget edits,
    instead of a NameError.

    Example:
        >>> type_hints(memkit.FSDP)["mixed_precision"]      # torch.dtype | MixedPrecisionPolicy | None
    """
    try:
        return typing.get_type_hints(cls)
    except NameError:
        pass
    known = set(vars(builtins))
    for klass in cls.__mro__:
        module = sys.modules.get(klass.__module__)
        known |= set(vars(module)) if module is not None else set()

    class _Unknown(dict):  # eval asks the locals first: a name the modules define is refused here, found there
        def __missing__(self, name: str) -> type:
            if name in known:
                raise KeyError(name)
            return type(name, (), {"__module__": cls.__module__})

    return typing.get_type_hints(cls, localns=_Unknown())


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _field_of(f: dataclasses.Field, hint: Any, doc: str, extra: tuple) -> Field | None:
    default = _default_of(f)
    members, optional = _members(hint)
    literal = all(typing.get_origin(m) is Literal for m in members) and members
    if members == [bool]:
        if optional:
            return Field(f.name, "choice", default, doc, (None, True, False), ("None", "True", "False"), True)
        return Field(f.name, "bool", default, doc)
    if literal:
        values = tuple(v for m in members for v in typing.get_args(m)) + ((None,) if optional else ())
        return Field(f.name, "choice", default, doc, values, tuple(map(str, values)), optional)
    if any(_is_dtype(m) for m in members) and not any(m in (str, int, float) for m in members):
        import torch  # a dtype field belongs to a config that imported torch already

        # a menu of dtypes; the other types the field takes (FSDP's MixedPrecisionPolicy) are set from Python
        values = (None,) * optional + tuple(getattr(torch, n) for n in _DTYPE_NAMES)
        labels = ("None",) * optional + _DTYPE_NAMES
        return Field(f.name, "choice", default, doc, values, labels, optional)
    if members == [str] and extra:  # a plain string that takes a few names: a menu
        values = extra + ((None,) if optional else ())
        return Field(f.name, "choice", default, doc, values, tuple(map(str, values)), optional)
    if members in ([int], [float], [int, float], [float, int]):
        kind = "int" if members == [int] else "float"
        return Field(f.name, kind, default, doc, optional=optional)
    if str in members:  # free text, whatever else the field takes (a pattern: "every:3", or a tuple)
        return Field(f.name, "text", default, doc, extra, optional=optional)
    return None


def _members(hint: Any) -> tuple[list[Any], bool]:
    """The types of a union (one type: itself) without None, and whether None was one of them."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
    else:
        args = (hint,)
    members = [a for a in args if a is not type(None)]
    return members, len(members) < len(args)


def _is_dtype(tp: Any) -> bool:
    return getattr(tp, "__module__", None) == "torch" and getattr(tp, "__name__", None) == "dtype"


@functools.cache
def _field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string right under it in the class body), as plain text."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):  # no source (built in a REPL, frozen apps): no tooltips
            continue
        body = next((n.body for n in tree.body if isinstance(n, ast.ClassDef)), [])
        for node, after in zip(body, body[1:], strict=False):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = _plain(after.value.value)
    return docs


def _plain(doc: str) -> str:
    text = " ".join(inspect.cleandoc(doc).split())
    text = re.sub(r":\w+:`~?([^`]+)`", r"\1", text)  # :class:`memkit.Step` -> memkit.Step
    return text.replace("``", "")


class OptimizationSettings:
    """One optimization's panel as data: on or off, and a value per field the panel shows.

    Values are what the widgets hold (text for numbers that may be empty); :meth:`config` parses them into the
    optimization's config, starting from the registry value last picked with :meth:`use` (fields the panel
    does not show keep that value's settings).

    Example:
        >>> s = OptimizationSettings(REGISTRY["checkpointing"])
        >>> s.use("every:2"); s.values["provider"] = "selective"
        >>> s.config()
        Checkpointing(pattern='every:2', provider='selective', ...)
    """

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        self.fields: list[Field] = panel_fields(spec)
        self.enabled = False
        self.values: dict[str, Any] = {}
        self._base: Any = None
        self.use(spec.choices[0])

    @property
    def name(self) -> str:
        return self.spec.name

    def use(self, choice: str) -> None:
        """Set every field from one of the registry's values (``spec.choices``, e.g. ``"all@selective"``)."""
        config = self.spec.parse(choice)
        self._base = config
        for f in self.fields:
            self.values[f.name] = f.widget_value(getattr(config, f.name))

    def set(self, name: str, value: Any) -> None:
        """Set one field's widget value; a KeyError names the fields there are."""
        if name not in self.values:
            raise KeyError(f"{self.name} has no field {name!r} in its panel; fields: {list(self.values)}")
        self.values[name] = value

    def config(self) -> Any:
        """The optimization's config from the current values; a ValueError names the optimization and field."""
        kwargs = {}
        for f in self.fields:
            try:
                kwargs[f.name] = f.parse(self.values[f.name])
            except ValueError as e:
                raise ValueError(f"{self.name}: {e}") from None
        try:
            return dataclasses.replace(self._base, **kwargs)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{self.name}: {e}") from None

    @property
    def choice(self) -> str | None:
        """The registry value these settings equal (``spec.choices``), or None when they are custom."""
        try:
            config = self.config()
        except ValueError:
            return None
        return next((c for c in self.spec.choices if self.spec.parse(c) == config), None)

    def __repr__(self) -> str:
        state = "on" if self.enabled else "off"
        return f"OptimizationSettings({self.name}, {state}, {self.values})"
