"""Reading a gateway's REST API: what links-only events name (GoCardless,
Mollie). One GET, with a timeout, no redirects followed; any failure is
`GatewayUnavailable`, which leaves the job to RQ's retries."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import httpx

from payhook.errors import GatewayUnavailable
from payhook.gateways.base import Config

#: Hosts an API may be reached on over plain HTTP: a local fake, in tests.
LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


def base_url(config: Config, default: str) -> str:
    """The endpoint's `api_base_url`, else `default`; `ValueError` unless it
    is https (or a local fake's)."""
    url = config.settings.get("api_base_url") or default
    parts = urlsplit(url)
    local = parts.scheme == "http" and parts.hostname in LOCAL_HOSTS
    if not (parts.scheme == "https" or local) or not parts.hostname or parts.query:
        raise ValueError(f"api_base_url: expected an https:// URL, got {url!r}")
    return url.rstrip("/")


def get_json(
    config: Config, default: str, path: str, headers: Mapping[str, str], timeout: float
) -> Any:
    """`GET {api}{path}` with `headers`: the JSON it answered with 200."""
    try:
        url = base_url(config, default) + path
    except ValueError as exc:
        raise GatewayUnavailable(str(exc)) from None
    try:
        response = httpx.get(
            url,
            headers={"user-agent": "payhook", "accept": "application/json", **headers},
            timeout=timeout,
            follow_redirects=False,
        )
    except httpx.HTTPError as exc:
        raise GatewayUnavailable(f"GET {path}: {exc.__class__.__name__}") from None
    if response.status_code != 200:
        raise GatewayUnavailable(f"GET {path}: {response.status_code}")
    try:
        return response.json()
    except ValueError:
        raise GatewayUnavailable(f"GET {path}: not JSON") from None
