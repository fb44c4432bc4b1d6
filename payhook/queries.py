"""Named SQL queries, loaded once from `sql/queries/*.sql`.

A file holds several queries, each under a header line `-- query_name --`,
followed by `--` description lines and then the SQL, with `%(param)s`
placeholders. Python code calls queries by name only.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import LiteralString

from payhook.errors import QueryFileError

_HEADER = re.compile(r"^--\s*([a-z_][a-z0-9_]*)\s*--\s*$")


def sql_root() -> Path:
    """The `sql/` folder: inside the installed package, else the source tree."""
    packaged = Path(__file__).parent / "_sql"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent / "sql"


def parse_queries(text: str, source: str = "<string>") -> dict[str, LiteralString]:
    """Split one file's text into `{name: sql}`."""
    queries: dict[str, list[str]] = {}
    current: list[str] | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        header = _HEADER.match(line)
        if header:
            name = header.group(1)
            if name in queries:
                raise QueryFileError(f"{source}:{number}: query {name!r} defined twice")
            current = queries[name] = []
        elif current is None:
            if line.strip() and not line.startswith("--"):
                raise QueryFileError(f"{source}:{number}: SQL before the first '-- name --' header")
        elif not (line.startswith("--") and not any(s.strip() for s in current)):
            current.append(line)
    result: dict[str, LiteralString] = {}
    for name, lines in queries.items():
        sql = "\n".join(lines).strip().rstrip(";").strip()
        if not sql:
            raise QueryFileError(f"{source}: query {name!r} is empty")
        result[name] = sql
    return result


def load_queries(folder: Path) -> dict[str, LiteralString]:
    """Every query of every `.sql` file in `folder`; names are unique across files."""
    result: dict[str, LiteralString] = {}
    for path in sorted(folder.glob("*.sql")):
        for name, sql in parse_queries(path.read_text(), source=path.name).items():
            if name in result:
                raise QueryFileError(f"{path.name}: query {name!r} is already defined")
            result[name] = sql
    return result


@functools.cache
def _all() -> dict[str, LiteralString]:
    return load_queries(sql_root() / "queries")


def query(name: str) -> LiteralString:
    """The SQL of the named query."""
    try:
        return _all()[name]
    except KeyError:
        raise QueryFileError(f"no query named {name!r}") from None


def all_queries() -> dict[str, LiteralString]:
    """All named queries (a copy)."""
    return dict(_all())
