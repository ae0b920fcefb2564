"""Benchmarks of llamabatch against its peers (``llamabatch bench``, the asv suites).

Modules: :mod:`llamabatch.bench.generate` (generation workloads: batched and mixed
arrivals, against a raw static batch and llama-cpp-python) and
:mod:`llamabatch.bench.memory` (RSS growth over many requests).
"""
