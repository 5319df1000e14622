#!/usr/bin/env bash
# Build .venv-conformance from scratch: vLLM and SGLang from PyPI WITHOUT their
# GPU dependencies, plus the few pure-Python packages their chat-request parsing
# imports, so that tests/conformance/engines.py can run the engines' own parsing.
#
#   bash tests/conformance/install.sh            # -> .venv-conformance/
#   CONFORMANCE_VENV=/tmp/v bash tests/conformance/install.sh
#
# Needs CPython 3.11 (SGLang ships cp311 wheels only for this release), network
# access to PyPI, ~2.5 GiB of disk; takes about 3 minutes on 2 cores. torch is
# the CPU wheel where pip finds one (find-links); elsewhere pip brings PyPI's
# default build with its CUDA libraries (several GiB more, same behaviour).
set -euo pipefail

VLLM_VERSION=0.33.0
SGLANG_VERSION=0.5.23
TORCH_VERSION=2.13.0

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
# torch with its own dependencies (vLLM's chat parsing imports it at module level).
pip install "torch==$TORCH_VERSION"
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
