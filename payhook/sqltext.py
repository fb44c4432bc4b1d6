"""Reading migration SQL: its statements, and the names they give.

payhook parses only what its migration runner and `payhook uniqueness` need:
where one statement ends and the next begins, and the identifiers of an index
or a table, which PostgreSQL folds to lower case unless they are quoted.
"""

from __future__ import annotations

import re
from typing import LiteralString

#: An identifier as SQL writes it: unquoted, or in double quotes ("" for one).
IDENTIFIER = r'(?:"(?:[^"]|"")+"|[^\W\d][\w$]*)'
#: A table or index name, perhaps schema-qualified.
QUALIFIED = rf"{IDENTIFIER}(?:\s*\.\s*{IDENTIFIER})?"

#: A word of SQL outside quotes: a keyword or an unquoted identifier.
_WORD = re.compile(r"\w[\w$]*")
#: The start of a dollar-quoted string: `$$` or `$tag$`.
_DOLLAR_QUOTE = re.compile(r"\$(?:[A-Za-z_][A-Za-z0-9_]*)?\$")
_PART = re.compile(IDENTIFIER)
#: A name PostgreSQL reads the same without quotes.
_PLAIN = re.compile(r"^[a-z_][a-z0-9_$]*$")


#: What PostgreSQL makes of an unquoted identifier: ASCII letters folded, others kept.
_FOLD = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")
#: Bytes of a name PostgreSQL keeps (NAMEDATALEN - 1).
MAX_NAME_BYTES = 63


def identifier(text: str) -> str:
    """The name an identifier written in SQL stands for: `Foo` is `foo`, `"Foo"` is `Foo`."""
    text = text.strip()
    if text.startswith('"'):
        return text[1:-1].replace('""', '"')
    return text.translate(_FOLD)


def default_name(relation: str, columns: tuple[str, ...], label: str) -> str:
    """The name PostgreSQL gives an index or constraint created without one
    (`label`: idx, key, pkey), if that name is free (else it adds a number):
    the table's name, the columns' (none for a primary key) and the label,
    joined with `_`, the longer part cut first to fit 63 bytes."""
    parts = [relation, "_".join(columns)] if columns else [relation]
    room = MAX_NAME_BYTES - len(label.encode()) - len(parts)
    sizes = [len(p.encode()) for p in parts]
    while sum(sizes) > room:  # as PostgreSQL's makeObjectName: a tie cuts the columns
        sizes[0 if sizes[0] > sizes[-1] else -1] -= 1
    cut = [p.encode()[:n].decode(errors="ignore") for p, n in zip(parts, sizes, strict=True)]
    return "_".join([*cut, label])


def code_only(statement: str) -> str:
    """A statement with what is not code taken out, bodies of `DO` blocks and
    functions read as code: comments removed, string literals emptied (`''`),
    dollar quotes dropped. What is left may be searched for statements a
    migration runs, never for one it only mentions."""
    out: list[str] = []
    i, n = 0, len(statement)
    while i < n:
        char = statement[i]
        end = _comment_end(statement, i)
        if end is not None:
            out.append(" " if char == "/" else "")
            i = end
            continue
        if char in "'\"":
            end = _quoted_end(statement, i)
            out.append("''" if char == "'" else statement[i:end])
            i = end
            continue
        if char == "$" and not _word_before(statement, i):
            tag = _DOLLAR_QUOTE.match(statement, i)
            if tag is not None:
                out.append(" ")
                i = tag.end()
                continue
        out.append(char)
        i += 1
    return "".join(out)


def name_parts(text: str) -> tuple[str, ...]:
    """The names of a possibly qualified name written in SQL: `s."T"` is ("s", "T")."""
    return tuple(identifier(m.group()) for m in _PART.finditer(text))


def qualified(text: str) -> str:
    """A possibly qualified name written in SQL, written the one way PostgreSQL
    reads back as the same object (`to_regclass`): quoted only where needed."""
    return ".".join(
        part if _PLAIN.match(part) else '"' + part.replace('"', '""') + '"'
        for part in name_parts(text)
    )


def split_statements(text: str) -> list[LiteralString]:
    """The SQL statements of a migration, without comments or their final `;`.

    Splits, as psql does, on `;` outside quoted strings (`'...'`, `E'...'`),
    quoted identifiers, dollar-quoted bodies, comments (`--`, nested `/* */`),
    parentheses (`CREATE RULE ... DO ALSO (a; b)`) and `BEGIN ... END` blocks
    (a `BEGIN ATOMIC` function body, with its `CASE ... END`s): a `BEGIN` or
    `CASE` that is not the statement's first word opens a block, `END` closes
    one. Comments are left out of the statements.
    """
    statements: list[str] = []
    current: list[str] = []
    parens = blocks = words = 0
    i, n = 0, len(text)
    while i < n:
        char = text[i]
        word = _WORD.match(text, i) if char.isalpha() or char == "_" else None
        if word is not None and not _word_before(text, i):
            words += 1
            keyword = word.group().lower()
            if keyword in ("begin", "case") and words > 1:
                blocks += 1
            elif keyword == "end" and blocks:
                blocks -= 1
            current.append(word.group())
            i = word.end()
            continue
        end = _comment_end(text, i)
        if end is not None:
            current.append(" " if char == "/" else "")
            i = end
            continue
        if char in "'\"":
            end = _quoted_end(text, i)
            current.append(text[i:end])
            i = end
            continue
        if char == "$" and not _word_before(text, i):
            tag = _DOLLAR_QUOTE.match(text, i)
            if tag is not None:
                close = text.find(tag.group(), tag.end())
                end = n if close < 0 else close + len(tag.group())
                current.append(text[i:end])
                i = end
                continue
        if char == "(":
            parens += 1
        elif char == ")":
            parens = max(parens - 1, 0)
        if char == ";" and not parens and not blocks:
            statements.append("".join(current))
            current = []
            words = 0
        else:
            current.append(char)
        i += 1
    statements.append("".join(current))
    return [s.strip() for s in statements if s.strip()]


def _comment_end(text: str, i: int) -> int | None:
    """Just past the comment that starts at `i` (`--` up to the end of its
    line, or a `/* */` with those nested in it); None if none starts there."""
    if text.startswith("--", i):
        end = text.find("\n", i)
        return len(text) if end < 0 else end
    if not text.startswith("/*", i):
        return None
    depth, i = 1, i + 2
    while i < len(text) and depth:
        if text.startswith("/*", i):
            depth, i = depth + 1, i + 2
        elif text.startswith("*/", i):
            depth, i = depth - 1, i + 2
        else:
            i += 1
    return i


def _quoted_end(text: str, start: int) -> int:
    """Just past the string (`'...'`, `E'...'`) or quoted identifier starting at `start`."""
    quote = text[start]
    escapes = (
        quote == "'" and start > 0 and text[start - 1] in "eE" and not _word_before(text, start - 1)
    )
    return _quote_end(text, start, quote, escapes)


def _word_before(text: str, i: int) -> bool:
    """Whether the character before `i` continues an identifier or a number."""
    return i > 0 and (text[i - 1].isalnum() or text[i - 1] in "_$")


def _quote_end(text: str, start: int, quote: str, escapes: bool) -> int:
    """The index just past the string or identifier quoted at `start`."""
    i = start + 1
    while i < len(text):
        if escapes and text[i] == "\\":
            i += 2
            continue
        if text[i] == quote:
            if text.startswith(quote * 2, i):
                i += 2
                continue
            return i + 1
        i += 1
    return len(text)
