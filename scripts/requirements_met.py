"""Exit 0 when every requirement in the given requirements file is met by this Python's installed packages,
else print each unmet one ("name: installed X, wanted SPEC" / "name: not installed") and exit 1.

Used by scripts/env.sh to install ComfyUI's pinned requirements whenever they changed (a reused venv must not
keep old comfy-kitchen / comfy-aimdo under a newer core). Standard library plus ``packaging`` (pip vendors
it); lines with markers that do not apply, options (``-r``, ``--index-url``) and URLs are skipped.
"""
from __future__ import annotations

import sys
from importlib import metadata

try:
    from packaging.requirements import InvalidRequirement, Requirement
except ImportError:  # pragma: no cover - pip's vendored copy
    from pip._vendor.packaging.requirements import InvalidRequirement, Requirement


def unmet(lines) -> list[str]:
    out = []
    for raw in lines:
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-") or "://" in line:
            continue
        try:
            req = Requirement(line)
        except InvalidRequirement:
            out.append(f"{line}: not a requirement this check understands")
            continue
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            out.append(f"{req.name}: not installed (wanted {req.specifier or 'any version'})")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            out.append(f"{req.name}: installed {have}, wanted {req.specifier}")
    return out


def main(argv: list[str]) -> int:
    with open(argv[1], encoding="utf-8") as f:
        bad = unmet(f)
    for b in bad:
        print(f"  {b}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
