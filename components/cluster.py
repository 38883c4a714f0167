"""The one place that starts or joins Ray.

Local by default (a fresh single-node instance sized for this machine), or an existing
cluster when ``ray.address`` is ``auto`` or ``ray://host:port``. Local settings are tuned for
small boxes: token auth off (Ray 2.5x turns it on for local clusters), a bounded object store,
no dashboard unless asked, and a logical CPU count that lets Ray Data and Ray Train workers
with fractional CPUs run side by side instead of starving each other.

Knows Ray and the ``ray`` config section; nothing about stages.
"""

from __future__ import annotations

import os
from typing import Any

from components.config import RayConfig


def local_init_kwargs(cfg: RayConfig) -> dict[str, Any]:
    """Arguments of ``ray.init`` for a local instance on this machine."""
    kwargs: dict[str, Any] = {
        "num_cpus": cfg.num_cpus or os.cpu_count() or 1,
        "include_dashboard": cfg.include_dashboard,
        "log_to_driver": True,
        "configure_logging": True,
        "logging_level": "WARNING",
    }
    if cfg.object_store_memory_mb:
        kwargs["object_store_memory"] = cfg.object_store_memory_mb * 1024 * 1024
    return kwargs


def init_ray(cfg: RayConfig) -> dict[str, Any]:
    """Starts or joins Ray once per process; returns the cluster's resources."""
    import ray

    if ray.is_initialized():
        return ray.cluster_resources()
    if cfg.address is None:
        if cfg.disable_auth_locally:
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
        ray.init(**local_init_kwargs(cfg))
    else:  # ship this checkout's packages so cluster workers run the same code as the driver
        import components
        import pipelines

        ray.init(address=cfg.address, logging_level="WARNING",
                 runtime_env={"py_modules": [components, pipelines]})
    return ray.cluster_resources()


def shutdown_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()

