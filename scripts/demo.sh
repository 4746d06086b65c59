#!/usr/bin/env bash
# The main job: environment (scripts/env.sh), then an H3 workflow through real ComfyUI on the tiny model.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$here/scripts/env.sh"
exec "$H3T_PY" -m h3_turbo.demo "$@"
