"""``turboh3_w8a8``: TurboDiffusion ``Int8Linear`` layers in an H3 DiT (the TurboH3 W8A8 export, release format
``h3_fl2va_turbo_w8a8_128``).

Per quantized layer ``P`` (thu-ml/TurboDiffusion ``turbodiffusion/ops/core.py``, class ``Int8Linear``, verified):
``P.int8_weight`` int8 [out, in], ``P.scale`` fp32 [ceil(out/128), ceil(in/128)] (amax/128 per 128x128 tile),
optional ``P.bias``. The release's key names are not public: the module names are read with the Diffusers / core
mapping (:mod:`.diffusers_map`), Q/K/V may be one fused ``attn.to_qkv`` or split ``to_q``/``to_k``/``to_v``
(fused exactly on load), anything else is refused with the list of what was found. AdaLN weights may be absent
(the release omits them: the model then needs an AdaLN table).
"""
from __future__ import annotations

from .base import Evidence, HeaderView, stems_evidence
from .diffusers_map import ReleaseScheme

#: the format string the TurboH3 card gives the W8A8 export (expected in ``__metadata__["format"]``, unverified)
RELEASE_FORMAT = "h3_fl2va_turbo_w8a8_128"


class W8A8Int8(ReleaseScheme):
    name = "turboh3_w8a8"
    summary = "H3 DiT with TurboDiffusion Int8Linear W8A8 projections (int8_weight + 128x128 fp32 scale)"
    quantized = True

    def claims(self, view: HeaderView) -> Evidence | None:
        return stems_evidence(view.stems_with("int8_weight"), "carry an Int8Linear int8_weight")


SCHEME = W8A8Int8()
