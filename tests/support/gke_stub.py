"""A local stand-in for Google's OAuth token endpoint and the GKE API's clusters.get, over real HTTP.

The Google provider's hooks run unchanged against it: a service-account key whose
``token_uri`` points here gets real OAuth tokens (short-lived when asked), and the
GKE REST client reads the cluster's endpoint and CA from here.
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import socket
import threading
from typing import Any

from aiohttp import web
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa


class GoogleStub:
    """OAuth token endpoint + ``GET /v1/projects/*/locations/*/clusters/*``.

    :param api_server: ``host:port`` of the Kubernetes API server the cluster answers with.
    :param ca_pem: the API server's CA certificate (PEM).
    :param token_lifetime: ``expires_in`` of issued tokens, in seconds.
    :param on_token: called with each issued token (e.g. to make the API server accept it).
    """

    def __init__(self, api_server: str, ca_pem: bytes, token_lifetime: int, on_token: Any) -> None:
        self.api_server = api_server
        self.ca_pem = ca_pem
        self.token_lifetime = token_lifetime
        self.on_token = on_token
        self.tokens: list[str] = []
        self.cluster_reads: list[str] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> GoogleStub:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/token", self._token)
        app.router.add_get("/v1/projects/{project}/locations/{location}/clusters/{cluster}", self._cluster)
        runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.SockSite(runner, self._sock).start())
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())

    async def _token(self, request: web.Request) -> web.Response:
        form = await request.post()
        assert form["grant_type"] == "urn:ietf:params:oauth:grant-type:jwt-bearer"
        token = "ya29." + secrets.token_urlsafe(16)
        self.on_token(token)
        self.tokens.append(token)
        return web.json_response({"access_token": token, "expires_in": self.token_lifetime, "token_type": "Bearer"})

    async def _cluster(self, request: web.Request) -> web.Response:
        self.cluster_reads.append(request.path)
        return web.json_response({
            "name": request.match_info["cluster"],
            "endpoint": self.api_server,
            "masterAuth": {"clusterCaCertificate": base64.b64encode(self.ca_pem).decode()},
            "status": "RUNNING",
        })

    def service_account_key(self, project: str) -> dict[str, str]:
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption()).decode()
        return {
            "type": "service_account",
            "project_id": project,
            "private_key_id": "test-key",
            "private_key": pem,
            "client_email": f"airflow@{project}.iam.gserviceaccount.com",
            "client_id": "1",
            "token_uri": f"{self.url}/token",
        }

    def gcp_connection(self, project: str) -> str:
        return json.dumps({"conn_type": "google_cloud_platform",
                           "extra": {"keyfile_dict": json.dumps(self.service_account_key(project)),
                                     "project": project}})
