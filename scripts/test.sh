#!/usr/bin/env bash
# The test command: environment (scripts/env.sh), then the whole suite. Extra args go to pytest.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$here/scripts/env.sh"
cd "$here"
exec "$H3T_PY" -m pytest "$@"
