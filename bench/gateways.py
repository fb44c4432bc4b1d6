"""The ingress's cost per gateway: each gateway's verification beside the bare route.

    python -m bench.gateways [--seconds S] [--rounds R] [--connections C]

One ingress process serves an endpoint of every gateway; wrk drives it with
each gateway's own signed requests (`Gateway.sample_request`, the bodies
`payhook send` sends: a payment event of a few hundred bytes; two per
request for Adyen and GoCardless, PayPal's signature checked against a
pinned certificate), rounds alternating with the bare Starlette route of
`bench.ingress`. Reported per gateway: the median requests per second, its
ratio to the bare route, that ratio beside Standard Webhooks' in the same
run (goal: within 10% of it), and the ingress's CPU per request.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psycopg
from psycopg import sql

from bench.ingress import PG, bare_app, measure, run_wrk, wait_ready, wrk_script
from bench.services import private_redis, process, spare_port
from control import admin
from control.migrations import apply_migrations
from payhook.db import connect
from payhook.gateways import GATEWAYS
from payhook.gateways.base import NO_CONFIG, Config, Sample
from payhook.settings import Settings
from tests.certificates import authority, leaf
from tests.factories import TEST_KEYRING, TEST_SECRETS_KEY

DB = "payhook_bench_gateways"
#: Distinct signed requests per gateway the load cycles through.
REQUESTS = 500
#: The gateways that send several events in one request, and how many.
BATCHED = {"adyen": 2, "gocardless": 2}
PAYPAL_URL = "https://api.paypal.com/v1/notifications/certs/CERT-bench"

# For the module's import: `bare_app` is what uvicorn serves as the ceiling.
__all__ = ["bare_app"]


def configs() -> tuple[dict[str, Config], dict[str, Config], dict[str, str]]:
    """Per gateway: the endpoint's settings, what signing needs, a given secret."""
    signer = leaf(authority())
    endpoint = {
        "gocardless": Config({"api_base_url": "http://127.0.0.1:9"}, {"access_token": "t"}),
        "mollie": Config({"api_base_url": "http://127.0.0.1:9"}, {"api_key": "k"}),
        "paypal": Config({"certificates": signer.pem}),
        "square": Config({"notification_url": "https://shop.example/square"}),
    }
    sending = {
        "paypal": Config({"cert_url": PAYPAL_URL}, {"signing_key": signer.key_pem}),
        "square": endpoint["square"],
    }
    return endpoint, sending, {"paypal": "WH-BENCH-WEBHOOK-ID"}


def types(name: str) -> list[str]:
    sample_type = GATEWAYS[name].sample_type
    if name == "gocardless":
        return ["payments.confirmed", "payments.paid_out"]
    return [sample_type] * BATCHED.get(name, 1)


def requests_for(
    name: str, secret: str, sending: Config, count: int
) -> list[tuple[bytes, dict[str, str]]]:
    gateway = GATEWAYS[name]
    now = int(time.time())
    made = []
    for i in range(count):
        order = f"order_{uuid.uuid4().hex[:16]}"
        samples = [
            Sample(gateway.new_event_id(), t, order, 1500 + i, "EUR", f"ref-{i}", now - 60)
            for t in types(name)
        ]
        body, headers = gateway.sample_request(samples, secret, now, sending)
        headers.setdefault("content-type", "application/json")
        made.append((body, headers))
    return made


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=5, help="length of each wrk round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per gateway")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--gateways", default=",".join(sorted(GATEWAYS)))
    args = parser.parse_args(argv)
    if shutil.which("wrk") is None:
        print("bench.gateways: wrk is missing: apt-get install -y wrk", file=sys.stderr)
        return 2
    names = [n for n in args.gateways.split(",") if n]
    endpoint_configs, sending, given = configs()
    python = sys.executable
    with (
        private_redis("always") as (redis_url, _redis_pid),
        tempfile.TemporaryDirectory(prefix="payhook-bench-") as folder,
    ):
        settings = scratch_settings(redis_url)
        scripts = {}
        with connect(settings) as conn:
            tenant = admin.add_tenant(conn, "bench", keyring=TEST_KEYRING)
            for name in names:
                config = endpoint_configs.get(name, NO_CONFIG)
                endpoint = admin.add_endpoint(
                    conn, tenant, name, given.get(name), keyring=TEST_KEYRING, config=config
                )
                made = requests_for(name, endpoint.secret, sending.get(name, NO_CONFIG), REQUESTS)
                scripts[name] = wrk_script(
                    f"/webhooks/{endpoint.endpoint_id}", made, Path(folder), name,
                    "status >= 200 and status < 300",
                )  # fmt: skip
        env = dict(os.environ) | {
            "DATABASE_URL": settings.database_url,
            "REDIS_URL": redis_url,
            "PAYHOOK_QUEUE": settings.queue,
            "PAYHOOK_LOG_LEVEL": "WARNING",
            "PAYHOOK_SECRETS_KEY": TEST_SECRETS_KEY,
        }
        bare_port, ingress_port = spare_port(), spare_port()
        bare = [python, "-m", "uvicorn", "bench.ingress:bare_app", "--port", str(bare_port),
                "--no-access-log", "--log-level", "warning"]  # fmt: skip
        ingress = [python, "-m", "control.cli", "ingress", "--port", str(ingress_port)]
        bare_script = scripts[names[0]]
        rates: dict[str, list[float]] = {n: [] for n in ["bare", *names]}
        cpu: dict[str, list[float]] = {n: [] for n in ["bare", *names]}
        with (
            process(bare, env, bare_port) as bare_proc,
            process(ingress, env, ingress_port) as proc,
        ):
            wait_ready(ingress_port)
            for name in names:  # warm every path
                run_wrk(ingress_port, scripts[name], 1, args.connections)
            run_wrk(bare_port, bare_script, 1, args.connections)
            for _ in range(args.rounds):
                for name in ["bare", *names]:
                    port, script, pid = (
                        (bare_port, bare_script, bare_proc.pid)
                        if name == "bare"
                        else (ingress_port, scripts[name], proc.pid)
                    )
                    done = measure(port, script, args.seconds, args.connections, {"app": pid})
                    rates[name].append(done.rps)
                    cpu[name].append(done.cpu_us["app"])
        drop(settings)
    bare_median = statistics.median(rates["bare"])
    reference = statistics.median(rates["standard"]) / bare_median if "standard" in rates else None
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print(f"wrk -t1 -c{args.connections}, {args.rounds} rounds of {args.seconds}s per app")
    print(f"  {'bare Starlette route':22s} {bare_median:9,.0f} req/s")
    for name in names:
        median = statistics.median(rates[name])
        ratio = median / bare_median
        beside = f"  {ratio / reference:6.1%} of standard's" if reference else ""
        events = len(types(name))
        print(
            f"  {name:22s} {median:9,.0f} req/s  ratio to bare {ratio:6.1%}{beside}"
            f"  CPU {statistics.median(cpu[name]):5.0f} us/request ({events} event(s))"
        )
    return 0


def scratch_settings(redis_url: str) -> Settings:
    with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(DB)))
    settings = Settings.from_env(
        {
            "DATABASE_URL": f"{PG}/{DB}",
            "REDIS_URL": redis_url,
            "PAYHOOK_QUEUE": "payhook-bench",
            "PAYHOOK_SECRETS_KEY": TEST_SECRETS_KEY,
        }
    )
    apply_migrations(settings)
    return settings


def drop(settings: Settings) -> None:
    with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(DB)))


if __name__ == "__main__":
    raise SystemExit(main())
