"""Tenants, endpoints, orders and signed events for tests."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from control import admin
from payhook.db import Row, execute
from payhook.destinations import DestinationPolicy
from payhook.envelope import Envelope
from payhook.gateways import standard, stripe
from payhook.gateways.base import NO_CONFIG, Config
from payhook.sealing import Keyring
from payhook.settings import Settings

#: The destinations tests deliver to: receivers on this machine, over http.
LOCAL_RECEIVER_SETTINGS = {
    "PAYHOOK_ALLOW_INSECURE_FULFILMENT": "1",
    "PAYHOOK_FULFILMENT_ALLOW_NETWORKS": "127.0.0.0/8",
}
LOCAL_RECEIVERS = DestinationPolicy.from_settings(Settings.from_env(LOCAL_RECEIVER_SETTINGS))

#: The key-encryption key of every test process (`PAYHOOK_SECRETS_KEY`): fixed,
#: so that a database written by one test process opens in another.
TEST_SECRETS_KEY = "test1:" + "dGVzdC1rZXktZW5jcnlwdGlvbi1rZXktMzItYnl0ZXM="
#: The keyring `TEST_SECRETS_KEY` makes.
TEST_KEYRING = Keyring.parse([("PAYHOOK_SECRETS_KEY", TEST_SECRETS_KEY)])


@dataclass
class Shop:
    """A tenant with one endpoint."""

    tenant_id: str
    endpoint_id: str
    secret: str
    gateway: str


@dataclass
class StandardEvent:
    """A Standard Webhooks event and how to sign it."""

    type: str = "payment.succeeded"
    gateway_order_id: str = "pi_1"
    merchant_reference: str | None = "order-1"
    amount: int = 1999
    currency: str = "EUR"
    event_id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    timestamp: int = field(default_factory=lambda: int(time.time()))
    extra: dict[str, Any] = field(default_factory=dict)

    def body(self) -> bytes:
        data: dict[str, Any] = {
            "gateway_order_id": self.gateway_order_id,
            "amount": self.amount,
            "currency": self.currency,
        }
        if self.merchant_reference is not None:
            data["merchant_reference"] = self.merchant_reference
        payload = {
            "type": self.type,
            "timestamp": datetime.fromtimestamp(self.timestamp, UTC).isoformat(),
            "data": data | self.extra,
        }
        return json.dumps(payload).encode()

    def headers(self, secret: str, body: bytes | None = None) -> dict[str, str]:
        body = self.body() if body is None else body
        return {
            "webhook-id": self.event_id,
            "webhook-timestamp": str(self.timestamp),
            "webhook-signature": standard.sign(secret, self.event_id, self.timestamp, body),
        }


def stripe_body(
    event_type: str = "payment_intent.succeeded",
    *,
    event_id: str | None = None,
    payment_intent: str | None = "pi_1",
    charge: str = "ch_1",
    order_ref: str | None = "order-1",
    amount: int = 1999,
    currency: str = "eur",
    pending_webhooks: int = 1,
    received: int | None = None,
) -> bytes:
    """A Stripe event; `received` is a PaymentIntent's `amount_received` (by
    default all of `amount` when it succeeded, nothing when it failed). A
    charge and a dispute name `charge` and `payment_intent` (None: null, as
    for a charge of the Charges API)."""
    metadata = {"order_id": order_ref} if order_ref else {}
    if event_type.startswith("payment_intent."):
        if received is None:
            received = amount if event_type == "payment_intent.succeeded" else 0
        obj: dict[str, Any] = {
            "id": payment_intent,
            "object": "payment_intent",
            "amount": amount,
            "amount_received": received,
        }
    elif event_type == "charge.refunded":
        obj = {
            "id": charge,
            "object": "charge",
            "payment_intent": payment_intent,
            "amount": amount,
            "amount_refunded": amount,
        }
    else:
        obj = {
            "id": "dp_1",
            "object": "dispute",
            "charge": charge,
            "payment_intent": payment_intent,
            "amount": amount,
        }
    obj |= {"currency": currency, "metadata": metadata}
    event = {
        "id": event_id or f"evt_{uuid.uuid4().hex}",
        "object": "event",
        "api_version": "2024-06-20",
        "created": int(time.time()),
        "type": event_type,
        "livemode": False,
        "pending_webhooks": pending_webhooks,
        "request": {"id": f"req_{uuid.uuid4().hex[:8]}", "idempotency_key": None},
        "data": {"object": obj},
    }
    return json.dumps(event).encode()


def stripe_headers(secret: str, body: bytes, timestamp: int | None = None) -> dict[str, str]:
    return {"stripe-signature": stripe.sign(secret, timestamp or int(time.time()), body)}


def envelope(shop: Shop, body: bytes, headers: dict[str, str]) -> Envelope:
    return Envelope(
        endpoint_id=shop.endpoint_id,
        body=body,
        headers=headers,
        received_at=datetime.now(UTC),
        delivery_id=str(uuid.uuid4()),
    )


class Factory:
    def __init__(self, conn: psycopg.Connection[Row]) -> None:
        self.conn = conn

    def shop(
        self,
        gateway: str = "standard",
        fulfilment_url: str | None = None,
        config: Config = NO_CONFIG,
    ) -> Shop:
        tenant_id = admin.add_tenant(
            self.conn,
            f"shop-{uuid.uuid4().hex[:6]}",
            fulfilment_url,
            keyring=TEST_KEYRING,
            destinations=LOCAL_RECEIVERS,
        )
        endpoint = admin.add_endpoint(
            self.conn, tenant_id, gateway, keyring=TEST_KEYRING, config=config
        )
        return Shop(tenant_id, endpoint.endpoint_id, endpoint.secret, gateway)

    def order(
        self,
        shop: Shop,
        merchant_reference: str = "order-1",
        gateway_order_id: str = "pi_1",
        amount: int = 1999,
        currency: str = "EUR",
    ) -> str:
        return admin.add_order(
            self.conn, shop.tenant_id, merchant_reference, gateway_order_id, amount, currency
        )

    def standard_envelope(self, shop: Shop, event: StandardEvent) -> Envelope:
        body = event.body()
        return envelope(shop, body, event.headers(shop.secret, body))

    def count(self, table: str, **where: Any) -> int:
        clause = " AND ".join(f"{k} = %({k})s" for k in where) or "true"
        row = self.conn.execute(
            f"SELECT count(*) AS n FROM payhook.{table} WHERE {clause}",
            where,
        ).fetchone()
        assert row is not None
        return int(row["n"])

    def order_state(self, shop: Shop, order_id: str) -> str:
        row = self.conn.execute(
            "SELECT state FROM payhook.payment_orders WHERE tenant_id = %s AND id = %s",
            (shop.tenant_id, order_id),
        ).fetchone()
        assert row is not None
        return str(row["state"])

    def order_totals(self, order_id: str) -> dict[str, Any]:
        """An order's state and refunded total."""
        row = self.conn.execute(
            "SELECT state, refunded_minor FROM payhook.payment_orders WHERE id = %s", (order_id,)
        ).fetchone()
        assert row is not None
        return dict(row)

    def outbox_rows(
        self, shop: Shop, order_id: str, count: int = 1, *, name: str = ""
    ) -> list[str]:
        """`count` pending outbox rows for one order, written as the consumer writes them."""
        ids = []
        for _ in range(count):
            row_id, event_id = uuid.uuid4(), f"msg_{name}{uuid.uuid4().hex}"
            payload = {
                "action": "fulfil_order",
                "tenant_id": shop.tenant_id,
                "order_id": order_id,
                "merchant_reference": "order-1",
                "event_id": event_id,
            }
            execute(
                self.conn,
                "insert_outbox",
                {
                    "id": row_id,
                    "tenant_id": shop.tenant_id,
                    "order_id": order_id,
                    "event_id": event_id,
                    "action": "fulfil_order",
                    "payload": Jsonb(payload),
                },
            )
            ids.append(str(row_id))
        return ids

    def outbox_row(self, row_id: str) -> dict[str, Any]:
        """One outbox row, with `due_in`: how long until it is due."""
        found = self.conn.execute(
            "SELECT *, next_attempt_at - now() AS due_in FROM payhook.payment_outbox WHERE id = %s",
            (row_id,),
        ).fetchone()
        assert found is not None
        return found

    def end_backends(self, pids: list[int]) -> None:
        """End these backends as an administrator would (`pg_terminate_backend`),
        and wait until each has exited: its client has the server's goodbye."""
        found = self.conn.execute(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 5000)) AS n"
            " FROM unnest(%s::int[]) AS pid",
            (pids,),
        ).fetchone()
        assert found == {"n": len(pids)}
