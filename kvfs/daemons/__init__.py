"""Composition roots: one module per process, building it from the packages below and running it."""
