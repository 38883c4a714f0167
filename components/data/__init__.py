"""Data stage building blocks: prompt sources, target rollouts, hidden-state records, shards, streams.

Import the submodules directly; this package imports nothing heavy at import time.
"""
