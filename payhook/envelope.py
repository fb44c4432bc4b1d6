"""The job payload the ingress enqueues and the consumer applies.

The consumer re-verifies the exact bytes the gateway signed, so the raw body
travels unchanged: as JSON text (`body`) when it is UTF-8, which every JSON
webhook is, else base64-encoded (`body_b64`). Text serializes and compresses
faster and smaller than base64 (see `ingress.jobs.call_data`); decoding UTF-8
strictly and encoding it again gives back the same bytes. Only the gateway's
signature headers travel.

A request that carries several events (a GoCardless or Adyen batch) becomes
one job per event, all queued at once: each job's `body` is its event alone,
and its `part` says which event of which request it is, with a proof
(`part_proof`) that the ingress verified the request: an HMAC keyed with the
endpoint's secret, which the consumer checks in place of the gateway's
signature (the gateway signed the whole request, which the job does not
carry). A job forged in Redis has no secret to make one with.

Version 1 carried every body as base64; it is still read, for jobs queued
before an upgrade. Version 3 adds `part`; an envelope without one is written
as version 2, which every release since that version reads.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from payhook.errors import PayhookError

#: Version of the envelope format written; versions 1 to this one are read.
ENVELOPE_VERSION = 3
#: The version an envelope without a part is written as.
SINGLE_VERSION = 2
#: What a part proof's HMAC signs ahead of the part: no gateway signs this.
PART_PROOF_CONTEXT = b"payhook part v1"


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
class Part:
    """Which event of a batched request a job carries."""

    #: The delivery id of the request: shared by its jobs.
    request_id: str
    #: Position of the event in the request, from 0, and how many it carried.
    index: int
    count: int
    #: `part_proof` of the job, hex.
    proof: str

    def to_json(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "index": self.index,
            "count": self.count,
            "proof": self.proof,
        }

    @classmethod
    def from_json(cls, data: object) -> Part:
        if not isinstance(data, dict):
            raise MalformedJob()
        index, count, proof = data.get("index"), data.get("count"), data.get("proof")
        if type(index) is not int or type(count) is not int or not 0 <= index < count:
            raise MalformedJob()
        if not isinstance(proof, str):
            raise MalformedJob()
        return cls(str(uuid.UUID(data["request_id"])), index, count, proof)


def part_proof(
    secret: str, endpoint_id: str, request_id: str, index: int, count: int, body: bytes
) -> str:
    """HMAC-SHA256, keyed with an endpoint secret, of one event of a request:
    what the ingress vouches for when it splits a request it verified."""
    head = f"{endpoint_id}|{request_id}|{index}|{count}|".encode()
    digest = hmac.new(secret.encode("utf-8", "surrogatepass"), PART_PROOF_CONTEXT, hashlib.sha256)
    digest.update(b"|" + head)
    digest.update(body)
    return digest.hexdigest()


def part_proven(envelope: Envelope, secrets: Sequence[str]) -> bool:
    """Whether the envelope's part proof was made with one of `secrets`;
    every secret is tried, in constant time for each."""
    part = envelope.part
    if part is None:
        return False
    found = False
    for secret in secrets:
        expected = part_proof(
            secret, envelope.endpoint_id, part.request_id, part.index, part.count, envelope.body
        )
        found |= hmac.compare_digest(expected, part.proof)
    return found


@dataclass(frozen=True)
class Envelope:
    endpoint_id: str
    body: bytes
    headers: Mapping[str, str]
    received_at: datetime
    delivery_id: str
    #: Set when the job carries one event of a batched request.
    part: Part | None = None

    def to_json(self) -> dict[str, Any]:
        data = {
            "v": SINGLE_VERSION if self.part is None else ENVELOPE_VERSION,
            "endpoint_id": self.endpoint_id,
            "headers": dict(self.headers),
            "received_at": self.received_at.isoformat(),
            "delivery_id": self.delivery_id,
        }
        if self.part is not None:
            data["part"] = self.part.to_json()
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
                part=Part.from_json(data["part"]) if version >= 3 and "part" in data else None,
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
