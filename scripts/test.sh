#!/usr/bin/env bash
# The test command: installs what the tests need (idempotent), then runs lint and every test suite.
#   - .venv        the project + test extras (scripts/setup.sh)
#   - .venv-sglang the real SGLang 0.5.23 HiCache classes on CPU (scripts/setup-sglang-venv.sh)
#   - .venv-vllm   the real vLLM 0.32 KV offloading connector on CPU (scripts/setup-vllm-venv.sh, ~3.5 GB, ~2.5 min)
#   - prometheus + promtool from Debian (apt-get, when missing)
# Lint (ruff), types (mypy), then the tests (doctests of every module included).
# Set SKIP_SGLANG=1 to skip the SGLang suite (and its ~6 GB venv), SKIP_VLLM=1 the vLLM suite (and its venv).
# SGLANG_VERSION=0.5.22 runs the SGLang suite against the previous release instead (in .venv-sglang-0.5.22); CI runs
# 0.5.23.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
  SUDO=""; [[ $(id -u) -eq 0 ]] || SUDO="sudo"
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq prometheus >/dev/null \
    || { echo "test.sh: could not install Debian's prometheus package" >&2; exit 1; }
  # the package starts a system service where systemd runs; the tests start their own servers
  $SUDO systemctl stop prometheus prometheus-node-exporter 2>/dev/null || true
fi

# Refuse at once, in one line, when the venvs still to be built cannot fit: pip's "No space left on device" comes
# minutes later, in the middle of an install. Sizes: what each venv takes here.
need_mb=0
[[ -x .venv/bin/python ]] || need_mb=$((need_mb + 1200))
if [[ "${SKIP_SGLANG:-0}" != 1 ]]; then
  sglang_venv=.venv-sglang; [[ "${SGLANG_VERSION:-0.5.23}" == 0.5.23 ]] || sglang_venv=".venv-sglang-$SGLANG_VERSION"
  [[ -x "$sglang_venv/bin/python" ]] || need_mb=$((need_mb + 6600))
fi
[[ "${SKIP_VLLM:-0}" == 1 || -x .venv-vllm/bin/python ]] || need_mb=$((need_mb + 3700))
free_mb=$(df -Pm . | awk 'NR == 2 {print $4}')
if ((free_mb < need_mb)); then
  printf 'test.sh: the test venvs still to be built need about %d MB free in %s; %d MB is (SKIP_SGLANG=1 or SKIP_VLLM=1 needs less)\n' \
    "$need_mb" "$ROOT" "$free_mb" >&2
  exit 1
fi

bash scripts/setup.sh || { echo "test.sh: scripts/setup.sh failed" >&2; exit 1; }
if [[ "${SKIP_SGLANG:-0}" != 1 ]]; then
  bash scripts/setup-sglang-venv.sh || { echo "test.sh: scripts/setup-sglang-venv.sh failed" >&2; exit 1; }
fi
if [[ "${SKIP_VLLM:-0}" != 1 ]]; then
  bash scripts/setup-vllm-venv.sh || { echo "test.sh: scripts/setup-vllm-venv.sh failed" >&2; exit 1; }
fi

status=0
.venv/bin/ruff check . || status=1
.venv/bin/ruff format --check . || status=1
.venv/bin/mypy || status=1  # otel_hicache, benchmarks and tests, configured in pyproject.toml

.venv/bin/python -m pytest -p no:cacheprovider -m "not sglang and not vllm" "$@"
rc=$?; [[ $rc -eq 0 ]] || status=$rc

if [[ "${SKIP_SGLANG:-0}" != 1 ]]; then
  "$sglang_venv/bin/python" -m pytest -p no:cacheprovider -m sglang tests/sglang tests/test_benchmarks_smoke.py "$@"
  rc=$?; [[ $rc -eq 0 || $rc -eq 5 ]] || status=$rc
fi
if [[ "${SKIP_VLLM:-0}" != 1 ]]; then
  # vLLM and what it imports report usage over the network unless told not to
  VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 LMCACHE_TRACK_USAGE=false \
    .venv-vllm/bin/python -m pytest -p no:cacheprovider -m vllm tests/vllm "$@"
  rc=$?; [[ $rc -eq 0 || $rc -eq 5 ]] || status=$rc
fi
exit $status
