"""The API key, enforced on every route of the app but the public ones.

``key_dependency(key)`` is a FastAPI dependency the app is built with (``FastAPI(dependencies=
[...])``), so it runs before the handler of every route the app has, one added later included:
a route is protected unless its path is in ``PUBLIC``; nothing has to remember to check. The
key goes as ``Authorization: Bearer <key>`` (what the OpenAI clients send), compared in constant
time; a missing or wrong key is a 401 OpenAI error. With no key configured every route is open.

Public, and why: ``/health`` (load balancers and Kubernetes probes carry no key, and it says
only whether the replica is warm) and ``/metrics`` (Prometheus scrapers carry no key either, as
with vLLM's server, whose key guards the API routes only; it holds counts and latencies, never a
request's text). Knows FastAPI's ``Request``; nothing about the routes' work.
"""

import hmac
import os
from collections.abc import Callable

from fastapi import Request

from components.config import ConfigError, ServeConfig
from components.serving.protocol import APIError

PUBLIC = frozenset({"/health", "/metrics"})


def key_dependency(key: str | None) -> Callable[[Request], None]:
    """The dependency that refuses a request to a non-public route without ``key``."""
    def check_key(request: Request) -> None:
        if key is None or request.url.path in PUBLIC:
            return
        given = request.headers.get("authorization", "")
        token = given[7:] if given.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
    return check_key


def api_key(sc: ServeConfig) -> str | None:
    """``serve.api_key``, else the environment variable ``serve.api_key_env`` names (which must be set)."""
    if sc.api_key:
        return sc.api_key
    if sc.api_key_env:
        key = os.environ.get(sc.api_key_env)
        if not key:
            raise ConfigError(f"serve.api_key_env: the environment variable '{sc.api_key_env}' is not set or empty")
        return key
    return None
