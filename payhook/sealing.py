"""Secrets sealed at rest: AES-256-GCM under a key-encryption key from the environment.

A sealed value is text, `sealed:v1:<key id>:<base64url of nonce + ciphertext>`,
so it fits the columns that held the plaintext (`text`, `text[]`, jsonb) and
says which key opens it. The associated data binds it to its place (table,
tenant and row; see `endpoint_aad` and `tenant_aad`): a sealed value copied to
another row or table does not open. PostgreSQL never sees a plaintext secret;
sealing and opening happen here, in the process.

The keys come from `PAYHOOK_SECRETS_KEY` (`id:base64key`, comma-separated)
and/or `PAYHOOK_SECRETS_KEY_FILE` (the same, one per line; `#` starts a
comment). The first key seals; every key opens. A key id marked with a
trailing `*` seals instead of the first (`k2*:...`).

A value that does not start with `sealed:` is plaintext written before
sealing existed: it is accepted as is until `payhook secrets seal` seals it,
so a rolling upgrade goes on working.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from payhook.db import Row, fetch_one
from payhook.errors import PayhookError, SettingsError
from payhook.settings import Secret, Settings

KEY_VARIABLE = "PAYHOOK_SECRETS_KEY"
KEY_FILE_VARIABLE = "PAYHOOK_SECRETS_KEY_FILE"
#: Prefix of every sealed value; anything else is legacy plaintext.
PREFIX = "sealed:"
#: Format version written today.
VERSION = "v1"
#: Bytes of an AES-256 key.
KEY_BYTES = 32
#: Bytes of a GCM nonce: random for every seal (96 bits, GCM's recommended size).
NONCE_BYTES = 12
_KEY_ID = re.compile(r"^[A-Za-z0-9_.-]{1,32}$")


class SealingError(PayhookError):
    """A sealed secret could not be opened."""


class MissingKey(SealingError):
    """Sealed secrets exist but no key is configured."""

    def __init__(self) -> None:
        super().__init__(
            f"sealed secrets exist but no key is configured: set {KEY_VARIABLE} "
            f"(or {KEY_FILE_VARIABLE}) to the key-encryption key(s) that sealed them"
        )


def endpoint_aad(tenant_id: str, endpoint_id: str) -> str:
    """The associated data of a webhook endpoint's secrets, active or retired:
    one per row, so retiring a secret (SQL moving it between the two columns)
    keeps it openable while copying it to another endpoint does not."""
    return f"payhook.webhook_endpoints.secret|{tenant_id}|{endpoint_id}"


def credential_aad(tenant_id: str, endpoint_id: str, name: str) -> str:
    """The associated data of an endpoint's credential `name` (an API token,
    a password): bound to its row and its name, so that neither copying it
    to another endpoint nor renaming it keeps it openable."""
    return f"payhook.webhook_endpoints.credential|{tenant_id}|{endpoint_id}|{name}"


def tenant_aad(tenant_id: str) -> str:
    """The associated data of a tenant's signing secret."""
    return f"payhook.tenants.signing_secret|{tenant_id}"


def is_sealed(value: str) -> bool:
    return value.startswith(PREFIX)


def key_id_of(value: str) -> str | None:
    """The id of the key that sealed `value`; None for plaintext."""
    if not is_sealed(value):
        return None
    parts = value.split(":", 3)
    return parts[2] if len(parts) == 4 else None


def generate_key_line(key_id: str = "k1") -> str:
    """A new key as a line of the key file: `id:base64key`."""
    return f"{key_id}:{base64.b64encode(AESGCM.generate_key(bit_length=256)).decode()}"


@dataclass(frozen=True)
class Keyring:
    """Key-encryption keys by id; `current` seals. Keys never show in a repr."""

    keys: Mapping[str, AESGCM] = field(default_factory=dict, repr=False)
    current: str | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> Keyring:
        """The keyring `PAYHOOK_SECRETS_KEY` and `PAYHOOK_SECRETS_KEY_FILE` name
        (either, both or neither; the variable's keys come first)."""
        entries: list[tuple[str, str]] = []
        raw = settings.get(KEY_VARIABLE) or ""
        if raw.strip():
            entries += [(KEY_VARIABLE, part) for part in raw.split(",") if part.strip()]
        path = settings.get(KEY_FILE_VARIABLE) or ""
        if path.strip():
            try:
                text = Path(path).read_text()
            except OSError as exc:
                raise SettingsError(
                    f"{KEY_FILE_VARIABLE}: cannot read {path}: {exc.strerror}"
                ) from None
            for line in text.splitlines():
                line = line.split("#", 1)[0].strip()
                if line:
                    entries.append((KEY_FILE_VARIABLE, line))
        return cls.parse(entries)

    @classmethod
    def parse(cls, entries: Iterable[tuple[str, str]]) -> Keyring:
        """Keys from `(setting name, "id:base64key")` pairs, in order."""
        keys: dict[str, AESGCM] = {}
        first: str | None = None
        marked: str | None = None
        for name, entry in entries:
            key_id, sep, encoded = entry.strip().partition(":")
            star = key_id.endswith("*")
            key_id = key_id.removesuffix("*")
            if not sep or not _KEY_ID.match(key_id):
                raise SettingsError(
                    f"{name}: expected id:base64key entries (an id of letters, digits, "
                    "'.', '_' or '-')"
                )
            try:
                material = base64.b64decode(encoded.strip(), validate=True)
            except (binascii.Error, ValueError):
                raise SettingsError(f"{name}: key {key_id} is not base64") from None
            if len(material) != KEY_BYTES:
                raise SettingsError(
                    f"{name}: key {key_id} must be {KEY_BYTES} bytes (AES-256), got {len(material)}"
                )
            if key_id in keys:
                raise SettingsError(f"{name}: key id {key_id} appears twice")
            if star:
                if marked is not None:
                    raise SettingsError(f"{name}: only one key may be marked with *")
                marked = key_id
            keys[key_id] = AESGCM(material)
            first = first or key_id
        return cls(keys=keys, current=marked or first)

    def __bool__(self) -> bool:
        return bool(self.keys)

    def sealing_prefix(self) -> str:
        """The start of every value sealed under the current key."""
        if self.current is None:
            raise SealingError(
                f"no key to seal secrets with: set {KEY_VARIABLE} (or {KEY_FILE_VARIABLE})"
            )
        return f"{PREFIX}{VERSION}:{self.current}:"

    def seal(self, plaintext: str, aad: str) -> str:
        """`plaintext` sealed under the current key, bound to `aad`."""
        prefix = self.sealing_prefix()
        nonce = os.urandom(NONCE_BYTES)
        ciphertext = self.keys[str(self.current)].encrypt(nonce, plaintext.encode(), aad.encode())
        return prefix + base64.urlsafe_b64encode(nonce + ciphertext).decode()

    def open(self, value: str, aad: str) -> Secret:
        """The plaintext of `value` (as is when it is legacy plaintext).

        Raises `SealingError` naming the key id, never the value, when the key
        is unknown or the value was tampered with, sealed under another key of
        the same id, or bound to another place."""
        if not is_sealed(value):
            return Secret(value)
        parts = value.split(":", 3)
        if len(parts) != 4 or parts[1] != VERSION:
            raise SealingError("a sealed secret is malformed or of an unknown version")
        key_id, blob = parts[2], parts[3]
        if not self.keys:
            raise MissingKey()
        key = self.keys.get(key_id)
        if key is None:
            raise SealingError(
                f"a secret is sealed under key {key_id}, which {KEY_VARIABLE} does not hold"
            )
        try:
            raw = base64.urlsafe_b64decode(blob.encode())
            plaintext = key.decrypt(raw[:NONCE_BYTES], raw[NONCE_BYTES:], aad.encode())
        except (InvalidTag, binascii.Error, ValueError):
            raise SealingError(
                f"a secret sealed under key {key_id} does not open: a wrong key, "
                "a damaged value, or a value copied from another row"
            ) from None
        return Secret(plaintext.decode())

    def needs_sealing(self, value: str) -> bool:
        """Whether `value` is plaintext or sealed under a key other than the current one."""
        return key_id_of(value) != self.current

    def reseal(self, value: str, aad: str) -> str:
        """`value` sealed under the current key (opened first when sealed)."""
        return self.seal(self.open(value, aad), aad)


def require_key(conn: psycopg.Connection[Row], keyring: Keyring) -> None:
    """Refuse to go on without a key while any stored secret is sealed (`MissingKey`)."""
    if keyring:
        return
    row = fetch_one(conn, "any_sealed_secret")
    if row is not None and row["sealed"]:
        raise MissingKey()
