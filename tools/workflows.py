"""The pack's example workflows, generated in both ComfyUI formats from one graph description.

``python -m h3_turbo.tools.workflows [--check]`` writes (or, with ``--check``, compares)
``example_workflows/<name>.json`` (UI / LiteGraph format: what the frontend opens by drag-and-drop and
lists in the template browser under the pack's folder name) and ``example_workflows/api/<name>.json``
(API format: what ``POST /prompt`` and ``python -m h3_turbo.client submit`` take).

Pieces:
- :data:`SPECS`: for every node type used, its inputs in ComfyUI's ``input_order`` (name, type, kind) and
  outputs (name, type). Kinds: ``link`` (socket), ``widget`` (value in ``widgets_values``); suffixes
  ``?`` optional, ``+ctrl`` (the frontend adds a "control after generate" value after it), ``+upload``
  (the frontend adds an upload-button value after it). Core nodes come from :data:`CORE_SPECS` (checked
  against the live ComfyUI node definitions by ``tests/test_workflows.py``); the pack's own nodes are
  read from their schemas (``GET_NODE_INFO_V1``) on first use, which needs ComfyUI importable
  (``$COMFYUI_PATH`` or ``~/ComfyUI``).
- :class:`Node` / :class:`Workflow`: the graph description; :func:`to_ui` and :func:`to_api` render it.
- :func:`ui_to_api`: the independent reverse conversion (reads only the UI JSON and a spec table) used by
  the tests to prove each UI file converts to the same graph as its API twin.
"""
from __future__ import annotations

import argparse
import json
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

PACK_ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = PACK_ROOT / "example_workflows"
NOTE_TYPES = ("MarkdownNote", "Note")
WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO", "COMFY_DYNAMICCOMBO_V3")

# ---------------------------------------------------------------------------------------------- specs
# {type: (inputs [(name, type, kind)], outputs [(name, type)], python package for the "cnr_id" property)}
CORE_SPECS: dict[str, tuple[list[tuple[str, str, str]], list[tuple[str, str]], str]] = {
    # core (ComfyUI 0.33, 2026-08): read from the live node definitions, see the comfyui test
    "UNETLoader": ([("unet_name", "COMBO", "widget"), ("weight_dtype", "COMBO", "widget")],
                   [("MODEL", "MODEL")], "comfy-core"),
    "CLIPLoader": ([("clip_name", "COMBO", "widget"), ("type", "COMBO", "widget"), ("device", "COMBO", "widget?")],
                   [("CLIP", "CLIP")], "comfy-core"),
    "VAELoader": ([("vae_name", "COMBO", "widget")], [("VAE", "VAE")], "comfy-core"),
    "LoadImage": ([("image", "COMBO", "widget+upload")], [("IMAGE", "IMAGE"), ("MASK", "MASK")], "comfy-core"),
    "MiniMaxH3ImageToVideo": ([("clip", "CLIP", "link"), ("vae", "VAE", "link"), ("prompt", "STRING", "widget"),
                               ("width", "INT", "widget"), ("height", "INT", "widget"), ("length", "INT", "widget"),
                               ("first_frame", "IMAGE", "link?"), ("last_frame", "IMAGE", "link?")],
                              [("positive", "CONDITIONING"), ("LATENT", "LATENT")], "comfy-core"),
    "EmptyMiniMaxH3LatentAV": ([("width", "INT", "widget"), ("height", "INT", "widget"), ("length", "INT", "widget")],
                               [("LATENT", "LATENT")], "comfy-core"),
    "MiniMaxH3SigmaShift": ([("model", "MODEL", "link"), ("shift_video", "FLOAT", "widget"),
                             ("shift_audio", "FLOAT", "widget")], [("MODEL", "MODEL")], "comfy-core"),
    "BasicGuider": ([("model", "MODEL", "link"), ("conditioning", "CONDITIONING", "link")],
                    [("GUIDER", "GUIDER")], "comfy-core"),
    "RandomNoise": ([("noise_seed", "INT", "widget+ctrl")], [("NOISE", "NOISE")], "comfy-core"),
    "SamplerCustomAdvanced": ([("noise", "NOISE", "link"), ("guider", "GUIDER", "link"), ("sampler", "SAMPLER", "link"),
                               ("sigmas", "SIGMAS", "link"), ("latent_image", "LATENT", "link")],
                              [("output", "LATENT"), ("denoised_output", "LATENT")], "comfy-core"),
    "BasicScheduler": ([("model", "MODEL", "link"), ("scheduler", "COMBO", "widget"), ("steps", "INT", "widget"),
                        ("denoise", "FLOAT", "widget")], [("SIGMAS", "SIGMAS")], "comfy-core"),
    "KSamplerSelect": ([("sampler_name", "COMBO", "widget")], [("SAMPLER", "SAMPLER")], "comfy-core"),
    "VAEDecode": ([("samples", "LATENT", "link"), ("vae", "VAE", "link")], [("IMAGE", "IMAGE")], "comfy-core"),
    "VAEDecodeAudio": ([("samples", "LATENT", "link"), ("vae", "VAE", "link")], [("AUDIO", "AUDIO")], "comfy-core"),
    "CreateVideo": ([("images", "IMAGE", "link"), ("fps", "FLOAT", "widget"), ("audio", "AUDIO", "link?"),
                     ("bit_depth", "INT", "widget?")], [("VIDEO", "VIDEO")], "comfy-core"),
    "SaveVideo": ([("video", "VIDEO", "link"), ("filename_prefix", "STRING", "widget"), ("format", "COMBO", "widget"),
                   ("codec", "COMFY_DYNAMICCOMBO_V3", "widget")], [("video", "VIDEO")], "comfy-core"),
    "LTXVSeparateAVLatent": ([("av_latent", "LATENT", "link")],
                             [("video_latent", "LATENT"), ("audio_latent", "LATENT")], "comfy-core"),
    "SaveLatent": ([("samples", "LATENT", "link"), ("filename_prefix", "STRING", "widget")],
                   [("samples", "LATENT")], "comfy-core"),
    # frontend-only
    "MarkdownNote": ([("text", "STRING", "widget")], [], ""),
}

#: the title ComfyUI's frontend (1.49.6) gives an untitled core node, and so the ``_meta.title`` it queues: the
#: server's display name, or the frontend's own English name for the node where it has one (LTXVSeparateAVLatent),
#: else the node id. tests/test_browser.py checks every workflow against the frontend's queued graph.
CORE_TITLES: dict[str, str] = {
    "UNETLoader": "Load Diffusion Model", "CLIPLoader": "Load CLIP", "VAELoader": "Load VAE",
    "LoadImage": "Load Image", "MiniMaxH3ImageToVideo": "MiniMax H3 Image to Video",
    "EmptyMiniMaxH3LatentAV": "Empty MiniMax H3 AV Latent", "MiniMaxH3SigmaShift": "ModelSamplingMiniMaxH3",
    "BasicGuider": "Basic Guider", "RandomNoise": "RandomNoise", "SamplerCustomAdvanced": "SamplerCustomAdvanced",
    "BasicScheduler": "BasicScheduler", "KSamplerSelect": "KSamplerSelect", "VAEDecode": "VAE Decode",
    "VAEDecodeAudio": "VAE Decode Audio", "CreateVideo": "Create Video", "SaveVideo": "Save Video",
    "LTXVSeparateAVLatent": "LTXVSeparateAVLatent", "SaveLatent": "Save Latent",
}



def _import_comfy() -> None:
    """Make ComfyUI's packages (comfy_api, folder_paths) importable, from $COMFYUI_PATH or ~/ComfyUI."""
    try:
        import comfy_api  # noqa: F401
        return
    except ImportError:
        pass
    from ..harness import comfyui_first_on_path, find_comfyui

    comfyui_first_on_path(find_comfyui())


class _Specs(Mapping):
    """:data:`CORE_SPECS` plus the pack's nodes, whose specs are read from their schemas on first use."""

    def __init__(self):
        self._pack: dict | None = None
        self._titles: dict[str, str] = {}

    def pack(self) -> dict:
        if self._pack is None:
            _import_comfy()
            from ..nodes import all_nodes

            specs = {}
            for cls in all_nodes():
                info = cls.GET_NODE_INFO_V1()
                specs[info["name"]] = (*spec_from_node_info(info), "h3-turbo")
                self._titles[info["name"]] = info.get("display_name") or info["name"]
            self._pack = specs
        return self._pack

    def title(self, key: str) -> str:
        """The display name of node type ``key`` (what the frontend titles an untitled node)."""
        if key in CORE_TITLES:
            return CORE_TITLES[key]
        self.pack()
        if key not in self._titles:
            raise KeyError(f"no display name for node type {key!r} (add it to CORE_TITLES)")
        return self._titles[key]

    def __getitem__(self, key):
        if key in CORE_SPECS:
            return CORE_SPECS[key]
        return self.pack()[key]

    def __iter__(self):
        yield from CORE_SPECS
        yield from (k for k in self.pack() if k not in CORE_SPECS)

    def __len__(self):
        return len(set(CORE_SPECS) | set(self.pack()))

    def __contains__(self, key):
        return key in CORE_SPECS or key in self.pack()


#: every node type the workflows may use: {type: (inputs, outputs, python package for "cnr_id")}
SPECS = _Specs()


def pack_node_types() -> tuple[str, ...]:
    """Node ids of the pack (from its node classes; needs ComfyUI importable)."""
    return tuple(SPECS.pack())


def spec_from_node_info(info: dict) -> tuple[list[tuple[str, str, str]], list[tuple[str, str]]]:
    """(inputs, outputs) in :data:`SPECS` form from one entry of ComfyUI's ``GET /object_info``."""
    ins = []
    for section in ("required", "optional"):
        defs = info["input"].get(section) or {}
        for name in (info.get("input_order") or {}).get(section, list(defs)):
            d = defs[name]
            t = d[0]
            opts = d[1] if len(d) > 1 and isinstance(d[1], dict) else {}
            if isinstance(t, (list, tuple)):
                t = "COMBO"
            kind = "widget" if t in WIDGET_TYPES and not opts.get("forceInput") else "link"
            if section == "optional":
                kind += "?"
            if kind.startswith("widget"):
                if opts.get("control_after_generate"):
                    kind += "+ctrl"
                if opts.get("image_upload"):
                    kind += "+upload"
            ins.append((name, t, kind))
    outs = list(zip(info.get("output_name") or info["output"], info["output"]))
    return ins, [(str(n), str(t)) for n, t in outs]


def live_defaults(info: dict) -> dict[str, object]:
    """{widget name: default} of one ``GET /object_info`` entry, as the frontend names its widgets: a dynamic combo's
    inputs under its default option (the first) as ``"<combo>.<input>"``, recursively. Widgets without a default
    (e.g. file combos) map to their first option, or None."""
    out: dict[str, object] = {}

    def walk(defs: dict, order: dict | None, prefix: str) -> None:
        for section in ("required", "optional"):
            d = defs.get(section) or {}
            for name in (order or {}).get(section, list(d)):
                spec = d[name]
                t = spec[0]
                opts = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
                key = prefix + name
                if t == "COMFY_DYNAMICCOMBO_V3":
                    options = opts.get("options") or []
                    first = options[0] if options else {}
                    out[key] = opts.get("default", first.get("key"))
                    chosen = next((o for o in options if o.get("key") == out[key]), first)
                    walk(chosen.get("inputs") or {}, None, key + ".")
                elif isinstance(t, (list, tuple)):
                    out[key] = opts.get("default", t[0] if t else None)
                elif t in WIDGET_TYPES:
                    out[key] = opts.get("default", (opts.get("options") or [None])[0])

    walk(info.get("input") or {}, info.get("input_order"), "")
    return out


def core_drift(node_type: str, info: dict) -> list[str]:
    """How a core node's live definition (``GET /object_info`` entry) differs from its :data:`CORE_SPECS` entry, in
    the ways a newer core may change it without breaking the files: an input added as an optional widget (the
    frontend fills its default), a widget made optional, a combo made a dynamic combo whose options hold the
    files' value. Returns one line per difference (empty: none); any other difference (an input removed, renamed,
    reordered, a link's type changed, an output changed) is a ValueError naming it."""
    want_ins, want_outs, _ = CORE_SPECS[node_type]
    ins, outs = spec_from_node_info(info)
    if outs != want_outs:
        raise ValueError(f"{node_type}: outputs {outs} != {want_outs}")
    live = {n: (t, k) for n, t, k in ins}
    notes = []
    order = [n for n, _, _ in ins if n in {w[0] for w in want_ins}]
    if order != [w[0] for w in want_ins]:
        raise ValueError(f"{node_type}: inputs {[w[0] for w in want_ins]} are {order} in this core")
    for name, t, kind in want_ins:
        lt, lk = live[name]
        if (lt, lk) == (t, kind):
            continue
        if kind.startswith("link") or lk.startswith("link"):
            raise ValueError(f"{node_type}: input {name!r} is {lt} {lk} in this core, the files have {t} {kind}")
        if lt != t:
            if not (t == "COMBO" and lt == "COMFY_DYNAMICCOMBO_V3"):
                raise ValueError(f"{node_type}: widget {name!r} is {lt} in this core, the files have {t}")
            defs = {**(info["input"].get("required") or {}), **(info["input"].get("optional") or {})}
            keys = [o.get("key") for o in defs[name][1].get("options", [])]
            used = {n.inputs[name] for wf in workflows() for n in wf.nodes if n.type == node_type and name in n.inputs}
            if not used <= set(keys):
                raise ValueError(f"{node_type}: widget {name!r} offers {keys} in this core, the files use "
                                 f"{sorted(used - set(keys))}")
            notes.append(f"{name}: COMBO -> dynamic combo with options {keys}")
        if lk != kind:
            if lk.rstrip("?") != kind.rstrip("?"):
                raise ValueError(f"{node_type}: widget {name!r} is {lk} in this core, the files have {kind}")
            notes.append(f"{name}: {kind} -> {lk}")
    defaults = live_defaults(info)
    for name, t, kind in ins:
        if name not in {w[0] for w in want_ins}:
            if not kind.endswith("?") or not kind.startswith("widget"):
                raise ValueError(f"{node_type}: this core adds the required input {name!r} ({t} {kind})")
            notes.append(f"{name}: added ({t}, default {defaults.get(name)!r})")
    return notes


# ---------------------------------------------------------------------------------------------- graph
@dataclass
class Node:
    """One node. ``inputs``: {name: value} for widgets, {name: (node_id, slot)} (a tuple) for links."""

    id: int
    type: str
    inputs: dict = field(default_factory=dict)
    pos: tuple[float, float] = (0, 0)
    title: str | None = None
    size: tuple[float, float] | None = None
    color: str | None = None


@dataclass
class Workflow:
    name: str
    title: str
    nodes: list[Node]
    groups: list[tuple[str, list[int]]] = field(default_factory=list)
    description: str = ""


def _is_link(v) -> bool:
    return isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], int)


def _ctrl_default(node: Node) -> str:
    return "fixed"


def _topo_order(wf: Workflow) -> dict[int, int]:
    deps = {n.id: {v[0] for v in n.inputs.values() if _is_link(v)} for n in wf.nodes}
    order, done = {}, set()
    while len(done) < len(deps):
        ready = sorted(i for i, d in deps.items() if i not in done and d <= done)
        if not ready:
            raise ValueError(f"workflow {wf.name}: cycle among nodes {sorted(set(deps) - done)}")
        for i in ready:
            order[i] = len(order)
            done.add(i)
    return order


def _check(wf: Workflow) -> None:
    ids = {n.id for n in wf.nodes}
    if len(ids) != len(wf.nodes):
        raise ValueError(f"workflow {wf.name}: duplicate node ids")
    for n in wf.nodes:
        if n.type not in SPECS:
            raise ValueError(f"workflow {wf.name}: node {n.id} has type {n.type!r} with no entry in SPECS")
        names = {i[0] for i in SPECS[n.type][0]}
        for k, v in n.inputs.items():
            if k not in names:
                raise ValueError(f"workflow {wf.name}: node {n.id} ({n.type}) has no input {k!r} (has {sorted(names)})")
            if _is_link(v) and v[0] not in ids:
                raise ValueError(f"workflow {wf.name}: node {n.id}.{k} links to missing node {v[0]}")
        for name, _t, kind in SPECS[n.type][0]:
            if "?" not in kind and name not in n.inputs:
                raise ValueError(f"workflow {wf.name}: node {n.id} ({n.type}) lacks required input {name!r}")


FILE_WIDGETS = ("unet_name", "clip_name", "vae_name", "turbo")  # combos of (long) model file names


def _default_size(n: Node) -> list[float]:
    if n.size:
        return list(n.size)
    ins, outs, _ = SPECS[n.type]
    links = sum(1 for i in ins if i[2].startswith("link"))
    widgets = sum(1 for i in ins if i[2].startswith("widget"))
    width = 360 if any(i[0] in FILE_WIDGETS for i in ins) else 320
    return [width, 46 + 24 * max(links, len(outs)) + 26 * widgets]


def to_ui(wf: Workflow) -> dict:
    """The LiteGraph (UI) JSON of ``wf``: version 0.4, nodes with widgets_values, a links table, groups."""
    _check(wf)
    by_id = {n.id: n for n in wf.nodes}
    order = _topo_order(wf)
    links: list[list] = []
    out_links: dict[tuple[int, int], list[int]] = {}
    in_entries: dict[int, list[dict]] = {}
    for n in wf.nodes:
        entries = []
        for name, typ, kind in SPECS[n.type][0]:
            v = n.inputs.get(name)
            if kind.startswith("link"):
                e = {"name": name, "type": typ, "link": None}
                if "?" in kind:
                    e["shape"] = 7
            elif _is_link(v):
                e = {"name": name, "type": typ, "widget": {"name": name}, "link": None}
            else:
                continue
            if _is_link(v):
                src, slot = v
                lid = len(links) + 1
                st = SPECS[by_id[src].type][1][slot][1]
                links.append([lid, src, slot, n.id, len(entries), st])
                out_links.setdefault((src, slot), []).append(lid)
                e["link"] = lid
            entries.append(e)
        in_entries[n.id] = entries
    nodes = []
    for n in sorted(wf.nodes, key=lambda n: n.id):
        ins, outs, cnr = SPECS[n.type]
        wv = []
        for name, _typ, kind in ins:
            if not kind.startswith("widget"):
                continue
            v = n.inputs.get(name)
            if _is_link(v):
                v = None
            wv.append(v)
            if "+ctrl" in kind:
                wv.append(_ctrl_default(n))
            if "+upload" in kind:
                wv.append("image")
        d = {"id": n.id, "type": n.type, "pos": list(n.pos), "size": _default_size(n), "flags": {},
             "order": order[n.id], "mode": 0, "inputs": in_entries[n.id],
             "outputs": [{"name": on, "type": ot, "links": out_links.get((n.id, k)) or None}
                         for k, (on, ot) in enumerate(outs)]}
        if n.title:
            d["title"] = n.title
        props = {"Node name for S&R": n.type}
        if cnr:
            props["cnr_id"] = cnr
        models = _node_models(n)
        if models:
            props["models"] = models
        d["properties"] = props if n.type not in NOTE_TYPES else {}
        if wv:  # the frontend writes no widgets_values for a node without widgets
            d["widgets_values"] = wv
        if n.color:
            d["color"], d["bgcolor"] = n.color, "#000"
        nodes.append(d)
    groups = []
    for gi, (title, members) in enumerate(wf.groups, 1):
        ms = [by_id[i] for i in members]
        x0 = min(m.pos[0] for m in ms) - 20
        y0 = min(m.pos[1] for m in ms) - 60
        x1 = max(m.pos[0] + _default_size(m)[0] for m in ms) + 20
        y1 = max(m.pos[1] + _default_size(m)[1] for m in ms) + 20
        groups.append({"id": gi, "title": title, "bounding": [x0, y0, x1 - x0, y1 - y0], "color": "#3f789e",
                       "font_size": 24, "flags": {}})
    out = {
        "id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"h3-turbo/example_workflows/{wf.name}")),
        "revision": 0,
        "last_node_id": max(n.id for n in wf.nodes),
        "last_link_id": len(links),
        "nodes": nodes,
        "links": links,
        "groups": groups,
        "config": {},
        "extra": {"ds": _fit_view(wf, groups),
                  "h3_turbo": {"generator": "python -m h3_turbo.tools.workflows", "api_twin": f"api/{wf.name}.json",
                               "title": wf.title}},
        "version": 0.4,
    }
    models = [m for n in nodes for m in n["properties"].get("models", [])]
    if models:  # the graph-level list (frontend schema: name, url, directory), one entry per file
        out["models"] = [m for k, m in enumerate(models) if m not in models[:k]]
    return out


def _node_models(n: Node) -> list[dict]:
    """The ``properties.models`` entries of ``n`` (frontend convention: name, url, directory) for the file names
    among its widget values that :data:`MODEL_SOURCES` knows."""
    return [{"name": v, "url": MODEL_SOURCES[v][1], "directory": MODEL_SOURCES[v][0]}
            for v in n.inputs.values() if isinstance(v, str) and v in MODEL_SOURCES]


VIEW_W, VIEW_H = 1450, 820  # the canvas area a workflow should fit on opening (a 1600x1000 window, less the UI)
MIN_SCALE = 0.6  # below this zoom the frontend draws nodes without their text (low-quality rendering)


def _fit_view(wf: Workflow, groups: list[dict]) -> dict:
    """``extra.ds`` (LiteGraph: screen = (pos + offset) * scale) that opens on the graph's top-left corner (the
    note) at the largest zoom that fits the whole graph, but never below :data:`MIN_SCALE`."""
    boxes = [(n.pos[0], n.pos[1] - TITLE_H, n.pos[0] + _default_size(n)[0], n.pos[1] + _default_size(n)[1])
             for n in wf.nodes]
    boxes += [(g["bounding"][0], g["bounding"][1], g["bounding"][0] + g["bounding"][2],
               g["bounding"][1] + g["bounding"][3]) for g in groups]
    x0, y0 = min(b[0] for b in boxes), min(b[1] for b in boxes)
    x1, y1 = max(b[2] for b in boxes), max(b[3] for b in boxes)
    scale = round(max(MIN_SCALE, min(1.0, VIEW_W / (x1 - x0), VIEW_H / (y1 - y0))), 2)
    return {"scale": scale, "offset": [round(90 / scale - x0), round(90 / scale - y0)]}


def to_api(wf: Workflow) -> dict:
    """The API-format prompt of ``wf``: {"<id>": {"class_type", "inputs", "_meta": {"title"}}}; notes dropped,
    unset optional inputs omitted, links as ["<id>", slot]."""
    _check(wf)
    out = {}
    for n in sorted(wf.nodes, key=lambda n: n.id):
        if n.type in NOTE_TYPES:
            continue
        inputs = {}
        for name, _typ, _kind in SPECS[n.type][0]:
            if name not in n.inputs:
                continue
            v = n.inputs[name]
            inputs[name] = [str(v[0]), v[1]] if _is_link(v) else v
        out[str(n.id)] = {"class_type": n.type, "inputs": inputs, "_meta": {"title": n.title or SPECS.title(n.type)}}
    return out


def ui_to_api(ui: dict, specs: dict | None = None, title=None) -> dict:
    """Convert a UI (LiteGraph) workflow to an API prompt, reading only ``ui``, a spec table
    ({type: (inputs, outputs, ...)}, default :data:`SPECS`) and ``title`` (type -> display name, default
    ``SPECS.title``: the title the frontend gives an untitled node). Bypassed/muted nodes (mode != 0) and notes
    are dropped. Raises ValueError naming the node when widgets_values does not fit the spec."""
    specs = specs or SPECS
    title = title or SPECS.title
    links = {lk[0]: lk for lk in ui["links"]}
    out = {}
    for nd in ui["nodes"]:
        if nd["type"] in NOTE_TYPES or nd.get("mode", 0) != 0:
            continue
        if nd["type"] not in specs:
            raise ValueError(f"node {nd['id']}: no spec for type {nd['type']!r}")
        ins = specs[nd["type"]][0]
        by_name = {e["name"]: e for e in nd.get("inputs", [])}
        wv = list(nd.get("widgets_values") or [])
        inputs, k = {}, 0
        for name, _typ, kind in ins:
            e = by_name.get(name)
            linked = e is not None and e.get("link") is not None
            if kind.startswith("widget"):
                if k >= len(wv):
                    raise ValueError(f"node {nd['id']} ({nd['type']}): widgets_values has {len(wv)} values, "
                                     f"the spec needs one for {name!r}")
                val = wv[k]
                k += 1 + ("+ctrl" in kind) + ("+upload" in kind)
                if not linked:
                    inputs[name] = val
            if linked:
                lk = links[e["link"]]
                inputs[name] = [str(lk[1]), lk[2]]
        if k != len(wv):
            raise ValueError(f"node {nd['id']} ({nd['type']}): widgets_values has {len(wv)} values, spec uses {k}")
        out[str(nd["id"])] = {"class_type": nd["type"], "inputs": inputs,
                              "_meta": {"title": nd.get("title") or title(nd["type"])}}
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


# ---------------------------------------------------------------------------------------------- files
TEXT_ENCODER = "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors"
VIDEO_VAE = "minimax_h3_video_vae_fp16.safetensors"
AUDIO_VAE = "minimax_h3_audio_vae_fp32.safetensors"
NVFP4_MODEL = "minimax_h3_fl2va_nvfp4.safetensors"
TURBO_4STEP = "minimax_h3_fl2v_turbo_4step_v1.1_768p_comfyui_bf16.safetensors"
TURBO_8STEP = "minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors"
TINY_MODEL = "h3_tiny_nvfp4.safetensors"
TINY_TURBO_4STEP = "h3_tiny_turbo_4step_comfyui_bf16.safetensors"
_CORE_H3 = "https://huggingface.co/Comfy-Org/MiniMax-H3/resolve/main/"
_TURBO = "https://huggingface.co/lightx2v/Minimax-h3-Turbo/resolve/main/"
#: where each file the real workflows need comes from: {file name: (ComfyUI models folder, public download URL)}.
#: Core's H3 files: the Comfy-Org/MiniMax-H3 repository core's own H3 templates download them from; the Turbo
#: LoRAs: lightx2v/Minimax-h3-Turbo (docs/h3-facts.md#turbo-lora-files). The H3 NVFP4 model has no official
#: download (community exports only), so it has no entry: the frontend's schema needs a URL, and the notes say
#: where the file goes.
MODEL_SOURCES: dict[str, tuple[str, str]] = {
    TEXT_ENCODER: ("text_encoders", _CORE_H3 + "text_encoders/" + TEXT_ENCODER),
    VIDEO_VAE: ("vae", _CORE_H3 + "vae/" + VIDEO_VAE),
    AUDIO_VAE: ("vae", _CORE_H3 + "vae/" + AUDIO_VAE),
    TURBO_4STEP: ("loras", _TURBO + TURBO_4STEP),
    TURBO_8STEP: ("loras", _TURBO + TURBO_8STEP),
}
PROMPT = ("A calm restaurant at dusk. The camera slowly pushes in past the tables toward the window; warm lamps, "
          "soft chatter, cutlery clinking, a quiet piano in the background.")

_FILES_NOTE = """## Files (ComfyUI `models/` folder)

- `{model}` in `diffusion_models/`: your MiniMax H3 FL2VA checkpoint in NVFP4 (ComfyUI-native, ModelOpt or LightX2V export; there is no official NVFP4 release), or a BF16 one (quantized while loading). Pick it in the loader.
{rows}
ComfyUI's missing-models panel offers the downloads with a source. Put the first frame in ComfyUI's `input/` folder, or upload it in the Load Image node.
"""


def _files_note(*files: str) -> str:
    """The note's file list: the H3 model, then ``files`` (keys of :data:`MODEL_SOURCES`) with folder and source."""
    rows = ""
    for f in files:
        folder, url = MODEL_SOURCES[f]
        repo = url.split("huggingface.co/", 1)[1].split("/resolve/", 1)[0]
        rows += f"- `{f}` in `{folder}/`, from [{repo}]({url})\n"
    return _FILES_NOTE.format(model=NVFP4_MODEL, rows=rows)


TITLE_H = 30   # LiteGraph draws a node's title bar above its pos
NODE_GAP = 40  # vertical gap between stacked nodes
GROUP_GAP = 120  # vertical gap between stacked groups (group headers take ~60 px)


def _stack(nodes: list[Node], segments: list[tuple]) -> list[Node]:
    """Set node positions column by column: each segment (x, top, [ids]) stacks its nodes downwards from
    ``top`` (a number, or ("below", [ids]) = under the lowest of those nodes + GROUP_GAP)."""
    by_id = {n.id: n for n in nodes}
    for x, top, ids in segments:
        if isinstance(top, tuple):
            top = max(by_id[i].pos[1] + _default_size(by_id[i])[1] for i in top[1]) + GROUP_GAP + TITLE_H
        y = top
        for i in ids:
            by_id[i].pos = (x, y)
            y += _default_size(by_id[i])[1] + TITLE_H + NODE_GAP
    return nodes


def _real_front(turbo: str | None) -> list[Node]:
    """Nodes 1-8 shared by the real workflows: image, loaders, attention (+ Turbo), conditioning."""
    nodes = [
        Node(1, "LoadImage", {"image": "example.png"}, (0, 660), title="First frame", size=(320, 340)),
        Node(2, "H3TurboNVFP4Loader", {"unet_name": NVFP4_MODEL, "compute": "auto", "adaln": "auto", "weights": "auto"}, (0, 0)),
        Node(3, "H3TurboAttention", {"model": (2, 0), "backend": "auto"}, (380, 0)),
        Node(5, "CLIPLoader", {"clip_name": TEXT_ENCODER, "type": "minimax", "device": "default"}, (0, 160)),
        Node(6, "VAELoader", {"vae_name": VIDEO_VAE}, (0, 340), title="Video VAE"),
        Node(7, "VAELoader", {"vae_name": AUDIO_VAE}, (0, 450), title="Audio VAE"),
        Node(8, "MiniMaxH3ImageToVideo", {"clip": (5, 0), "vae": (6, 0), "prompt": PROMPT, "width": 960, "height": 544,
                                          "length": 124, "first_frame": (1, 0)}, (380, 660), size=(400, 420)),
    ]
    if turbo:
        nodes.append(Node(4, "H3TurboLoRA", {"model": (3, 0), "turbo": turbo, "strength": 1.0, "variant": "auto"},
                          (380, 150)))
    return nodes


def _real_back(model_src: int, sigmas: Node, sampler: Node, seed: int, prefix: str) -> list[Node]:
    return [
        Node(9, "BasicGuider", {"model": (model_src, 0), "conditioning": (8, 0)}, (820, 0)),
        sigmas, sampler,
        Node(12, "RandomNoise", {"noise_seed": seed}, (820, 470)),
        Node(13, "SamplerCustomAdvanced", {"noise": (12, 0), "guider": (9, 0), "sampler": (11, 0), "sigmas": (10, 0),
                                           "latent_image": (8, 1)}, (1200, 0)),
        Node(14, "VAEDecode", {"samples": (13, 0), "vae": (6, 0)}, (1620, 0)),
        Node(15, "VAEDecodeAudio", {"samples": (13, 0), "vae": (7, 0)}, (1620, 140)),
        Node(16, "CreateVideo", {"images": (14, 0), "fps": 24.0, "audio": (15, 0), "bit_depth": 8}, (1620, 280)),
        Node(17, "SaveVideo", {"video": (16, 0), "filename_prefix": prefix, "format": "auto", "codec": "auto"},
             (2000, 0), size=(420, 420)),
    ]


def _turbo_workflow(name: str, variant: str, official: str, nfe: int, shifts: str, seed: int) -> Workflow:
    note = (f"# MiniMax H3 image to video + audio, Turbo {variant} (NVFP4)\n\n"
            f"A 960x544 video of 124 frames (about 5 s at 24 fps) with stereo sound, from a first frame and a prompt, "
            f"in {nfe} model calls instead of 20.\n\n"
            f"- **Load H3 NVFP4 Diffusion Model** loads the 33 B H3 model with 4-bit (NVFP4) weights; `compute` "
            f"auto picks the fastest path for your GPU.\n"
            f"- **Apply H3 Turbo LoRA** adds the official {variant} Turbo LoRA beside the weights (never merged). "
            f"The LoRA decides the sampling: {nfe} model calls, shifts {shifts}.\n"
            f"- **H3 Turbo Sigmas** at steps 0 takes the LoRA's {nfe}; any other step count is refused with an "
            f"error, as is CFG: keep Basic Guider.\n"
            f"- **H3 Turbo Sampler** is the sampler the LoRA was trained with.\n"
            f"- First and last frame: connect a second Load Image to `last_frame` of MiniMax H3 Image to Video.\n\n"
            + _files_note(official, TEXT_ENCODER, VIDEO_VAE, AUDIO_VAE))
    nodes = _real_front(official) + _real_back(
        4, Node(10, "H3TurboSigmas", {"model": (4, 0), "steps": 0}, (820, 140)),
        Node(11, "H3TurboSampler", {"state_dtype": "fp32", "update": "auto"}, (820, 350)), seed, f"h3turbo/turbo_{variant}")
    nodes.append(Node(30, "MarkdownNote", {"text": note}, (-620, 0), title="Read me", size=(580, 540),
                      color="#432"))
    _stack(nodes, [(0, 0, [2, 5, 6, 7]), (380, 0, [3, 4]), (0, ("below", [2, 3, 4, 5, 6, 7]), [1]),
                   (380, ("below", [2, 3, 4, 5, 6, 7]), [8]), (840, 0, [9, 10, 11, 12]), (1220, 0, [13]),
                   (1640, 0, [14, 15, 16]), (2020, 0, [17])])
    return Workflow(name, f"MiniMax H3 FL2VA Turbo {variant} (NVFP4)", nodes,
                    groups=[("Models", [2, 3, 4, 5, 6, 7]), ("Prompt and first frame", [1, 8]),
                            ("Sampling", [9, 10, 11, 12, 13]), ("Decode and save", [14, 15, 16, 17])])


def _base_workflow() -> Workflow:
    note = ("# MiniMax H3 image to video + audio, 20 steps (no Turbo)\n\n"
            "Core's own sampling, unchanged: the `res_multistep` sampler with the `beta` scheduler, 20 steps, shifts "
            "12/3 (ModelSamplingMiniMaxH3), no CFG, on the pack's NVFP4 loader and attention. Use it as the "
            "reference for the Turbo workflows.\n\n"
            "- When you compare with core's own loader, set `compute` to `exact` on the loader: `auto` may pick "
            "the approximate `fp8` path (Ada/Hopper GPUs).\n\n"
            + _files_note(TEXT_ENCODER, VIDEO_VAE, AUDIO_VAE))
    nodes = _real_front(None)
    nodes.append(Node(4, "MiniMaxH3SigmaShift", {"model": (3, 0), "shift_video": 12.0, "shift_audio": 3.0}, (380, 150)))
    nodes += _real_back(4, Node(10, "BasicScheduler", {"model": (4, 0), "scheduler": "beta", "steps": 20, "denoise": 1.0},
                                (820, 140)),
                        Node(11, "KSamplerSelect", {"sampler_name": "res_multistep"}, (820, 350)), 440408,
                        "h3turbo/base_beta_res")
    nodes.append(Node(30, "MarkdownNote", {"text": note}, (-620, 0), title="Read me", size=(580, 440),
                      color="#432"))
    _stack(nodes, [(0, 0, [2, 5, 6, 7]), (380, 0, [3, 4]), (0, ("below", [2, 3, 4, 5, 6, 7]), [1]),
                   (380, ("below", [2, 3, 4, 5, 6, 7]), [8]), (840, 0, [9, 10, 11, 12]), (1220, 0, [13]),
                   (1640, 0, [14, 15, 16]), (2020, 0, [17])])
    return Workflow("h3turbo_base_beta_res_20step", "MiniMax H3 base beta/RES 20 steps (no Turbo)", nodes,
                    groups=[("Models", [2, 3, 4, 5, 6, 7]), ("Prompt and first frame", [1, 8]),
                            ("Sampling", [9, 10, 11, 12, 13]), ("Decode and save", [14, 15, 16, 17])])


def _tiny_workflow() -> Workflow:
    note = ("# Tiny demo (runs on the CPU in seconds)\n\n"
            "The whole Turbo path (NVFP4 loader, Turbo LoRA, Turbo sigmas and sampler) on a tiny H3 with the real "
            "layout (50 + 2 blocks, width 64) and a tiny 4-step Turbo LoRA, without the 60 GB of real files. It "
            "has no text encoder and no VAE: **H3 Turbo Random Conditioning** stands in for the prompt, and the "
            "outputs are the video and audio latents plus a latent preview video.\n\n"
            "- Turbo off: set the LoRA's `turbo` to `none` **and** H3 Turbo Sigmas' `steps` above 0 (steps 0 means "
            "the LoRA's count, and there is none).\n\n"
            "## Files\n\nMake them with `python -m h3_turbo.tools make-fixtures <folder>`, then start ComfyUI "
            "with that folder as a models folder (README, \"Serve the tiny demo\"):\n\n"
            f"- `{TINY_MODEL}` in `diffusion_models/`\n- `{TINY_TURBO_4STEP}` in `loras/`\n"
            "- `h3_tiny_turbo_8step_comfyui_bf16.safetensors` in `loras/`\n")
    nodes = [
        Node(1, "H3TurboNVFP4Loader", {"unet_name": TINY_MODEL, "compute": "auto", "adaln": "auto", "weights": "auto"}, (0, 0)),
        Node(2, "H3TurboLoRA", {"model": (1, 0), "turbo": TINY_TURBO_4STEP, "strength": 1.0, "variant": "auto"},
             (380, 0)),
        Node(3, "H3TurboTestConditioning", {"model": (2, 0), "seed": 0, "tokens": 16}, (380, 170)),
        Node(4, "BasicGuider", {"model": (2, 0), "conditioning": (3, 0)}, (800, 0)),
        Node(5, "H3TurboSigmas", {"model": (2, 0), "steps": 0}, (800, 130)),
        Node(6, "H3TurboSampler", {"state_dtype": "fp32", "update": "auto"}, (800, 260)),
        Node(7, "RandomNoise", {"noise_seed": 42}, (800, 370)),
        Node(8, "EmptyMiniMaxH3LatentAV", {"width": 128, "height": 96, "length": 22}, (800, 500)),
        Node(9, "SamplerCustomAdvanced", {"noise": (7, 0), "guider": (4, 0), "sampler": (6, 0), "sigmas": (5, 0),
                                          "latent_image": (8, 0)}, (1180, 0)),
        Node(10, "LTXVSeparateAVLatent", {"av_latent": (9, 0)}, (1600, 0)),
        Node(11, "SaveLatent", {"samples": (10, 0), "filename_prefix": "h3turbo/tiny_video"}, (2020, 0),
             title="Save video latent"),
        Node(12, "SaveLatent", {"samples": (10, 1), "filename_prefix": "h3turbo/tiny_audio"}, (2020, 150),
             title="Save audio latent"),
        Node(13, "H3TurboSaveLatentPreview", {"av_latent": (9, 0), "filename_prefix": "h3turbo/tiny_preview"},
             (1600, 150), size=(380, 380)),
        Node(30, "MarkdownNote", {"text": note}, (-620, 0), title="Read me", size=(580, 400), color="#432"),
    ]
    _stack(nodes, [(0, 0, [1]), (380, 0, [2, 3]), (800, 0, [4, 5, 6, 7, 8]), (1180, 0, [9]), (1600, 0, [10, 13]),
                   (2020, 0, [11, 12])])
    return Workflow("h3turbo_tiny_demo", "H3 Turbo tiny demo (fixtures, CPU)", nodes,
                    groups=[("Model + Turbo", [1, 2, 3]), ("Sampling", [4, 5, 6, 7, 8, 9]), ("Save", [10, 11, 12, 13])])


def workflows() -> list[Workflow]:
    """Every example workflow, in template-browser order."""
    return [
        _turbo_workflow("h3turbo_fl2va_turbo_4step_nvfp4", "4step", TURBO_4STEP, 4, "6/3 (video/audio)", 440408),
        _turbo_workflow("h3turbo_fl2va_turbo_8step_nvfp4", "8step", TURBO_8STEP, 8, "12/3 (video/audio)", 440408),
        _base_workflow(),
        _tiny_workflow(),
    ]


def dumps(obj: dict) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"


def rendered(out_dir: Path = OUT_DIR) -> dict[Path, str]:
    """{path: file text} for every generated file under ``out_dir``."""
    files = {}
    for wf in workflows():
        files[out_dir / f"{wf.name}.json"] = dumps(to_ui(wf))
        files[out_dir / "api" / f"{wf.name}.json"] = dumps(to_api(wf))
    return files


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m h3_turbo.tools.workflows",
                                description="Write the pack's example workflows (UI and API format) from one "
                                            "description; --check compares instead.")
    p.add_argument("--check", action="store_true", help="exit 1 if a committed file differs from the generator")
    p.add_argument("--out", default=str(OUT_DIR), help="output folder (default: the pack's example_workflows/)")
    a = p.parse_args(argv)
    files = rendered(Path(a.out))
    bad = []
    for path, text in files.items():
        if a.check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                bad.append(str(path))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            print(path)
    if bad:
        print("out of date (run python -m h3_turbo.tools.workflows):\n  " + "\n  ".join(bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
