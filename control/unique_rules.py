"""The unique rules a migration adds, read from its SQL.

A rule is read from each CREATE UNIQUE INDEX and each ALTER TABLE ... ADD
[CONSTRAINT name] UNIQUE | PRIMARY KEY (columns): its name (PostgreSQL's own
when the SQL gives none), table, columns and scope, names read as PostgreSQL
reads them. A rule that cannot be checked (on expressions, of another form,
written in a string) is listed as such, never passed over in silence:
`control.uniqueness` checks the others against the rows of a live table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import structlog

from control.sqltext import (
    IDENTIFIER,
    QUALIFIED,
    UnreadableName,
    default_name,
    identifier,
    name_parts,
    qualified,
    split_code,
    split_statements,
)
from payhook.errors import PayhookError

log = structlog.get_logger(__name__)

_CREATE_UNIQUE = re.compile(r"\bCREATE\s+UNIQUE\s+INDEX\b", re.IGNORECASE)
#: An index name, absent only when the name is (PostgreSQL then makes one up).
_INDEX_NAME_PART = (
    r"CREATE\s+UNIQUE\s+INDEX\s+(?:CONCURRENTLY\s+)?(?:IF\s+NOT\s+EXISTS\s+)?"
    rf"(?:(?!ON\b)(?P<name>{IDENTIFIER})\s+)?ON\s+(?:ONLY\s+)?(?P<table>{QUALIFIED})"
)
_UNIQUE_INDEX = re.compile(
    rf"^\s*{_INDEX_NAME_PART}\s*(?:USING\s+btree\s*)?"
    r"\((?P<columns>[^()]*)\)(?P<rest>[^;]*)$",
    re.IGNORECASE | re.DOTALL,
)
_INDEX_NAME = re.compile(rf"\b{_INDEX_NAME_PART}", re.IGNORECASE)
#: An ALTER TABLE, inside a DO block too, up to the end of its actions (a `;`
#: in a quoted name, or a UESCAPE's, is not one).
_ALTER_TABLE = re.compile(
    rf"\bALTER\s+TABLE\s+(?:IF\s+EXISTS\s+)?(?:ONLY\s+)?(?P<table>{QUALIFIED})"
    r"""(?P<actions>(?:"(?:[^"]|"")*"|'[^']*'|[^;"'])*)""",
    re.IGNORECASE,
)
#: One action of an ALTER TABLE that adds a unique or primary key constraint.
_ADD_KEY = re.compile(
    rf"\bADD\s+(?:CONSTRAINT\s+(?P<name>{IDENTIFIER})\s+)?(?P<kind>UNIQUE|PRIMARY\s+KEY)\s*"
    r"(?P<nulls>NULLS\s+(?:NOT\s+)?DISTINCT\s*)?"
    r"(?:(?P<using>USING\s+INDEX)\b|\((?P<columns>[^()]*)\)"
    r"(?:\s*INCLUDE\s*\((?P<include>[^()]*)\))?)?",
    re.IGNORECASE,
)
#: The columns an index carries without comparing them; PostgreSQL names it after them too.
_INCLUDE = re.compile(r"\bINCLUDE\s*\((?P<include>[^()]*)\)", re.IGNORECASE)
#: A unique rule written in a string: run through EXECUTE or a function, or only mentioned.
_MENTION = re.compile(
    r"\bCREATE\s+UNIQUE\s+INDEX\b|\bALTER\s+TABLE\b[^;]*?\b(?:UNIQUE|PRIMARY\s+KEY)\b",
    re.IGNORECASE,
)
#: Wherever an ALTER TABLE says it (out of quoted names): a rule of some form, read or not.
_KEY_WORD = re.compile(r"\b(?:UNIQUE|PRIMARY\s+KEY)\b", re.IGNORECASE)
_QUOTED_NAME = re.compile(r'"(?:[^"]|"")*"')
_COLUMN = re.compile(
    rf"^({IDENTIFIER})(?:\s+(?:ASC|DESC))?(?:\s+NULLS\s+(?:FIRST|LAST))?$", re.IGNORECASE
)
#: The WHERE of a partial index: the first outside quoted names and strings.
_WHERE = re.compile(
    r"""^(?P<head>(?:"(?:[^"]|"")*"|'(?:[^']|'')*'|[^"'])*?)\bWHERE\b(?P<predicate>.*)$""",
    re.IGNORECASE | re.DOTALL,
)


class RuleError(PayhookError):
    """The unique rule cannot be checked."""


@dataclass(frozen=True)
class UniqueRule:
    """A unique index or constraint a migration adds: its name, table, columns and scope."""

    name: str
    table: str
    columns: tuple[str, ...]
    #: The WHERE of a partial index: SQL from a migration file.
    predicate: str | None = None
    #: False for NULLS NOT DISTINCT: rows with nulls in the key conflict too.
    nulls_distinct: bool = True


@dataclass(frozen=True)
class UncheckableRule:
    """A unique rule a migration adds that cannot be checked: the index build is the check."""

    name: str
    reason: str


def rules_in(text: str, *, strict: bool = True) -> list[UniqueRule]:
    """The unique rules a migration's SQL adds (CREATE UNIQUE INDEX, ADD ... UNIQUE (...)).

    A rule on expressions cannot be checked: `RuleError`, or with `strict=False`
    a warning, and the index build itself is the check.
    """
    rules: list[UniqueRule] = []
    for rule in all_rules_in(text):
        if isinstance(rule, UniqueRule):
            rules.append(rule)
        elif strict:
            raise RuleError(rule.reason)
        else:
            log.warning("unique_rule_unchecked", rule=rule.name, reason=rule.reason)
    return rules


def all_rules_in(text: str) -> list[UniqueRule | UncheckableRule]:
    """The unique rules a migration's SQL adds, in order, those that cannot be checked too.

    Read: CREATE UNIQUE INDEX on plain columns (with a WHERE or NULLS NOT
    DISTINCT), and ALTER TABLE ... ADD [CONSTRAINT name] UNIQUE | PRIMARY KEY
    (columns), each action of the statement. A rule without a name gets the
    one PostgreSQL gives it. Any other form of rule an ALTER TABLE adds (a
    column's UNIQUE, say), and a rule written in a string (EXECUTE, a
    function's body, a notice), is listed as one that cannot be checked,
    never passed over in silence.
    """
    rules: list[UniqueRule | UncheckableRule] = []
    for statement in split_statements(text):
        try:
            rules += _statement_rules(statement)
        except UnreadableName as exc:  # PostgreSQL refuses the whole statement
            rules.append(
                UncheckableRule(" ".join(statement.split()), f"{exc}; the build is the check")
            )
    return rules


def _statement_rules(statement: str) -> list[UniqueRule | UncheckableRule]:
    """The rules of one statement (`UnreadableName`: one of its names PostgreSQL refuses)."""
    rules: list[UniqueRule | UncheckableRule] = []
    # Comments and strings apart: a rule in a string is at most a warning.
    code, strings = split_code(statement)
    if _CREATE_UNIQUE.search(code):
        try:
            rules.append(_index_rule(statement))
        except RuleError as exc:
            named = _INDEX_NAME.search(code)
            name = (
                identifier(named["name"])
                if named and named["name"]
                else " ".join(statement.split())
            )
            rules.append(UncheckableRule(name, str(exc)))
    for alter in _ALTER_TABLE.finditer(code):
        rules += _table_rules(alter, statement)
    mention = _MENTION.search(strings)
    if mention is not None:
        written = " ".join(strings[mention.start() :].split())[:120]
        rules.append(
            UncheckableRule(
                written,
                "a unique rule written in a string: if the migration runs it (EXECUTE, "
                "a function) it cannot be checked, and the build is the check",
            )
        )
    return rules


def _table_rules(alter: re.Match[str], statement: str) -> list[UniqueRule | UncheckableRule]:
    table = qualified(alter["table"])
    rules: list[UniqueRule | UncheckableRule] = []
    adds = list(_ADD_KEY.finditer(alter["actions"]))
    for add in adds:
        if add["using"]:
            continue  # an index built before: its build was the check
        try:
            rules.append(_added_rule(add, table, statement))
        except RuleError as exc:
            name = identifier(add["name"]) if add["name"] else table
            rules.append(UncheckableRule(name, str(exc)))
    if len(_KEY_WORD.findall(_QUOTED_NAME.sub('""', alter["actions"]))) > len(adds):
        rules.append(
            UncheckableRule(
                table,
                f"cannot read every unique rule of: {' '.join(statement.split())} (only "
                "ADD [CONSTRAINT name] UNIQUE | PRIMARY KEY (columns) can be checked; "
                "the build is the check)",
            )
        )
    return rules


def _added_rule(add: re.Match[str], table: str, statement: str) -> UniqueRule:
    """The rule of one ADD ... UNIQUE | PRIMARY KEY action (`RuleError`: unreadable)."""
    if add["columns"] is None:
        raise RuleError(
            f"cannot read the columns of the rule in: {' '.join(statement.split())} "
            "(the build is the check)"
        )
    columns = _columns(add["columns"], statement)
    if add["name"]:
        name = identifier(add["name"])
    elif add["kind"].upper().startswith("PRIMARY"):
        name = default_name(name_parts(table)[-1], (), "pkey")
    else:
        included = _included(add["include"], statement)
        name = default_name(name_parts(table)[-1], columns + included, "key")
    return UniqueRule(
        name=name,
        table=table,
        columns=columns,
        nulls_distinct=re.search(r"\bNOT\b", add["nulls"] or "", re.IGNORECASE) is None,
    )


def _index_rule(statement: str) -> UniqueRule:
    match = _UNIQUE_INDEX.match(statement)
    if match is None:
        raise RuleError(
            f"cannot read the unique rule of: {' '.join(statement.split())} (only a rule "
            "on plain columns can be checked; the index build is the check)"
        )
    rest = match["rest"]
    where = _WHERE.match(rest)
    head = where["head"] if where else rest
    included = _INCLUDE.search(head)
    table = qualified(match["table"])
    columns = _columns(match["columns"], statement)
    return UniqueRule(
        name=identifier(match["name"])
        if match["name"]
        else default_name(
            name_parts(table)[-1],
            columns + _included(included and included["include"], statement),
            "idx",
        ),
        table=table,
        columns=columns,
        predicate=where["predicate"].strip() if where else None,
        nulls_distinct=re.search(
            r"\bNULLS\s+NOT\s+DISTINCT\b", _QUOTED_NAME.sub('""', head), re.IGNORECASE
        )
        is None,
    )


def _included(text: str | None, statement: str) -> tuple[str, ...]:
    """The columns of an INCLUDE, for the name PostgreSQL gives the rule."""
    return _columns(text, statement) if text else ()


def _columns(text: str, statement: str) -> tuple[str, ...]:
    columns = []
    for part in text.split(","):
        match = _COLUMN.match(part.strip())
        if match is None:
            raise RuleError(
                f"only plain column lists can be checked, not {part.strip()!r} in: "
                f"{' '.join(statement.split())}"
            )
        columns.append(identifier(match.group(1)))
    return tuple(columns)
