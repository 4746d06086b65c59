"""``python -m h3_turbo.tools inspect`` for a Turbo LoRA: what the pack would make of the file, offline.

Uses the Turbo LoRA readers of :mod:`h3_turbo.adapters.turbo_lora` (the ones ``Apply H3 Turbo LoRA`` runs):
container and key checks (``read_header``, ``classify_keys``), the conversion to the canonical fused form with
its shape / alpha / ``training_scale`` checks (``canonicalize``), the contract (``contract_for``,
``check_contract_alpha``) and the SHA-256 (``sha256_file``). On top, the checks that need a model at apply
time, made against the released H3 instead: every one of the 208 targets present, one geometry per projection,
finite factors.

:func:`inspect_turbo_lora` returns ``(report, findings)`` like :func:`h3_turbo.tools.inspect_ckpt.inspect_file`;
findings are ``"[error] ..."`` / ``"[warning] ..."`` lines, and the report's ``ok`` is False when any is an
error.
"""
from __future__ import annotations

import os
import re
from collections import Counter

from .. import model_facts
from ..adapters import contracts, turbo_lora
from ..errors import TurboLoRAError

#: published download locations of the official files (docs/h3-facts.md#turbo-lora-files)
PUBLISHED_REPO = "lightx2v/Minimax-h3-Turbo"
#: [out, in] per projection of the released H3: hidden 5376, attention 56 x 128 = 7168, FFN 14336
RELEASED = {"hidden": model_facts.HIDDEN, "attention": model_facts.HEADS * model_facts.HEAD_DIM, "ffn": 14336}

_BLOCK_RE = re.compile(r"^(blocks|token_refiner\.blocks)\.(\d+)\.")


def looks_like_lora(keys) -> bool:
    """True when a safetensors file's tensor names are a LoRA adapter's (``*.lora_A`` / ``*.lora_B`` / ``*.alpha``)."""
    return any(".lora_" in k or k.endswith((".alpha", ".lora_A", ".lora_B")) for k in keys)


def _geometry(targets: dict[str, turbo_lora.TargetLoRA], errors: list[str]) -> dict | None:
    """The H3 widths the factors fit (hidden, attention, FFN), checked to be one geometry for every block."""
    by_proj: dict[str, dict[tuple, list[str]]] = {}
    for t, tl in targets.items():
        by_proj.setdefault(_BLOCK_RE.sub("", t), {}).setdefault((int(tl.B.shape[0]), int(tl.A.shape[1])), []).append(t)
    mixed = {p: s for p, s in by_proj.items() if len(s) > 1}
    if mixed:
        def odd(sizes: dict[tuple, list[str]]) -> str:
            """The most common size with its count, then every other size with the targets that have it."""
            common = max(sizes, key=lambda k: len(sizes[k]))
            rest = [f"[out {o}, in {i}] in {', '.join(sorted(sizes[(o, i)])[:3])}"
                    + (f" (+{len(sizes[(o, i)]) - 3} more)" if len(sizes[(o, i)]) > 3 else "")
                    for o, i in sorted(sizes) if (o, i) != common]
            return f"[out {common[0]}, in {common[1]}] in {len(sizes[common])} target(s); " + "; ".join(rest)

        errors.append("targets of one projection have different sizes (" + "; ".join(
            f"{p}: {odd(s)}" for p, s in sorted(mixed.items())) + "): not one H3 model")
        return None
    one = {p: next(iter(s)) for p, s in by_proj.items()}
    if set(one) != set(model_facts.PROJECTIONS):
        return None
    (qkv_o, hidden), (out_o, attention), (fc1_o, fc1_i), (fc2_o, ffn) = (
        one[p] for p in model_facts.PROJECTIONS)
    if not (qkv_o == 3 * attention and out_o == hidden == fc1_i == fc2_o and fc1_o == 2 * ffn):
        errors.append(f"the projection sizes do not fit one H3 block (qkv [out {qkv_o}, in {hidden}], out_proj "
                      f"[{out_o}, {attention}], fc1 [{fc1_o}, {fc1_i}], fc2 [{fc2_o}, {ffn}])")
        return None
    return {"hidden": hidden, "attention": attention, "ffn": ffn}


def _coverage(targets, errors: list[str]) -> dict:
    """Blocks and refiner blocks covered; a missing target is an error (the adapter would not load)."""
    blocks: dict[str, set[int]] = {"blocks": set(), "token_refiner.blocks": set()}
    for t in targets:
        m = _BLOCK_RE.match(t)
        blocks[m.group(1)].add(int(m.group(2)))
    n_blocks = max(blocks["blocks"], default=-1) + 1
    n_ref = max(blocks["token_refiner.blocks"], default=-1) + 1
    missing = [t for t in turbo_lora.target_names(n_blocks, n_ref) if t not in targets]
    if missing:
        errors.append(turbo_lora._listing("missing targets (an adapter must cover all four projections of "
                                          "every block)", missing))
    if (n_blocks, n_ref) != (model_facts.DEPTH, model_facts.REFINER_DEPTH):
        errors.append(f"covers {n_blocks} blocks + {n_ref} refiner blocks; MiniMax H3 has {model_facts.DEPTH} + "
                      f"{model_facts.REFINER_DEPTH}: it would not load on H3")
    return {"blocks": n_blocks, "refiner_blocks": n_ref}


def _per_projection(targets) -> dict[str, dict]:
    """Per projection: ranks, alpha values and alpha/rank (each with its number of targets)."""
    out: dict[str, dict] = {}
    for proj in model_facts.PROJECTIONS:
        tls = [tl for t, tl in targets.items() if t.endswith("." + proj)]
        out[proj] = {"targets": len(tls),
                     "rank": dict(sorted(Counter(tl.rank for tl in tls).items())),
                     "alpha": dict(sorted(Counter(tl.alpha for tl in tls).items())),
                     "alpha_over_rank": dict(sorted(Counter(round(tl.scale, 9) for tl in tls).items()))}
    return out


def _published(name: str, sha: str, errors: list[str]) -> dict:
    art = contracts.by_sha256(sha)
    if art is not None:
        return {"published": True, "official_name": art.filename, "repository": PUBLISHED_REPO,
                "renamed": art.filename != name}
    art = contracts.by_filename(name)
    if art is not None and art.sha256:
        errors.append(f"named like the official {art.filename} but its SHA-256 {sha} is not the published "
                      f"{art.sha256}: a damaged download or another release (download it again from "
                      f"{PUBLISHED_REPO})")
        return {"published": False, "official_name": art.filename, "repository": PUBLISHED_REPO}
    if art is not None:
        return {"published": None, "official_name": art.filename, "repository": PUBLISHED_REPO,
                "note": "an official file name with no published SHA-256 to compare"}
    return {"published": False, "official_name": None, "repository": None}


def inspect_turbo_lora(path: str) -> tuple[dict, list[str]]:
    """Inspect a Turbo LoRA file: (report, findings). Never raises for a bad file."""
    from safetensors import safe_open

    errors: list[str] = []
    warnings: list[str] = []
    rep: dict = {"path": path, "kind": "turbo_lora", "ok": False}

    def done():
        rep["errors"], rep["warnings"] = len(errors), len(warnings)
        rep["ok"] = not errors
        return rep, [f"[error] {e}" for e in errors] + [f"[warning] {w}" for w in warnings]

    try:
        header, metadata = turbo_lora.read_header(path)
        rep.update(file_bytes=os.path.getsize(path), tensors=len(header), metadata=metadata)
        layout, style, _ = turbo_lora.classify_keys(header, path)
        rep.update(layout=layout, key_style=style)
        with safe_open(path, framework="pt", device="cpu") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        # canonicalize checks every tensor's values (NaN / Inf, naming each tensor and its counts): its one
        # error is the finding, not a second listing of the same tensors
        targets, _layout, _style, notes = turbo_lora.canonicalize(tensors, metadata, path)
    except TurboLoRAError as e:
        errors.append(str(e))
        return done()
    del tensors
    warnings.extend(notes)
    rep["targets"] = len(targets)
    rep.update(_coverage(targets, errors))
    geo = _geometry(targets, errors)
    rep["geometry"] = geo
    if geo is not None and geo != RELEASED:
        warnings.append(f"sized for an H3 of hidden {geo['hidden']}, attention {geo['attention']}, FFN {geo['ffn']}; "
                        f"the released 33 B H3 has {RELEASED['hidden']}, {RELEASED['attention']}, {RELEASED['ffn']}: "
                        "it fits only a model of its own size")
    rep["projections"] = _per_projection(targets)
    sha = turbo_lora.sha256_file(path)
    rep["sha256"] = sha
    rep["artifact"] = _published(os.path.basename(path), sha, errors)
    refused = False
    try:
        contract = turbo_lora.contract_for(path, metadata, sha)
        turbo_lora.check_contract_alpha(targets, contract, path)
    except TurboLoRAError as e:
        errors.append(str(e))
        contract, refused = None, True
    if contract is None:
        rep["contract"] = None
        if not refused:
            warnings.append("no Turbo contract: not a known artifact and no contract metadata, so H3 Turbo Sigmas "
                            "and H3 Turbo Sampler cannot enforce its step count and shifts (set the steps yourself)")
    else:
        rep["contract"] = {"variant": contract.variant, "nfe": contract.nfe, "shift_video": contract.shift_video,
                           "shift_audio": contract.shift_audio, "alpha_over_rank": contract.alpha_over_rank,
                           "source": contract.source, "verified": contract.extra.get("verified")}
    return done()


def _num(v: float) -> str:
    return f"{v:g}"


_LAYOUTS = {"comfy": "ComfyUI layout", "diffusers": "Diffusers layout (converted exactly to the fused ComfyUI form)"}
_KEYS = {"diffusion_model.": "diffusion_model.<block>.<projection>.*", "bare": "<block>.<projection>.* (no prefix)",
         "peft": "PEFT .lora_A.default.weight", "mixed": "mixed prefixes", "diffusers": "transformer_blocks.N.*"}
_SOURCES = {"known-artifact": "the official artifact", "metadata": "the file's metadata"}
_BY_NAME = {False: " by its file name only (the content is not the published file)",
            None: " by its file name (no published SHA-256 to check it against)"}


def print_report(rep: dict, findings: list[str]) -> None:
    """The text form of :func:`inspect_turbo_lora`'s result (``RESULT: OK`` / ``RESULT: ERRORS`` last)."""
    print(f"file: {rep['path']}")
    if "file_bytes" in rep:
        print(f"size: {rep['file_bytes']} bytes ({rep['file_bytes'] / 2**30:.3f} GiB)")
    print("kind: Turbo LoRA" + (f", {_LAYOUTS.get(rep['layout'], rep['layout'])}, keys "
                                f"{_KEYS.get(rep['key_style'], rep['key_style'])}" if "layout" in rep else ""))
    if "targets" in rep:
        print(f"targets: {rep['targets']} ({rep['blocks']} blocks + {rep['refiner_blocks']} refiner blocks x 4 "
              f"projections), {rep['tensors']} tensors in the file")
    geo = rep.get("geometry")
    if geo:
        same = " (the released 33 B H3)" if geo == RELEASED else ""
        print(f"fits: H3 of hidden {geo['hidden']}, attention {geo['attention']}, FFN {geo['ffn']}{same}")
    for proj, d in (rep.get("projections") or {}).items():
        def vals(c):
            return ", ".join(_num(v) + (f" ({n} targets)" if len(c) > 1 else "") for v, n in c.items()) or "-"
        print(f"  {proj:<14} {d['targets']:>3} targets  rank {vals(d['rank'])}  alpha {vals(d['alpha'])}  "
              f"alpha/rank {vals(d['alpha_over_rank'])}")
    if "contract" in rep:
        c = rep["contract"]
        print("contract: none" if c is None else
              f"contract: {c['variant']}: {c['nfe']} model evaluations, shifts {_num(c['shift_video'])}/"
              f"{_num(c['shift_audio'])} (video/audio), from {_SOURCES.get(c['source'], c['source'])}"
              + (_BY_NAME.get(rep["artifact"]["published"], "") if c["source"] == "known-artifact" else ""))
    if "sha256" in rep:
        print(f"sha256: {rep['sha256']}")
        a = rep["artifact"]
        if a["published"]:
            print(f"published artifact: yes, {a['official_name']} ({a['repository']})"
                  + (", renamed here" if a.get("renamed") else ""))
        elif a["published"] is None:
            print(f"published artifact: {a['official_name']} by name; {a['note']}")
        else:
            print("published artifact: no" + (f" (named like {a['official_name']})" if a["official_name"] else ""))
    print(f"findings: {len(findings)}" + ("" if findings else " (none)"))
    for f in findings:
        print("  " + f)
    print("RESULT: " + ("OK" if rep["ok"] else "ERRORS"))
