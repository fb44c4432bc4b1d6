"""Reading migration SQL with PostgreSQL's own parser (pglast).

payhook reads only what its migration runner and `payhook uniqueness` need:
the statements of a file and their parse trees, the strings written in them,
the statements a DO block runs, and names as PostgreSQL reads them (folded
unless quoted, `U&"..."` decoded, cut to 63 bytes).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, LiteralString

from pglast import ast, parse_plpgsql
from pglast.parser import ParseError, Token, parse_sql, scan

from payhook.errors import PayhookError

#: A name PostgreSQL reads the same without quotes.
_PLAIN = re.compile(r"[a-z_][a-z0-9_$]*")
#: The lexer's tokens that are comments, not SQL.
_COMMENTS = frozenset({"SQL_COMMENT", "C_COMMENT"})
#: The lexer's tokens that are string constants.
_STRINGS = frozenset({"SCONST", "USCONST"})
#: The parse mode of a PL/pgSQL expression that is a whole SQL statement.
_RAW_PARSE_DEFAULT = 0


class UnreadableName(PayhookError):
    """Not one name PostgreSQL reads: no name is guessed for it."""


@dataclass(frozen=True)
class Statement:
    """One statement as written, its comments left out, and its parse tree:
    None where PostgreSQL's grammar refuses it, and `error` says why."""

    text: LiteralString
    node: ast.Node | None
    error: str = ""


def statements(text: str) -> list[Statement]:
    """The statements of a migration, as PostgreSQL splits them (a `;` in a
    string, a body or a `BEGIN ATOMIC` block ends none). A statement the
    grammar refuses is one without a tree, from the `;` before the error to
    the one after it; those around it are parsed on their own."""
    try:
        parsed = parse_sql(text)
    except ParseError as error:
        return _around(text, error)
    found = []
    for raw in parsed:
        start = raw.stmt_location or 0
        end = start + raw.stmt_len if raw.stmt_len else len(text)  # 0: up to the end
        found.append(Statement(_code(text[start:end]), raw.stmt))
    return found


def split_statements(text: str) -> list[LiteralString]:
    """The statements of a migration, without comments or their final `;`."""
    return [statement.text for statement in statements(text)]


def _around(text: str, error: ParseError) -> list[Statement]:
    """The statements of a text the grammar refuses at `error`'s index."""
    at = error.args[-1]
    try:
        ends = [t.start for t in scan(text) if t.name == "ASCII_59"]
    except ParseError:  # not even tokens: an unterminated string, say
        ends = None
    if not isinstance(at, int) or ends is None:
        return [Statement(_code(text), None, str(error))] if text.strip() else []
    start = max((e + 1 for e in ends if e < at), default=0)
    end = min((e for e in ends if e >= at), default=len(text))
    broken = Statement(_code(text[start:end]), None, str(error))
    return [*statements(text[:start]), broken, *statements(text[end + 1 :])]


def _code(text: str) -> str:
    """The text without its comments (a `/* */` one stands for a space)."""
    try:
        comments = [t for t in scan(text) if t.name in _COMMENTS]
    except ParseError:
        return text.strip()
    for token in reversed(comments):
        gap = " " if token.name == "C_COMMENT" else ""
        text = text[: token.start] + gap + text[token.end + 1 :]
    return text.strip()


def tokens(text: str) -> list[Token]:
    """The tokens PostgreSQL's lexer reads in a piece of SQL, comments left out
    (`ParseError`: one it cannot read, an unterminated string say)."""
    return [t for t in scan(text) if t.name not in _COMMENTS]


def strings_in(text: str) -> list[str]:
    """The string constants written in a piece of SQL, as PostgreSQL reads them."""
    try:
        found = tokens(text)
    except ParseError:
        return [text]
    return [_string(text[t.start : t.end + 1]) for t in found if t.name in _STRINGS]


def _string(written: str) -> str:
    try:
        (raw,) = parse_sql(f"SELECT {written}")
    except ParseError:
        return written  # an escape it refuses, or a U&'' without its UESCAPE
    match raw.stmt:
        case ast.SelectStmt(targetList=(ast.ResTarget(val=ast.A_Const(val=ast.String() as s)),)):
            return str(s.sval)
    return written


def block_parts(node: ast.DoStmt) -> tuple[list[str], list[str]]:
    """What a DO block runs: the SQL statements of its body, and the strings
    it holds (its messages and the string constants of its expressions).

    A body in another language than PL/pgSQL is a string. `ParseError`: a
    body PostgreSQL would refuse."""
    options = {d.defname: d.arg.sval for d in node.args or () if isinstance(d.arg, ast.String)}
    body = str(options.get("as", ""))
    if options.get("language", "plpgsql") != "plpgsql":
        return [], [body]
    code: list[str] = []
    strings: list[str] = []
    literal = "'" + body.replace("'", "''") + "'"  # as standard_conforming_strings reads it
    function = f"CREATE FUNCTION do_block() RETURNS void LANGUAGE plpgsql AS {literal}"
    _walk(parse_plpgsql(function), code, strings)
    return code, strings


def _walk(tree: Any, code: list[str], strings: list[str]) -> None:
    """Collect from a PL/pgSQL tree (plain lists and dicts) its statements and strings."""
    if isinstance(tree, list):
        for item in tree:
            _walk(item, code, strings)
    elif isinstance(tree, dict):
        expr = tree.get("PLpgSQL_expr")
        if expr is not None:
            query = str(expr["query"])
            if expr.get("parseMode", _RAW_PARSE_DEFAULT) == _RAW_PARSE_DEFAULT:
                code.append(query)
            else:
                strings.extend(strings_in(query))
            return
        if isinstance(tree.get("message"), str):  # RAISE's format
            strings.append(tree["message"])
        for value in tree.values():
            _walk(value, code, strings)


def name_parts(text: str) -> tuple[str, ...]:
    """The names of a possibly qualified name written in SQL: `s."T"` is ("s", "T").

    PostgreSQL's lexer finds them and its parser decodes each. `UnreadableName`
    for anything else, or a `U&` one PostgreSQL refuses."""
    try:
        found = tokens(text)
    except ParseError as exc:
        raise UnreadableName(f"{text}: {exc}") from None
    parts: list[list[Token]] = [[]]
    for token in found:
        if token.name == "ASCII_46":
            parts.append([])
        else:
            parts[-1].append(token)
    return tuple(_name(text, part) for part in parts)


def _name(text: str, tokens: list[Token]) -> str:
    """One name: a word (a keyword too), a quoted one, or `U&"..." [UESCAPE 'c']`."""
    word = len(tokens) == 1 and (
        tokens[0].name in ("IDENT", "UIDENT") or tokens[0].kind != "NO_KEYWORD"
    )
    escaped = [t.name for t in tokens] == ["UIDENT", "UESCAPE", "SCONST"]
    if not (word or escaped):
        raise UnreadableName(f"{text}: not a name as SQL writes it")
    try:  # any keyword may stand after AS, so this reads every name
        (raw,) = parse_sql(f"SELECT 1 AS {text[tokens[0].start : tokens[-1].end + 1]}")
    except ParseError as exc:
        raise UnreadableName(f"{text}: {exc}") from None
    match raw.stmt:
        case ast.SelectStmt(targetList=(ast.ResTarget(name=str(name)),)):
            return name
    raise UnreadableName(f"{text}: not a name as SQL writes it")


def identifier(text: str) -> str:
    """The name an identifier written in SQL stands for: `Foo` is `foo`,
    `"Foo"` and `U&"F\\006fo"` are `Foo`; cut, as PostgreSQL cuts it, to 63
    bytes. `UnreadableName` for anything but one name."""
    parts = name_parts(text)
    if len(parts) != 1:
        raise UnreadableName(f"{text}: not one name")
    return parts[0]


def quoted(name: str) -> str:
    """A name as SQL writes it: quoted only where it must be."""
    return name if _PLAIN.fullmatch(name) else '"' + name.replace('"', '""') + '"'


def qualified(text: str) -> str:
    """A possibly qualified name written in SQL, written the one way PostgreSQL
    reads back as the same object (`to_regclass`): quoted only where needed."""
    return ".".join(quoted(part) for part in name_parts(text))


def relation_name(relation: ast.RangeVar) -> str:
    """A table a parse tree names, written as `qualified` writes it."""
    parts = (relation.catalogname, relation.schemaname, relation.relname)
    return ".".join(quoted(part) for part in parts if part)
