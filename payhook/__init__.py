"""payhook: payment-gateway webhooks applied exactly once."""

__version__ = "0.2.0"
