"""Shared test configuration.

Hypothesis profiles, chosen by the ``HYPOTHESIS_PROFILE`` environment variable:
``dev`` (default, modest) and ``ci`` (the default when ``CI`` is set; more examples; the
core tests stay within about a minute on 2 cores).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile("dev", max_examples=40, deadline=None)
settings.register_profile(
    "ci", max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
