"""Fuzzing the geometry validators against the specification.

* :mod:`fuzz.oracle` — one input (bytes) through both validators, the specification as
  the oracle; any disagreement or exception is a crash.
* :mod:`fuzz.atheris_harness` — the coverage-guided libFuzzer engine (its own process).
* :mod:`fuzz.hypothesis_harness` — the same oracle behind Hypothesis' ``fuzz_one_input``.
* :mod:`fuzz.campaign` — the runner: ``python -m fuzz --seconds N --report PATH``.
* ``fuzz/seeds/`` — the committed seed corpus.
"""
