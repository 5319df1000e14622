#!/usr/bin/env bash
# Build .venv-conformance from scratch: vLLM and SGLang from PyPI WITHOUT their
# GPU dependencies, plus the few pure-Python packages their chat-request parsing
# imports, so that tests/conformance/engines.py can run the engines' own parsing.
#
#   bash tests/conformance/install.sh            # -> .venv-conformance/
#   CONFORMANCE_VENV=/tmp/v bash tests/conformance/install.sh
#
# Needs CPython 3.11 (SGLang ships cp311 wheels only for this release), network
# access to PyPI, ~7 GiB of disk (torch and torchvision are the CUDA build: they run on
# the CPU); takes about 4 minutes on 2 cores, less where pip finds torch on local disk.
set -euo pipefail

VLLM_VERSION=0.33.0
SGLANG_VERSION=0.5.23
TORCH_VERSION=2.14.1
# SGLang's app imports torchvision at module level (sglang.srt.multimodal.internvl_utils);
# PyPI's torchvision does not load beside the CPU torch 2.13.0 build: this is the pair
# that loads here (a CUDA build, ~5.5 GB, run on the CPU).
TORCHVISION_VERSION=0.29.1

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
VENV=${CONFORMANCE_VENV:-$ROOT/.venv-conformance}
# SGLang 0.5.23 ships wheels for CPython 3.11 only: take python3.11 where there is one.
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}

rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT
pip() {
    # --no-deps makes pip list every declared dependency left out: expected, not shown.
    local status=0
    "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" >"$LOG" 2>&1 || status=$?
    grep -vE "^(ERROR: pip's dependency resolver|(vllm|sglang) [^ ]+ requires )|is ignored: it is neither" "$LOG" || true
    return "$status"
}

# The engines, without a single one of their declared dependencies.
pip install --no-deps "vllm==$VLLM_VERSION" "sglang==$SGLANG_VERSION"
# torch with its own dependencies (vLLM's chat parsing imports it at module level), and
# torchvision for SGLang's app (tests/conformance/test_sglang_mounted.py).
pip install "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"
# The rest, pinned, exactly as listed.
pip install --no-deps -r "$HERE/requirements.txt"

"$VENV/bin/python" "$HERE/engines.py" --versions
# Both engines answer one body with an image in it.
body='{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"https://x.test/a.png"}}]}]}'
for engine in vllm sglang; do
    view=$(echo "$body" | "$VENV/bin/python" "$HERE/engines.py" --engine "$engine")
    case "$view" in
        *'"accepted": true'*'"image": 1'*) echo "$engine: ok" ;;
        *) echo "$engine: unexpected view: $view" >&2; exit 1 ;;
    esac
done
