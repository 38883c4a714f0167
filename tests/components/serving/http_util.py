"""Raw HTTP helpers for the serving tests (stdlib only): JSON posts, SSE streams, free ports."""

from __future__ import annotations

import http.client
import json
import socket
import time
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(port: int, method: str, path: str, body: Any = None, key: str | None = None,
            raw: bytes | None = None, timeout: float = 60) -> tuple[int, dict[str, str], bytes]:
    """(status, headers (lower-case names), body bytes)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    try:
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def post(port: int, path: str, body: Any, key: str | None = None, **kw: Any) -> tuple[int, dict[str, Any]]:
    status, _, data = request(port, "POST", path, body, key, **kw)
    return status, json.loads(data)


def sse_events(data: bytes) -> list[Any]:
    """The ``data:`` payloads of an SSE body (JSON, or the string ``[DONE]``)."""
    out = []
    for block in data.decode().split("\n\n"):
        if block.startswith("data: "):
            payload = block[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def wait_for(check, timeout: float, every: float = 0.2) -> Any:
    """Polls ``check()`` until it returns something truthy (returned) or ``timeout`` passes (None)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            got = check()
        except (OSError, http.client.HTTPException):
            got = None
        if got:
            return got
        time.sleep(every)
    return None


def burst(port: int, path: str, body: Any, key: str | None, n: int,
          timeout: float = 120) -> list[tuple[int, float, dict[str, str], bytes]]:
    """``n`` POSTs sent at once on ``n`` connections (one event loop, so the client adds little):
    (status, seconds from the request's write to its whole response, headers, body) each."""
    import asyncio

    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n"
            + (f"Authorization: Bearer {key}\r\n" if key else "") + "\r\n").encode()

    async def one(opened: Any) -> tuple[int, float, dict[str, str], bytes]:
        reader, writer = await opened
        t0 = time.perf_counter()
        writer.write(head + data)
        raw = await reader.read(-1)  # Connection: close: the whole response
        seconds = time.perf_counter() - t0
        writer.close()
        top, _, payload = raw.partition(b"\r\n\r\n")
        lines = top.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        if headers.get("transfer-encoding") == "chunked":
            payload = _unchunk(payload)
        return int(lines[0].split()[1]), seconds, headers, payload

    async def all_at_once() -> list[tuple[int, float, dict[str, str], bytes]]:
        opened = [asyncio.ensure_future(asyncio.open_connection("127.0.0.1", port, limit=1 << 20))
                  for _ in range(n)]
        await asyncio.gather(*opened)  # every connection is up before the first request goes
        return list(await asyncio.wait_for(asyncio.gather(*(one(o) for o in opened)), timeout))

    return asyncio.run(all_at_once())


def _unchunk(payload: bytes) -> bytes:
    out = bytearray()
    while payload:
        size, _, rest = payload.partition(b"\r\n")
        length = int(size.split(b";")[0] or b"0", 16)
        if length == 0:
            break
        out += rest[:length]
        payload = rest[length + 2:]
    return bytes(out)


def asgi_status(app: Any, method: str, path: str, headers: dict[str, str] | None = None) -> int:
    """The status an ASGI ``app`` answers a bodiless request with, called in this process."""
    import asyncio

    sent: list[dict] = []
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return next(m["status"] for m in sent if m["type"] == "http.response.start")
