#!/usr/bin/env bash
# Every benchmark on CUDA (pinned host memory, device timing events), for a GPU machine; under 10 minutes.
#
#   benchmarks/gpu.sh [OUT_DIR]        (default: benchmarks/results-gpu)
#
# Runs the same code paths as the CPU runs with --device cuda: the hot path with CUDA-event acks, the scheduler
# loop with real device<->pinned-host copies on a side stream, the reference controller's merged transfers against
# raw copies (512 MiB each), and a 3-minute soak. Fails fast when CUDA is not available.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/benchmarks/results-gpu}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[[ -x "$PY" ]] || PY=python3
cd "$ROOT"
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'benchmarks/gpu.sh: no CUDA device (torch.cuda.is_available() is False)')"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv \
  >"$OUT/gpu.txt" 2>&1 || true
# 540 s in all: hot path ~20 s, loop ~2 min, transfer ~30 s, soak 180 s + burst, with room to spare.
timeout 540 "$PY" -m benchmarks hotpath loop transfer soak --device cuda --soak-seconds 180 \
  --markdown "$OUT/RESULTS.md" --json "$OUT/results.json"
echo "benchmarks/gpu.sh: tables in $OUT/RESULTS.md"
