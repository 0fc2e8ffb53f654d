#!/usr/bin/env bash
# GPU check, from a clean clone on a machine with a CUDA GPU, in a few minutes:
#   bash benchmarks/gpu_check.sh
# Uses the machine's torch when it has a CUDA build; otherwise installs the default PyPI wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv --system-site-packages .venv-gpu
.venv-gpu/bin/python -c "import torch; assert torch.cuda.is_available()" 2>/dev/null \
  || .venv-gpu/bin/pip install --quiet torch
.venv-gpu/bin/pip install --quiet -e ".[runner,test]"
.venv-gpu/bin/python -m benchmarks.gpu_check
