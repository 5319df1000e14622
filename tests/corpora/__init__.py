"""The test suite's generated corpora, shared with the benchmarks that need them.

``hostile``: hostile HTTP requests (paths, methods, headers, bodies, media) with the
invariants every answer must keep, and a recording upstream; ``fuzz_long``: the
long-run fuzzing harness over them (``python tests/corpora/fuzz_long.py --help``),
used by ``tests/hardening/test_fuzz_asgi.py`` in short runs and by
``benchmarks/load_mixed.py``. Nothing here measures speed.
"""
