"""``python -m h3_turbo.client {submit,ready}``: see :mod:`h3_turbo.client`.

Exit status: 0 success, 1 execution failed, 2 prompt rejected by validation, 3 client error
(bad arguments, server unreachable, time-out).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from . import DEFAULT_SERVER, Client, ClientError, ExecutionFailed, PromptRejected, apply_sets, load_workflow


def _positive(text: str) -> float:
    """argparse type: a finite number of seconds > 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (v > 0 and v != float("inf")):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of seconds > 0")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m h3_turbo.client",
                                description="Submit API-format workflows to ComfyUI; read /h3turbo/ready.")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("submit", help="queue a workflow, follow its progress, download its outputs")
    s.add_argument("workflow", help="API-format workflow JSON (e.g. example_workflows/api/h3turbo_tiny_demo.json)")
    s.add_argument("--server", default=os.environ.get("COMFYUI_SERVER", DEFAULT_SERVER),
                   help=f"ComfyUI's address (default: $COMFYUI_SERVER, else {DEFAULT_SERVER})")
    s.add_argument("--set", dest="sets", action="append", default=[], metavar="NODE_OR_TITLE.INPUT=VALUE",
                   help="override an input (node id, title or class_type; VALUE as JSON or a string); repeatable")
    s.add_argument("--out", default="h3turbo_outputs", help="folder for the downloaded outputs")
    s.add_argument("--timeout", type=_positive, default=3600.0, help="seconds to wait for the run (> 0)")
    s.add_argument("--no-progress", action="store_true", help="no progress bars")
    s.add_argument("--json", action="store_true", help="print a JSON summary instead of the file list")
    r = sub.add_parser("ready", help="print GET /h3turbo/ready")
    r.add_argument("--server", default=os.environ.get("COMFYUI_SERVER", DEFAULT_SERVER),
                   help=f"ComfyUI's address (default: $COMFYUI_SERVER, else {DEFAULT_SERVER})")
    r.add_argument("--rescan", action="store_true",
                   help="re-scan the loras folders first (new or replaced Turbo LoRA files) and wait for the listing")
    r.add_argument("--wait", type=_positive, default=60.0, help="seconds to wait for the re-scan (> 0)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        c = Client(a.server)
        if a.cmd == "ready":
            print(json.dumps(c.ready(rescan=a.rescan, wait=a.wait), indent=2, default=str))
            return 0
        prompt = apply_sets(load_workflow(a.workflow), a.sets)
        res = c.submit(prompt, out_dir=a.out, timeout=a.timeout, progress=not a.no_progress)
    except PromptRejected as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ExecutionFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ClientError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    if a.json:
        print(json.dumps({"prompt_id": res["prompt_id"], "files": res["files"], "outputs": res["outputs"]},
                         indent=2, default=str))
    else:
        print(f"prompt {res['prompt_id']}: {len(res['files'])} file(s) in {a.out}")
        for f in res["files"]:
            print(f"  {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
