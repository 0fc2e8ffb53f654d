#!/usr/bin/env bash
# GPU check, from a clean clone on a machine with a CUDA GPU, in a few minutes:
#   bash benchmarks/gpu_check.sh
# Uses the machine's torch when it has a CUDA build; otherwise installs the default PyPI wheel.
# With no package index: WHEELS=DIR bash benchmarks/gpu_check.sh installs DIR's wheels (what the
# machine's Python lacks) into a private folder and runs on the machine's own Python and torch.
# Three parts: the runner on CUDA (benchmarks.gpu_check), FLUX.1-dev's transformer at full size
# with random weights, plain and accelerated (benchmarks.flux_full), and the same transformer split
# over 1, 2 and 4 GPUs with Ulysses (benchmarks.flux_group; the degrees with too few visible GPUs
# are reported as not measured); all run, and the script fails when any does.
set -euo pipefail
cd "$(dirname "$0")/.."
export USE_HUB_KERNELS=0  # the in-process baseline loads as the runner does: no kernels from the Hub
if [[ -n "${WHEELS:-}" ]]; then
  python3 -m pip install --quiet --no-index --no-deps --upgrade --target /tmp/gpu-check-site "$WHEELS"/*.whl
  export PYTHONPATH="/tmp/gpu-check-site:$PWD:$PWD/protos/gen/python"
  python=python3
else
  python3 -m venv --system-site-packages .venv-gpu
  .venv-gpu/bin/python -c "import torch; assert torch.cuda.is_available()" 2>/dev/null \
    || .venv-gpu/bin/pip install --quiet torch
  .venv-gpu/bin/pip install --quiet -e ".[runner,test]"
  python=.venv-gpu/bin/python
fi
status=0
"$python" -m benchmarks.gpu_check || status=1
"$python" -m benchmarks.flux_full || status=1
"$python" -m benchmarks.flux_group || status=1
exit "$status"
