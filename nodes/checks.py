"""Numeric node inputs, declared once and checked in the node.

ComfyUI checks a widget's min/max only for values typed into the prompt, and ``NaN`` passes those checks
(every comparison with NaN is false); a value that arrives through a link is not checked at all. So each
numeric input of the pack is a :class:`Number` in its node's ``NUMBERS`` table: the table builds the
schema input (:meth:`Number.input`) and :func:`check` runs at the start of ``execute``, before anything
else, raising :class:`h3_turbo.errors.InputError` for a value that is not a finite number in range.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import InputError


@dataclass(frozen=True)
class Number:
    """One numeric input: ``kind`` "float" or "int", its default and its inclusive range [min, max]."""

    kind: str
    default: float
    min: float
    max: float
    step: float | None = None

    def input(self, name: str, **kw):
        """The ``io.Float.Input`` / ``io.Int.Input`` of this number (``kw``: tooltip, optional, ...)."""
        from comfy_api.latest import io

        cls = io.Float.Input if self.kind == "float" else io.Int.Input
        if self.step is not None:
            kw.setdefault("step", self.step)
        return cls(name, default=self.default, min=self.min, max=self.max, **kw)

    def check(self, node: str, name: str, value):
        """``value`` as float / int when it is a finite number in [min, max]; else InputError naming ``node``,
        ``name``, the value and the range."""
        lo, hi = (f"{self.min:g}", f"{self.max:g}") if self.kind == "float" else (f"{self.min}", f"{self.max}")
        want = f"expected {'a number' if self.kind == 'float' else 'an integer'} in [{lo}, {hi}]"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InputError(f"{node}: {name} = {value!r} is not a number ({want})")
        if not math.isfinite(value):
            raise InputError(f"{node}: {name} = {value!r} is not a finite number ({want})")
        if self.kind == "int" and value != int(value):
            raise InputError(f"{node}: {name} = {value!r} is not an integer ({want})")
        if not self.min <= value <= self.max:
            raise InputError(f"{node}: {name} = {value!r} is out of range ({want})")
        return int(value) if self.kind == "int" else float(value)


def check(node_cls, **values) -> list:
    """Check each of ``values`` against ``node_cls.NUMBERS[name]`` (see :meth:`Number.check`); returns the
    checked values in the order given. The node's display name is taken from ``node_cls.DISPLAY``."""
    return [node_cls.NUMBERS[name].check(node_cls.DISPLAY, name, v) for name, v in values.items()]
