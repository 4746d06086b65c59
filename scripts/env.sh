#!/usr/bin/env bash
# Make (or reuse) the Python environment that runs this pack with a real ComfyUI on the CPU, then
# install the pack into it (editable). Prints only progress (pip's own output only on failure);
# sourced by test.sh and demo.sh.
#
#   H3T_VENV      the venv to use/create (default: $HOME/comfyui-venv)
#   COMFYUI_PATH  a ComfyUI checkout with MiniMax H3 (default: $HOME/ComfyUI); its requirements.txt
#                 is installed whenever one of its requirements is not met (missing or another version
#                 than pinned). Without one, only the pack's own dependencies are installed and the
#                 integration tests skip (loudly).
#   H3T_CHROMIUM a Chromium binary for the browser tests (default: chromium on PATH; installed with apt-get
#                 when missing and this runs as root on Debian/Ubuntu)
# Pinned stack (verified): Python 3.11, torch 2.14.1 + torchvision 0.29.1, torchaudio 2.11.1 (--no-deps),
# ComfyUI's requirements (comfy-kitchen 0.2.31). The [test] extra adds Playwright (it drives that Chromium;
# no browser download) and comfy-cli (`comfy node validate`); neither changes a package ComfyUI pins. The [multigpu] extra
# adds yunchang (pure Python, no dependency but torch) so the Multi-GPU tests run on 2 gloo CPU processes.
set -euo pipefail

# quiet_pip VENV ARGS...: VENV's pip with its output kept in a temporary log, printed only when pip fails.
quiet_pip() {
  local venv=$1 log rc=0
  shift
  log=$(mktemp)
  "$venv/bin/pip" "$@" > "$log" 2>&1 || rc=$?
  if [ "$rc" != 0 ]; then cat "$log" >&2; echo "[h3-turbo] pip $* failed" >&2; fi
  rm -f "$log"
  return "$rc"
}

# comfy_requirements VENV COMFY PACK: install COMFY's requirements.txt (without torch*) into VENV whenever one
# of them is not met there (scripts/requirements_met.py: missing, or another version than pinned), so a reused
# venv never keeps old comfy-kitchen / comfy-aimdo under a newer core. Tested by tests/test_env_script.py.
comfy_requirements() {
  local venv=$1 comfy=$2 pack=$3 reqs
  reqs=$(mktemp)
  grep -v -E '^(#|$)|^torch$|^torchvision|^torchaudio' "$comfy/requirements.txt" > "$reqs"
  if ! "$venv/bin/python" "$pack/scripts/requirements_met.py" "$reqs"; then
    echo "[h3-turbo] installing ComfyUI requirements from $comfy/requirements.txt (the ones above are not met)"
    quiet_pip "$venv" install -q -r "$reqs" packaging
  fi
  rm -f "$reqs"
}
if [ "${H3T_ENV_FUNCTIONS_ONLY:-}" = 1 ]; then return 0; fi

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${H3T_VENV:-$HOME/comfyui-venv}
comfy=${COMFYUI_PATH:-$HOME/ComfyUI}
py=${PYTHON:-python3.11}
if ! "$venv/bin/python" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.14.1") else 1)' 2>/dev/null; then
  echo "[h3-turbo] creating venv $venv (torch 2.14.1, torchvision 0.29.1, torchaudio 2.11.1)"
  "$py" -m venv "$venv"
  quiet_pip "$venv" install -q --upgrade pip
  quiet_pip "$venv" install -q torch==2.14.1 torchvision==0.29.1
  quiet_pip "$venv" install -q --no-deps torchaudio==2.11.1
fi
if [ -f "$comfy/requirements.txt" ]; then
  comfy_requirements "$venv" "$comfy" "$here"
else
  echo "[h3-turbo] no ComfyUI at $comfy (set COMFYUI_PATH): integration tests will be skipped" >&2
  quiet_pip "$venv" install -q comfy-kitchen==0.2.31
fi
if [ -z "${H3T_CHROMIUM:-}" ] && ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "[h3-turbo] installing chromium (apt-get) for the browser tests"
    apt_log=$(mktemp)
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } > "$apt_log" 2>&1 \
      || { cat "$apt_log" >&2; rm -f "$apt_log"; echo "[h3-turbo] apt-get install chromium failed" >&2; exit 1; }
    rm -f "$apt_log"
  else
    echo "[h3-turbo] no chromium found and no root apt-get: the browser tests will be skipped (set H3T_CHROMIUM)" >&2
  fi
fi
pip_log=$(mktemp)
"$venv/bin/pip" install -q --no-build-isolation -e "$here[test,multigpu]" > "$pip_log" 2>&1 \
  || { cat "$pip_log" >&2; rm -f "$pip_log"; echo "[h3-turbo] pip install -e failed" >&2; exit 1; }
rm -f "$pip_log"
"$venv/bin/python" -c 'import h3_turbo' || { echo "[h3-turbo] editable install failed" >&2; exit 1; }
export H3T_PY="$venv/bin/python"
