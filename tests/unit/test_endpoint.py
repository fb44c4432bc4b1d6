"""payhook.endpoints.Endpoint: the one endpoint the ingress and the consumer hold."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from payhook.endpoints import Endpoint
from payhook.gateways import get_gateway
from payhook.gateways.standard import sign

ACTIVE = "whsec_YWN0aXZlLXNlY3JldC1vbmU="
RETIRED = "whsec_cmV0aXJlZC1zZWNyZXQtdHdv"
RETIRED_AT = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def endpoint() -> Endpoint:
    return Endpoint(
        "e1",
        "t1",
        "standard",
        (ACTIVE,),
        retired=((RETIRED, RETIRED_AT),),
        credentials={"api_token": "whsec_YWN0"},
    )


def test_no_repr_shows_a_secret() -> None:
    """Not the endpoint's, not its secrets', not a tuple's or a log line's
    that holds them."""
    shown = [
        repr(endpoint()),
        str(endpoint()),
        repr(endpoint().secrets),
        repr(endpoint().retired),
        repr(endpoint().secrets_at(RETIRED_AT, timedelta(minutes=1))),
        repr({"endpoint": endpoint()}),
        repr(endpoint().config),
        repr(endpoint().credentials),
    ]
    for text in shown:
        assert "whsec" not in text and "YWN0" not in text and "cmV0" not in text, text
    assert repr(endpoint()) == (
        "Endpoint(id='e1', tenant_id='t1', gateway='standard', settings={})"
    )


def test_the_secrets_still_verify_and_compare_as_given() -> None:
    held = endpoint()
    assert held.secrets == (ACTIVE,) and held.retired == ((RETIRED, RETIRED_AT),)
    assert held == Endpoint(
        "e1",
        "t1",
        "standard",
        (ACTIVE,),
        ((RETIRED, RETIRED_AT),),
        credentials={"api_token": "whsec_YWN0"},
    )
    body = b'{"type": "payment.succeeded"}'
    for secret in (ACTIVE, RETIRED):
        headers = {
            "webhook-id": "msg_1",
            "webhook-timestamp": "1767268800",
            "webhook-signature": sign(secret, "msg_1", 1767268800, body),
        }
        verify = get_gateway("standard").verify
        before = held.secrets_at(RETIRED_AT - timedelta(minutes=1), timedelta(0))
        verify(headers, body, before, now=None, tolerance=None)


def test_a_retired_secret_verifies_jobs_received_before_it_retired_and_within_the_grace() -> None:
    grace = timedelta(seconds=35)
    held = endpoint()
    assert held.secrets_at(RETIRED_AT - timedelta(hours=1), grace) == (ACTIVE, RETIRED)
    assert held.secrets_at(RETIRED_AT + timedelta(seconds=30), grace) == (ACTIVE, RETIRED)
    assert held.secrets_at(RETIRED_AT + timedelta(seconds=40), grace) == (ACTIVE,)
