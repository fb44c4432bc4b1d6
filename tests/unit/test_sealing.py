"""Sealing secrets: the format, the keyring settings, and what fails to open."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from payhook.errors import SettingsError
from payhook.sealing import (
    Keyring,
    MissingKey,
    SealingError,
    endpoint_aad,
    generate_key_line,
    is_sealed,
    key_id_of,
    tenant_aad,
)
from payhook.settings import Settings

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
AAD = endpoint_aad("t-1", "e-1")


def keyring(*lines: str) -> Keyring:
    return Keyring.from_settings(Settings.from_env({"PAYHOOK_SECRETS_KEY": ",".join(lines)}))


def test_a_sealed_secret_opens_and_shows_nothing_of_itself() -> None:
    ring = keyring(generate_key_line("k1"))
    sealed = ring.seal(SECRET, AAD)
    assert is_sealed(sealed) and sealed.startswith("sealed:v1:k1:")
    assert SECRET not in sealed and key_id_of(sealed) == "k1"
    assert ring.open(sealed, AAD) == SECRET
    assert ring.seal(SECRET, AAD) != sealed  # a fresh nonce every time
    assert SECRET not in repr(ring.open(sealed, AAD))


def test_a_value_moved_to_another_row_or_table_does_not_open() -> None:
    ring = keyring(generate_key_line("k1"))
    sealed = ring.seal(SECRET, AAD)
    for elsewhere in (endpoint_aad("t-1", "e-2"), endpoint_aad("t-2", "e-1"), tenant_aad("t-1")):
        with pytest.raises(SealingError, match="k1") as caught:
            ring.open(sealed, elsewhere)
        assert SECRET not in str(caught.value)


def test_a_wrong_key_with_the_same_id_fails_loudly() -> None:
    sealed = keyring(generate_key_line("k1")).seal(SECRET, AAD)
    with pytest.raises(SealingError, match="sealed under key k1 does not open"):
        keyring(generate_key_line("k1")).open(sealed, AAD)


def test_a_key_id_the_keyring_lacks_is_named() -> None:
    sealed = keyring(generate_key_line("old")).seal(SECRET, AAD)
    with pytest.raises(SealingError, match="key old, which PAYHOOK_SECRETS_KEY does not hold"):
        keyring(generate_key_line("new")).open(sealed, AAD)


def test_a_tampered_ciphertext_does_not_open() -> None:
    ring = keyring(generate_key_line("k1"))
    sealed = ring.seal(SECRET, AAD)
    prefix, blob = sealed.rsplit(":", 1)
    raw = bytearray(base64.urlsafe_b64decode(blob))
    raw[-1] ^= 1
    with pytest.raises(SealingError):
        ring.open(f"{prefix}:{base64.urlsafe_b64encode(bytes(raw)).decode()}", AAD)
    with pytest.raises(SealingError):
        ring.open(f"{prefix}:not base64!", AAD)
    with pytest.raises(SealingError, match="unknown version"):
        ring.open(sealed.replace(":v1:", ":v9:"), AAD)


def test_without_keys_plaintext_opens_and_sealed_values_name_the_setting() -> None:
    empty = Keyring()
    assert not empty and empty.open(SECRET, AAD) == SECRET
    sealed = keyring(generate_key_line("k1")).seal(SECRET, AAD)
    with pytest.raises(MissingKey, match="PAYHOOK_SECRETS_KEY"):
        empty.open(sealed, AAD)
    with pytest.raises(SealingError, match="PAYHOOK_SECRETS_KEY"):
        empty.seal(SECRET, AAD)


def test_the_first_key_seals_unless_another_is_marked_and_all_open() -> None:
    old, new = generate_key_line("old"), generate_key_line("new")
    sealed_old = keyring(old).seal(SECRET, AAD)
    both = keyring(new, old)
    assert both.current == "new" and both.open(sealed_old, AAD) == SECRET
    assert both.needs_sealing(sealed_old) and both.needs_sealing(SECRET)
    resealed = both.reseal(sealed_old, AAD)
    assert key_id_of(resealed) == "new" and not both.needs_sealing(resealed)
    assert keyring(old, "new*:" + new.split(":", 1)[1]).current == "new"


def test_keys_come_from_the_file_too(tmp_path: Path) -> None:
    sealed = keyring(generate_key_line("k2")).seal(SECRET, AAD)
    path = tmp_path / "keys"
    path.write_text(f"# rotated in May\n{generate_key_line('k3')}\n\n")
    env = {"PAYHOOK_SECRETS_KEY_FILE": str(path), "PAYHOOK_SECRETS_KEY": generate_key_line("k2")}
    ring = Keyring.from_settings(Settings.from_env(env))
    assert ring.current == "k2" and set(ring.keys) == {"k2", "k3"}
    with pytest.raises(SealingError):
        ring.open(sealed, AAD)  # the same id, another key


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("nocolon", "PAYHOOK_SECRETS_KEY: expected id:base64key"),
        ("k1:***", "PAYHOOK_SECRETS_KEY: key k1 is not base64"),
        ("k1:" + base64.b64encode(b"short").decode(), "must be 32 bytes"),
        (generate_key_line("k1") + "," + generate_key_line("k1"), "appears twice"),
        (
            "a*:" + generate_key_line().split(":")[1] + ",b*:" + generate_key_line().split(":")[1],
            "only one",
        ),
    ],
    # Named, not by their random keys: parallel workers must collect the same ids.
    ids=["no-colon", "not-base64", "short", "twice", "two-current"],
)
def test_a_malformed_key_setting_is_named(value: str, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        keyring(value)


def test_an_unreadable_key_file_is_named(tmp_path: Path) -> None:
    settings = Settings.from_env({"PAYHOOK_SECRETS_KEY_FILE": str(tmp_path / "absent")})
    with pytest.raises(SettingsError, match="PAYHOOK_SECRETS_KEY_FILE: cannot read"):
        Keyring.from_settings(settings)


def test_the_key_never_shows_in_a_repr_of_the_settings_or_keyring() -> None:
    line = generate_key_line("k1")
    settings = Settings.from_env({"PAYHOOK_SECRETS_KEY": line})
    material = line.split(":", 1)[1]
    assert material not in repr(settings) and material not in repr(keyring(line))
