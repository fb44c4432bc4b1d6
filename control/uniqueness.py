"""Unique rules added to live tables: find, classify and resolve historical duplicates.

A unique index built over rows that already share a key fails after scanning
the whole table. Before a migration builds one:

    payhook uniqueness check     find the groups of rows the rule would reject and
                                 classify each into payhook.uniqueness_conflicts
    payhook uniqueness resolve   collapse the `redelivery` groups, keeping the first row
    payhook migrate              refuses while any group remains, and says which kind

`redelivery`: the rows agree on every column except generated ids (identity,
serial, or a random-uuid primary key), arrival stamps and the columns named
with `--ignore`, so they are one event recorded twice, and the copies move to
payhook.uniqueness_quarantine. Any other primary-key column is content: rows
that differ only there are not copies unless it is named with `--ignore`.
`distinct`: the rows differ; they are legitimate records the rule would
forbid, and no tool decides which of them is wrong: change the rule, or the
rows, by hand.

The report stores, in `ignored`, the columns left out automatically and, each
written `--ignore=NAME`, those the operator named. Resolve trusts only the
latter: it works the automatic part out again from the table as it is then,
so a report written by an older check that left out a natural primary-key
column cannot make it delete rows that differ there; such a group becomes
`distinct` (run the check again, with `--ignore`, if it is a redelivery).
"""

from __future__ import annotations

import functools
import json
import shlex
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, LiteralString

import psycopg
import structlog
from psycopg import sql

from control.sqltext import name_parts, quoted
from control.unique_rules import RuleError, UniqueRule
from payhook.db import Row, execute, fetch_all, fetch_one
from payhook.errors import MigrationError
from payhook.queries import load_queries, query, sql_root

log = structlog.get_logger(__name__)

#: Tenant recorded for groups of a table that has no tenant_id column.
NO_TENANT = "00000000-0000-0000-0000-000000000000"
#: Tables that are not distributed by tenant (DESIGN.md): their rules need not
#: begin with tenant_id.
LOCAL_TABLES = frozenset({"tenants", "security_anomalies", "schema_migrations", "endpoint_version"})
#: Groups one resolve transaction collapses.
RESOLVE_BATCH = 100
#: Session settings that decide how key values are rendered as jsonb text
#: (timestamptz in the TimeZone, intervals, floats): pinned, as connection
#: options, on the sessions of `uniqueness` and `migrate`, and with SET LOCAL
#: inside every transaction here, so keys written by one session match those
#: computed by another.
SESSION_OPTIONS = (
    "-c TimeZone=UTC -c DateStyle=ISO -c IntervalStyle=postgres -c extra_float_digits=3"
)
#: What a check prints for a rule whose table or column a pending migration creates.
CREATED_BY_MIGRATION = "created by the migration: the build is the check"
#: Marks, in the report's `ignored`, a column the operator named with --ignore.
NAMED_IGNORE = "--ignore="


class NotYetThere(RuleError):
    """The rule names a table or column that does not exist (yet): a migration
    may create it in a statement before the rule."""


class UnresolvedConflicts(MigrationError):
    """Rows of the table already break the unique rule the migration adds."""


@dataclass(frozen=True)
class Group:
    """Rows that share one key of a rule."""

    tenant_id: str
    key: dict[str, Any]
    copies: int
    versions: int
    classification: str
    #: The key as jsonb text, which reads back exactly (numerics included).
    key_text: str = ""


@dataclass(frozen=True)
class CheckReport:
    rule: UniqueRule
    ignored: tuple[str, ...]
    groups: list[Group]

    def summary(self) -> dict[str, Any]:
        kinds = Counter(g.classification for g in self.groups)
        return {
            "rule": self.rule.name,
            "table": self.rule.table,
            "columns": list(self.rule.columns),
            "ignored": list(self.ignored),
            "groups": len(self.groups),
            "rows": sum(g.copies for g in self.groups),
            "redelivery": kinds["redelivery"],
            "distinct": kinds["distinct"],
            "distinct_examples": [
                {"tenant_id": g.tenant_id, **g.key}
                for g in self.groups
                if g.classification == "distinct"
            ][:10],
        }


@dataclass(frozen=True)
class Resolved:
    rule: str
    collapsed: int
    quarantined: int
    reclassified: int
    #: Groups left open: rows remain whose key the report's did not match.
    unmatched: int = 0


# Table shape and SQL composition


@dataclass(frozen=True)
class _Shape:
    columns: tuple[str, ...]
    #: Identity or serial columns.
    generated: frozenset[str]
    #: Columns defaulting to a random uuid (gen_random_uuid() and the like).
    random_ids: frozenset[str]
    stamped: frozenset[str]
    primary_key: tuple[str, ...]
    #: The rule begins with a uuid tenant_id, which the report keeps apart.
    by_tenant: bool
    #: Partitioned: its rows live in its partitions, several physical tables.
    partitioned: bool = False
    #: Inherited from: rules and their checks cover the table's own rows (ONLY).
    has_children: bool = False
    #: Each column's type as SQL (format_type).
    types: tuple[tuple[str, str], ...] = ()


def _shape(conn: psycopg.Connection[Row], rule: UniqueRule) -> _Shape:
    rows = fetch_all(conn, "table_columns", {"table": rule.table})
    if not rows:
        raise NotYetThere(f"{rule.name}: no table {rule.table}")
    columns = tuple(r["name"] for r in rows)
    missing = [c for c in rule.columns if c not in columns]
    if missing:
        raise NotYetThere(f"{rule.name}: {rule.table} has no column {', '.join(missing)}")
    local = name_parts(rule.table)[-1] in LOCAL_TABLES
    if "tenant_id" in columns and not local and rule.columns[0] != "tenant_id":
        raise RuleError(
            f"{rule.name}: every unique rule of a tenant table begins with tenant_id, "
            "so the schema can be distributed by tenant"
        )
    keyed = sorted(
        (r for r in rows if r["key_position"] is not None), key=lambda r: r["key_position"]
    )
    return _Shape(
        columns=columns,
        generated=frozenset(r["name"] for r in rows if r["generated"]),
        random_ids=frozenset(r["name"] for r in rows if r["random_default"]),
        stamped=frozenset(r["name"] for r in rows if r["arrival_stamp"]),
        primary_key=tuple(r["name"] for r in keyed),
        by_tenant=rule.columns[0] == "tenant_id"
        and any(r["name"] == "tenant_id" and r["type"] == "uuid" for r in rows),
        partitioned=rows[0]["partitioned"],
        has_children=rows[0]["has_children"],
        types=tuple((r["name"], r["type"]) for r in rows),
    )


def _stored_ignored(ignored: tuple[str, ...], named: tuple[str, ...]) -> list[str]:
    """The report's `ignored`: the columns left out, those the operator named marked."""
    return [NAMED_IGNORE + c if c in named else c for c in ignored]


def _named_ignored(stored: list[str]) -> tuple[str, ...]:
    """The columns of a report's `ignored` that the operator named with --ignore.

    Only marked ones: an unmarked name was chosen by the check of the day,
    perhaps by rules since tightened (an older check left out every
    primary-key column, natural keys included).
    """
    return tuple(c[len(NAMED_IGNORE) :] for c in stored if c.startswith(NAMED_IGNORE))


def _ignored(rule: UniqueRule, shape: _Shape, extra: tuple[str, ...]) -> tuple[str, ...]:
    unknown = [c for c in extra if c not in shape.columns]
    if unknown:
        raise RuleError(f"--ignore: {rule.table} has no column {', '.join(unknown)}")
    # A primary-key column is left out only when the database generates it; a
    # natural key (an event id, a refund id) tells legitimate rows apart.
    random_keys = shape.random_ids & set(shape.primary_key)
    chosen = (shape.generated | random_keys | shape.stamped | set(extra)) - set(rule.columns)
    return tuple(c for c in shape.columns if c in chosen)


def _parts(rule: UniqueRule, shape: _Shape) -> dict[str, sql.Composable]:
    rest = rule.columns[1:] if shape.by_tenant else rule.columns
    types = dict(shape.types)
    conditions: list[sql.Composable] = []
    if rule.nulls_distinct:
        conditions += [sql.SQL("{} IS NOT NULL").format(sql.Identifier(c)) for c in rule.columns]
    if rule.predicate:
        # The predicate is SQL from a migration file: code, not input.
        conditions.append(sql.SQL("({})").format(sql.SQL(rule.predicate)))
    return {
        "table": sql.SQL(
            "ONLY {}" if shape.has_children and not shape.partitioned else "{}"
        ).format(sql.Identifier(*name_parts(rule.table))),
        "columns": sql.SQL(", ").join(map(sql.Identifier, rule.columns)),
        "tenant": sql.SQL("coalesce(tenant_id, {}::uuid)").format(sql.Literal(NO_TENANT))
        if shape.by_tenant
        else sql.SQL("{}::uuid").format(sql.Literal(NO_TENANT)),
        "key": sql.SQL("jsonb_build_object({})").format(
            sql.SQL(", ").join(
                sql.SQL("{}, {}").format(sql.Literal(c), sql.Identifier(c)) for c in rest
            )
        ),
        "key_row": sql.SQL("ROW({})").format(
            sql.SQL(", ").join(sql.Identifier("t", c) for c in rest)
        ),
        "stored_row": sql.SQL("ROW({})").format(
            sql.SQL(", ").join(sql.Identifier("k", c) for c in rest)
        ),
        # Types from format_type: SQL from the catalog, not input.
        "key_columns": sql.SQL(", ").join(
            sql.SQL("{} {}").format(sql.Identifier(c), sql.SQL(types[c])) for c in rest
        )
        if rest
        else sql.SQL("none_ text"),
        "scope": sql.SQL(" AND ").join(conditions) if conditions else sql.SQL("true"),
        "order": sql.SQL(", ").join(sql.Identifier("t", c) for c in shape.primary_key)
        if shape.primary_key
        else sql.SQL("t.ctid"),
    }


@functools.cache
def _templates() -> dict[str, LiteralString]:
    return load_queries(sql_root() / "templates")


def _template(name: str, parts: dict[str, sql.Composable]) -> sql.Composed:
    return sql.SQL(_templates()[name]).format(**parts)


@contextmanager
def _pinned_transaction(conn: psycopg.Connection[Row]) -> Iterator[None]:
    """A transaction whose keys render the same whatever the session's settings."""
    with conn.transaction():
        execute(conn, "pin_key_settings")
        yield


# Check, resolve, guard


def check_rule(
    conn: psycopg.Connection[Row], rule: UniqueRule, ignore: tuple[str, ...] = ()
) -> CheckReport:
    """Find and classify the groups of rows the rule would reject; record them in the report."""
    shape = _shape(conn, rule)
    ignored = _ignored(rule, shape, ignore)
    parts = _parts(rule, shape)
    stored_ignored = _stored_ignored(ignored, ignore)
    with _pinned_transaction(conn):
        found = conn.execute(_template("find_conflicts", parts)).fetchall()
        compared = (
            conn.execute(
                _template("compare_conflicts", parts),
                {
                    "ignored": list(ignored),
                    "tenants": [g["tenant_id"] for g in found],
                    "keys": [g["key_text"] for g in found],
                },
            ).fetchall()
            if found
            else []
        )
        groups = [
            Group(
                str(r["tenant_id"]),
                r["key"],
                r["copies"],
                r["versions"],
                "redelivery" if r["versions"] == 1 else "distinct",
                r["key_text"],
            )
            for r in compared
        ]
        with conn.cursor() as cursor:
            cursor.executemany(
                query("record_conflict"),
                [
                    {
                        "tenant_id": g.tenant_id,
                        "rule": rule.name,
                        "table_name": rule.table,
                        "key": g.key_text,
                        "copies": g.copies,
                        "versions": g.versions,
                        "classification": g.classification,
                        "ignored": stored_ignored,
                    }
                    for g in groups
                ],
            )
        execute(conn, "close_vanished_conflicts", {"rule": rule.name, "table_name": rule.table})
    return CheckReport(rule, ignored, sorted(groups, key=lambda g: (g.tenant_id, _canon(g.key))))


def resolve_rule(
    conn: psycopg.Connection[Row], rule: UniqueRule, *, batch: int = RESOLVE_BATCH
) -> Resolved:
    """Collapse the rule's open `redelivery` groups: keep the first row, quarantine the copies.

    Each batch of groups is one short transaction that locks only the rows of
    those groups. A group whose rows no longer agree becomes `distinct`.
    """
    shape = _shape(conn, rule)
    if shape.partitioned:
        # Copies are deleted by ctid, which names a row only within one
        # physical table: on the parent it would match rows of every partition.
        raise RuleError(
            f"{rule.name}: {rule.table} is partitioned; check, then resolve, each "
            f"partition by name (--rule {shlex.quote(quoted(rule.name))} --table PARTITION "
            f"--columns {shlex.quote(','.join(map(quoted, rule.columns)))})"
        )
    parts = _parts(rule, shape)
    lock = _template("lock_group_rows", parts)
    quarantine = _template("quarantine_rows", parts)
    recount = _template("count_group_rows", parts)
    collapsed = quarantined = reclassified = unmatched = 0
    after: dict[str, Any] = {"after_tenant": None, "after_key": None}
    while True:
        with _pinned_transaction(conn):
            groups = fetch_all(
                conn,
                "open_redeliveries",
                {"rule": rule.name, "table_name": rule.table, "limit": batch} | after,
            )
            if not groups:
                break
            after = {"after_tenant": groups[-1]["tenant_id"], "after_key": groups[-1]["key_text"]}
            # The columns left out are worked out again from the table as it is
            # now; of the report's, only those the operator named are kept.
            ignored = {id(g): _ignored(rule, shape, _named(shape, g)) for g in groups}
            members: dict[tuple[str, str], list[Row]] = defaultdict(list)
            for columns in set(ignored.values()):
                alike = [g for g in groups if ignored[id(g)] == columns]
                for row in conn.execute(
                    lock,
                    {
                        "ignored": list(columns),
                        "tenants": [g["tenant_id"] for g in alike],
                        "keys": [g["key_text"] for g in alike],
                    },
                ).fetchall():
                    members[(str(row["tenant_id"]), row["key_text"])].append(row)
            doomed: list[str] = []
            for group in groups:
                rows = members[(str(group["tenant_id"]), group["key_text"])]
                where = {
                    "tenant_id": group["tenant_id"],
                    "rule": rule.name,
                    "table_name": rule.table,
                    "key": group["key_text"],
                }
                if not rows and _still_there(conn, recount, group):
                    # Its key matched none of the rows that are there: the report
                    # and the table disagree on how the key reads. Leave it open.
                    log.warning("conflict_key_unmatched", rule=rule.name, key=group["key"])
                    unmatched += 1
                    continue
                versions = len({r["content"] for r in rows})
                if versions > 1:
                    stored = _stored_ignored(ignored[id(group)], _named(shape, group))
                    execute(
                        conn,
                        "reclassify_conflict",
                        where | {"versions": versions, "copies": len(rows), "ignored": stored},
                    )
                    reclassified += 1
                    continue
                doomed += [r["row_ctid"] for r in rows[1:]]
                collapsed += len(rows) > 1
                execute(conn, "settle_conflict", where)
            if doomed:
                quarantined += conn.execute(
                    quarantine, {"ctids": doomed, "rule": rule.name, "table_name": rule.table}
                ).rowcount
    return Resolved(rule.name, collapsed, quarantined, reclassified, unmatched)


def _named(shape: _Shape, group: Row) -> tuple[str, ...]:
    """The columns the operator named for a group of the report, of those still there."""
    return tuple(c for c in _named_ignored(group["ignored"]) if c in shape.columns)


def _still_there(conn: psycopg.Connection[Row], recount: sql.Composed, group: Row) -> bool:
    """Whether rows of the group remain, compared column by column with its key's values."""
    row = conn.execute(
        recount, {"tenant_id": group["tenant_id"], "key": group["key_text"]}
    ).fetchone()
    return row is not None and row["copies"] > 0


def remaining_conflicts(conn: psycopg.Connection[Row], rule: UniqueRule) -> Counter[str]:
    """Groups that would make the index build fail now, by classification or `unclassified`."""
    parts = _parts(rule, _shape(conn, rule))
    report = fetch_one(conn, "table_exists", {"table": "payhook.uniqueness_conflicts"})
    with _pinned_transaction(conn):
        if report is None or not report["present"]:  # before the migration that creates it
            found = conn.execute(_template("find_conflicts", parts)).fetchall()
            return Counter(unclassified=len(found)) if found else Counter()
        rows = conn.execute(
            _template("live_conflicts", parts), {"rule": rule.name, "table_name": rule.table}
        ).fetchall()
    return Counter(r["classification"] or "unclassified" for r in rows)


def require_no_conflicts(conn: psycopg.Connection[Row], rule: UniqueRule) -> None:
    """Refuse (UnresolvedConflicts) while rows of an existing table break the rule."""
    present = fetch_one(conn, "table_exists", {"table": rule.table})
    if present is None or not present["present"]:
        return  # created by the same migration: nothing to conflict with
    try:
        counts = remaining_conflicts(conn, rule)
    except NotYetThere:
        return  # a column the same migration adds: no row can break the rule yet
    except RuleError as exc:
        raise MigrationError(str(exc)) from exc
    if not counts:
        return
    advice = {
        "unclassified": "not classified yet: run `payhook uniqueness check`",
        "redelivery": "the same event recorded twice: run `payhook uniqueness resolve`",
        "distinct": "legitimate rows the rule forbids: change the rule or the rows by hand",
    }
    detail = "; ".join(f"{counts[k]} {advice[k]}" for k in advice if counts[k])
    raise UnresolvedConflicts(
        f"{rule.name} on {rule.table}: {sum(counts.values())} groups of rows already share "
        f"a key ({detail}); report: payhook.uniqueness_conflicts"
    )


def _canon(key: dict[str, Any]) -> str:
    return json.dumps(key, sort_keys=True)
