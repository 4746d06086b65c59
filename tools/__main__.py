"""``python -m h3_turbo.tools <command>``: fixtures and checkpoint tools (no ComfyUI needed)."""
from __future__ import annotations

import argparse
import sys


def _cmd_make_fixtures(args: argparse.Namespace) -> int:
    import os

    from .fixtures import make_fixtures

    if os.path.exists(args.dir) and not os.path.isdir(args.dir):
        print(f"error: {args.dir}: is an existing file, not a folder (expected a folder to write the models tree "
              "into, e.g. ./h3_fixtures)", file=sys.stderr)
        return 1
    from .fixtures import FIXTURE_FILES

    existed = {os.path.join(args.dir, d, f) for d, f in FIXTURE_FILES.values()
               if os.path.exists(os.path.join(args.dir, d, f))}
    try:
        paths = make_fixtures(args.dir, seed=args.seed, nvfp4=not args.no_nvfp4)
    except OSError as e:   # e.g. a file where one of the tree's folders goes, or no permission
        print(f"error: {args.dir}: cannot write the fixtures: {e}", file=sys.stderr)
        return 1
    for name, p in paths.items():
        print(f"{name}: {p}" + ("  (replaced the file that was there)" if p in existed else ""))
    # a ComfyUI extra-model-paths file naming these folders (paths relative to the file's own folder)
    folders = sorted({os.path.basename(os.path.dirname(p)) for p in paths.values()})
    yaml_path = os.path.join(args.dir, "extra_model_paths.yaml")
    with open(yaml_path, "w", encoding="utf-8") as f:
        f.write("h3turbo_fixtures:\n    base_path: .\n" + "".join(f"    {d}: {d}\n" for d in folders))
    print(f"extra_model_paths: {yaml_path}\n"
          f"  serve them: python main.py --cpu --extra-model-paths-config {os.path.abspath(yaml_path)}  "
          "(in your ComfyUI folder)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m h3_turbo.tools",
                                description="Fixtures and checkpoint tools of H3 Turbo (no ComfyUI needed). "
                                            "'python -m h3_turbo.tools COMMAND --help' for a command's options.")
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("make-fixtures", help="write the tiny H3 fixtures (a models tree) and an "
                                             "extra_model_paths.yaml for ComfyUI into DIR")
    f.add_argument("dir", help="folder to write diffusion_models/ and loras/ into (a ComfyUI models folder)")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--no-nvfp4", action="store_true", help="skip the NVFP4 file (needs comfy-kitchen)")
    f.set_defaults(func=_cmd_make_fixtures)
    from .inspect_ckpt import add_parsers

    add_parsers(sub)
    from .release import add_parsers as add_release_parsers

    add_release_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
