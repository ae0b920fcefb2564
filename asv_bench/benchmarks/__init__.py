"""asv benchmarks of llamabatch.

Run from ``asv_bench/`` in an environment where llamabatch is built
(``pip install -e . --no-build-isolation``)::

    asv run --python=same --quick            # every benchmark, one pass
    asv run --python=same -b bench_core      # the scheduler core only

``python asv_bench/benchmarks/bench_core.py`` prints the core's target figures (one full
tick, Cython vs the pure-Python reference, side by side).
"""
