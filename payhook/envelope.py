"""The job payload the ingress enqueues and the consumer applies.

The consumer re-verifies the exact bytes the gateway signed, so the raw body
travels unchanged: as JSON text (`body`) when it is UTF-8, which every JSON
webhook is, else base64-encoded (`body_b64`). Text serializes and compresses
faster and smaller than base64 (see `ingress.jobs.call_data`); decoding UTF-8
strictly and encoding it again gives back the same bytes. Only the gateway's
signature headers travel.

Version 1 carried every body as base64; it is still read, for jobs queued
before an upgrade.
"""

from __future__ import annotations

import base64
import binascii
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from payhook.errors import PayhookError

#: Version of the envelope format written; versions 1 to this one are read.
ENVELOPE_VERSION = 2


class MalformedJob(PayhookError):
    """The job's envelope is not one payhook wrote."""


class NewerEnvelope(PayhookError):
    """The envelope is of a later version than this release reads: written by a
    newer ingress. The job must fail (and be retried, then wait in the
    dead-letter queue) rather than be recorded as malformed: it was acknowledged."""

    def __init__(self, version: int) -> None:
        super().__init__(f"envelope version {version}; this release reads {ENVELOPE_VERSION}")
        self.version = version


@dataclass(frozen=True)
class Envelope:
    endpoint_id: str
    body: bytes
    headers: Mapping[str, str]
    received_at: datetime
    delivery_id: str

    def to_json(self) -> dict[str, Any]:
        data = {
            "v": ENVELOPE_VERSION,
            "endpoint_id": self.endpoint_id,
            "headers": dict(self.headers),
            "received_at": self.received_at.isoformat(),
            "delivery_id": self.delivery_id,
        }
        try:
            data["body"] = self.body.decode("utf-8")
        except UnicodeDecodeError:
            data["body_b64"] = base64.b64encode(self.body).decode()
        return data

    @classmethod
    def from_json(cls, data: object) -> Envelope:
        """Read an envelope back; `NewerEnvelope` for a later version,
        `MalformedJob` for anything else."""
        if not isinstance(data, dict):
            raise MalformedJob()
        version = data.get("v")
        if type(version) is int and version > ENVELOPE_VERSION:
            raise NewerEnvelope(version)
        if type(version) is not int or version < 1:
            raise MalformedJob()
        try:
            headers = data["headers"]
            if not isinstance(headers, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
            ):
                raise MalformedJob()
            received_at = datetime.fromisoformat(data["received_at"])
            if received_at.tzinfo is None:
                raise MalformedJob()
            return cls(
                endpoint_id=str(uuid.UUID(data["endpoint_id"])),
                body=_body(data, version),
                headers={k.lower(): v for k, v in headers.items()},
                received_at=received_at,
                delivery_id=str(uuid.UUID(data["delivery_id"])),
            )
        except (KeyError, TypeError, ValueError, binascii.Error):
            raise MalformedJob() from None


def _body(data: dict[str, Any], version: int) -> bytes:
    """The raw body: version 1 has `body_b64`; version 2 one of `body`, `body_b64`."""
    text = data.get("body") if version >= 2 else None
    if text is not None:
        if not isinstance(text, str) or "body_b64" in data:
            raise MalformedJob()
        # Strict: a lone surrogate cannot come from a UTF-8 body.
        return text.encode("utf-8")
    return base64.b64decode(data["body_b64"], validate=True)
