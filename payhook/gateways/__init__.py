"""Gateway adapters: verify a raw request, normalize its event."""

from __future__ import annotations

from payhook.gateways import (
    adyen,
    braintree,
    checkout,
    gocardless,
    mollie,
    paddle,
    paypal,
    razorpay,
    square,
    standard,
    stripe,
)
from payhook.gateways.base import KINDS, Event, Gateway

#: Every gateway payhook speaks, by the name endpoints are created with.
GATEWAYS: dict[str, Gateway] = {
    gateway.name: gateway
    for gateway in (
        standard.StandardGateway(),
        stripe.StripeGateway(),
        adyen.AdyenGateway(),
        gocardless.GoCardlessGateway(),
        paypal.PayPalGateway(),
        braintree.BraintreeGateway(),
        square.SquareGateway(),
        checkout.CheckoutGateway(),
        razorpay.RazorpayGateway(),
        paddle.PaddleGateway(),
        mollie.MollieGateway(),
    )
}


def get_gateway(name: str) -> Gateway:
    try:
        return GATEWAYS[name]
    except KeyError:
        raise ValueError(f"unknown gateway {name!r}; expected one of {sorted(GATEWAYS)}") from None


def generate_secret(gateway: str) -> str:
    """A fresh endpoint secret in the gateway's format."""
    return get_gateway(gateway).generate_secret()


__all__ = ["GATEWAYS", "KINDS", "Event", "Gateway", "generate_secret", "get_gateway"]
