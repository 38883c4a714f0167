"""The one place that starts or joins Ray.

Local by default (a fresh single-node instance sized for this machine), or an existing
cluster when ``ray.address`` is ``auto`` or ``ray://host:port``. Local settings are tuned for
small boxes: token auth off (Ray 2.5x turns it on for local clusters), a bounded object store,
the dashboard on loopback (its URL printed as Ray starts), and a logical CPU count that lets Ray Data and Ray Train workers
with fractional CPUs run side by side instead of starving each other.

Within a log session (:mod:`components.logs`) the output Ray's workers stream to the driver
goes to the run's log file (through :data:`components.logs.WORKER_LOGGER`) instead of the
console, workers draw no progress bars (nobody sees them there) and Ray Data draws none in the
driver either; with ``log_level: verbose`` Ray prints its workers' output itself as well.

Knows Ray and the ``ray`` config section; nothing about stages.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from components import logs
from components.config import RayConfig

RAY_PRINTER = "ray_print_logs"  # Ray's own handler of the workers' streamed output (prints it)
LOG_WRITER = "specline_worker_log"  # ours: the same output → logs.WORKER_LOGGER
# Env vars of every Ray worker within an info-level session: their output only reaches the log file.
QUIET_WORKER_ENV = {"TQDM_DISABLE": "1", "RAY_DATA_DISABLE_PROGRESS_BARS": "1"}
TQDM_MAGIC = "__ray_tqdm_magic_token__"  # ray.experimental.tqdm_ray's state updates: not text


def worker_env(level: str | None) -> dict[str, str]:
    """Env vars for every worker of a session at ``level`` (None: no session, nothing set)."""
    return dict(QUIET_WORKER_ENV) if level == logs.INFO else {}


def local_init_kwargs(cfg: RayConfig, level: str | None = None) -> dict[str, Any]:
    """Arguments of ``ray.init`` for a local instance on this machine (``level``: the log session's)."""
    kwargs: dict[str, Any] = {
        "num_cpus": cfg.num_cpus or os.cpu_count() or 1,
        "include_dashboard": cfg.include_dashboard,
        **({"dashboard_host": cfg.dashboard_host} if cfg.include_dashboard else {}),
        "log_to_driver": True,
        "configure_logging": True,
        "logging_level": "WARNING",
    }
    if cfg.include_dashboard and cfg.dashboard_port is not None:
        kwargs["dashboard_port"] = cfg.dashboard_port
    if cfg.object_store_memory_mb:
        kwargs["object_store_memory"] = cfg.object_store_memory_mb * 1024 * 1024
    if env := worker_env(level):
        kwargs["runtime_env"] = {"env_vars": env}
    return kwargs


def _text_lines(data: dict[str, Any]) -> list[str]:
    """The lines of a streamed batch worth keeping: the autoscaler's events only (as Ray prints
    them), no tqdm_ray state updates."""
    lines = data.get("lines", [])
    if data.get("pid") == "autoscaler":
        try:
            from ray._private.worker import filter_autoscaler_events

            return list(filter_autoscaler_events(lines))
        except Exception:  # noqa: BLE001 -- Ray's private helper moved or needs a connection: drop them
            return []
    return [line for line in lines if TQDM_MAGIC not in line]


def write_worker_lines(data: dict[str, Any]) -> None:
    """One batch of a worker's streamed stdout/stderr → :data:`components.logs.WORKER_LOGGER`
    (called on Ray's log thread, which must never see an exception)."""
    try:
        _write_worker_lines(data)
    except Exception:
        logging.getLogger(__name__).debug("cluster: a batch of worker output was dropped", exc_info=True)


_last_progress = [""]  # the last progress line shown (Ray's log thread is the only writer)


def _write_worker_lines(data: dict[str, Any]) -> None:
    log = logging.getLogger(logs.WORKER_LOGGER)
    who = data.get("actor_name") or data.get("task_name") or ""
    where = f"{who} pid={data.get('pid')}".strip()
    if data.get("ip") and data.get("ip") != data.get("localhost"):
        where += f", ip={data['ip']}"
    stream = "stderr" if data.get("is_err") else "stdout"
    for line in _text_lines(data):
        if line.startswith(logs.PROGRESS_MARK):  # a worker's progress: on the console as a stage line
            text = line[len(logs.PROGRESS_MARK):].rstrip()
            if text != _last_progress[0]:  # Ray Train streams a worker's line twice; progress lines all differ
                _last_progress[0] = text
                logging.getLogger(logs.CONSOLE_LOGGER).info("%s", text)
        else:
            log.info("(%s %s) %s", where, stream, line.rstrip())


def route_worker_output(level: str | None) -> None:
    """Within a session: the workers' streamed output also goes to the log file and, below
    ``verbose``, no longer to the console. Outside one (None): Ray's default."""
    if level is None:
        return
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:  # Ray moved its private dispatcher: keep its console output
        logging.getLogger(__name__).warning("cluster: Ray's worker output stays on the console "
                                            "(this Ray has no stdstream dispatcher)")
        return
    dispatcher.remove_handler(LOG_WRITER)
    dispatcher.add_handler(LOG_WRITER, write_worker_lines)
    if level != logs.VERBOSE:
        dispatcher.remove_handler(RAY_PRINTER)


def quiet_driver(level: str | None) -> None:
    """Within an info-level session: no Ray Data progress bars in the driver (the stages report
    their own progress), and Ray's libraries log through the session's handlers."""
    if level is None:
        return
    if level == logs.INFO:
        from ray.data import DataContext

        DataContext.get_current().enable_progress_bars = False
    logs.adopt_library_loggers()  # importing ray.data configured its logger: adopt it now


def init_ray(cfg: RayConfig) -> dict[str, Any]:
    """Starts or joins Ray once per process; returns the cluster's resources."""
    import ray

    if ray.is_initialized():
        return ray.cluster_resources()
    level = logs.console_level()
    if cfg.address is None:
        if cfg.disable_auth_locally:
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
        # Ray's C++ failure-signal handler dumps a stack for SIGTERM (how Kubernetes, systemd and
        # docker stop a process); the serve stage stops on SIGTERM cleanly instead
        os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
        ray.init(**local_init_kwargs(cfg, level))
    else:  # ship this checkout's components so cluster workers run the same code as the driver
        import components  # (the stages in pipelines/ run in the driver only: workers never import them)

        runtime_env: dict[str, Any] = {"py_modules": [components]}
        if env := worker_env(level):
            runtime_env["env_vars"] = env
        ray.init(address=cfg.address, logging_level="WARNING", runtime_env=runtime_env)
    route_worker_output(level)
    quiet_driver(level)
    if url := dashboard_url():
        logging.getLogger(logs.CONSOLE_LOGGER).info("Ray dashboard: %s", url)
    return ray.cluster_resources()


def dashboard_url() -> str | None:
    """The Ray dashboard's address (http://host:port), None when it is off."""
    try:
        from ray._private.worker import get_dashboard_url

        url = get_dashboard_url()
    except Exception:  # noqa: BLE001  (no dashboard)
        return None
    return (url if url.startswith("http") else f"http://{url}") if url else None


def shutdown_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()
        try:
            from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
        except ImportError:
            return
        dispatcher.remove_handler(LOG_WRITER)

