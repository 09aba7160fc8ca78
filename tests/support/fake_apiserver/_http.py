"""aiohttp plumbing shared by the request handler, the watch streams, faults and the service proxy."""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

from aiohttp import web

from ._errors import ApiError


def json_response(body: Any, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(body=json.dumps(body, separators=(",", ":")).encode(), status=status,
                        headers={"Content-Type": "application/json", **(headers or {})})


def status_response(err: ApiError) -> web.Response:
    return json_response(err.body(), err.code, err.headers)


async def read_json(request: web.Request) -> Any:
    raw = await request.read()
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise ApiError.bad_request(f"error decoding body: {exc}") from None


def abort(request: web.Request) -> None:
    """Close the client's TCP connection at once, with RST (no response, no terminating chunk)."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    transport.abort()
