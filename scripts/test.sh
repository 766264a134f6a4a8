#!/usr/bin/env bash
# The test command: installs what the tests need (idempotent), then runs lint and every test suite.
#   - .venv        the project + test extras (scripts/setup.sh)
#   - .venv-sglang the real SGLang 0.5.23 HiCache classes on CPU (scripts/setup-sglang-venv.sh)
#   - .venv-vllm   the real vLLM 0.32 KV offloading connector on CPU (scripts/setup-vllm-venv.sh, ~3.5 GB, ~2.5 min)
#   - .venv-vllm-0.33 vLLM 0.33's Python code: its CUDA wheel on the CPU (VLLM_VERSION=0.33.0 scripts/setup-vllm-venv.sh,
#                  ~7.1 GB, ~2.7 min)
#   - .venv-vllm-0.34 vLLM 0.34's Python code, the same way (VLLM_VERSION=0.34.0, ~6.8 GB, ~3 min); the vLLM suite runs
#                  in all three, the real-engine tests in .venv-vllm only
#   - prometheus + promtool from Debian (apt-get, when missing)
# Lint (ruff), types (mypy), then the tests (doctests of every module included).
# Set SKIP_SGLANG=1 to skip the SGLang suite (and its ~6 GB venv), SKIP_VLLM=1 the vLLM suite (and its venv).
# SGLANG_VERSION=0.5.22 runs the SGLang suite against the previous release instead (in .venv-sglang-0.5.22); CI runs
# 0.5.23. VLLM_VERSION=0.32.0, 0.33.0 or 0.34.0 runs the vLLM suite against that release only; CI runs all three.
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
vllm_versions=()
[[ "${SKIP_VLLM:-0}" == 1 ]] || read -r -a vllm_versions <<<"${VLLM_VERSION:-0.32.0 0.33.0 0.34.0}"
vllm_venv() { if [[ $1 == 0.32.0 ]]; then echo .venv-vllm; else echo ".venv-vllm-${1%.*}"; fi; }
for version in "${vllm_versions[@]}"; do
  [[ -x "$(vllm_venv "$version")/bin/python" ]] || need_mb=$((need_mb + $(case $version in 0.32.0) echo 3700 ;; 0.33.0) echo 7300 ;; *) echo 7000 ;; esac)))
done
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
for version in "${vllm_versions[@]}"; do
  VLLM_VERSION=$version bash scripts/setup-vllm-venv.sh \
    || { echo "test.sh: VLLM_VERSION=$version scripts/setup-vllm-venv.sh failed" >&2; exit 1; }
done

status=0
.venv/bin/ruff check . || status=1
.venv/bin/ruff format --check . || status=1
.venv/bin/mypy || status=1  # otel_hicache, benchmarks and tests, configured in pyproject.toml

.venv/bin/python -m pytest -p no:cacheprovider -m "not sglang and not vllm" "$@"
rc=$?; [[ $rc -eq 0 ]] || status=$rc

if [[ "${SKIP_SGLANG:-0}" != 1 ]]; then
  # -W: a SWIG binding SGLang imports warns once more as the interpreter exits, after pytest's own filters
  "$sglang_venv/bin/python" -W "ignore:builtin type swigvarlink:DeprecationWarning" \
    -m pytest -p no:cacheprovider -m sglang tests/sglang tests/test_benchmarks_smoke.py "$@"
  rc=$?; [[ $rc -eq 0 || $rc -eq 5 ]] || status=$rc
fi
for version in "${vllm_versions[@]}"; do
  # vLLM and what it imports report usage over the network unless told not to
  VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 LMCACHE_TRACK_USAGE=false \
    "$(vllm_venv "$version")/bin/python" -m pytest -p no:cacheprovider -m vllm tests/vllm "$@"
  rc=$?; [[ $rc -eq 0 || $rc -eq 5 ]] || status=$rc
done
exit $status
