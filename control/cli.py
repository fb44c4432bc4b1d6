"""The `payhook` command: parse arguments, build settings, call one function.

Each process's wiring lives in its component's `main` module; they are
imported only by the command that runs them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psycopg
from redis.exceptions import RedisError

from control import audit
from payhook.errors import PayhookError
from payhook.gateways import GATEWAYS
from payhook.logs import configure_logging
from payhook.outcomes import ANOMALY_KINDS, EXCEPTION_KINDS
from payhook.settings import Settings


def _whole(value: str, what: str, most: int) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value!r}") from None
    if not 1 <= number <= most:
        raise argparse.ArgumentTypeError(f"expected 1 to {most}, got {number}")
    return number


def port(value: str) -> int:
    """A TCP port to listen on, 1 to 65535 (argparse type)."""
    return _whole(value, "a port number", 65535)


def batch_size(value: str) -> int:
    """Rows per transaction, 1 to 10000 (argparse type)."""
    return _whole(value, "a number", 10_000)


#: Commands that run a service and configure their own logging (to stdout).
SERVICES = frozenset({"ingress", "consumer", "outbox-worker", "dashboard", "up"})

Command = Callable[[argparse.Namespace, Settings], int]


def cmd_migrate(args: argparse.Namespace, settings: Settings) -> int:
    from control.migrations import migrate
    from control.sealed import reseal_all
    from payhook.db import connect
    from payhook.sealing import Keyring

    applied = migrate(settings)
    print(f"applied {len(applied)} migration(s)" + (": " + ", ".join(applied) if applied else ""))
    keyring = Keyring.from_settings(settings)
    if keyring:
        # Plaintext an older release wrote is sealed as part of the upgrade.
        with connect(settings, "migrate", owner=True) as conn:
            sealed = reseal_all(conn, keyring, plaintext_only=True)
        print(f"sealed the secrets of {sealed.resealed} row(s)")
        if sealed.remaining:
            raise PayhookError(
                f"{sealed.remaining} row(s) still hold plaintext secrets: "
                + "; ".join(sealed.failures[:3])
            )
    return 0


def cmd_tenants_add(args: argparse.Namespace, settings: Settings) -> int:
    from control.admin import add_tenant
    from payhook.db import connect
    from payhook.destinations import DestinationPolicy
    from payhook.sealing import Keyring

    destinations = DestinationPolicy.from_settings(settings)
    keyring = Keyring.from_settings(settings)
    with connect(settings) as conn:
        tenant_id = add_tenant(
            conn, args.name, args.fulfilment_url, keyring=keyring, destinations=destinations
        )
        audit.record(conn, "tenant_add", "tenant", tenant_id, tenant_id=tenant_id)
    print(tenant_id)
    return 0


def cmd_endpoints_add(args: argparse.Namespace, settings: Settings) -> int:
    from control.admin import add_endpoint
    from control.sender import named_values
    from payhook.db import connect
    from payhook.gateways.base import Config
    from payhook.sealing import Keyring

    keyring = Keyring.from_settings(settings)
    with connect(settings) as conn:
        endpoint = add_endpoint(
            conn,
            args.tenant,
            args.gateway,
            args.secret,
            keyring=keyring,
            config=Config(
                named_values("--setting", args.setting or []),
                named_values("--credential", args.credential or []),
            ),
        )
        audit.record(
            conn,
            "endpoint_add",
            "endpoint",
            endpoint.endpoint_id,
            tenant_id=args.tenant,
            result={"gateway": args.gateway},  # never a secret
        )
    print(json.dumps(endpoint.__dict__))
    return 0


def cmd_endpoints_rotate(args: argparse.Namespace, settings: Settings) -> int:
    from control.admin import rotate_endpoint_secret
    from payhook.db import connect
    from payhook.sealing import Keyring

    keyring = Keyring.from_settings(settings)
    with connect(settings) as conn:
        secret = rotate_endpoint_secret(conn, args.endpoint, args.secret, keyring=keyring)
        _audit_endpoint(conn, "endpoint_rotate", args.endpoint)
    print(json.dumps({"endpoint_id": args.endpoint, "secret": secret}))
    return 0


def cmd_endpoints_configure(args: argparse.Namespace, settings: Settings) -> int:
    from control.admin import configure_endpoint
    from control.sender import named_values
    from payhook.db import connect
    from payhook.gateways.base import Config
    from payhook.sealing import Keyring

    config = Config(
        named_values("--setting", args.setting or []),
        named_values("--credential", args.credential or []),
    )
    with connect(settings) as conn:
        stored = configure_endpoint(
            conn,
            args.endpoint,
            keyring=Keyring.from_settings(settings),
            config=config,
            unset=tuple(args.unset or ()),
        )
        # Names only: the settings and the credentials' names, never a value.
        _audit_endpoint(conn, "endpoint_configure", args.endpoint, result=stored)
    print(json.dumps(stored))
    return 0


def cmd_endpoints_retire(args: argparse.Namespace, settings: Settings) -> int:
    from control.admin import retire_old_secrets
    from payhook.db import connect

    with connect(settings) as conn:
        retire_old_secrets(conn, args.endpoint)
        _audit_endpoint(conn, "endpoint_retire_secrets", args.endpoint)
    print(json.dumps({"endpoint_id": args.endpoint, "retired": True}))
    return 0


def _audit_endpoint(
    conn: psycopg.Connection[Any], action: str, endpoint_id: str, **options: Any
) -> None:
    from payhook.db import tenant_of

    found = tenant_of(conn, "webhook_endpoints", endpoint_id)
    tenant_id = None if found is None else str(found)
    audit.record(conn, action, "endpoint", endpoint_id, tenant_id=tenant_id, **options)


def cmd_secrets_new_key(args: argparse.Namespace, settings: Settings) -> int:
    from payhook.sealing import generate_key_line

    print(generate_key_line(args.id))
    return 0


def cmd_secrets(args: argparse.Namespace, settings: Settings) -> int:
    from control.sealed import check_all, reseal_all
    from payhook.db import connect
    from payhook.sealing import Keyring

    keyring = Keyring.from_settings(settings)
    with connect(settings, "secrets", owner=True) as conn:
        if args.action == "check":
            checked = check_all(conn, keyring)
            print(
                json.dumps(
                    {
                        "opened": checked.opened,
                        "by_key": checked.by_key,
                        "plaintext": checked.plaintext,
                        "failures": checked.failures,
                    }
                )
            )
            return 0 if checked.ok else 1
        sealed = reseal_all(conn, keyring, args.batch, plaintext_only=args.action == "seal")
        audit.record(
            conn,
            f"secrets_{args.action.replace('-', '_')}",
            "secrets",
            "*",
            result={"key": keyring.current, "resealed": sealed.resealed},
        )
    print(
        json.dumps(
            {
                "key": keyring.current,
                "resealed": sealed.resealed,
                "remaining": sealed.remaining,
                "failures": sealed.failures,
            }
        )
    )
    return 0 if sealed.remaining == 0 else 1


def cmd_orders_add(args: argparse.Namespace, settings: Settings) -> int:
    from control.admin import add_order
    from payhook.db import connect

    with connect(settings) as conn:
        order_id = add_order(
            conn, args.tenant, args.merchant_ref, args.gateway_order_id, args.amount, args.currency
        )
        audit.record(conn, "order_add", "order", order_id, tenant_id=args.tenant)
    print(order_id)
    return 0


def cmd_consumer(args: argparse.Namespace, settings: Settings) -> int:
    from consumer.main import run

    return run(settings, burst=args.burst)


def cmd_ingress(args: argparse.Namespace, settings: Settings) -> int:
    from ingress.main import run

    return run(settings, host=args.host, port=args.port, workers=args.workers)


def cmd_outbox_worker(args: argparse.Namespace, settings: Settings) -> int:
    from outbox_worker.main import run

    return run(settings, once=args.once)


def cmd_outbox(args: argparse.Namespace, settings: Settings) -> int:
    from control.outbox_admin import run

    return run(args, settings)


def cmd_send(args: argparse.Namespace, settings: Settings) -> int:
    from control.sender import run

    return run(args, settings)


def cmd_up(args: argparse.Namespace, settings: Settings) -> int:
    from control.stack import StackOptions, run

    options = StackOptions(
        host=args.host,
        port=args.port,
        dashboard_port=args.dashboard_port,
        consumers=args.consumers,
        fulfilment_url=args.fulfilment_url,
        state_dir=Path(args.state_dir),
        embedded=args.embedded,
    )
    return run(settings, os.environ, options)


def cmd_dashboard(args: argparse.Namespace, settings: Settings) -> int:
    from control.dashboard import run

    return run(settings, host=args.host, port=args.port)


def cmd_check(args: argparse.Namespace, settings: Settings) -> int:
    from control.alerts import check

    return check(settings, show_all=args.all)


def cmd_operations(args: argparse.Namespace, settings: Settings) -> int:
    from control.operations import run

    return run(args, settings)


def cmd_quarantine(args: argparse.Namespace, settings: Settings) -> int:
    from control import quarantined
    from payhook.queue import redis_connection

    if args.action == "purge" and not (args.all or args.job_ids):
        raise PayhookError("quarantine purge: name JOB_IDs or give --all")

    def purged(job_ids: list[str], count: int) -> None:
        from payhook.db import connect

        with connect(settings) as conn:
            audit.record(
                conn, "quarantine_purge", "quarantine", "*" if args.all else ",".join(job_ids),
                result={"purged": count, "jobs": len(job_ids)},
            )  # fmt: skip

    redis = redis_connection(settings, timeout=10)
    try:
        return quarantined.run(args.action, args, redis, settings.queue, sys.stdout, purged)
    finally:
        redis.close()


def cmd_retention(args: argparse.Namespace, settings: Settings) -> int:
    from control.retention import run

    return run(args, settings)


def cmd_reconcile(args: argparse.Namespace, settings: Settings) -> int:
    from datetime import timedelta

    from control import reconcile
    from payhook.db import connect
    from payhook.sealing import Keyring
    from payhook.settings import parse_duration

    since = timedelta(seconds=parse_duration("--since", args.since))
    keyring = Keyring.from_settings(settings)
    if args.scheduled:
        return reconcile.run_scheduled(settings, since, keyring)
    if (args.endpoint is None) == (not args.all):
        raise PayhookError("reconcile: name --endpoint ID, or --all")
    from payhook.queue import redis_connection

    with connect(settings) as conn:
        if args.runs:
            if args.endpoint is None:
                raise PayhookError("reconcile --runs: name the --endpoint")
            for row in reconcile.runs(conn, args.endpoint, args.limit):
                print(json.dumps(row))
            return 0
        redis = redis_connection(settings, timeout=10)
        try:
            if args.all:
                done = reconcile.reconcile_all(
                    conn, redis, settings, since, keyring=keyring, dry_run=args.dry_run
                )
            else:
                done = [
                    reconcile.reconcile(
                        conn, redis, settings, args.endpoint, since, keyring=keyring,
                        dry_run=args.dry_run, restart=args.restart,
                    )
                ]  # fmt: skip
            for run in done:
                audit.record(
                    conn, "reconcile", "endpoint", run.endpoint_id,
                    tenant_id=run.tenant_id, result=run.to_json(),
                )  # fmt: skip
        finally:
            redis.close()
    for run in done:
        print(json.dumps(run.to_json()))
    return 1 if any(run.error for run in done) else 0


def cmd_audit(args: argparse.Namespace, settings: Settings) -> int:
    from payhook.db import connect

    with connect(settings) as conn:
        for row in audit.actions(conn, args.tenant, args.event_id, args.limit):
            print(json.dumps(row, default=str))
    return 0


def cmd_uniqueness(args: argparse.Namespace, settings: Settings) -> int:
    from control.uniqueness_command import run

    return run(args, settings)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="payhook", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(
        name: str,
        func: Command,
        help: str,
        sub: argparse._SubParsersAction[argparse.ArgumentParser] = commands,
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(func=func)
        return p

    add("migrate", cmd_migrate, "apply pending migrations (safe to run twice or concurrently)")

    tenants = commands.add_parser("tenants", help="manage tenants").add_subparsers(
        dest="action", required=True, metavar="ACTION"
    )
    p = add("add", cmd_tenants_add, "create a tenant and print its id", tenants)
    p.add_argument("name")
    p.add_argument("--fulfilment-url", help="where the outbox worker POSTs fulfilment")

    endpoints = commands.add_parser("endpoints", help="manage webhook endpoints").add_subparsers(
        dest="action", required=True, metavar="ACTION"
    )
    p = add("add", cmd_endpoints_add, "create an endpoint; prints JSON", endpoints)
    p.add_argument("--tenant", required=True)
    p.add_argument("--gateway", required=True, choices=sorted(GATEWAYS))
    p.add_argument("--secret", help="the signing secret (generated when omitted)")
    p.add_argument(
        "--setting",
        action="append",
        metavar="NAME=VALUE",
        help="a setting the gateway reads (docs/gateways.md lists them; @PATH: a file's text)",
    )
    p.add_argument(
        "--credential",
        action="append",
        metavar="NAME=VALUE",
        help="a credential, sealed at rest (VALUE - : read a line from stdin)",
    )
    p = add("rotate", cmd_endpoints_rotate, "add a new secret; old ones still verify", endpoints)
    p.add_argument("endpoint")
    p.add_argument("--secret", help="the new secret (generated when omitted)")
    p = add(
        "configure",
        cmd_endpoints_configure,
        "set or unset settings and credentials (rotate an API token); prints JSON",
        endpoints,
    )
    p.add_argument("endpoint")
    p.add_argument("--setting", action="append", metavar="NAME=VALUE")
    p.add_argument(
        "--credential",
        action="append",
        metavar="NAME=VALUE",
        help="sealed at rest (VALUE - : read a line from stdin)",
    )
    p.add_argument("--unset", action="append", metavar="NAME", help="remove a setting")
    p = add("retire-secrets", cmd_endpoints_retire, "keep only the newest secret", endpoints)
    p.add_argument("endpoint")

    secrets = commands.add_parser(
        "secrets", help="stored secrets, sealed under PAYHOOK_SECRETS_KEY"
    ).add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, text in (
        ("rotate-key", "re-seal every secret not under the newest key; resumable; prints JSON"),
        ("seal", "seal plaintext secrets an older release wrote; resumable; prints JSON"),
    ):
        p = add(action, cmd_secrets, text, secrets)
        p.add_argument("--batch", type=batch_size, default=100, help="rows per transaction")
    add("check", cmd_secrets, "verify every stored secret opens; exit 1 if not", secrets)
    p = add(
        "new-key",
        cmd_secrets_new_key,
        "print a new random key as ID:BASE64, for PAYHOOK_SECRETS_KEY",
        secrets,
    )
    p.add_argument("--id", default="k1", help="the key's id (default k1)")

    orders = commands.add_parser("orders", help="manage orders").add_subparsers(
        dest="action", required=True, metavar="ACTION"
    )
    p = add("add", cmd_orders_add, "create an order awaiting payment; prints its id", orders)
    p.add_argument("--tenant", required=True)
    p.add_argument("--merchant-ref", required=True)
    p.add_argument("--gateway-order-id", required=True)
    p.add_argument("--amount", required=True, type=int, help="in minor units (cents)")
    p.add_argument("--currency", required=True)

    p = add("ingress", cmd_ingress, "run the webhook ingress under uvicorn")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--workers", type=int, default=1)

    p = add("consumer", cmd_consumer, "run one RQ worker on the events queue")
    p.add_argument("--burst", action="store_true", help="exit once the queue is empty")

    p = add("outbox-worker", cmd_outbox_worker, "run the outbox delivery loop")
    p.add_argument("--once", action="store_true", help="deliver what is due, then exit")

    outbox = commands.add_parser("outbox", help="inspect and retry outbox rows").add_subparsers(
        dest="action", required=True, metavar="ACTION"
    )
    p = add("list", cmd_outbox, "list outbox rows", outbox)
    p.add_argument("--state", choices=["pending", "delivered", "dead"])
    p.add_argument("--limit", type=int, default=50)
    p = add("retry", cmd_outbox, "make one dead or pending row due now", outbox)
    p.add_argument("id")
    add("retry-dead", cmd_outbox, "make every dead row due again", outbox)

    p = add("send", cmd_send, "sign and POST a test event, like a gateway would")
    p.add_argument("--url", required=True, help="the endpoint's full webhook URL")
    p.add_argument("--gateway", default="standard", choices=sorted(GATEWAYS))
    p.add_argument("--secret", required=True)
    p.add_argument(
        "--type",
        action="append",
        help="the gateway's event type (default: payment.succeeded for standard, "
        "payment_intent.succeeded for stripe, ...); repeated, one request carries "
        "each, for a gateway that batches (adyen, gocardless)",
    )
    p.add_argument(
        "--setting",
        action="append",
        metavar="NAME=VALUE",
        help="a setting of the endpoint, as the gateway is configured (@PATH: a file's text)",
    )
    p.add_argument(
        "--credential",
        action="append",
        metavar="NAME=VALUE",
        help="a credential the gateway signs or authenticates with (VALUE - : read from stdin)",
    )
    p.add_argument("--merchant-ref")
    p.add_argument("--gateway-order-id", required=True)
    p.add_argument("--amount", type=int, required=True, help="in minor units")
    p.add_argument("--currency", default="EUR")
    p.add_argument(
        "--event-id",
        help="fixed event id (default: a new one); sent again, the same body: a redelivery",
    )
    p.add_argument(
        "--occurred-at",
        help="when the event happened, ISO 8601 (default: now; with --event-id, 00:00 UTC today)",
    )
    p.add_argument("--copies", type=int, default=1, help="send the same signed event N times")
    p.add_argument("--concurrency", type=int, default=1)

    p = add("up", cmd_up, "the whole stack on this machine, for a newcomer; Ctrl-C stops it")
    p.add_argument("--host", default="127.0.0.1", help="the ingress's address")
    p.add_argument("--port", type=port, default=8000, help="the ingress's port")
    p.add_argument("--dashboard-port", type=port, default=9181)
    p.add_argument("--consumers", type=int, default=2, help="consumer processes")
    p.add_argument("--fulfilment-url", help="where the demo tenant's fulfilment is POSTed")
    p.add_argument(
        "--embedded",
        action="store_true",
        help="embedded PostgreSQL and Redis under --state-dir even when local ones answer",
    )
    p.add_argument("--state-dir", default=".payhook", help="data of embedded services")

    p = add("dashboard", cmd_dashboard, "rq-dashboard for the events queue, with basic auth")
    p.add_argument("--host", help="default PAYHOOK_DASHBOARD_HOST or 127.0.0.1")
    p.add_argument("--port", type=port, help="default PAYHOOK_DASHBOARD_PORT or 9181")

    p = add("check", cmd_check, "print active alerts; exit 1 when any is active, else 0")
    p.add_argument("--all", action="store_true", help="print every signal, active or not")

    p = add("trace", cmd_operations, "one event: receipt, order, transition, outbox, exceptions")
    p.add_argument("event_id")
    p.add_argument("--tenant", required=True)
    p.add_argument("--json", action="store_true", help="one JSON object instead of text")

    exceptions = commands.add_parser(
        "exceptions", help="authentic events that could not be applied"
    ).add_subparsers(dest="action", required=True, metavar="ACTION")
    p = add("list", cmd_operations, "open exceptions, newest first, as JSON lines", exceptions)
    p.add_argument("--all", action="store_true", help="resolved ones too")
    p.add_argument("--kind", choices=sorted(EXCEPTION_KINDS))
    p.add_argument("--tenant")
    p.add_argument("--limit", type=int, default=50)
    p = add("replay", cmd_operations, "re-apply an exception's event once fixed", exceptions)
    p.add_argument("id", type=int)
    p.add_argument("--tenant")
    p.add_argument("--dry-run", action="store_true", help="show what would change, write nothing")
    p = add("resolve", cmd_operations, "close an exception without applying it", exceptions)
    p.add_argument("id", type=int)
    p.add_argument("--tenant")
    p.add_argument("--note", required=True, help="why, kept in the audit trail")

    anomalies = commands.add_parser("anomalies", help="security anomalies").add_subparsers(
        dest="action", required=True, metavar="ACTION"
    )
    p = add("list", cmd_operations, "anomalies, newest first, as JSON lines", anomalies)
    p.add_argument("--kind", choices=sorted(ANOMALY_KINDS))
    p.add_argument("--since", help="only the last DURATION, e.g. 24h")
    p.add_argument("--limit", type=int, default=50)

    dlq = commands.add_parser("dlq", help="the dead-letter queue of event jobs").add_subparsers(
        dest="action", required=True, metavar="ACTION"
    )
    p = add("list", cmd_operations, "dead-letter jobs, oldest first, as JSON lines", dlq)
    p.add_argument("--limit", type=int, default=50)
    p = add("requeue", cmd_operations, "put dead-letter jobs back on the events queue", dlq)
    p.add_argument("job_ids", nargs="*", metavar="JOB_ID")
    p.add_argument("--all", action="store_true", help="every dead-letter event job")

    quarantined = commands.add_parser(
        "quarantine", help="jobs in Redis the consumers could not read, set aside"
    ).add_subparsers(dest="action", required=True, metavar="ACTION")
    p = add("list", cmd_quarantine, "quarantined jobs, newest first, as JSON lines", quarantined)
    p.add_argument("--limit", type=int, default=100)
    p = add("show", cmd_quarantine, "why a job was quarantined, and its fields' sizes", quarantined)
    p.add_argument("job_ids", nargs="+", metavar="JOB_ID")
    p = add("purge", cmd_quarantine, "delete quarantined jobs for good", quarantined)
    p.add_argument("job_ids", nargs="*", metavar="JOB_ID")
    p.add_argument("--all", action="store_true", help="every quarantined job")

    retention = commands.add_parser(
        "retention", help="archive old receipts, delete old bookkeeping"
    ).add_subparsers(dest="action", required=True, metavar="ACTION")
    p = add(
        "run",
        cmd_retention,
        "move receipts older than PAYHOOK_RECEIPT_RETENTION to the archive; delete delivered "
        "outbox rows, resolved exceptions and anomalies older than theirs; prints JSON",
        retention,
    )
    p.add_argument("--dry-run", action="store_true", help="count what would go; change nothing")

    p = add("audit", cmd_audit, "a tenant's operator actions, newest first, a JSON line each")
    p.add_argument("--tenant", required=True)
    p.add_argument("--event-id", help="only those about this event")
    p.add_argument("--limit", type=int, default=50)

    p = add(
        "reconcile",
        cmd_reconcile,
        "list the endpoint's events for the window through the gateway's API and queue those "
        "payhook acts on and has no receipt of; prints the run as JSON, exit 1 on an error",
    )
    p.add_argument("--endpoint")
    p.add_argument("--all", action="store_true", help="every endpoint with an API key")
    p.add_argument(
        "--scheduled",
        action="store_true",
        help="--all every PAYHOOK_RECONCILE_EVERY until stopped (idle while it is unset)",
    )
    p.add_argument("--since", default="72h", help="the window, back from now (default 72h)")
    p.add_argument("--dry-run", action="store_true", help="count what is missing; queue nothing")
    p.add_argument(
        "--restart",
        action="store_true",
        help="list the window anew, rather than resume where a failed run stopped",
    )
    p.add_argument("--runs", action="store_true", help="print the endpoint's latest runs instead")
    p.add_argument("--limit", type=int, default=20, help="with --runs: how many")

    uniqueness = commands.add_parser(
        "uniqueness", help="rows that break a unique rule before it is built"
    ).add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, text in (
        ("check", "find and classify rows breaking the unique rules of pending migrations"),
        ("resolve", "collapse groups classified as redelivery; copies go to the quarantine"),
    ):
        p = add(
            action, cmd_uniqueness, text + "; JSON per rule, exit 1 while any remain", uniqueness
        )
        p.add_argument("--rule", help="only this rule (the index or constraint name)")
        p.add_argument("--table", help="a rule no migration adds yet: its schema.table")
        p.add_argument("--columns", help="with --table: the rule's columns, comma-separated")
        if action == "check":
            p.add_argument(
                "--ignore",
                help="columns that may differ between two copies of one event, comma-separated",
            )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = Settings.from_env(os.environ)
        if args.command not in SERVICES:
            configure_logging(settings.log_level, stream=sys.stderr)
        return int(args.func(args, settings))
    except PayhookError as exc:
        print(f"payhook: error: {exc}", file=sys.stderr)
        return 2
    except (
        psycopg.errors.UndefinedTable,
        psycopg.errors.UndefinedFunction,
        psycopg.errors.InvalidSchemaName,
    ) as exc:
        first = str(exc).splitlines()[0] if str(exc) else "a table is missing"
        print(f"payhook: error: PostgreSQL: {first}; run `payhook migrate`", file=sys.stderr)
        return 2
    except psycopg.Error as exc:
        # Unreachable, or a statement refused: the server's own message.
        print(f"payhook: error: PostgreSQL: {exc}".rstrip(), file=sys.stderr)
        return 2
    except RedisError as exc:
        print(f"payhook: error: Redis: {exc}".rstrip(), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
