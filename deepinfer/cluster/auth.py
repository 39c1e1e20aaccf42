"""Authentication inside a prefill/decode cluster: the shared cluster token on internal HTTP.

The router and its workers share one secret (`--cluster-token` / $DEEPINFER_CLUSTER_TOKEN; the local
and Ray launchers generate one). Every `/internal/*` request carries it in `CLUSTER_TOKEN_HEADER`;
without it a worker or router answers 401 before reading the body. A worker's public API (`/v1/*`,
`/tokenize`, ...) needs it too: clients go through the router, whose API keys a worker does not check
(`serve(..., api_token=)`). That is what lets a worker take
the tenant of a request (`cache_tenant` in the body) from the router: a client cannot reach the
endpoint that sets it. The KV transfer port proves the same token with a challenge/response
(`cluster/transfer.py`), so no KV byte goes to or comes from a peer without it.

With no token configured (processes started by hand without one) every check passes, as before.
"""

from __future__ import annotations

import hmac
import secrets

from fastapi import Request

from deepinfer.server.protocol import APIError

CLUSTER_TOKEN_HEADER = "x-deepinfer-cluster-token"


def new_token() -> str:
    """A fresh random cluster token (256 bits)."""
    return secrets.token_urlsafe(32)


def token_headers(token: str | None) -> dict[str, str]:
    """The headers that authenticate an internal request (none without a token)."""
    return {CLUSTER_TOKEN_HEADER: token} if token else {}


def require_token(token: str | None, message: str = "this internal endpoint needs the cluster token"):
    """A FastAPI dependency refusing requests that do not carry `token` (401, `message`); None: allows
    everything."""

    async def check(request: Request) -> None:
        if token is None:
            return
        given = request.headers.get(CLUSTER_TOKEN_HEADER, "")
        if not hmac.compare_digest(given.encode(), token.encode()):
            raise APIError(401, message, type="authentication_error", code="invalid_cluster_token")

    return check
