"""Where outbound requests may go: the policy for tenants' fulfilment URLs.

A fulfilment URL is chosen by whoever sets a tenant up, and the outbox worker
POSTs to it, signed: unchecked, it would be a way into the network the worker
sits in (a cloud metadata service, Redis, an admin port). A destination is
allowed when

- its scheme is `https`, or `http` with `PAYHOOK_ALLOW_INSECURE_FULFILMENT=1`;
- it carries no credentials (`user:pass@`);
- every address its host resolves to is globally reachable (`is_global`) and
  not multicast, or lies in a network of `PAYHOOK_FULFILMENT_ALLOW_NETWORKS`.

An IPv6 address that carries an IPv4 one is judged by it too: IPv4-mapped
and IPv4-compatible addresses are refused unless the IPv4 address is allowed,
and 6to4 and NAT64 addresses are judged as the IPv4 address they reach.

Hosts are resolved with `getaddrinfo`, as the connection would be, so the
numeric forms resolvers accept (`0x7f000001`, `2130706433`, `0177.0.0.1`)
are judged as the address they mean. `payhook tenants add` checks a URL
once; the outbox worker checks it again at every connection, after its own
resolution, and connects only to an address it checked
(`outbox_worker.egress`).

This module uses the standard library only: the kernel imports no HTTP client.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from payhook.errors import PayhookError, SettingsError
from payhook.settings import Settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
#: Resolves `(host, port)` to the addresses a connection would try, in order.
Resolve = Callable[[str, int], list[str]]

#: Variable naming the networks an operator allows on purpose (CIDRs, comma-separated).
ALLOW_NETWORKS = "PAYHOOK_FULFILMENT_ALLOW_NETWORKS"
#: Variable that lets fulfilment URLs use plain `http` (`1`; default `0`).
ALLOW_INSECURE = "PAYHOOK_ALLOW_INSECURE_FULFILMENT"
#: NAT64's well-known prefix (RFC 6052): the last 32 bits are the IPv4 address reached.
NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
#: IPv4-compatible IPv6 addresses (deprecated by RFC 4291): `::a.b.c.d`.
IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")


class DestinationRefused(PayhookError):
    """The fulfilment URL points where outbound requests may not go."""


@dataclass(frozen=True)
class DestinationPolicy:
    """What a fulfilment URL may be; the default is the strict policy."""

    #: Whether plain `http` is allowed.
    allow_insecure: bool = False
    #: Networks allowed although not globally reachable.
    allow_networks: tuple[IPNetwork, ...] = ()

    @classmethod
    def from_settings(cls, settings: Settings) -> DestinationPolicy:
        """Read the two variables; a bad value raises `SettingsError` naming it."""
        extra = settings.extra
        insecure = extra.get(ALLOW_INSECURE, "0").strip()
        if insecure not in ("0", "1"):
            raise SettingsError(f"{ALLOW_INSECURE}: expected 0 or 1, got {insecure!r}")
        networks = []
        for part in extra.get(ALLOW_NETWORKS, "").split(","):
            if not part.strip():
                continue
            try:
                networks.append(ipaddress.ip_network(part.strip()))
            except ValueError:
                raise SettingsError(
                    f"{ALLOW_NETWORKS}: expected CIDRs such as 10.1.0.0/16, "
                    f"comma-separated, got {part.strip()!r}"
                ) from None
        return cls(allow_insecure=insecure == "1", allow_networks=tuple(networks))

    def check_url(self, url: str) -> tuple[str, int]:
        """Refuse a URL by its form: scheme, credentials, an address written in it.

        Returns the host and port to resolve; never resolves anything itself.
        Messages never repeat the URL, which may carry credentials.
        """
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError:
            raise DestinationRefused("the URL cannot be parsed") from None
        if parts.scheme not in ("http", "https"):
            raise DestinationRefused("the URL is not http or https")
        if parts.scheme == "http" and not self.allow_insecure:
            raise DestinationRefused(
                f"the URL is http, not https (allow it with {ALLOW_INSECURE}=1)"
            )
        if "@" in parts.netloc:
            raise DestinationRefused("the URL carries credentials (user:password@)")
        if not parts.hostname:
            raise DestinationRefused("the URL has no host")
        host = parts.hostname
        literal = address_literal(host)
        if literal is not None:
            self.check_address(literal)
        return host, port if port is not None else (443 if parts.scheme == "https" else 80)

    def check_address(self, address: IPAddress) -> None:
        """Refuse an address that is neither globally reachable nor allowed."""
        if self.allowed(address):
            return
        reason = refusal(address)
        if reason is not None:
            raise DestinationRefused(
                f"{address} is {reason} (allow its network with {ALLOW_NETWORKS})"
            )

    def allowed(self, address: IPAddress) -> bool:
        """Whether an allowed network holds `address`, or the IPv4 address it maps."""
        candidates: list[IPAddress] = [address]
        if isinstance(address, ipaddress.IPv6Address):
            embedded = embedded_ipv4(address)
            if embedded is not None:
                candidates.append(embedded)
        return any(a in network for a in candidates for network in self.allow_networks)

    def check_host(self, host: str, port: int, resolve: Resolve | None = None) -> list[str]:
        """Resolve `host` and refuse it if any of its addresses is refused.

        Returns the addresses, checked, in the resolver's order: connect to
        these and no others, so a second answer cannot differ from the first.
        Every address counts, not only the first: a name answering with one
        public and one internal address could otherwise reach the internal one.
        """
        addresses = (resolve or resolve_host)(host, port)
        if not addresses:
            raise DestinationRefused("the host resolves to no address")
        for text in addresses:
            self.check_address(ipaddress.ip_address(text))
        return addresses


def refusal(address: IPAddress) -> str | None:
    """Why `address` may not be a destination (as "a ... address"), or None."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return f"an IPv4-mapped address (of {address.ipv4_mapped})"
        if address in IPV4_COMPATIBLE and int(address) > 1:
            return f"an IPv4-compatible address (of {embedded_ipv4(address)})"
        embedded = embedded_ipv4(address)
        if embedded is not None:
            # 6to4 and NAT64 reach the IPv4 address they carry.
            reason = refusal(embedded)
            return None if reason is None else f"a way to reach {embedded}, {reason}"
    return _kind(address)


def _kind(address: IPAddress) -> str | None:
    for attribute, name in (
        ("is_unspecified", "an unspecified address"),
        ("is_loopback", "a loopback address"),
        ("is_link_local", "a link-local address"),
        ("is_multicast", "a multicast address"),
        ("is_private", "a private address"),
        ("is_reserved", "a reserved address"),
    ):
        if getattr(address, attribute):
            return name
    if not address.is_global:
        return "an address that is not globally reachable"
    return None


def embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one carries: IPv4-mapped, IPv4-compatible, 6to4, NAT64."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address in NAT64 or (address in IPV4_COMPATIBLE and int(address) > 1):
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def address_literal(host: str) -> IPAddress | None:
    """The address `host` is written as, in any form a resolver reads as one.

    `inet_aton` takes the forms of the C library (`0x7f000001`, `2130706433`,
    `0177.0.0.1`, `127.1`) that `ipaddress` does not.
    """
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except (OSError, ValueError):
        return None


def resolve_host(host: str, port: int) -> list[str]:
    """The addresses `getaddrinfo` gives for a TCP connection to `host`, without repeats.

    Raises `OSError` (`socket.gaierror`) when the name does not resolve, and
    `UnicodeError` for a name no resolver can take.
    """
    found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses: list[str] = []
    for _family, _type, _proto, _name, sockaddr in found:
        address = str(sockaddr[0])
        if address not in addresses:
            addresses.append(address)
    return addresses


def describe(networks: Sequence[IPNetwork]) -> str:
    """The allowed networks as the variable would name them."""
    return ",".join(str(network) for network in networks)
