"""Tooling for ``make run``, the tests and the benchmarks (``sagelmi tiny-model``, ``sagelmi tiny-adapter``)."""
