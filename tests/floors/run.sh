#!/usr/bin/env bash
# The floors job: modalgate installed at the lowest version of each direct dependency
# that pyproject allows (tests/floors/constraints.py), the gateway's, validators',
# policy's and media tests run there. A floor nobody installed is a floor nobody
# tested: where this fails, the floor in pyproject is raised.
#
#   bash tests/floors/run.sh                    # -> .venv-floors/, then pytest
#   FLOORS_VENV=/tmp/v bash tests/floors/run.sh
#
# Left out, each for a reference stack the floors do not include (the encoder extra's
# torch and transformers are tested at their newest by the main job):
set -euo pipefail
NEEDS_REFERENCE_STACK=(
    tests/validators/test_tokens.py               # transformers' image processors
    tests/validators/test_video_tokens.py         # transformers' video processors
    tests/validators/test_audio_tokens.py         # transformers' audio processors
    tests/validators/test_av_processors.py        # transformers' loaders
    tests/validators/test_family_processors.py    # transformers' processors, torch
    tests/gateway/service/test_embeds_rewrite.py  # a torch encoder
    tests/gateway/service/test_encode_disconnect.py
    tests/gateway/service/test_encode_params.py
    tests/gateway/service/test_proxy_embeds.py
    tests/gateway/service/test_envoy_extproc.py   # grpcio, Envoy
    tests/gateway/service/test_envoy_routing.py   # grpcio, Envoy
    tests/gateway/service/test_envoy_doors.py     # grpcio, Envoy
    tests/gateway/service/test_envoy_one_message.py  # grpcio, Envoy
)
# Checks of the tree against the newest, not of the floors: docs/policy.schema.json is
# written by the newest pydantic (2.7 spells a one-value Literal with an extra "enum").
NEWEST_ONLY=(
    tests/policy/test_policy.py::test_schema_doc_is_current
)

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
VENV=${FLOORS_VENV:-$ROOT/.venv-floors}
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}

rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
"$VENV/bin/python" -m pip --disable-pip-version-check -q install packaging
"$VENV/bin/python" "$HERE/constraints.py" >"$CONSTRAINTS"
echo "floors: $(tr '\n' ' ' <"$CONSTRAINTS")"
"$VENV/bin/python" -m pip --disable-pip-version-check -q install \
    -c "$CONSTRAINTS" -e "$ROOT" -r "$HERE/tools.txt"
# What got installed, for the log (pip fails above where it cannot honour a constraint).
"$VENV/bin/python" -m pip --disable-pip-version-check list --format=freeze \
    | grep -iE "^($(sed 's/==.*//' "$CONSTRAINTS" | paste -sd'|'))==" || true

cd "$ROOT"
"$VENV/bin/python" -m pytest -p no:cacheprovider \
    tests/validators tests/gateway tests/policy tests/media tests/test_errors.py \
    "${NEEDS_REFERENCE_STACK[@]/#/--ignore=}" "${NEWEST_ONLY[@]/#/--deselect=}"
