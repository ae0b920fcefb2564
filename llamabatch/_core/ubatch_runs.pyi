"""Type stubs for the compiled ``llamabatch._core.ubatch_runs``: C functions only (see ubatch_runs.pyx)."""
