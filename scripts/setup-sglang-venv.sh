#!/usr/bin/env bash
# Build .venv-sglang: the real SGLang 0.5.23 HiCache classes on a CPU, for tests/sglang.
# SGLANG_VERSION=0.5.22 builds .venv-sglang-0.5.22 instead: the previous release, for running the same suite against
# it (`SGLANG_VERSION=0.5.22 bash scripts/test.sh`); CI runs 0.5.23 only.
#
# Idempotent: a stamp records what was installed; a second run with the same inputs only re-checks the import.
#
# Why these choices:
# - sglang is installed with --no-deps: its full dependency set pulls CUDA kernels and GPU-only wheels
#   (flashinfer, sglang-kernel, deep-gemm, ...). The HiCache code path needs only the pure-python imports below.
# - torch==2.14.1 + torchvision==0.29.1, the pair sglang 0.5.23 pins (a CUDA build that runs on a CPU; both wheels
#   are served from local disk, ~65 s, ~5.5 GB). The smaller torch==2.13.0 CPU wheel was tried and rejected:
#   sglang imports torchvision at import time (configs -> multimodal utils), torchvision 0.28 (the 2.13 pair) is
#   a CUDA build whose operators fail to register against the CPU torch, and a stand-in torchvision module would be
#   a fake in every test run. The real pinned pair needs no stand-in.
# - otel-hicache goes in last, editable, with torch pinned again so pip never changes it. Its test extra brings
#   opentelemetry-distro: without a configurator `opentelemetry-instrument` loads instrumentors but sets up no SDK
#   (tests/sglang/test_auto_instrumentation.py runs the real CLI).
#
# Usage: [SGLANG_VERSION=0.5.22] scripts/setup-sglang-venv.sh [VENV_DIR]
#        (default: <repo>/.venv-sglang for 0.5.23, <repo>/.venv-sglang-<version> for another release)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
case "$SGLANG_VERSION" in
  0.5.23) OPENAI_SPEC="openai==2.8.0"; DEFAULT_VENV="$ROOT/.venv-sglang" ;;
  0.5.22) OPENAI_SPEC="openai==2.6.1"; DEFAULT_VENV="$ROOT/.venv-sglang-0.5.22" ;;  # the pin of sglang 0.5.22
  *) echo "setup-sglang-venv: SGLANG_VERSION must be 0.5.23 or 0.5.22 (got $SGLANG_VERSION)" >&2; exit 2 ;;
esac
VENV="${1:-$DEFAULT_VENV}"
PY="${PYTHON:-python3}"

TORCH_SPEC="torch==2.14.1"
TORCHVISION_SPEC="torchvision==0.29.1"
# Pure-python imports the HiCache path needs; versions follow sglang's own pins where it has one.
SGLANG_RUNTIME_DEPS=(
  numpy orjson psutil pybase64 pillow starlette msgspec pydantic pyzmq tqdm IPython aiohttp
  "apache-tvm-ffi==0.1.11" "transformers==5.19.0" dill "sentencepiece==0.2.1" "compressed-tensors==0.18.0"
  gguf "$OPENAI_SPEC" partial-json-parser requests packaging "prometheus-client>=0.20.0" setproctitle
  "python-dateutil<3" regex einops
)

STAMP="$VENV/.otel-hicache-sglang-stamp"
WANT="sglang=$SGLANG_VERSION $TORCH_SPEC $TORCHVISION_SPEC ${SGLANG_RUNTIME_DEPS[*]} $(sha256sum "$ROOT/pyproject.toml" | cut -c1-16)"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]] && "$VENV/bin/python" -c "import sglang.srt.managers.cache_controller" 2>/dev/null; then
  echo "setup-sglang-venv: $VENV is up to date"
  exit 0
fi

[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

"${PIP[@]}" --upgrade pip setuptools wheel
"${PIP[@]}" "$TORCH_SPEC" "$TORCHVISION_SPEC"
"${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION"
# sglang's GPU requirements stay out on purpose: pip's list of them after every later install says nothing new
"${PIP[@]}" --no-warn-conflicts "${SGLANG_RUNTIME_DEPS[@]}" "$TORCH_SPEC" "$TORCHVISION_SPEC"
# The project itself with its test extras; pinning torch again keeps pip from "upgrading" it.
"${PIP[@]}" --no-warn-conflicts -e "$ROOT[test]" "opentelemetry-distro>=0.66b0" "$TORCH_SPEC" "$TORCHVISION_SPEC"

"$VENV/bin/python" -c "import sglang, torch; print('setup-sglang-venv: sglang', sglang.__version__, 'torch', torch.__version__)"
echo "$WANT" >"$STAMP"
