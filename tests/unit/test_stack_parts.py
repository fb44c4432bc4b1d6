"""`payhook up`'s pieces that need no processes: service choice, banner, log lines."""

from __future__ import annotations

import io
import json
import shlex
import socket
from pathlib import Path

import pytest

from control.cli import build_parser
from control.stack import (
    Demo,
    LineWriter,
    Output,
    StackOptions,
    _readable,
    _safe_url,
    banner,
    find_services,
)


def never(url: str) -> bool:
    raise AssertionError(f"probed {url} although the environment names a service")


def test_the_environment_wins_then_the_local_servers(tmp_path: Path) -> None:
    out = Output(io.StringIO())
    env = {"DATABASE_URL": "postgresql://u:pw@db/x", "REDIS_URL": "redis://:pw@cache:6379/1"}
    chosen = find_services(
        env, StackOptions(), tmp_path, out, postgres_answers=never, redis_answers=never
    )
    assert (chosen.database_url, chosen.redis_url) == (env["DATABASE_URL"], env["REDIS_URL"])
    assert chosen.notes == [
        "PostgreSQL: DATABASE_URL (postgresql://u:***@db/x)",
        "Redis: REDIS_URL (redis://:***@cache:6379/1)",
    ]
    local = find_services(
        {}, StackOptions(), tmp_path, out, postgres_answers=bool, redis_answers=bool
    )
    assert local.database_url == "postgresql://postgres@127.0.0.1:5432/payhook"
    assert local.redis_url == "redis://127.0.0.1:6379/0"
    assert local.redis_child is None and local.stop_postgres is None


def test_the_banner_prints_a_send_line_the_cli_accepts() -> None:
    demo = Demo(
        endpoint_id="0d8f6c1e-53a6-4a53-9f59-8f0e0d7c1a11",
        secret="whsec_c2VjcmV0IHdpdGggc3BhY2VzICsgc2xhc2hlcy8=",
        gateway="standard",
        order={
            "merchant_reference": "demo-1",
            "gateway_order_id": "pi_demo_1",
            "amount_minor": 1999,
            "currency": "EUR",
        },
    )
    lines = banner("http://127.0.0.1:8000", StackOptions(), "payhook", "pw", demo)
    [send] = [line.strip() for line in lines if line.strip().startswith("payhook send")]
    args = build_parser().parse_args(shlex.split(send)[1:])
    assert args.url == "http://127.0.0.1:8000/webhooks/0d8f6c1e-53a6-4a53-9f59-8f0e0d7c1a11"
    assert args.secret == demo.secret
    assert (args.merchant_ref, args.gateway_order_id, args.amount, args.currency) == (
        "demo-1",
        "pi_demo_1",
        1999,
        "EUR",
    )
    assert any("user payhook, password pw" in line for line in lines)
    given = banner("http://127.0.0.1:8000", StackOptions(), "payhook", None, demo)
    assert any("password from PAYHOOK_DASHBOARD_PASSWORD" in line for line in given)


def test_lines_are_prefixed_and_json_is_readable_on_a_terminal() -> None:
    stream = io.StringIO()
    out = Output(stream, width=8)
    writer = LineWriter(out)
    writer.write('{"event": "migration_applied", "level": "info", "migration": "0001"}\npart')
    writer.write("ial\n")
    assert stream.getvalue().splitlines() == [
        'up      | {"event": "migration_applied", "level": "info", "migration": "0001"}',
        "up      | partial",
    ]
    line = json.dumps({"event": "event_applied", "level": "info", "timestamp": "t", "x": 1})
    assert _readable(line) == "INFO    event_applied x=1"
    assert _readable("INFO: Started server") == "INFO: Started server"


def test_urls_are_shown_without_their_passwords() -> None:
    assert _safe_url("redis://:secret@host:6379/0") == "redis://:***@host:6379/0"
    assert _safe_url("postgresql://user@host/db") == "postgresql://user@host/db"
    assert _safe_url("unix:///tmp/r.sock?db=0") == "unix:///tmp/r.sock?db=0"
    assert _safe_url("host=db user=u password=s3cret dbname=p") == (
        "host=db user=u password=*** dbname=p"
    )
    assert _safe_url(r"host=db password = 'it\'s s3cret' port=5") == "host=db password = *** port=5"
    assert _safe_url("postgresql://db/p?sslmode=require&password=s3cret&x=1") == (
        "postgresql://db/p?sslmode=require&password=***&x=1"
    )


def test_the_ingress_host_may_be_ipv6_and_its_urls_bracket_it() -> None:
    from control.stack import _check_port, _display_host
    from payhook.errors import SettingsError

    assert [_display_host(h) for h in ("0.0.0.0", "::", "::1", "127.0.0.1", "localhost")] == [
        "127.0.0.1",
        "[::1]",
        "[::1]",
        "127.0.0.1",
        "localhost",
    ]
    with pytest.raises(SettingsError, match=r"^--port: cannot listen on no-such-host\.invalid"):
        _check_port("no-such-host.invalid", 8000, "--port")
    _check_port("127.0.0.1", 0, "--port")
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    _check_port("::1", 0, "--port")
