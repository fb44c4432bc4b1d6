"""What became of an event or a job: every name payhook records, in one place.

Python takes its lists from here. The database keeps copies it cannot take
from Python: the CHECK constraints that migrations wrote, and the rules in
`payhook.decide_v1` and `payhook.apply_event_v2` (which outcomes record an
exception). `check_outcomes` compares the constraints with these lists when
a process starts, so that a schema and a release that disagree stop at once
rather than at the first event one of them refuses.

A job's outcome is a receipt outcome; `duplicate` or `digest_conflict` when
its event already had a receipt; or one of `REFUSED_OUTCOMES`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import psycopg

from payhook.db import Row, fetch_all
from payhook.errors import OutcomesMismatch

#: Receipt outcomes that record a `payment_exceptions` row of that kind: an
#: authentic event that could not be applied, kept for an operator.
EXCEPTION_KINDS: Mapping[str, str] = MappingProxyType(
    {
        "amount_mismatch": "the amount is not the order's, or a refund would exceed it",
        "currency_mismatch": "the currency is not the order's",
        "identity_mismatch": "the identifiers disagree with the order's, or name several orders",
        "unmapped_order": "no order of the tenant carries either identifier",
        "invalid_transition": "the order's state does not allow it; replayed when the order moves",
        "second_payment": "another gateway payment for an order already paid",
        "malformed": "an authentic body payhook cannot read or store",
        "beyond_horizon": "dated before the receipt retention horizon, so never applied",
    }
)

#: Receipt outcomes that change nothing and record no exception.
QUIET_OUTCOMES: Mapping[str, str] = MappingProxyType(
    {
        "already_applied": "the order is already where the event would move it",
        "superseded": "a failed payment attempt delivered after the payment that succeeded",
        "ignored": "an event type payhook does not act on",
    }
)

#: Every outcome a receipt (`payment_event_receipts.outcome`) may hold.
RECEIPT_OUTCOMES: Mapping[str, str] = MappingProxyType(
    {
        "processing": "claimed; the column's default until its transaction records the outcome",
        "applied": "the order moved one state forward; its side effect is in the outbox",
        **QUIET_OUTCOMES,
        **EXCEPTION_KINDS,
    }
)

#: Kinds of `security_anomalies`: safe metadata of what payhook could not trust.
ANOMALY_KINDS: Mapping[str, str] = MappingProxyType(
    {
        "digest_conflict": "an event id delivered again with other content",
        "signature_invalid": "a job that no secret of its endpoint verifies",
        "unknown_endpoint": "a job naming an endpoint that does not exist",
        "malformed_job": "a job whose envelope cannot be read",
    }
)

#: Outcomes of a job the consumer could not trust or read: each is recorded
#: as a security anomaly of that kind, applies nothing, and fails the job
#: into the dead-letter queue without retries.
REFUSED_OUTCOMES = frozenset({"signature_invalid", "unknown_endpoint", "malformed_job"})

#: Outcomes after which an event is accounted for: a replay that reaches one
#: closes the event's exception.
RESOLVING_OUTCOMES = frozenset({"applied", "already_applied", "superseded"})


@dataclass(frozen=True)
class ListedColumn:
    """A column whose CHECK constraint lists the names it may hold."""

    table: str
    column: str
    #: Where the names live in Python, as a message names them.
    source: str
    names: frozenset[str]
    #: Whether the schema must have such a constraint; if not, one it has is checked.
    required: bool = True

    @property
    def where(self) -> str:
        return f"payhook.{self.table}.{self.column}"


#: The columns `check_outcomes` compares. `payment_exceptions.kind` has no
#: CHECK in the schema today (its kinds are receipt outcomes, which have one):
#: one added later is held to `EXCEPTION_KINDS`.
LISTED_COLUMNS = (
    ListedColumn(
        "payment_event_receipts",
        "outcome",
        "payhook.outcomes.RECEIPT_OUTCOMES",
        frozenset(RECEIPT_OUTCOMES),
    ),
    ListedColumn(
        "security_anomalies", "kind", "payhook.outcomes.ANOMALY_KINDS", frozenset(ANOMALY_KINDS)
    ),
    ListedColumn(
        "payment_exceptions",
        "kind",
        "payhook.outcomes.EXCEPTION_KINDS",
        frozenset(EXCEPTION_KINDS),
        required=False,
    ),
)

_LITERAL = r"'(?:[^']|'')*'::text"
#: `col IN ('a', 'b')` as PostgreSQL prints it back; a list of one prints as `col = 'a'`.
_LIST_CHECK = re.compile(
    rf"CHECK \(\(\w+ = (?:ANY \(ARRAY\[(?P<items>{_LITERAL}(?:, {_LITERAL})*)\]\)"
    rf"|(?P<one>{_LITERAL}))\)\)(?: NOT VALID)?"
)
_ITEM = re.compile(r"'((?:[^']|'')*)'::text")


def check_outcomes(
    conn: psycopg.Connection[Row], columns: tuple[ListedColumn, ...] = LISTED_COLUMNS
) -> None:
    """Raise `OutcomesMismatch`, naming both lists, unless the CHECK
    constraint of each column lists exactly the names Python has for it.

    Reads only the catalog, which any role that may connect can read.
    """
    tables = sorted({listed.table for listed in columns})
    rows = fetch_all(conn, "list_checks", {"tables": tables})
    problems: list[str] = []
    for listed in columns:
        found = [
            r for r in rows if (r["table_name"], r["column_name"]) == (listed.table, listed.column)
        ]
        if not found and listed.required:
            problems.append(
                f"{listed.where}: no CHECK constraint lists its names, "
                f"{listed.source} lists {_show(listed.names)}: run `payhook migrate`"
            )
        problems.extend(
            problem
            for row in found
            if (problem := _compare(listed, row["constraint_name"], row["definition"]))
        )
    if problems:
        raise OutcomesMismatch("; ".join(problems))


def listed_names(definition: str) -> frozenset[str] | None:
    """The names a CHECK constraint allows in its column, from its definition
    as PostgreSQL prints it; None when it is not a plain list of names."""
    match = _LIST_CHECK.fullmatch(definition)
    if match is None:
        return None
    text = match.group("items") or match.group("one")
    return frozenset(item.replace("''", "'") for item in _ITEM.findall(text))


def _compare(listed: ListedColumn, constraint: str, definition: str) -> str | None:
    """What differs between the constraint and Python's list; None if nothing."""
    allowed = listed_names(definition)
    if allowed is None:
        return f"{listed.where}: its CHECK {constraint} is not a list of names: {definition}"
    if allowed == listed.names:
        return None
    differences = ", ".join(
        f"only {side} has {_show(names)}"
        for side, names in (
            ("the database", allowed - listed.names),
            ("payhook", listed.names - allowed),
        )
        if names
    )
    return (
        f"{listed.where}: the database's CHECK {constraint} lists {_show(allowed)}, "
        f"{listed.source} lists {_show(listed.names)}: {differences}"
    )


def _show(names: frozenset[str]) -> str:
    return "[" + ", ".join(sorted(names)) + "]"
