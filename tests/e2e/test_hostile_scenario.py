"""Hostile input across real processes: nothing a byte, a forged job or an
operator's click does loses or stalls an accepted event.

A real ingress, two consumers, an outbox worker and the dashboard, on a
PostgreSQL and a Redis of their own. Authentic events, authentic events
holding what PostgreSQL cannot store, unsigned requests and job hashes
forged straight into Redis arrive together, while an operator presses every
dashboard action and the dashboard is killed in the middle of one.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import cast

import httpx
import pytest
from redis import Redis
from redis.typing import EncodableT, FieldT
from rq.registry import FailedJobRegistry

from control import admin
from control.dashboard import CSRF_COOKIE, CSRF_HEADER
from payhook import quarantine
from payhook.gateways import stripe
from payhook.jobhash import data_bound
from payhook.queue import events_queue
from payhook.settings import Settings
from tests.e2e.stack import Stack, free_port, running_stack
from tests.factories import TEST_KEYRING, Shop, StandardEvent, stripe_body
from tests.processes import start, stop, wait_until

pytestmark = pytest.mark.slow

USER, PASSWORD = "payhook", "hostile-scenario-password"
#: Authentic payments, each for an order of its own.
PAYMENTS = 60


def post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, str | None]:
    """The status, and the delivery id of a 202."""
    answer = httpx.post(url, content=body, headers=headers, timeout=15)
    delivery = answer.json()["delivery_id"] if answer.status_code == 202 else None
    return answer.status_code, delivery


def standard(
    url: str, shop: Shop, event: StandardEvent, body: bytes | None = None
) -> tuple[int, str | None]:
    body = event.body() if body is None else body
    return post(url, body, event.headers(shop.secret, body) | {"content-type": "application/json"})


def stripe_post(url: str, secret: str, body: bytes) -> tuple[int, str | None]:
    signature = stripe.sign(secret, int(time.time()), body)
    return post(url, body, {"stripe-signature": signature, "content-type": "application/json"})


def with_timestamp(event: StandardEvent, timestamp: str) -> bytes:
    """The event's body, its `timestamp` replaced."""
    data = json.loads(event.body())
    return json.dumps(data | {"timestamp": timestamp}).encode()


def odd_events() -> list[tuple[StandardEvent, bytes | None]]:
    """Authentic events holding what PostgreSQL cannot store as it is."""
    surrogate = StandardEvent(gateway_order_id="x")
    return [
        (StandardEvent(merchant_reference="a\u0000b"), None),
        (surrogate, surrogate.body().replace(b'"x"', b'"\\ud800"')),
        (far := StandardEvent(), with_timestamp(far, "9999-12-31T23:59:59Z")),
        (late := StandardEvent(), with_timestamp(late, "9999-12-31T23:59:59-14:00")),
        (StandardEvent(), b"\xff not json"),
    ]


def forge_jobs(redis: Redis, settings: Settings, template: bytes) -> list[bytes]:
    """Job hashes written straight into Redis, each on the events queue."""
    queue = events_queue(redis, settings)
    fields = cast(dict[FieldT, EncodableT], redis.hgetall(b"rq:job:" + template))
    forgeries: dict[bytes, dict[bytes, bytes]] = {
        str(uuid.uuid4()).encode(): {b"status": b"exploded"},
        str(uuid.uuid4()).encode(): {b"created_at": b"yesterday"},
        str(uuid.uuid4()).encode(): {b"retries_left": b"many"},
        str(uuid.uuid4()).encode(): {
            b"data": zlib.compress(b"\0" * (data_bound(settings.max_body) + 1), 9)
        },
        str(uuid.uuid4()).encode(): {b"success_callback_name": b"os.system"},
        b"\xff\xfe-not-utf8": {},
        b"not-a-uuid": {},
    }
    for job_id, forged in forgeries.items():
        redis.hset(b"rq:job:" + job_id, mapping=fields | forged)
        redis.rpush(queue.key, job_id)
    return list(forgeries)


def test_hostile_input_and_clicks_lose_no_accepted_event(tmp_path: Path) -> None:
    with running_stack(ingresses=1, consumers=2, outbox_workers=1) as stack:
        run_scenario(stack, tmp_path)


def run_scenario(stack: Stack, tmp_path: Path) -> None:
    shop = stack.shop()
    url = stack.url(shop)
    with stack.db() as conn:
        stripe_endpoint = admin.add_endpoint(conn, shop.tenant_id, "stripe", keyring=TEST_KEYRING)
    stripe_url = url.replace(shop.endpoint_id, stripe_endpoint.endpoint_id)
    payments = [
        StandardEvent(merchant_reference=f"o-{i}", gateway_order_id=f"pi-{i}")
        for i in range(PAYMENTS)
    ]
    for event in payments:
        stack.order(shop, event.merchant_reference or "", event.gateway_order_id)
    redis = Redis.from_url(str(stack.settings.redis_url))
    wait_until(
        lambda: standard(url, shop, StandardEvent(type="payment.noted"))[0] == 202,
        30,
        "the ingress to know the endpoints",
    )
    wait_until(
        lambda: (
            stripe_post(stripe_url, stripe_endpoint.secret, stripe_body("customer.created"))[0]
            == 202
        ),
        30,
        "the Stripe endpoint",
    )

    port = free_port()
    env = stack.env | {"PAYHOOK_DASHBOARD_PASSWORD": PASSWORD}
    dashboard = start(["dashboard", "--port", str(port)], env, tmp_path / "dashboard.log")
    base = f"http://127.0.0.1:{port}"
    accepted: list[str] = []
    try:
        wait_until(lambda: _answers(f"{base}/healthz"), 30, "the dashboard")
        with ThreadPoolExecutor(8) as pool:
            sends = [pool.submit(standard, url, shop, event) for event in payments]
            sends += [pool.submit(standard, url, shop, e, body) for e, body in odd_events()]
            # A Stripe body with no readable id, twice: one receipt, keyed by its digest.
            for _ in range(2):
                sends.append(
                    pool.submit(stripe_post, stripe_url, stripe_endpoint.secret, b"\xff not json")
                )
            # A Stripe id longer than an index row allows, twice: one receipt.
            long_id = stripe_body(event_id="evt_" + "x" * 3000)
            for _ in range(2):
                sends.append(pool.submit(stripe_post, stripe_url, stripe_endpoint.secret, long_id))
            # Unsigned and wrongly signed: refused at the door, never queued.
            refused = [
                pool.submit(post, url, b"{}", {"content-type": "application/json"}),
                pool.submit(post, url, b"{}", StandardEvent().headers("whsec_" + "A" * 43)),
            ]
            forged = forge_jobs(redis, stack.settings, _a_job_id(redis))
            clicks = press_every_action(base, stack.settings, dashboard)
            results = [f.result() for f in sends]
            assert [f.result()[0] for f in refused] == [400, 401]
        assert all(status == 202 for status, _ in results), results
        accepted = [delivery for _, delivery in results if delivery]
        stack.settle(timeout=120)
        # Every acknowledged delivery ended as a receipt: its own, or the one
        # of the event it repeated (the second Stripe body with no id, the
        # second long Stripe id).
        with stack.db() as conn:
            receipts = {
                str(row["delivery_id"]): row
                for row in conn.execute(
                    "SELECT delivery_id, event_id, outcome FROM payhook.payment_event_receipts"
                    " WHERE tenant_id = %s",
                    (shop.tenant_id,),
                ).fetchall()
            }
        first_deliveries = [d for d in accepted if d in receipts]
        assert len(accepted) - len(first_deliveries) == 2  # the two repeats
        assert (
            stack.count("SELECT count(*) AS n FROM payhook.payment_order_transitions") == PAYMENTS
        )
        outcomes = [receipts[d]["outcome"] for d in first_deliveries]
        assert outcomes.count("applied") == PAYMENTS
        # The odd standard events, the Stripe body with no id, the long id.
        assert outcomes.count("malformed") == len(odd_events()) + 2
        assert len(first_deliveries) == PAYMENTS + len(odd_events()) + 2
        assert stack.alive(stack.consumers) == stack.consumers, "a consumer exited"
        # Every forged job is quarantined, or refused into the dead-letter queue.
        quarantined = set(quarantine.all_ids(redis, stack.settings.queue))
        dead = {
            j.encode()
            for j in FailedJobRegistry(stack.settings.queue, connection=redis).get_job_ids()
        }
        assert set(forged) <= quarantined | dead
        assert set(forged) - quarantined == {forged[4]}  # the callback: refused, failed
        check = subprocess.run(
            [sys.executable, "-m", "control.cli", "check"],
            env=stack.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert check.returncode == 1
        assert any(line.startswith("quarantined_jobs ") for line in check.stdout.splitlines())
        assert clicks == {"compact": 403, "empty": 403, "empty failed": 403, "delete": 403}
    finally:
        stop(dashboard, signal.SIGKILL)
        redis.close()


def press_every_action(
    base: str, settings: Settings, dashboard: subprocess.Popen[bytes]
) -> dict[str, int]:
    """Compact, empty and delete (each refused), then requeue-all, during
    which the dashboard is killed."""
    page = httpx.get(f"{base}/", auth=(USER, PASSWORD), timeout=10)
    own_page = {
        CSRF_HEADER: page.cookies[CSRF_COOKIE],
        "Origin": base,
        "Sec-Fetch-Site": "same-origin",
    }

    def press(path: str) -> int:
        return httpx.post(
            f"{base}{path}",
            auth=(USER, PASSWORD),
            headers=own_page,
            cookies=page.cookies,
            timeout=30,
        ).status_code

    answers = {
        "compact": press(f"/queue/{settings.queue}/compact"),
        "empty": press(f"/queue/{settings.queue}/queued/empty"),
        "empty failed": press(f"/queue/{settings.queue}/failed/empty"),
        "delete": press(f"/job/{uuid.uuid4()}/delete"),
    }
    with ThreadPoolExecutor(1) as pool:
        pool.submit(press, f"/requeue/{settings.queue}")
        time.sleep(0.05)
        stop(dashboard, signal.SIGKILL)
    return answers


def _a_job_id(redis: Redis) -> bytes:
    """The id of an event job whose hash the forgeries copy."""
    keys = cast(list[bytes], redis.keys(b"rq:job:*"))
    assert keys, "no job to copy"
    return sorted(keys)[0].removeprefix(b"rq:job:")


def _answers(address: str) -> bool:
    try:
        return httpx.get(address, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
