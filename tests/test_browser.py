"""The pack as a user meets it in ComfyUI's own frontend: headless Chromium (Playwright) on the real server of
tests/conftest.py (``server``: ``main.py --cpu --listen 127.0.0.1`` with the pack and the tiny fixtures).

One browser and one page for the whole module. As a user would: the node library lists every pack node under
"H3 Turbo"; each UI example workflow dropped on the canvas loads with no missing node types and every widget
value valid for its widget, the graph the frontend would queue (its own ``app.graphToPrompt()``) equals the
workflow's ``api/`` twin, and a file the fixture server lacks is one the frontend can name the folder (and the
download) of; the tiny demo queued with the Run button completes with progress events and its outputs are
served; no page errors from the pack. A screenshot of each loaded workflow is saved under pytest's tmp dir (the
path is printed at the end of the run).

Skipped loudly (conftest) when Playwright or Chromium is missing.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import chromium_path  # tests/ is on sys.path (as for tests/corpus)
from h3_turbo.tools import workflows as W

pytestmark = [pytest.mark.browser, pytest.mark.server]

REPO = Path(__file__).resolve().parent.parent
EX = REPO / "example_workflows"
NAMES = [w.name for w in W.workflows()]
VIEWPORT = {"width": 1600, "height": 1000}
RUN_TIMEOUT_MS = 240_000

# Helpers installed in the page. ``stores()`` reads the frontend's own Pinia stores (missing nodes / models /
# media), ``drop(text, name)`` drops a .json file on the canvas like a drag from the desktop.
PAGE_HELPERS = """() => {
  const pinia = () => Array.from(document.querySelectorAll('*')).find(e => e.__vue_app__)
      .__vue_app__.config.globalProperties.$pinia;
  window.__h3 = {
    events: [],
    store: id => pinia()._s.get(id),
    drop: async (text, name) => {
      const dt = new DataTransfer();
      dt.items.add(new File([text], name, {type: 'application/json'}));
      document.querySelector('#graph-canvas').dispatchEvent(
          new DragEvent('drop', {dataTransfer: dt, bubbles: true, cancelable: true}));
    },
  };
  const api = window.comfyAPI.api.api;
  for (const t of ['execution_start', 'executing', 'progress', 'executed', 'execution_cached', 'execution_success',
                   'execution_error', 'execution_interrupted'])
    api.addEventListener(t, e => window.__h3.events.push([t, e.detail]));
}"""

# What the loaded graph looks like to the frontend: per node its widgets (name, type, value, options) and
# whether its type is a registered node type; the missing-nodes / missing-models / missing-media findings.
GRAPH_STATE = """() => {
  const LG = window.LiteGraph, graph = window.app.graph;
  const plain = v => (v === undefined ? null : JSON.parse(JSON.stringify(v)));
  const nodes = graph.nodes.map(n => ({
    id: n.id, type: n.type, title: n.title, registered: n.type in LG.registered_node_types,
    has_def: !!(n.constructor && n.constructor.nodeData),
    widgets: (n.widgets || []).map(w => ({
      name: w.name, type: w.type, value: plain(w.value),
      values: Array.isArray(w.options && w.options.values) ? w.options.values : null,
      min: w.options ? plain(w.options.min) : null, max: w.options ? plain(w.options.max) : null,
      precision: w.options ? plain(w.options.precision) : null,
    })),
  }));
  const mm = window.__h3.store('missingModel'), mn = window.__h3.store('missingNodesError');
  const media = window.__h3.store('missingMedia');
  return {
    nodes,
    missing_nodes: plain(mn.missingNodesError),
    missing_models: plain(mm.missingModelCandidates || []),
    missing_media: plain(media.missingMediaCandidates || []),
    serialized: plain(graph.serialize().nodes.map(n => [n.id, n.widgets_values === undefined ? null : n.widgets_values])),
  };
}"""


SETTLED = """() => {
  const listed = new Set([...(window.__h3.store('missingModel').missingModelCandidates || []),
                          ...(window.__h3.store('missingMedia').missingMediaCandidates || [])].map(m => m.name));
  return window.app.graph.nodes.every(n => (n.widgets || []).every(w =>
      !Array.isArray(w.options && w.options.values) || w.options.values.includes(w.value) || listed.has(w.value)));
}"""


class UI:
    def __init__(self, page, errors: list, shots: Path, server: dict):
        self.page, self.errors, self.shots, self.server = page, errors, shots, server

    def drop_workflow(self, name: str) -> None:
        """Drop ``example_workflows/<name>.json`` on the canvas; wait until the frontend has loaded it."""
        text = (EX / f"{name}.json").read_text(encoding="utf-8")
        # a new blank workflow first (Ctrl+Alt+N), so the wait below cannot see the previous graph
        self.page.evaluate("() => window.app.extensionManager.command.execute('Comfy.NewBlankWorkflow')")
        self.page.wait_for_function("() => !(window.app.graph.extra || {}).h3_turbo")
        self.page.evaluate("([t, n]) => window.__h3.drop(t, n)", [text, f"{name}.json"])
        self.page.wait_for_function(
            "twin => ((window.app.graph.extra || {}).h3_turbo || {}).api_twin === twin",
            arg=f"api/{name}.json", timeout=30_000)
        # the missing-model/media checks run after the graph is configured: wait until each combo value the
        # server does not offer is listed by them (or 10 s; the test's asserts then say what is missing)
        from playwright.sync_api import TimeoutError as PlaywrightTimeout

        try:
            self.page.wait_for_function(SETTLED, timeout=10_000)
        except PlaywrightTimeout:
            pass

    def state(self) -> dict:
        return self.page.evaluate(GRAPH_STATE)

    def screenshot(self, name: str) -> Path:
        path = self.shots / f"{name}.png"
        self.page.screenshot(path=str(path))
        return path


@pytest.fixture(scope="module")
def ui(server, tmp_path_factory, request):
    import requests
    from playwright.sync_api import sync_playwright

    # a user who has opened ComfyUI before: no first-run template browser over the canvas
    r = requests.post(server["url"] + "/settings/Comfy.TutorialCompleted", json=True, timeout=10)
    assert r.status_code == 200, r.text
    shots = tmp_path_factory.mktemp("browser_screenshots")
    request.config._h3_browser_screenshots = shots  # printed in the terminal summary (conftest)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport=VIEWPORT)
            errors: list[tuple[str, str]] = []
            page.on("pageerror", lambda e: errors.append(("pageerror", str(e))))
            page.on("console", lambda m: errors.append(("console", m.text)) if m.type == "error" else None)
            page.goto(server["url"])
            page.wait_for_function("() => window.app && window.app.graph && window.comfyAPI && "
                                   "window.app.extensionManager", timeout=60_000)
            page.evaluate(PAGE_HELPERS)
            yield UI(page, errors, shots, server)
        finally:
            browser.close()


def _pack_node_info(server) -> dict[str, dict]:
    import requests

    info = requests.get(server["url"] + "/object_info", timeout=30).json()
    ready = requests.get(server["url"] + "/h3turbo/ready", timeout=10).json()
    assert ready["nodes"], "the pack registered no nodes"
    return {nid: info[nid] for nid in ready["nodes"]}


def _core_drift(server) -> dict[str, dict]:
    """{core node type of the files: its live defaults ({widget: default}, tools/workflows.live_defaults)} for the
    core nodes whose live definition differs from the hand-kept spec (a newer core), printed with the differences
    (W.core_drift raises for a difference the files do not survive)."""
    import requests

    info = requests.get(server["url"] + "/object_info", timeout=30).json()
    out = {}
    for t in W.CORE_SPECS:
        if t in W.NOTE_TYPES or t not in info:
            continue
        drift = W.core_drift(t, info[t])
        if drift:
            print(f"\n[core drift] {t}: " + "; ".join(drift))
            out[t] = W.live_defaults(info[t])
    return out


def _tolerated(got: list | None, want: list | None, defaults: dict) -> list:
    """The values ``got`` (the frontend's widgets_values of a drifted core node) has beyond the file's ``want``: the
    file's values first, then only defaults of the live definition's widgets. [] when equal; AssertionError else."""
    got, want = list(got or []), list(want or [])
    assert got[:len(want)] == want, (got, want)
    extra = got[len(want):]
    assert all(v in defaults.values() for v in extra), (extra, defaults)
    return extra


def test_node_library_lists_every_pack_node_under_h3_turbo(ui):
    page = ui.page
    pack = _pack_node_info(ui.server)
    assert {d["category"] for d in pack.values()} == {"H3 Turbo"}
    page.locator("button.node-library-tab-button").click()
    folder = page.locator("[role=treeitem][aria-level='1']", has_text="H3 Turbo")
    folder.wait_for(timeout=10_000)
    if folder.get_attribute("aria-expanded") != "true":
        folder.click()
    page.wait_for_function("() => document.querySelectorAll(\"[role=treeitem][aria-level='2']\").length > 0")
    rows = page.evaluate("""() => Array.from(document.querySelectorAll('[role=treeitem]'))
        .map(e => [e.getAttribute('aria-level'), e.innerText.trim()])""")
    start = rows.index(["1", "H3 Turbo"])
    under = []
    for level, text in rows[start + 1:]:
        if level == "1":
            break
        under.append(text)
    assert sorted(under) == sorted(d["display_name"] for d in pack.values())
    ui.screenshot("node_library")
    page.locator("button.node-library-tab-button").click()  # close the sidebar again


@pytest.mark.parametrize("name", NAMES)
def test_workflow_loads_exactly_as_its_api_twin(ui, name):
    ui.drop_workflow(name)
    st = ui.state()
    ui_json = json.loads((EX / f"{name}.json").read_text(encoding="utf-8"))
    api = json.loads((EX / "api" / f"{name}.json").read_text(encoding="utf-8"))
    shot = ui.screenshot(name)

    # no missing node types: every node is a registered type, with its definition from the server (the notes are
    # the frontend's own)
    assert not st["missing_nodes"], st["missing_nodes"]
    bad = [(n["id"], n["type"]) for n in st["nodes"]
           if not (n["registered"] and (n["has_def"] or n["type"] in W.NOTE_TYPES))]
    assert not bad, f"nodes the frontend does not know: {bad}"

    # the frontend read every widget value from the file unchanged (widgets_values in the frontend's order); on a
    # newer core whose definition of a core node adds widgets, the file's values first, then those widgets' defaults
    drift = _core_drift(ui.server)
    types = {n["id"]: n["type"] for n in ui_json["nodes"]}
    got = dict(map(tuple, st["serialized"]))
    for n in ui_json["nodes"]:
        if n["type"] in drift:
            _tolerated(got[n["id"]], n.get("widgets_values"), drift[n["type"]])
        else:
            assert got[n["id"]] == n.get("widgets_values"), (n["id"], n["type"])
    assert set(got) == set(types)

    # every widget value is valid for its widget; a combo value that is not offered must be a file the fixture
    # server lacks, which the frontend itself reports as a missing model (with its folder) or missing media
    missing_models = {m["name"]: m for m in st["missing_models"]}
    missing_media = {m["name"] for m in st["missing_media"]}
    for n in st["nodes"]:
        for w in n["widgets"]:
            where = f"{name}: node {n['id']} ({n['type']}) widget {w['name']!r} = {w['value']!r}"
            if w["values"] is not None:
                assert w["value"] in w["values"] or w["value"] in missing_models or w["value"] in missing_media, where
            elif w["type"] == "number":
                assert isinstance(w["value"], (int, float)), where
                assert w["min"] is None or w["value"] >= w["min"], where
                assert w["max"] is None or w["value"] <= w["max"], where
                if w["precision"] == 0:
                    assert float(w["value"]).is_integer(), where
    for fname, m in missing_models.items():
        assert fname in W.MODEL_SOURCES or fname == W.NVFP4_MODEL, (name, m)
        if fname in W.MODEL_SOURCES:
            directory, url = W.MODEL_SOURCES[fname]
            assert (m.get("directory"), m.get("url")) == (directory, url), (name, m)
    if name == "h3turbo_tiny_demo":  # every file of the tiny demo is on the fixture server
        assert not missing_models and not missing_media, (missing_models, missing_media)

    # the graph the frontend would queue is the API twin
    queued = ui.page.evaluate("async () => (await window.app.graphToPrompt()).output")
    for nid, node in api.items():      # a drifted core node: the twin's inputs, plus the added widgets' defaults
        if node["class_type"] in drift and nid in queued:
            defaults = drift[node["class_type"]]
            q = queued[nid]["inputs"]
            added = {k: v for k, v in q.items() if k not in node["inputs"]}
            assert all(defaults.get(k) == v for k, v in added.items()), (nid, added, defaults)
            queued[nid] = dict(queued[nid], inputs={k: v for k, v in q.items() if k in node["inputs"]})
    assert queued == api, f"{name}: the frontend would queue another graph than api/{name}.json (screenshot {shot})"


def test_tiny_demo_runs_from_the_run_button(ui):
    page = ui.page
    ui.drop_workflow("h3turbo_tiny_demo")
    # a noise seed no other test uses, set in the RandomNoise widget, so the sampler runs even when an earlier test
    # of this session ran the same graph (ComfyUI would serve it from its cache)
    seed = 777001
    page.evaluate("""s => { window.app.graph.getNodeById(7).widgets.find(w => w.name === 'noise_seed').value = s; }""",
                  seed)
    page.evaluate("() => { window.__h3.events.length = 0; }")
    page.get_by_test_id("queue-button").click()
    page.wait_for_function("() => window.__h3.events.some(e => ['execution_success', 'execution_error', "
                           "'execution_interrupted'].includes(e[0]))", timeout=RUN_TIMEOUT_MS)
    events = page.evaluate("() => window.__h3.events")
    kinds = [e for e, _ in events]
    assert "execution_error" not in kinds and "execution_interrupted" not in kinds, events
    (pid,) = [d["prompt_id"] for e, d in events if e == "execution_success"]
    # the sampler's progress, one event per model evaluation of the 4-step contract
    steps = [d["value"] for e, d in events if e == "progress" and d.get("node") == "9"]
    assert steps == [1, 2, 3, 4], events
    # the outputs, as the frontend received them, are served by /view
    outs = {d["node"]: d["output"] for e, d in events if e == "executed" and d.get("prompt_id") == pid}
    assert set(outs) == {"11", "12", "13"}, outs
    files = [it for o in outs.values() for k in ("latents", "images") for it in o.get(k, [])]
    assert len(files) == 3, outs
    for it in files:
        got = page.evaluate("""async it => { const r = await fetch('/api/view?' + new URLSearchParams(
            {filename: it.filename, subfolder: it.subfolder, type: it.type}));
            const b = new Uint8Array(await r.arrayBuffer());
            return [r.status, b.length, String.fromCharCode(...b.slice(4, 8))]; }""", it)
        assert got[0] == 200 and got[1] > 0, (it, got)
        assert (ui.server["output"] / it["subfolder"] / it["filename"]).stat().st_size == got[1]
        if it["filename"].endswith(".mp4"):
            assert got[2] == "ftyp", (it, got)
    # the queued prompt carried the typed seed, and the preview node shows the served video
    hist = page.evaluate("async pid => (await (await fetch('/api/history/' + pid)).json())[pid]", pid)
    assert hist["prompt"][2]["7"]["inputs"]["noise_seed"] == seed
    preview = outs["13"]["images"][0]["filename"]
    page.wait_for_function("f => Array.from(document.querySelectorAll('video')).some(v => v.src.includes(f))",
                           arg=preview, timeout=10_000)
    ui.screenshot("h3turbo_tiny_demo_after_run")


def test_no_page_errors_from_the_pack(ui):
    """Runs last: covers everything the tests above did in this page."""
    page_errors = [m for kind, m in ui.errors if kind == "pageerror"]
    assert not page_errors, page_errors
    # The frontend asks the download host of each missing model for its size; this server (--disable-api-nodes)
    # sets a Content-Security-Policy that blocks every outside connection, so those requests fail here by design.
    urls = {url for _, url in W.MODEL_SOURCES.values()}
    blocked = [m for _, m in ui.errors if "Content Security Policy" in m and any(u in m for u in urls)]
    pack = [m for _, m in ui.errors if m not in blocked
            and any(k in m.lower() for k in ("h3turbo", "h3_turbo", "h3 turbo", "h3-turbo"))]
    assert not pack, pack
