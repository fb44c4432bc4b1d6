"""Where fulfilment deliveries may go (`payhook.destinations`), without a network."""

from __future__ import annotations

import ipaddress
import re

import pytest

from payhook.destinations import (
    DestinationPolicy,
    DestinationRefused,
    Resolve,
    address_literal,
)
from payhook.errors import SettingsError
from payhook.settings import Settings

STRICT = DestinationPolicy()
INSECURE = DestinationPolicy(allow_insecure=True)


def resolving_to(*addresses: str) -> Resolve:
    """A resolver that answers `addresses` for any name."""

    def resolve(host: str, port: int) -> list[str]:
        return list(addresses)

    return resolve


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("http://169.254.169.254/latest/meta-data/", "169.254.169.254 is a link-local address"),
        ("http://127.0.0.1:6379", "127.0.0.1 is a loopback address"),
        ("http://10.0.0.1/", "10.0.0.1 is a private address"),
        ("http://[::1]/", "::1 is a loopback address"),
        ("http://0x7f000001/", "127.0.0.1 is a loopback address"),
        ("http://2130706433/", "127.0.0.1 is a loopback address"),
        ("http://0177.0.0.1/", "127.0.0.1 is a loopback address"),
        ("http://127.1/", "127.0.0.1 is a loopback address"),
        ("http://[::ffff:127.0.0.1]/", "is an IPv4-mapped address"),
        ("http://[::ffff:8.8.8.8]/", "is an IPv4-mapped address"),
        ("http://[::127.0.0.1]/", "is an IPv4-compatible address"),
        ("http://224.0.0.1/", "224.0.0.1 is a multicast address"),
        ("http://[ff02::1]/", "ff02::1 is a multicast address"),
        ("http://0.0.0.0/", "0.0.0.0 is an unspecified address"),
        ("http://[::]/", ":: is an unspecified address"),
        ("http://[fc00::1]/", "fc00::1 is a private address"),
        ("http://[fe80::1]/", "fe80::1 is a link-local address"),
        ("http://100.64.0.1/", "100.64.0.1 is an address that is not globally reachable"),
        ("http://192.168.1.1/", "192.168.1.1 is a private address"),
        ("http://172.16.0.1/", "172.16.0.1 is a private address"),
        ("http://240.0.0.1/", "240.0.0.1 is a private address"),
        ("http://[2002:a00:1::]/", "a way to reach 10.0.0.1, a private address"),
        ("http://[64:ff9b::7f00:1]/", "a way to reach 127.0.0.1, a loopback address"),
    ],
)
def test_an_internal_address_written_in_the_url_is_refused(url: str, reason: str) -> None:
    with pytest.raises(DestinationRefused, match="PAYHOOK_FULFILMENT_ALLOW_NETWORKS") as refused:
        INSECURE.check_url(url)
    assert reason in str(refused.value)


@pytest.mark.parametrize(
    "url", ["https://8.8.8.8/fulfil", "https://[2606:4700::1111]/", "https://[64:ff9b::808:808]/"]
)
def test_a_public_address_is_allowed(url: str) -> None:
    host, port = STRICT.check_url(url)
    assert port == 443 and ipaddress.ip_address(host).is_global


def test_the_url_names_the_host_and_port_to_resolve() -> None:
    assert STRICT.check_url("https://Shop.Example:8443/x") == ("shop.example", 8443)
    assert INSECURE.check_url("http://shop.example/x") == ("shop.example", 80)


@pytest.mark.parametrize(
    "url",
    [
        "https://user:s3cr3t@shop.example/",
        "https://s3cr3t@shop.example/",
        "https://:s3cr3t@8.8.8.8/",
    ],
)
def test_credentials_in_the_url_are_refused_and_not_repeated(url: str) -> None:
    with pytest.raises(DestinationRefused, match="carries credentials") as refused:
        INSECURE.check_url(url)
    assert "s3cr3t" not in str(refused.value)


def test_http_needs_the_insecure_flag() -> None:
    with pytest.raises(DestinationRefused, match="PAYHOOK_ALLOW_INSECURE_FULFILMENT=1"):
        STRICT.check_url("http://shop.example/fulfil")
    assert INSECURE.check_url("http://shop.example/fulfil") == ("shop.example", 80)


@pytest.mark.parametrize("url", ["ftp://shop.example/", "file:///etc/passwd", "gopher://x/"])
def test_other_schemes_are_refused(url: str) -> None:
    with pytest.raises(DestinationRefused, match="not http or https"):
        INSECURE.check_url(url)


def test_an_allowlisted_private_network_is_accepted() -> None:
    policy = DestinationPolicy(allow_networks=(ipaddress.ip_network("10.1.0.0/16"),))
    assert policy.check_url("https://10.1.2.3/") == ("10.1.2.3", 443)
    with pytest.raises(DestinationRefused, match=re.escape("10.2.0.1 is a private address")):
        policy.check_url("https://10.2.0.1/")


def test_an_allowlisted_ipv4_network_covers_its_mapped_addresses() -> None:
    policy = DestinationPolicy(allow_networks=(ipaddress.ip_network("127.0.0.0/8"),))
    policy.check_address(ipaddress.ip_address("::ffff:127.0.0.1"))
    with pytest.raises(DestinationRefused):
        policy.check_address(ipaddress.ip_address("::ffff:10.0.0.1"))


def test_a_host_resolving_to_a_private_address_is_refused() -> None:
    with pytest.raises(DestinationRefused, match=re.escape("10.0.0.7 is a private address")):
        STRICT.check_host("shop.example", 443, resolving_to("10.0.0.7"))


def test_every_resolved_address_is_checked_not_only_the_first() -> None:
    resolve = resolving_to("8.8.8.8", "127.0.0.1")
    with pytest.raises(DestinationRefused, match=re.escape("127.0.0.1 is a loopback address")):
        STRICT.check_host("shop.example", 443, resolve)


def test_the_checked_addresses_are_returned_in_order() -> None:
    resolve = resolving_to("8.8.8.8", "2606:4700::1111")
    addresses = STRICT.check_host("shop.example", 443, resolve)
    assert addresses == ["8.8.8.8", "2606:4700::1111"]


def test_a_host_resolving_to_nothing_is_refused() -> None:
    with pytest.raises(DestinationRefused, match="no address"):
        STRICT.check_host("shop.example", 443, resolving_to())


def test_localhost_resolves_to_loopback_and_is_refused() -> None:
    """The real resolver, on a name every machine answers locally."""
    with pytest.raises(DestinationRefused, match="loopback"):
        STRICT.check_host("localhost", 443)


@pytest.mark.parametrize(
    ("host", "address"),
    [
        ("0x7f000001", "127.0.0.1"),
        ("2130706433", "127.0.0.1"),
        ("0177.0.0.1", "127.0.0.1"),
        ("::1", "::1"),
        ("shop.example", None),
        ("1.example", None),
    ],
)
def test_addresses_are_read_the_way_resolvers_read_them(host: str, address: str | None) -> None:
    found = address_literal(host)
    assert (str(found) if found else None) == address


def test_settings_are_read_from_the_environment() -> None:
    settings = Settings.from_env(
        {
            "PAYHOOK_ALLOW_INSECURE_FULFILMENT": "1",
            "PAYHOOK_FULFILMENT_ALLOW_NETWORKS": " 10.0.0.0/8, fd00::/8 ,",
        }
    )
    policy = DestinationPolicy.from_settings(settings)
    assert policy.allow_insecure
    assert policy.allow_networks == (
        ipaddress.ip_network("10.0.0.0/8"),
        ipaddress.ip_network("fd00::/8"),
    )
    assert DestinationPolicy.from_settings(Settings.from_env({})) == STRICT


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("PAYHOOK_FULFILMENT_ALLOW_NETWORKS", "10.0.0.0/33"),
        ("PAYHOOK_FULFILMENT_ALLOW_NETWORKS", "10.0.0.1/8"),
        ("PAYHOOK_FULFILMENT_ALLOW_NETWORKS", "intranet"),
        ("PAYHOOK_ALLOW_INSECURE_FULFILMENT", "yes"),
    ],
)
def test_a_bad_setting_names_its_variable(name: str, value: str) -> None:
    with pytest.raises(SettingsError, match=f"^{name}: "):
        DestinationPolicy.from_settings(Settings.from_env({name: value}))
