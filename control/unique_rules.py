"""The unique rules a migration adds, read from its parse tree.

A rule is read from each CREATE UNIQUE INDEX and each ALTER TABLE ... ADD
[CONSTRAINT name] UNIQUE | PRIMARY KEY (columns), in the file or in the body
of a DO block: its name (PostgreSQL's own when the SQL gives none), table,
columns and scope. A rule that cannot be checked (on expressions, of another
form, written in a string, in SQL PostgreSQL cannot parse) is listed as such,
never passed over in silence: `control.uniqueness` checks the others against
the rows of a live table.
"""

from __future__ import annotations

import re
from contextlib import suppress
from dataclasses import dataclass

import structlog
from pglast import ast
from pglast.enums import AlterTableType, ConstrType, ObjectType
from pglast.parser import ParseError
from pglast.stream import RawStream

from control.sqltext import (
    Statement,
    UnreadableName,
    block_parts,
    identifier,
    qualified,
    relation_name,
    statements,
    strings_in,
    tokens,
)
from payhook.errors import PayhookError

log = structlog.get_logger(__name__)

#: Bytes of a name PostgreSQL keeps (NAMEDATALEN - 1).
MAX_NAME_BYTES = 63
_KEYS = (ConstrType.CONSTR_UNIQUE, ConstrType.CONSTR_PRIMARY)
#: A unique rule in text that is not SQL to parse: a string (run through EXECUTE
#: or a function, or only mentioned), or a statement PostgreSQL's grammar refuses.
_MENTION = re.compile(
    r"\bCREATE\s+UNIQUE\s+INDEX\b|\bALTER\s+TABLE\b[^;]*?\b(?:UNIQUE|PRIMARY\s+KEY)\b",
    re.IGNORECASE,
)


class RuleError(PayhookError):
    """The unique rule cannot be checked."""


@dataclass(frozen=True)
class UniqueRule:
    """A unique index or constraint a migration adds: its name, table, columns and scope."""

    name: str
    table: str
    columns: tuple[str, ...]
    #: The WHERE of a partial index: SQL from a migration file, as PostgreSQL prints it.
    predicate: str | None = None
    #: False for NULLS NOT DISTINCT: rows with nulls in the key conflict too.
    nulls_distinct: bool = True


@dataclass(frozen=True)
class UncheckableRule:
    """A unique rule a migration adds that cannot be checked: the index build is the check."""

    name: str
    reason: str


Rule = UniqueRule | UncheckableRule


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


def all_rules_in(text: str) -> list[Rule]:
    """The unique rules a migration's SQL adds, in order, those that cannot be checked too.

    Read: CREATE UNIQUE INDEX on plain columns (with a WHERE or NULLS NOT
    DISTINCT), and ALTER TABLE ... ADD [CONSTRAINT name] UNIQUE | PRIMARY KEY
    (columns), each action of the statement. A rule without a name gets the
    one PostgreSQL gives it. Any other form of rule an ALTER TABLE adds (a
    column's UNIQUE, say), a rule written in a string (EXECUTE, a function's
    body, a notice), and one in a statement PostgreSQL cannot parse, is listed
    as one that cannot be checked, never passed over in silence.
    """
    return [rule for statement in statements(text) for rule in _statement_rules(statement)]


def _statement_rules(statement: Statement) -> list[Rule]:
    node, text = statement.node, statement.text
    if node is None:
        return _unparsed(statement)
    if isinstance(node, ast.DoStmt):
        return _block_rules(node, text)
    rules: list[Rule] = []
    if isinstance(node, ast.IndexStmt) and node.unique:
        rules.append(_index_rule(node, text))
    elif isinstance(node, ast.AlterTableStmt) and node.objtype == ObjectType.OBJECT_TABLE:
        rules += _table_rules(node, text)
    return rules + _mentioned(strings_in(text))


def _block_rules(node: ast.DoStmt, text: str) -> list[Rule]:
    """The rules of the statements a DO block runs, and those in its strings."""
    try:
        code, strings = block_parts(node)
    except ParseError as exc:
        return _unparsed(Statement(text, None, str(exc)))
    rules = [rule for sql in code for s in statements(sql) for rule in _statement_rules(s)]
    return rules + _mentioned(strings)


def _index_rule(node: ast.IndexStmt, text: str) -> Rule:
    assert node.relation is not None  # the grammar requires ON table
    columns = _columns(node.indexParams)
    included = _columns(node.indexIncludingParams)
    if columns is None or included is None or node.accessMethod != "btree":
        return UncheckableRule(
            node.idxname or _flat(text),
            f"cannot read the unique rule of: {_flat(text)} (only a rule on plain columns "
            "can be checked; the index build is the check)",
        )
    name = node.idxname or default_name(str(node.relation.relname), columns + included, "idx")
    return UniqueRule(
        name=name,
        table=relation_name(node.relation),
        columns=columns,
        predicate=RawStream()(node.whereClause) if node.whereClause else None,
        nulls_distinct=not node.nulls_not_distinct,
    )


def _columns(elements: tuple[ast.IndexElem, ...] | None) -> tuple[str, ...] | None:
    """The columns of an index, if each is a plain one: None for an expression,
    or a collation or operator class (they change what is equal)."""
    if any(e.name is None or e.collation or e.opclass for e in elements or ()):
        return None
    return tuple(str(e.name) for e in elements or ())


def _table_rules(node: ast.AlterTableStmt, text: str) -> list[Rule]:
    assert node.relation is not None
    rules: list[Rule] = []
    unread = False
    for cmd in node.cmds or ():
        key = cmd.def_
        if cmd.subtype == AlterTableType.AT_AddConstraint and isinstance(key, ast.Constraint):
            if key.contype in _KEYS and key.indexname is None:  # USING INDEX: built before
                rules.append(_added_rule(key, node.relation, text))
        elif isinstance(key, ast.ColumnDef):
            unread |= any(c.contype in _KEYS for c in key.constraints or ())
    if unread:
        rules.append(
            UncheckableRule(
                relation_name(node.relation),
                f"cannot read every unique rule of: {_flat(text)} (only "
                "ADD [CONSTRAINT name] UNIQUE | PRIMARY KEY (columns) can be checked; "
                "the build is the check)",
            )
        )
    return rules


def _added_rule(key: ast.Constraint, relation: ast.RangeVar, text: str) -> Rule:
    """The rule of one ADD ... UNIQUE | PRIMARY KEY action."""
    if key.without_overlaps:  # compares ranges, not values
        return UncheckableRule(
            key.conname or relation_name(relation),
            f"only plain column lists can be checked, not WITHOUT OVERLAPS in: {_flat(text)}",
        )
    columns = tuple(str(k.sval) for k in key.keys or ())
    if key.conname:
        name = key.conname
    elif key.contype == ConstrType.CONSTR_PRIMARY:
        name = default_name(str(relation.relname), (), "pkey")
    else:
        included = tuple(str(k.sval) for k in key.including or ())
        name = default_name(str(relation.relname), columns + included, "key")
    return UniqueRule(
        name, relation_name(relation), columns, nulls_distinct=not key.nulls_not_distinct
    )


def _mentioned(strings: list[str]) -> list[Rule]:
    """A unique rule written in a string: listed, once, never checked."""
    text = "\n".join(strings)
    mention = _MENTION.search(text)
    if mention is None:
        return []
    written = _flat(text[mention.start() :])[:120]
    return [
        UncheckableRule(
            written,
            "a unique rule written in a string: if the migration runs it (EXECUTE, "
            "a function) it cannot be checked, and the build is the check",
        )
    ]


def _unparsed(statement: Statement) -> list[Rule]:
    """A statement PostgreSQL cannot parse that reads like a unique rule: it
    will refuse it too, and no rule is guessed from it."""
    try:  # UNIQUE or PRIMARY KEY as a keyword, not in a quoted name
        keyed = any(t.name in ("UNIQUE", "PRIMARY") for t in tokens(statement.text))
    except ParseError:
        keyed = False
    if not keyed and _MENTION.search(statement.text) is None:
        return []
    reason = f"PostgreSQL cannot parse: {_flat(statement.text)} ({statement.error}); "
    return [UncheckableRule(_label(statement.text), reason + "the build is the check")]


def _label(text: str) -> str:
    """What to list a statement PostgreSQL cannot parse under: the constraint
    named right before its first UNIQUE or PRIMARY KEY, else the table it
    alters, else the statement itself."""
    try:
        found = tokens(text)
    except ParseError:
        return _flat(text)
    kinds = [t.name for t in found]
    keyword = next((k for k, kind in enumerate(kinds) if kind in ("UNIQUE", "PRIMARY")), 0)
    named = [i + 1 for i in range(keyword) if kinds[i] == "CONSTRAINT"]
    if named and named[-1] < keyword:  # CONSTRAINT name UNIQUE
        with suppress(UnreadableName):
            return identifier(text[found[named[-1]].start : found[keyword - 1].end + 1])
    if kinds[:2] == ["ALTER", "TABLE"]:
        first = 2
        while first < len(kinds) and kinds[first] in ("IF_P", "EXISTS", "ONLY"):
            first += 1
        last = first  # a name ends at the next keyword: ADD, DROP...
        while last < len(kinds) and (found[last].kind == "NO_KEYWORD" or kinds[last] == "UESCAPE"):
            last += 1
        if first < last:
            with suppress(UnreadableName):
                return qualified(text[found[first].start : found[last - 1].end + 1])
    return _flat(text)


def default_name(relation: str, columns: tuple[str, ...], label: str) -> str:
    """The name PostgreSQL gives an index or constraint created without one
    (`label`: idx, key, pkey), if that name is free (else it adds a number):
    the table's name, the columns' (those of INCLUDE too, a repeated one
    numbered; none for a primary key) and the label, joined with `_`, the
    longer part cut first to fit 63 bytes."""
    names: list[str] = []
    for column in columns:  # as ChooseIndexColumnNames
        name, number = column, 0
        while name in names:
            number += 1
            name = _clip(column, MAX_NAME_BYTES - len(str(number))) + str(number)
        names.append(name)
    parts = [relation, "_".join(names)] if names else [relation]
    room = MAX_NAME_BYTES - len(label.encode()) - len(parts)
    sizes = [len(p.encode()) for p in parts]
    while sum(sizes) > room:  # as makeObjectName: a tie cuts the columns
        sizes[0 if sizes[0] > sizes[-1] else -1] -= 1
    return "_".join([*(_clip(p, n) for p, n in zip(parts, sizes, strict=True)), label])


def _clip(name: str, size: int) -> str:
    """The longest start of `name` that fits `size` bytes, whole characters only."""
    return name.encode()[:size].decode(errors="ignore")


def _flat(text: str) -> str:
    return " ".join(text.split())
