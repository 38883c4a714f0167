"""The API key by construction: the app's dependency guards every route but the public ones,
a route added to the app later included, without any check of its own. (Every route of the
served app, over HTTP: ``test_http.py``.)"""

from __future__ import annotations

from components.serving.app import Server, new_api
from components.serving.auth import PUBLIC
from tests.components.serving.http_util import asgi_status

KEY = "test-key"


def bare_api(key: str | None):
    """The app ``new_api`` builds for a replica, around a bare ``Server``: enough for its route
    table and for the key check, which runs before any handler."""
    return new_api(object.__new__(Server), key)


def route_table() -> list[tuple[str, str]]:
    """(method, path) of every route of the app."""
    api = bare_api(KEY)
    return [(m, r.path) for r in api.routes for m in sorted(getattr(r, "methods", None) or {"GET"}) if m != "HEAD"]


def test_only_the_declared_public_routes_are_open():
    assert PUBLIC == {"/health", "/metrics"}
    api = bare_api(KEY)
    for method, path in route_table():
        if path not in PUBLIC:
            assert asgi_status(api, method, path) == 401, (method, path)
            assert asgi_status(api, method, path, {"Authorization": "Bearer wrong"}) == 401, (method, path)


def test_a_route_added_later_is_protected_without_a_check_of_its_own():
    api = bare_api(KEY)
    api.get("/v1/added")(lambda: {"ok": True})
    api.get("/added-elsewhere")(lambda: {"ok": True})
    for path in ("/v1/added", "/added-elsewhere"):
        assert asgi_status(api, "GET", path) == 401
        assert asgi_status(api, "GET", path, {"Authorization": f"Bearer {KEY}"}) == 200
    open_api = bare_api(None)  # no key configured: every route is open
    open_api.get("/v1/added")(lambda: {"ok": True})
    assert asgi_status(open_api, "GET", "/v1/added") == 200
