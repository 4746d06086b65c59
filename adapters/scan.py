"""Recognize Turbo LoRA files on disk (for ``GET /h3turbo/ready``): by file name, header and SHA-256.

Recognition order for one ``.safetensors`` file (``recognize``, cheap: reads the header only):

1. the official file name (:func:`h3_turbo.adapters.contracts.by_filename`) -> source ``"filename"``;
2. a tiny-fixture header (``__metadata__["h3_turbo_fixture"]`` with ``nfe``) -> source ``"fixture-metadata"``;
3. otherwise, a header with the H3 Turbo LoRA layout (``diffusion_model.blocks.0.attn.qkv_proj.lora_A.weight``
   present) is a *candidate*: it is listed only if its SHA-256 equals a published one
   (:func:`h3_turbo.adapters.contracts.by_sha256`) -> source ``"sha256"``.

SHA-256 is computed by :class:`TurboScanner` in a background thread, once per (path, size, mtime_ns),
in the Turbo LoRA loader's process-wide cache (:func:`h3_turbo.adapters.turbo_lora.sha256_file`), so the
loader and the scan never hash the same file twice. ``verified`` is True when the hash equals the published one, False when a file with
an official name has another hash (``error`` says which), None while pending or when no hash is published.
"""
from __future__ import annotations

import logging
import os
import threading
import time

from . import contracts

log = logging.getLogger("h3_turbo")

H3_LORA_PROBE_KEY = "diffusion_model.blocks.0.attn.qkv_proj.lora_A.weight"

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


def recognize(path: str, name: str | None = None) -> dict | None:
    """Cheap recognition of one file (header only, no hashing).

    Returns None when the file is not a Turbo candidate, else a dict with ``variant`` ("4step",
    "8step" or "unknown" for a hash-only candidate), ``file`` (``name`` or the base name), ``path``,
    ``bytes``, ``source`` ("filename" | "fixture-metadata" | "candidate"), ``expected_sha256``
    (published hash or None), ``nfe``, ``shift_video``, ``shift_audio``.
    A damaged header on a file with an official name is reported with ``error`` (never raised).
    """
    import json

    base = os.path.basename(path)
    item = {"file": name or base, "path": path, "bytes": None, "sha256": None, "verified": None,
            "expected_sha256": None, "error": None}
    try:
        item["bytes"] = os.path.getsize(path)
    except OSError as e:
        return None if contracts.by_filename(base) is None else dict(item, variant="unknown", source="filename",
                                                                      error=f"cannot stat: {e}")
    art = contracts.by_filename(base)
    if art is not None:
        c = art.contract
        out = dict(item, variant=c.variant, source="filename", expected_sha256=art.sha256, nfe=c.nfe,
                   shift_video=c.shift_video, shift_audio=c.shift_audio)
        try:
            _read_header(path)  # header-only: names a Git LFS pointer / truncation before any hashing
        except Exception as e:
            out.update(verified=False, error=str(e))
        return out
    if not base.endswith(".safetensors"):
        return None
    try:
        hdr = _read_header(path)
    except Exception as e:  # a broken unrelated LoRA must not break the scan
        log.debug("h3_turbo scan: skipping %s: %s", path, e)
        return None
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
        self._status = {"state": "idle", "started_at": None, "listed_at": None, "finished_at": None,
                        "pending_hashes": 0, "files_seen": 0, "error": None}
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
            if self._thread is not None and self._thread.is_alive():
                self._again = True
                return False
            self._thread = threading.Thread(target=self._run, name="h3turbo-lora-scan", daemon=True)
            self._status.update(state="running", started_at=time.time(), error=None)
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
        from .. import state

        items = sorted(items, key=lambda i: (i["variant"], i["file"]))
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
                if not self._again:
                    return
                self._again = False
                self._status.update(state="running", started_at=time.time(), error=None)

    def _scan_once(self) -> None:
        files = self._lister()
        found = [it for it in (recognize(p, n) for n, p in files) if it is not None]
        for it in found:
            sha = cached_sha256(it["path"])
            if sha is not None:
                it.update(finish(it, sha) or {"_drop": True})
        found = [it for it in found if not it.get("_drop")]
        pending = [i for i, it in enumerate(found) if it["sha256"] is None and it.get("error") is None]
        with self._lock:
            self._status.update(listed_at=time.time(), files_seen=len(files), pending_hashes=len(pending))

        def publish():
            self._publish([it for it in found if it is not None and it["source"] != "candidate"])

        publish()
        for i in pending:
            it = found[i]
            try:
                found[i] = finish(it, sha256_file(it["path"]))
            except OSError as e:
                found[i] = dict(it, error=f"{it['path']}: cannot read for SHA-256: {e}")
            with self._lock:
                self._status["pending_hashes"] -= 1
            publish()
        with self._lock:
            self._status.update(state="done", finished_at=time.time(), pending_hashes=0)


SCANNER = TurboScanner()
