"""A small client for a running ComfyUI with this pack: submit API-format workflows, follow progress, fetch
outputs; read ``GET /h3turbo/ready``.

``python -m h3_turbo.client submit WORKFLOW_API.json --server http://127.0.0.1:8188 [--set NODE.INPUT=VALUE ...]
[--out DIR]`` and ``python -m h3_turbo.client ready --server URL [--rescan]``. Uses ComfyUI's own HTTP API:
``POST /prompt`` (with a ``client_id``), the ``/ws?clientId=`` websocket (events ``progress``, ``executing``,
``execution_success``, ``execution_error``, ``execution_interrupted``), ``GET /history/{prompt_id}`` and
``GET /view``. Needs ``requests`` and ``websocket-client``; no ComfyUI import.

Errors: :class:`PromptRejected` (HTTP 400 from ``/prompt``: ComfyUI's ``error`` and ``node_errors``),
:class:`ExecutionFailed` (an ``execution_error``/``execution_interrupted`` event or an error status in the
history), :class:`ClientError` (bad arguments, connection problems, time-outs; a server that does not answer is
one line ending "is ComfyUI running at URL?"). ``str()`` of each is a readable message; the raw ComfyUI JSON is
on ``.payload``.
"""
from __future__ import annotations

import json
import math
import os
import re
import time
import uuid
from pathlib import Path
from urllib.parse import urlencode, urlparse

DEFAULT_SERVER = "http://127.0.0.1:8188"


class ClientError(RuntimeError):
    """Bad arguments, an unreachable server or a time-out. ``payload``: extra data or None."""

    def __init__(self, message: str, payload=None):
        super().__init__(message)
        self.payload = payload


class PromptRejected(ClientError):
    """``POST /prompt`` answered 400: the prompt failed ComfyUI's validation. ``payload`` is the JSON body."""


class ExecutionFailed(ClientError):
    """The prompt was accepted but failed while running. ``payload`` is the ``execution_error`` data."""


# ----------------------------------------------------------------------------------------- workflows
def load_workflow(path: str | os.PathLike) -> dict:
    """Read an API-format workflow ({"<id>": {"class_type", "inputs"}}). A UI-format file (with "nodes" and
    "links") is refused with a hint to use its ``api/`` twin. Raises ClientError naming the file."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ClientError(f"{p}: cannot read the workflow JSON: {e}") from e
    if isinstance(data, dict) and "nodes" in data and "links" in data:
        raise ClientError(f"{p}: this is a UI-format workflow (nodes/links); submit the API-format twin "
                          f"(example_workflows/api/{p.name}) or export with 'Export (API)'")
    if isinstance(data, dict) and "prompt" in data and isinstance(data["prompt"], dict):
        data = data["prompt"]
    if not isinstance(data, dict) or not data or not all(
            isinstance(v, dict) and "class_type" in v for v in data.values()):
        raise ClientError(f"{p}: not an API-format workflow (expected {{\"<id>\": {{\"class_type\", \"inputs\"}}}})")
    return data


def _parse_value(text: str):
    """JSON if it parses (numbers, true/false, lists...), else the string. NaN/Infinity are refused:
    ComfyUI's API is strict JSON."""
    try:
        v = json.loads(text)
    except ValueError:
        return text
    if isinstance(v, float) and not math.isfinite(v):
        raise ClientError(f"--set value {text!r} is not a finite number (ComfyUI's API takes strict JSON)")
    return v


def find_node(prompt: dict, ref: str) -> str:
    """The id of the node that ``ref`` names: a node id, else a unique ``_meta.title``, else a unique
    ``class_type``. Raises ClientError listing the candidates when none or several match."""
    if ref in prompt:
        return ref
    for key, label in ((lambda n: (n.get("_meta") or {}).get("title"), "title"), (lambda n: n.get("class_type"), "class_type")):
        hits = [i for i, n in prompt.items() if key(n) == ref]
        if len(hits) == 1:
            return hits[0]
        if len(hits) > 1:
            raise ClientError(f"--set {ref}: {len(hits)} nodes have {label} {ref!r} (ids {', '.join(hits)}); "
                              f"use a node id")
    known = ", ".join(f"{i} ({n.get('class_type')}, title {(n.get('_meta') or {}).get('title')!r})"
                      for i, n in prompt.items())
    raise ClientError(f"--set {ref}: no node with that id, title or class_type; nodes: {known}")


def apply_sets(prompt: dict, sets: list[str]) -> dict:
    """A copy of ``prompt`` with each ``NODE_OR_TITLE.INPUT=VALUE`` applied (VALUE parsed as JSON when it
    parses, else taken as a string). The input must already exist on the node (typos are errors)."""
    out = json.loads(json.dumps(prompt))
    for s in sets or []:
        if "=" not in s:
            raise ClientError(f"--set {s!r}: expected NODE_OR_TITLE.INPUT=VALUE")
        lhs, value = s.split("=", 1)
        if "." not in lhs:
            raise ClientError(f"--set {s!r}: expected NODE_OR_TITLE.INPUT=VALUE (no '.' before '=')")
        ref, name = lhs.rsplit(".", 1)
        nid = find_node(out, ref)
        inputs = out[nid].setdefault("inputs", {})
        if name not in inputs:
            raise ClientError(f"--set {s!r}: node {nid} ({out[nid]['class_type']}) has no input {name!r}; "
                              f"inputs: {', '.join(sorted(inputs))}")
        inputs[name] = _parse_value(value)
    return out


def misspelt_inputs(prompt: dict, known: dict[str, set[str]]) -> list[str]:
    """Inputs of an API-format ``prompt`` that look like typos: a name its node class does not declare that is close
    (difflib, ratio >= 0.8) to a declared name the node does not set. ``known``: {class_type: declared input names}
    (required, optional, hidden); classes missing from it are not checked. ComfyUI ignores undeclared inputs, so a
    misspelt optional input (``weigths``) would otherwise run silently with that input's default. Dynamic inputs
    (``format.codec``, ``images.image0``) are not close to an unset declared name and pass. Returns one message per
    input: ``node 1 (H3TurboNVFP4Loader): unknown input 'weigths' (did you mean 'weights'?)``."""
    import difflib

    out = []
    for nid, node in sorted(prompt.items(), key=lambda kv: str(kv[0])):
        names = known.get(node.get("class_type")) if isinstance(node, dict) else None
        if not names:
            continue
        given = set(node.get("inputs") or {})
        for name in sorted(given - names):
            close = difflib.get_close_matches(name, sorted(names - given), n=1, cutoff=0.8)
            if close:
                out.append(f"node {nid} ({node['class_type']}): unknown input {name!r} (did you mean {close[0]!r}?)")
    return out


def input_names(types: dict | None) -> set[str]:
    """The declared input names (required, optional, hidden) of one node's ``INPUT_TYPES()`` or ``/object_info``
    ``input`` dict."""
    return {n for sect in ("required", "optional", "hidden") for n in ((types or {}).get(sect) or {})}


def object_info_inputs(object_info: dict) -> dict[str, set[str]]:
    """{class_type: declared input names} from ComfyUI's ``GET /object_info`` body (``input``: required, optional,
    hidden)."""
    return {cls: input_names(info.get("input")) for cls, info in object_info.items() if isinstance(info, dict)}


# ----------------------------------------------------------------------------------------- errors
def format_rejection(body: dict) -> str:
    """A readable message from a 400 body of ``POST /prompt`` ({"error": {...}, "node_errors": {...}})."""
    err = body.get("error") or {}
    if isinstance(err, str):
        lines = [err]
    else:
        lines = [f"{err.get('message', 'prompt rejected')}" + (f": {err['details']}" if err.get("details") else "")]
    for nid, ne in sorted((body.get("node_errors") or {}).items(), key=lambda kv: str(kv[0])):
        for e in ne.get("errors", []):
            extra = e.get("extra_info") or {}
            inp = f" input {extra['input_name']!r}" if extra.get("input_name") else ""
            lines.append(f"  node {nid} ({ne.get('class_type')}){inp}: {e.get('message')}"
                         + (f": {e['details']}" if e.get("details") else ""))
    return "\n".join(lines)


def format_execution_error(data: dict) -> str:
    """A readable message from an ``execution_error`` event (or history status message)."""
    return (f"node {data.get('node_id')} ({data.get('node_type')}) failed: "
            f"{data.get('exception_type', 'error')}: {data.get('exception_message', '').strip()}")


# ----------------------------------------------------------------------------------------- client
class Client:
    """HTTP + websocket client of one ComfyUI server (``server``: "http://host:port", optional path prefix)."""

    def __init__(self, server: str = DEFAULT_SERVER, timeout: float = 30.0):
        if "://" not in server:
            server = "http://" + server
        self.server = server.rstrip("/")
        self.timeout = timeout
        import requests

        self._http = requests.Session()
        self._declared: dict[str, set[str]] = {}     # class_type -> declared input names (:meth:`_declared_inputs`)

    def _url(self, path: str, **query) -> str:
        return self.server + path + (("?" + urlencode(query)) if query else "")

    def _ws_url(self, client_id: str) -> str:
        u = urlparse(self.server)
        scheme = "wss" if u.scheme == "https" else "ws"
        return f"{scheme}://{u.netloc}{u.path}/ws?clientId={client_id}"

    def _failed(self, what: str, e: Exception) -> ClientError:
        """ClientError for a request that raised ``e``: one line naming the server when it did not answer."""
        import requests

        if isinstance(e, (requests.ConnectionError, ConnectionRefusedError)) and \
                not isinstance(e, requests.exceptions.SSLError):
            m = re.search(r"\[Errno -?\d+\] ([^'\"\)]+)", str(e))
            why = m.group(1).strip() if m else type(e).__name__
            return ClientError(f"{what}: no answer ({why}): is ComfyUI running at {self.server}?")
        return ClientError(f"{what}: {e}")

    def _get(self, path: str, **query):
        import requests

        try:
            r = self._http.get(self._url(path, **query), timeout=self.timeout)
        except requests.RequestException as e:
            raise self._failed(f"GET {self.server}{path}", e) from e
        return r

    def ready(self, rescan: bool = False, wait: float = 60.0) -> dict:
        """JSON of ``GET /h3turbo/ready`` (tries ``/api/h3turbo/ready`` too). ClientError if neither answers 200.
        ``rescan``: asks for a re-scan of the loras folders (``?rescan=1``; asked again after ``scan.retry_in_s``
        while the server throttles it) and polls until that scan has listed and checked the files
        (``scan.scans_completed >= scan.requested``), at most ``wait`` seconds (then ClientError); a server without
        those fields (an older pack) is answered after its first reply."""
        last = None
        for path in ("/h3turbo/ready", "/api/h3turbo/ready"):
            r = self._get(path, **({"rescan": 1} if rescan else {}))
            if r.status_code == 200:
                return self._wait_scan(path, r.json(), wait) if rescan else r.json()
            last = f"GET {self.server}{path}: HTTP {r.status_code}: {r.text[:300]}"
        raise ClientError(f"{last} (is the H3 Turbo pack loaded in this ComfyUI?)")

    def _declared_inputs(self, prompt: dict) -> dict[str, set[str]]:
        """{class_type: declared input names} of the classes ``prompt`` uses, from ``GET /object_info/<class>`` (one
        small request per class, kept for this client's later prompts; a class the server does not know: empty)."""
        from urllib.parse import quote

        known = self._declared
        for cls in {n.get("class_type") for n in prompt.values() if isinstance(n, dict)} - set(known) - {None}:
            known.update(object_info_inputs(self._get_ok("/object_info/" + quote(str(cls), safe=""))))
            known.setdefault(cls, set())
        return known

    def _get_ok(self, path: str, **query) -> dict:
        r = self._get(path, **query)
        if r.status_code != 200:
            raise ClientError(f"GET {self.server}{path}: HTTP {r.status_code}: {r.text[:300]}")
        return r.json()

    def _wait_scan(self, path: str, body: dict, wait: float) -> dict:
        t_end = time.monotonic() + wait

        def check_time():
            if time.monotonic() > t_end:
                raise ClientError(f"GET {self.server}{path}?rescan=1: the re-scan of the loras folders did not "
                                  f"finish within {wait:g} s (scan: {body.get('scan')})")

        while (body.get("scan") or {}).get("rescan") == "throttled":
            check_time()
            time.sleep(min(max(float(body["scan"].get("retry_in_s") or 0.5), 0.05), 5.0))
            body = self._get_ok(path, rescan=1)
        want = (body.get("scan") or {}).get("requested")
        if want is None:
            return body
        while (body.get("scan") or {}).get("scans_completed", 0) < want:
            check_time()
            time.sleep(0.25)
            body = self._get_ok(path)
        return body

    def queue(self, prompt: dict, client_id: str) -> str:
        """``POST /prompt``; returns the prompt id. PromptRejected (with ComfyUI's message) on HTTP 400."""
        import requests

        try:
            r = self._http.post(self._url("/prompt"), json={"prompt": prompt, "client_id": client_id},
                                timeout=self.timeout)
        except requests.RequestException as e:
            raise self._failed(f"POST {self.server}/prompt", e) from e
        if r.status_code == 400:
            try:
                body = r.json()
            except ValueError:
                body = {"error": r.text}
            raise PromptRejected("ComfyUI rejected the prompt:\n" + format_rejection(body), body)
        if r.status_code != 200:
            raise ClientError(f"POST {self.server}/prompt: HTTP {r.status_code}: {r.text[:500]}")
        return r.json()["prompt_id"]

    def history(self, prompt_id: str) -> dict | None:
        """The history entry of ``prompt_id`` ({"outputs", "status", ...}) or None if not finished."""
        r = self._get(f"/history/{prompt_id}")
        if r.status_code != 200:
            raise ClientError(f"GET /history/{prompt_id}: HTTP {r.status_code}: {r.text[:300]}")
        return (r.json() or {}).get(prompt_id)

    def wait_history(self, prompt_id: str, timeout: float) -> dict:
        """Poll ``/history/{id}`` until the entry appears (bounded by ``timeout`` s)."""
        t_end = time.monotonic() + timeout
        while True:
            h = self.history(prompt_id)
            if h is not None and (h.get("status") or {}).get("completed") is not None:
                return h
            if time.monotonic() > t_end:
                raise ClientError(f"prompt {prompt_id}: no history entry after {timeout:.0f} s")
            time.sleep(0.25)

    def follow(self, ws, prompt_id: str, timeout: float, progress: bool = True) -> list[tuple[str, dict]]:
        """Read websocket events of ``prompt_id`` until it finishes. Returns the (event, data) list.
        Raises ExecutionFailed on ``execution_error`` / ``execution_interrupted``, ClientError on time-out."""
        import websocket

        bar = None
        events: list[tuple[str, dict]] = []
        t_end = time.monotonic() + timeout
        try:
            while True:
                left = t_end - time.monotonic()
                if left <= 0:
                    raise ClientError(f"prompt {prompt_id}: not finished after {timeout:.0f} s")
                ws.settimeout(min(left, 5.0))
                try:
                    msg = ws.recv()
                except websocket.WebSocketTimeoutException:
                    continue
                if not isinstance(msg, str):
                    continue  # binary preview frames
                m = json.loads(msg)
                ev, data = m.get("type"), m.get("data") or {}
                if data.get("prompt_id") not in (None, prompt_id):
                    continue
                events.append((ev, data))
                if ev == "progress" and progress:
                    if bar is None or bar.total != data.get("max") or data.get("value", 0) < bar.n:
                        if bar is not None:
                            bar.close()
                        from tqdm import tqdm

                        bar = tqdm(total=data.get("max"), desc=f"node {data.get('node')}", unit="step")
                    bar.update(data.get("value", 0) - bar.n)
                elif ev == "execution_error":
                    raise ExecutionFailed(format_execution_error(data), data)
                elif ev == "execution_interrupted":
                    raise ExecutionFailed(f"prompt {prompt_id} was interrupted at node {data.get('node_id')}", data)
                elif ev == "execution_success" or (ev == "executing" and data.get("node") is None
                                                   and data.get("prompt_id") == prompt_id):
                    return events
        finally:
            if bar is not None:
                bar.close()

    def download(self, entry: dict, out_dir: str | os.PathLike) -> list[Path]:
        """Save every file listed in a history entry's outputs ({"filename", "subfolder", "type"} items) under
        ``out_dir/<subfolder>/``. Returns the paths written."""
        out = Path(out_dir)
        paths = []
        for nid, node_out in sorted((entry.get("outputs") or {}).items()):
            for items in node_out.values():
                if not isinstance(items, list):
                    continue
                for it in items:
                    if not (isinstance(it, dict) and "filename" in it):
                        continue
                    q = {"filename": it["filename"], "subfolder": it.get("subfolder", ""),
                         "type": it.get("type", "output")}
                    r = self._get("/view", **q)
                    if r.status_code != 200:
                        raise ClientError(f"GET /view {q}: HTTP {r.status_code}: {r.text[:300]}")
                    sub = Path(*[s for s in q["subfolder"].replace("\\", "/").split("/") if s not in ("", ".", "..")])
                    dest = out / sub / os.path.basename(it["filename"])
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.write_bytes(r.content)
                    paths.append(dest)
        return paths

    def submit(self, prompt: dict, out_dir: str | os.PathLike | None = None, timeout: float = 3600.0,
               progress: bool = True) -> dict:
        """Queue ``prompt``, follow it over the websocket, then read the history and download the outputs.

        Returns {"prompt_id", "outputs" (history outputs), "files" (downloaded paths), "events"}.
        Raises PromptRejected / ExecutionFailed / ClientError.
        """
        import websocket

        try:
            typos = misspelt_inputs(prompt, self._declared_inputs(prompt))
        except Exception:   # no /object_info to read: the connection error comes below, ComfyUI's validation runs
            typos = []
        if typos:
            raise PromptRejected("workflow not queued: " + "; ".join(typos), {"misspelt_inputs": typos})
        client_id = uuid.uuid4().hex
        try:
            ws = websocket.create_connection(self._ws_url(client_id), timeout=self.timeout)
        except (OSError, websocket.WebSocketException) as e:
            if isinstance(e, ConnectionRefusedError):
                raise self._failed(f"websocket {self._ws_url(client_id)}", e) from e
            raise ClientError(f"websocket {self._ws_url(client_id)}: {e}") from e
        t0 = time.monotonic()
        try:
            prompt_id = self.queue(prompt, client_id)
            try:
                events = self.follow(ws, prompt_id, timeout, progress)
            except (websocket.WebSocketConnectionClosedException, ConnectionError) as e:
                # the socket dropped (proxy, server restart of the socket): the history still tells the outcome
                import logging

                logging.getLogger("h3_turbo").warning("websocket closed (%s); polling /history/%s", e, prompt_id)
                events = []
        finally:
            ws.close()
        entry = self.wait_history(prompt_id, timeout=max(60.0, timeout - (time.monotonic() - t0)))
        status = entry.get("status") or {}
        if status.get("status_str") == "error":
            errs = [d for ev, d in status.get("messages", []) if ev == "execution_error"]
            raise ExecutionFailed(format_execution_error(errs[0]) if errs else f"prompt {prompt_id} failed",
                                  errs[0] if errs else status)
        files = self.download(entry, out_dir) if out_dir is not None else []
        return {"prompt_id": prompt_id, "outputs": entry.get("outputs") or {}, "files": [str(p) for p in files],
                "events": events}
