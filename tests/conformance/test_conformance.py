"""The gate against vLLM's and SGLang's own parsing, on the generated corpus: no body the
gate forwards is refused or read as another modality by the engine (no bypass), and no
body the engine takes is refused by the gate outside policy limits (no false reject).

Needs ``.venv-conformance`` (``bash tests/conformance/install.sh``; ``.ci/run`` builds
it): the engines cannot be imported next to the gateway's own dependencies.
"""

from __future__ import annotations

import sys

import pytest

from conformance import corpus, differential

pytestmark = pytest.mark.skipif(
    not differential.ENGINE_PYTHON.exists(),
    reason=f"{differential.ENGINE_PYTHON} is missing: run bash tests/conformance/install.sh",
)


@pytest.fixture(scope="module")
def report() -> differential.Report:
    report = differential.run()
    sys.stdout.write("\n" + report.table() + "\n")
    return report


def test_the_corpus_is_big_enough_and_seeded():
    cases = corpus.build()
    assert len(cases) >= 500
    assert cases == corpus.build()  # the same bodies on every run


def test_no_body_bypasses_the_engine(report):
    bypasses = [row for row in report.found if row["outcome"] == "bypass"]
    assert bypasses == [], bypasses[:3]


def test_no_body_the_engine_takes_is_refused_outside_limits(report):
    false_rejects = [row for row in report.found if row["outcome"] == "false reject"]
    assert false_rejects == [], false_rejects[:3]


def test_every_model_and_engine_configuration_saw_every_body(report):
    bodies = len(corpus.build())
    expected = {
        (m.label, c.name) for m in differential.GATE_MODELS for c in differential.ENGINE_CONFIGS
    }
    assert set(report.counts) == expected
    assert {sum(count.values()) for count in report.counts.values()} == {bodies}
