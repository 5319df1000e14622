#!/usr/bin/env bash
# GPU checks for the encoder stage, for a session lent a GPU machine (the `device` tool).
# Runs in under 5 minutes on one H200: the CUDA tests, then preprocessing on the
# device vs the CPU, encode throughput and the batch speedup with a Kimi-K2.5-size tower.
#
# The device image has torch, torchvision, Pillow, numpy, httpx, anyio and pytest,
# but not every modalgate dependency, and it cannot reach PyPI. Prepare wheels here
# once (Python 3.12, x86-64), in the repo root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl pydantic pydantic-core orjson pybase64 starlette uvicorn transformers==5.24.0 \
#     typing-inspection annotated-types openai trustme
# and call: run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=420)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-/tmp/gpu_check}"
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
{
  nvidia-smi -L
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  echo "== CUDA tests (the CPU conformance tests run too: they are the reference)"
  timeout 150 python3 -m pytest -q -p no:cacheprovider \
    tests/encoder_adapter/kimi
  echo "== P4 preprocessing: ours vs transformers on the CPU, then ours on CUDA vs ours on the CPU"
  timeout 90 python3 benchmarks/p4_kimi_preprocess.py --quick
  timeout 60 python3 - <<'PY'
import time, numpy as np, torch
from PIL import Image
from modalgate.encoder_adapter.kimi.preprocess import KimiPreprocessor
image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (1080, 1920, 3), np.uint8))
cpu, gpu = KimiPreprocessor(max_patches=65536), KimiPreprocessor(max_patches=65536, device="cuda")
def best(run, sync=False, n=20):
    times = []
    for _ in range(n):
        start = time.perf_counter(); run(); torch.cuda.synchronize() if sync else None
        times.append(time.perf_counter() - start)
    return min(times)
gpu([image]); torch.cuda.synchronize()
c, g = best(lambda: cpu([image])), best(lambda: gpu([image]), sync=True)
print(f"1920x1080: cpu {c*1e3:.2f} ms, cuda {g*1e3:.2f} ms, cpu/cuda {c/g:.2f}")
PY
  echo "== P5 batched encode, Kimi-K2.5-size tower on the GPU (target >= 3)"
  timeout 120 python3 benchmarks/p5_batched_encode.py --quick --realistic --device cuda --side 448
} 2>&1 | tee "$OUT_DIR/gpu_check.log"
