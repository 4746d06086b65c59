"""The checkpoint formats the pack reads, in detection order, and the rule that picks one.

Every scheme in :data:`SCHEMES` is asked whether it claims a header (:meth:`Scheme.claims`); exactly one
may. None claiming gives :data:`~.schemes.plain.UNCLAIMED` (format ``unknown``, whose findings say why);
two or more is a :class:`CheckpointError` naming each claiming scheme and its evidence.

To add a format: write one module in ``formats/schemes/`` and add its ``SCHEME`` here
(``docs/EXTENDING.md``); ``tests/test_format_schemes.py`` picks it up.
"""
from __future__ import annotations

from .safetensors_io import CheckpointError, Header
from .schemes import comfy_metadata, comfy_native, diffusers_bf16, lightx2v, modelopt, plain, w8a8_int8
from .schemes.base import Evidence, HeaderView, Scheme
from .schemes.plain import UNCLAIMED

#: every format, in the order detection reports them (the first claimer is kept after a mixed-scheme error)
SCHEMES: tuple[Scheme, ...] = (
    comfy_native.SCHEME,
    comfy_metadata.SCHEME,
    lightx2v.SCHEME,
    modelopt.SCHEME,
    plain.BF16,
    plain.FP16,
    plain.FP32,
    plain.MIXED,
)

#: the TurboH3 DMD release formats (Diffusers naming, shards; W8A8 Int8Linear), read by ``formats/dmd.py`` for the
#: DMD loader; detection order as above (exactly one may claim a header)
RELEASE_SCHEMES = (
    diffusers_bf16.SCHEME,
    w8a8_int8.SCHEME,
)


def identify_release(view: HeaderView):
    """(scheme, evidence) of the one release scheme claiming ``view``, ``(None, None)`` when none does;
    CheckpointError naming both when two do."""
    found = [(s, ev) for s in RELEASE_SCHEMES if (ev := s.claims(view))]
    if len(found) > 1:
        raise CheckpointError(view.path, "several release formats claim the file: "
                                         + "; ".join(f"{s.name}: {ev}" for s, ev in found))
    return found[0] if found else (None, None)


def get(name: str) -> Scheme:
    """The scheme called ``name`` (``unknown`` included); ValueError naming the known ones otherwise."""
    for s in SCHEMES + (UNCLAIMED,) + RELEASE_SCHEMES:
        if s.name == name:
            return s
    raise ValueError(f"unknown checkpoint format {name!r}; known: {', '.join(s.name for s in SCHEMES)}")


def claims(view: HeaderView | Header) -> list[tuple[Scheme, Evidence]]:
    """(scheme, evidence) of every scheme that claims the header, in registry order."""
    if isinstance(view, Header):
        view = HeaderView.of(view)
    out = []
    for s in SCHEMES:
        ev = s.claims(view)
        if ev:
            out.append((s, ev))
    return out


def identify(view: HeaderView | Header) -> tuple[Scheme, Evidence | None]:
    """The one scheme claiming the header and its evidence; ``(UNCLAIMED, None)`` when none does.

    Raises :class:`CheckpointError` when several claim it: the message names each scheme and its evidence,
    ``err.claims`` holds the (scheme, evidence) pairs in registry order.
    """
    if isinstance(view, Header):
        view = HeaderView.of(view)
    found = claims(view)
    if not found:
        return UNCLAIMED, None
    if len(found) > 1:
        names = ", ".join(s.name for s, _ in found)
        why = "; ".join(f"{s.name}: {ev}" for s, ev in found)
        err = CheckpointError(view.path, f"mixed quantization schemes in one file: {names}; convert it with one "
                                         f"tool ({why})")
        err.claims = found
        raise err
    return found[0]
