#!/usr/bin/env bash
# Create .venv with the project and its test extras. Idempotent.
# torch is pinned to 2.13.0: on these machines it is a local CPU wheel; a bare `torch` would pull a CUDA build.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
[[ -x "$VENV/bin/python" ]] || "${PYTHON:-python3}" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" "torch==${TORCH_VERSION:-2.13.0}"
"${PIP[@]}" -e "$ROOT[test]" "torch==${TORCH_VERSION:-2.13.0}"
