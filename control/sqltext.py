"""Reading migration SQL: its statements, and the names they give.

payhook parses only what its migration runner and `payhook uniqueness` need:
where one statement ends and the next begins, and the identifiers of an index
or a table, which PostgreSQL folds to lower case unless they are quoted.
"""

from __future__ import annotations

import re
from typing import LiteralString

from payhook.errors import PayhookError

#: A Unicode-escaped identifier (`U&"d\0061t\+000061"`), perhaps with its own escape
#: character (`UESCAPE '!'`): read whole (never as the name `U`), its clause however written.
_UNICODE_NAME = r"""(?>[Uu]&"(?:[^"]|"")+"(?:\s*(?i:UESCAPE)\b\s*(?:'[^']*')?)?)"""
#: An identifier as SQL writes it: unquoted, in double quotes ("" for one), or Unicode-escaped.
IDENTIFIER = rf'(?:{_UNICODE_NAME}|"(?:[^"]|"")+"|(?![Uu]&")[^\W\d][\w$]*)'
#: A table or index name, perhaps schema-qualified.
QUALIFIED = rf"{IDENTIFIER}(?:\s*\.\s*{IDENTIFIER})?"

#: A word of SQL outside quotes: a keyword or an unquoted identifier.
_WORD = re.compile(r"\w[\w$]*")
#: The start of a dollar-quoted string: `$$` or `$tag$`.
_DOLLAR_QUOTE = re.compile(r"\$(?:[A-Za-z_][A-Za-z0-9_]*)?\$")
_PART = re.compile(IDENTIFIER)
#: A DO block: its first string (not its LANGUAGE's name) is code.
_DO = re.compile(r"^\s*DO\b", re.IGNORECASE)
#: A name PostgreSQL reads the same without quotes.
_PLAIN = re.compile(r"[a-z_][a-z0-9_$]*")
#: What PostgreSQL refuses as the escape character of a Unicode-escaped name.
_NO_UESCAPE = frozenset("0123456789abcdefABCDEF+'\" \t\n\r\f\v")
#: An escape of an E'' string, or the '' that quotes a quote in it too.
_E_ESCAPE = re.compile(r"(\\.|'')", re.DOTALL)
#: The escapes of an E'' string for a control character.
_CONTROL = {"b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


#: What PostgreSQL makes of an unquoted identifier: ASCII letters folded, others kept.
_FOLD = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")
#: Bytes of a name PostgreSQL keeps (NAMEDATALEN - 1).
MAX_NAME_BYTES = 63


class UnreadableName(PayhookError):
    """A Unicode-escaped name PostgreSQL would refuse: no name is guessed for it."""


def identifier(text: str) -> str:
    """The name an identifier written in SQL stands for: `Foo` is `foo`,
    `"Foo"` and `U&"F\\006fo"` are `Foo`; cut, as PostgreSQL cuts it, to 63
    bytes (once decoded). `UnreadableName` for a `U&` one PostgreSQL refuses."""
    text = text.strip()
    if text[:3] in ('U&"', 'u&"'):
        name = _unicode_name(text)
    elif text.startswith('"'):
        name = text[1:-1].replace('""', '"')
    else:
        name = text.translate(_FOLD)
    return _clip(name, MAX_NAME_BYTES)


def _unicode_name(text: str) -> str:
    """The name `U&"..." [UESCAPE 'c']` stands for, decoded as PostgreSQL
    decodes it: `cXXXX` or `c+XXXXXX` a code point (a UTF-16 surrogate pair
    one), `cc` the escape character itself."""
    end = _quote_end(text, 2, '"', escapes=False)
    mark = re.escape(_uescape(text, text[end:].strip()))

    def decoded(escape: re.Match[str]) -> str:
        code = escape[1]
        if code is None:
            raise UnreadableName(f"{text}: an escape is not one PostgreSQL reads")
        if len(code) == 1:  # the escape character, doubled
            return code
        if not 0 < int(code.lstrip("+"), 16) <= 0x10FFFF:
            raise UnreadableName(f"{text}: an escape names no Unicode character")
        return chr(int(code.lstrip("+"), 16))

    escapes = rf"{mark}({mark}|[0-9A-Fa-f]{{4}}|\+[0-9A-Fa-f]{{6}})?"
    name = re.sub(escapes, decoded, text[3 : end - 1].replace('""', '"'))
    try:
        return name.encode("utf-16-le", "surrogatepass").decode("utf-16-le")
    except UnicodeDecodeError:
        raise UnreadableName(f"{text}: a UTF-16 surrogate out of its pair") from None


def _uescape(text: str, clause: str) -> str:
    """The escape character of a Unicode-escaped name: `\\`, or its UESCAPE's
    (one ASCII character in a plain string, as PostgreSQL requires)."""
    if not clause:
        return "\\"
    given = re.fullmatch(r"UESCAPE\s*'([^'])'", clause, re.IGNORECASE | re.DOTALL)
    if given is None or not given[1].isascii() or given[1] in _NO_UESCAPE:
        raise UnreadableName(f"{text}: not an escape character PostgreSQL takes")
    return given[1]


def quoted(name: str) -> str:
    """A name as SQL writes it: quoted only where it must be."""
    return name if _PLAIN.fullmatch(name) else '"' + name.replace('"', '""') + '"'


def name_parts(text: str) -> tuple[str, ...]:
    """The names of a possibly qualified name written in SQL: `s."T"` is ("s", "T")."""
    return tuple(identifier(m.group()) for m in _PART.finditer(text))


def qualified(text: str) -> str:
    """A possibly qualified name written in SQL, written the one way PostgreSQL
    reads back as the same object (`to_regclass`): quoted only where needed."""
    return ".".join(quoted(part) for part in name_parts(text))


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


def split_code(statement: str) -> tuple[str, str]:
    """A statement's code, and the text of its strings, apart.

    The code is the statement with comments taken out and its strings
    emptied (`''`), but the one after `UESCAPE`: a Unicode-escaped name's
    escape character, part of the name. The body of a `DO` block, dollar-
    quoted or a plain string (`'...'`, `E'...'`, decoded), is code too, read
    the same way (a string in it is a string). The strings are everything
    else quoted, each on a line: text a migration only mentions, or runs
    through `EXECUTE` or a function, which no reader of SQL can tell apart.
    """
    do_block = _DO.match(statement) is not None
    code: list[str] = []
    strings: list[str] = []
    last = ""  # the code's last word or sign: a string after LANGUAGE names no body
    i, n = 0, len(statement)
    while i < n:
        char = statement[i]
        end = _comment_end(statement, i)
        if end is not None:
            code.append(" " if char == "/" else "")
            i = end
            continue
        word = _word_at(statement, i)
        if word is not None:
            code.append(word.group())
            if not _escaped(statement, word.end()):  # E of E'...' is no word
                last = word.group().lower()
            i = word.end()
            continue
        body, end = _quoted_at(statement, i)
        if end is None:
            code.append(char)
            last = last if char.isspace() else char
            i += 1
            continue
        if body is not None and do_block and last != "language":  # the block's body, once
            do_block = False
            if _escaped(statement, i):
                code.pop()  # its E
            body_code, body_strings = split_code(body)
            code.append(f" {body_code} ")
            strings.append(body_strings)
        elif char == '"' or (char == "'" and last == "uescape" and not _escaped(statement, i)):
            code.append(statement[i:end])
        else:
            code.append("''")
            strings.append(statement[i + 1 : end - 1] if char == "'" else body or "")
        last, i = char, end
    return "".join(code), "\n".join(strings)


def _quoted_at(text: str, i: int) -> tuple[str | None, int | None]:
    """What a string or quoted name starting at `i` encloses (None for a name,
    or a string whose escapes payhook does not decode), and the index just
    past it; no index if none starts there."""
    char = text[i]
    if char in "'\"":
        end = _quoted_end(text, i)
        return (_string_text(text, i, end) if char == "'" else None), end
    tag = _DOLLAR_QUOTE.match(text, i) if char == "$" and not _word_before(text, i) else None
    return _dollar_body(text, tag) if tag is not None else (None, None)


def _string_text(text: str, start: int, end: int) -> str | None:
    """The text a string (`'...'` or `E'...'`) stands for: `''` is `'`, and in
    an E'' one `\\c` is `c` (`\\n` a newline...). None for a `U&'...'` one, or
    one with octal, hex or Unicode escapes: it is read as a string only."""
    body = text[start + 1 : end - 1]
    if text[max(start - 2, 0) : start].lower() == "u&":
        return None
    if not _escaped(text, start):
        return body.replace("''", "'")
    parts = _E_ESCAPE.split(body)
    for k in range(1, len(parts), 2):
        escape = parts[k]
        if escape == "''":
            parts[k] = "'"
        elif escape[1] in "01234567xuU":
            return None
        else:
            parts[k] = _CONTROL.get(escape[1], escape[1])
    return "".join(parts)


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
        word = _word_at(text, i)
        if word is not None:
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
                _, end = _dollar_body(text, tag)
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


def _dollar_body(text: str, tag: re.Match[str]) -> tuple[str, int]:
    """The text a dollar quote (`$$` or `$tag$`, matched at `tag`) encloses,
    and the index just past its closing tag (the end of `text` if none)."""
    close = text.find(tag.group(), tag.end())
    if close < 0:
        return text[tag.end() :], len(text)
    return text[tag.end() : close], close + len(tag.group())


def _quoted_end(text: str, start: int) -> int:
    """Just past the string (`'...'`, `E'...'`) or quoted identifier starting at `start`."""
    return _quote_end(text, start, text[start], _escaped(text, start))


def _escaped(text: str, start: int) -> bool:
    """Whether a string with backslash escapes (`E'...'`) starts at `start`."""
    return (
        text.startswith("'", start)
        and text[start - 1 : start] in ("e", "E")
        and not _word_before(text, start - 1)
    )


def _word_at(text: str, i: int) -> re.Match[str] | None:
    """The word (keyword or unquoted identifier) that starts at `i`, if one does."""
    if (text[i].isalpha() or text[i] == "_") and not _word_before(text, i):
        return _WORD.match(text, i)
    return None


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
