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
    try:
        paths = make_fixtures(args.dir, seed=args.seed, nvfp4=not args.no_nvfp4)
    except OSError as e:   # e.g. a file where one of the tree's folders goes, or no permission
        print(f"error: {args.dir}: cannot write the fixtures: {e}", file=sys.stderr)
        return 1
    for name, p in paths.items():
        print(f"{name}: {p}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m h3_turbo.tools", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("make-fixtures", help="write tiny H3 fixtures (models tree) into DIR")
    f.add_argument("dir")
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
