"""Thin stage entry points: each reads its config, builds parts from components, runs them,
logs to MLflow and returns artifact references (paths, run ids) for the next stage."""
