"""Tooling for ``make run``, the tests and the benchmarks (``sagelmi tiny-model``;
``python -m container.tools.tiny_adapter`` for the tests)."""
