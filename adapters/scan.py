"""Recognize Turbo LoRA files on disk (for ``GET /h3turbo/ready``): by file name, header and SHA-256.

Recognition order for one ``.safetensors`` file (``recognize``, cheap: reads the header only):

1. the official file name (:func:`h3_turbo.adapters.contracts.by_filename`) -> source ``"filename"``;
2. a tiny-fixture header (``__metadata__["h3_turbo_fixture"]`` with ``nfe``) -> source ``"fixture-metadata"``;
3. otherwise, a header with the H3 Turbo LoRA layout (``diffusion_model.blocks.0.attn.qkv_proj.lora_A.weight``
   present) is a *candidate*: it is listed only if its SHA-256 equals a published one
   (:func:`h3_turbo.adapters.contracts.by_sha256`) -> source ``"sha256"``.

A ``.safetensors`` file whose header cannot be read (truncated download, Git LFS pointer, not safetensors) is
listed too, with source ``"unreadable"``, variant ``"unknown"`` and the reader's error (it may be a Turbo LoRA:
it must not vanish from the list).

SHA-256 is computed by :class:`TurboScanner` in a background thread, once per (path, size, mtime_ns),
in the Turbo LoRA loader's process-wide cache (:func:`h3_turbo.adapters.turbo_lora.sha256_file`), so the
loader and the scan never hash the same file twice. ``verified`` is True when the hash equals the published one, False when a file with
an official name has another hash (``error`` says which), None while pending or when no hash is published.

After the hash, each listed file is checked once per (path, size, mtime_ns) by :func:`check_file`: the
model-independent checks ``Apply H3 Turbo LoRA`` makes (``turbo_lora.load_turbo_lora``: keys, shapes, values,
alpha, ``training_scale``, an official name's alpha/rank) plus every block covering its four projections. A
problem goes into ``error`` (after the hash finding, when there is one), naming the file, the key and what was
expected: no listed file says ``error: null`` while it cannot be used.
"""
from __future__ import annotations

import logging
import os
import threading
import time

from .. import state
from . import contracts

log = logging.getLogger("h3_turbo")

H3_LORA_PROBE_KEY = "diffusion_model.blocks.0.attn.qkv_proj.lora_A.weight"
#: :func:`check_file` results: (real path, size, mtime_ns) -> the problem text, or None for a usable file
_CHECKS = state.Store("turbo_scan_checks")

def cached_sha256(path: str) -> str | None:
    """The cached SHA-256 of ``path`` at its current size and mtime, else None (shared with the Turbo LoRA
    loader's cache in :mod:`h3_turbo.adapters.turbo_lora`, so a file is hashed once per process)."""
    from . import turbo_lora

    return turbo_lora.cached_sha256(path)


def sha256_file(path: str) -> str:
    """SHA-256 (lowercase hex) of ``path`` through :func:`h3_turbo.adapters.turbo_lora.sha256_file` (cached per
    real path + size + mtime_ns; hashlib releases the GIL, so this is safe in a thread)."""
    from . import turbo_lora

    return turbo_lora.sha256_file(path)


def _read_header(path: str):
    from ..formats.safetensors_io import read_header

    return read_header(path)


def cached_check(path: str) -> tuple[bool, str | None]:
    """(True, problem or None) when :func:`check_file` already checked ``path`` at its current size and mtime,
    else (False, None). No I/O beyond stat."""
    from . import turbo_lora

    try:
        key = turbo_lora._stat_key(path)
    except OSError:
        return False, None
    st = _CHECKS
    with st.lock:
        if key in st.data:
            return True, st.data[key]
    return False, None


def check_file(path: str, sha: str | None = None) -> str | None:
    """Why the Turbo LoRA ``path`` cannot be used, or None: the checks of ``turbo_lora.load_turbo_lora`` (the
    loader of ``Apply H3 Turbo LoRA``) and every block covering its four projections (0..N-1 blocks and refiner
    blocks, as the file's own highest indices say). Model-independent: the sizes against a model are checked when
    it is applied. Cached per (real path, size, mtime_ns); reads the file's tensors (background thread only)."""
    import re

    from . import turbo_lora

    try:
        key = turbo_lora._stat_key(path)
    except OSError as e:
        return f"{path}: cannot stat: {e}"
    st = _CHECKS
    with st.lock:
        if key in st.data:
            return st.data[key]
    try:
        lora = turbo_lora.load_turbo_lora(path, sha256=sha)
        blocks: dict[str, set[int]] = {"blocks": set(), "token_refiner.blocks": set()}
        for t in lora.targets:
            m = re.match(r"^(blocks|token_refiner\.blocks)\.(\d+)\.", t)
            if m:
                blocks[m.group(1)].add(int(m.group(2)))
        n_blocks = max(blocks["blocks"], default=-1) + 1
        n_ref = max(blocks["token_refiner.blocks"], default=-1) + 1
        missing = [t for t in turbo_lora.target_names(n_blocks, n_ref) if t not in lora.targets]
        problem = None
        if missing:
            problem = (f"Turbo LoRA {os.path.basename(path)!r} is incomplete: " + turbo_lora._listing(
                f"missing targets (expected all four projections of blocks 0..{n_blocks - 1} and refiner blocks "
                f"0..{n_ref - 1}, as its highest block indices say)", missing) + f". File: {path}")
        del lora
    except turbo_lora.TurboLoRAError as e:
        problem = str(e)
    except Exception as e:   # any other reader failure is the file's problem too, reported, never raised
        problem = f"{path}: cannot be read as a Turbo LoRA: {type(e).__name__}: {e} (expected a Turbo LoRA file)"
    with st.lock:
        st.data[key] = problem
    return problem


def _with_problem(item: dict, problem: str | None) -> dict:
    """``item`` with ``problem`` added to its ``error`` (after a hash finding already there)."""
    if not problem:
        return item
    return dict(item, error=f"{item['error']}; {problem}" if item.get("error") else problem)


def recognize(path: str, name: str | None = None) -> dict | None:
    """Cheap recognition of one file (header only, no hashing).

    Returns None when the file is not a Turbo candidate, else a dict with ``variant`` ("4step",
    "8step" or "unknown" for a hash-only candidate), ``file`` (``name`` or the base name), ``path``,
    ``bytes``, ``source`` ("filename" | "fixture-metadata" | "candidate"), ``expected_sha256``
    (published hash or None), ``nfe``, ``shift_video``, ``shift_audio``.
    A file whose header cannot be read (an official name, or any ``.safetensors``) is listed with ``error``
    (source ``"unreadable"`` unless the official name says more; never raised). ``_readable`` (internal, removed
    before publishing) marks the items whose header was read: those are hashed and checked.
    """
    import json

    base = os.path.basename(path)
    item = {"file": name or base, "path": path, "bytes": None, "sha256": None, "verified": None,
            "expected_sha256": None, "error": None}
    try:
        item["bytes"] = os.path.getsize(path)
    except OSError as e:
        if contracts.by_filename(base) is None and not base.endswith(".safetensors"):
            return None
        return dict(item, variant="unknown", source="filename" if contracts.by_filename(base) else "unreadable",
                    error=f"{path}: cannot stat: {e}")
    art = contracts.by_filename(base)
    if art is not None:
        c = art.contract
        out = dict(item, variant=c.variant, source="filename", expected_sha256=art.sha256, nfe=c.nfe,
                   shift_video=c.shift_video, shift_audio=c.shift_audio)
        try:
            _read_header(path)  # header-only: names a Git LFS pointer / truncation before any hashing
            out["_readable"] = True
        except Exception as e:
            out.update(verified=False, error=str(e))
        return out
    if not base.endswith(".safetensors"):
        return None
    try:
        hdr = _read_header(path)
    except Exception as e:  # listed with its error (it may be a Turbo LoRA); never breaks the scan
        return dict(item, variant="unknown", source="unreadable", error=str(e))
    item["_readable"] = True
    fx = hdr.metadata.get("h3_turbo_fixture")
    if fx is not None and H3_LORA_PROBE_KEY in hdr.tensors:
        try:
            d = json.loads(fx)
            nfe = int(d["nfe"])
        except (ValueError, KeyError, TypeError) as e:
            return dict(item, variant="unknown", source="fixture-metadata",
                        error=f"__metadata__['h3_turbo_fixture'] unreadable: {e} (expected JSON with 'nfe')")
        return dict(item, variant=f"{nfe}step", source="fixture-metadata", nfe=nfe,
                    shift_video=float(d.get("shift_video", 0.0)), shift_audio=float(d.get("shift_audio", 0.0)))
    if H3_LORA_PROBE_KEY in hdr.tensors:
        return dict(item, variant="unknown", source="candidate")
    return None


def finish(item: dict, sha: str) -> dict | None:
    """Apply a computed SHA-256 to a :func:`recognize` item: sets ``sha256``/``verified``, resolves hash-only
    candidates through :func:`contracts.by_sha256` (None if the hash is not published)."""
    out = dict(item, sha256=sha)
    if item["source"] == "candidate":
        art = contracts.by_sha256(sha)
        if art is None:
            return None
        c = art.contract
        out.update(variant=c.variant, source="sha256", expected_sha256=art.sha256, verified=True, nfe=c.nfe,
                   shift_video=c.shift_video, shift_audio=c.shift_audio, official_name=art.filename)
        return out
    exp = item.get("expected_sha256")
    if exp:
        out["verified"] = sha == exp
        if sha != exp:
            out["error"] = (f"{item['path']}: SHA-256 {sha} differs from the published {exp} of "
                            f"{os.path.basename(item['path'])} (damaged or a different release)")
    return out


def list_lora_files() -> list[tuple[str, str]]:
    """(name as the loras combo shows it, full path) for every file of ComfyUI's ``loras`` folders."""
    import folder_paths

    out = []
    for name in folder_paths.get_filename_list("loras"):
        p = folder_paths.get_full_path("loras", name)
        if p:
            out.append((name, p))
    return out


class TurboScanner:
    """Background scan of the ``loras`` folders; publishes results with ``state.set_available_turbos``.

    ``start()`` returns at once; the scan lists and recognizes files (headers only), publishes them with
    ``sha256: None`` (pending), then hashes them one by one in the same thread, publishing after each.
    ``status()`` is cheap (no I/O). ``lister`` is injectable for tests: () -> [(name, path)].
    """

    def __init__(self, lister=None):
        self._lister = lister or list_lora_files
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        # scans_started / scans_completed count the scans; requested: the count of completed scans after which
        # the last start() is served (a scan started by it, or the one queued behind a running scan)
        self._status = {"state": "idle", "started_at": None, "listed_at": None, "finished_at": None,
                        "pending_hashes": 0, "files_seen": 0, "error": None, "scans_started": 0,
                        "scans_completed": 0, "requested": 0}
        self._again = False
        self._items: list[dict] = []

    def items(self) -> list[dict]:
        """The last published list (copies); [] before the first listing."""
        with self._lock:
            return [dict(i) for i in self._items]

    def status(self) -> dict:
        with self._lock:
            return dict(self._status)

    def start(self) -> bool:
        """Start a scan in a daemon thread unless one runs (then one more is queued). True if started."""
        with self._lock:
            st = self._status
            if self._thread is not None and self._thread.is_alive():
                self._again = True
                st["requested"] = st["scans_started"] + 1
                return False
            self._thread = threading.Thread(target=self._run, name="h3turbo-lora-scan", daemon=True)
            st.update(state="running", started_at=time.time(), error=None, scans_started=st["scans_started"] + 1)
            st["requested"] = st["scans_started"]
            self._thread.start()
            return True

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the running scan; True if no scan is running afterwards."""
        t = self._thread
        if t is not None:
            t.join(timeout)
            return not t.is_alive()
        return True

    def _publish(self, items: list[dict]) -> None:
        items = sorted(({k: v for k, v in i.items() if not k.startswith("_")} for i in items),
                       key=lambda i: (i["variant"], i["file"]))
        with self._lock:
            self._items = [dict(i) for i in items]
        state.set_available_turbos(items)

    def _run(self) -> None:
        while True:
            try:
                self._scan_once()
            except Exception as e:  # reported in /h3turbo/ready, never raised into the server
                log.exception("h3_turbo: Turbo LoRA scan failed")
                with self._lock:
                    self._status.update(state="failed", error=f"{type(e).__name__}: {e}", finished_at=time.time())
            with self._lock:
                self._status["scans_completed"] += 1
                if not self._again:
                    return
                self._again = False
                self._status.update(state="running", started_at=time.time(), error=None,
                                    scans_started=self._status["scans_started"] + 1)

    def _scan_once(self) -> None:
        files = self._lister()
        found = [it for it in (recognize(p, n) for n, p in files) if it is not None]
        for it in found:
            if not it.get("_readable"):
                continue
            sha = cached_sha256(it["path"])
            if sha is not None:
                it.update(finish(it, sha) or {"_drop": True})
                done, problem = cached_check(it["path"])
                if done:
                    it.update(_with_problem(it, problem), _checked=True)
        found = [it for it in found if not it.get("_drop")]
        # hashed and checked in this thread: every readable file not done yet (an unreadable one has its error)
        pending = [i for i, it in enumerate(found) if it.get("_readable") and not it.get("_checked")]
        with self._lock:
            self._status.update(listed_at=time.time(), files_seen=len(files), pending_hashes=len(pending))

        def publish():
            self._publish([it for it in found if it is not None and it["source"] != "candidate"])

        publish()
        for i in pending:
            it = found[i]
            try:
                if it["sha256"] is None:
                    it = finish(it, sha256_file(it["path"]))
                if it is not None:
                    it = _with_problem(it, check_file(it["path"], it["sha256"]))
                found[i] = it
            except OSError as e:
                found[i] = dict(it, error=f"{it['path']}: cannot read for SHA-256: {e}")
            with self._lock:
                self._status["pending_hashes"] -= 1
            publish()
        with self._lock:
            self._status.update(state="done", finished_at=time.time(), pending_hashes=0)


SCANNER = TurboScanner()
