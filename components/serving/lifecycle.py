"""A replica's life, as ``/health``, Ray Serve's ``check_health`` and the generation routes see it.

    loaded ──► warming up (one phase after another) ──► ok
       └────────────┴───────────── a failure ──────────┴──► dead (for good)

While warming up ``check_health`` passes (Serve counts a failed check at the end of start-up as a
failed start, and replaces a running replica after three failed periodic checks, so failing
would restart any warm-up longer than three ``health_check_period_s``, for ever) and requests
get 503 ``warming_up`` with ``Retry-After``. Once the warm-up or an engine round failed, the
replica is dead: ``check_health`` raises, so Serve replaces it, and requests get 503
``engine_dead``. Knows the states and the errors they give; nothing about the engine, the
warm-up's steps or HTTP.
"""

from __future__ import annotations

import logging
import time

from components.serving.protocol import APIError

log = logging.getLogger(__name__)
WARMING, OK, DEAD = "warming_up", "ok", "dead"


class Lifecycle:
    """Where one replica is: warming up (``phase``), ok, or dead (``error``)."""

    def __init__(self, retry_after_s: int = 1):
        self.retry_after_s = retry_after_s
        self.phase: str | None = "loaded"  # the warm-up step under way; None once warm
        self.error: str | None = None  # set once the warm-up or a round failed
        self.created = time.perf_counter()

    @property
    def state(self) -> str:
        return DEAD if self.error is not None else WARMING if self.phase is not None else OK

    @property
    def healthy(self) -> bool:
        """Ready for traffic (what ``/health`` answers 200 for)."""
        return self.state == OK

    def warm(self) -> None:
        self.phase = None
        log.info("replica warm %.1f s after it was created", time.perf_counter() - self.created)

    def died(self, err: BaseException, during: str | None = None) -> None:
        """Dead for good: during a warm-up phase (``during``), else in an engine round."""
        if self.error is None:
            self.error = str(err) if during is None else f"{during}: {type(err).__name__}: {err}"
            log.error("engine failed in %s; this replica reports unhealthy from now on: %s", during or "a round", err)

    def check_health(self) -> None:
        """Raises once dead (Ray Serve then replaces the replica); passes while warming up."""
        if self.error is not None:
            raise RuntimeError(f"engine is dead: {self.error}")

    def check_ready(self) -> None:
        """Raises the 503 ``APIError`` (with ``Retry-After``) while warming up or once dead."""
        if self.error is not None:
            raise self.dead_error(f"the engine of this replica failed ({self.error}); it is being replaced, "
                                  "retry shortly")
        if self.phase is not None:
            raise APIError(503, f"this replica is warming up ({self.phase}); retry after {self.retry_after_s} s",
                           code="warming_up", headers=self.retry_after())

    def dead_error(self, message: str) -> APIError:
        return APIError(503, message, code="engine_dead", headers=self.retry_after())

    def retry_after(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}

    def uptime(self) -> float:
        return round(time.perf_counter() - self.created, 3)
