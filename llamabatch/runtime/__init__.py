"""What both engines share at run time: the worker thread that owns a context (``worker``), the
telemetry events and counters (``telemetry``) and the Prometheus metrics over them (``metrics``)."""
