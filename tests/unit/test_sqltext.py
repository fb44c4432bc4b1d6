"""How a no-transaction migration is cut into statements, and its names and unique rules read."""

from __future__ import annotations

import pytest
from pglast import ast

from control.sqltext import (
    UnreadableName,
    block_parts,
    identifier,
    qualified,
    quoted,
    split_statements,
    statements,
)
from control.unique_rules import UncheckableRule, UniqueRule, all_rules_in, rules_in


def test_a_comment_after_the_semicolon_does_not_glue_the_next_statement_on() -> None:
    text = """-- payhook: no-transaction
CREATE INDEX CONCURRENTLY IF NOT EXISTS a ON payhook.t (x); -- for the alert
CREATE INDEX CONCURRENTLY IF NOT EXISTS b ON payhook.t (y); /* and the report */
CREATE INDEX CONCURRENTLY IF NOT EXISTS c ON payhook.t (z)
"""
    assert split_statements(text) == [
        "CREATE INDEX CONCURRENTLY IF NOT EXISTS a ON payhook.t (x)",
        "CREATE INDEX CONCURRENTLY IF NOT EXISTS b ON payhook.t (y)",
        "CREATE INDEX CONCURRENTLY IF NOT EXISTS c ON payhook.t (z)",
    ]


def test_semicolons_inside_strings_identifiers_bodies_and_comments_do_not_split() -> None:
    text = """INSERT INTO t VALUES ('a;
b', E'it\\'s; fine', 'it''s;');
SELECT 1 AS "odd;name" /* one; /* nested; */ still comment; */;
DO $body$ BEGIN PERFORM 1; PERFORM 'x;'; END $body$;
DO $$ BEGIN PERFORM 2; END $$;
SELECT 2 -- a comment; not a statement
;
"""
    assert split_statements(text) == [
        "INSERT INTO t VALUES ('a;\nb', E'it\\'s; fine', 'it''s;')",
        'SELECT 1 AS "odd;name"',
        "DO $body$ BEGIN PERFORM 1; PERFORM 'x;'; END $body$",
        "DO $$ BEGIN PERFORM 2; END $$",
        "SELECT 2",
    ]


def test_a_statement_that_begins_after_a_comment_is_read_whole() -> None:
    text = "-- first\n/* block */ CREATE INDEX CONCURRENTLY a ON t (x);\n-- only a comment\n;;"
    assert split_statements(text) == ["CREATE INDEX CONCURRENTLY a ON t (x)"]


def test_a_unique_rule_after_a_trailing_comment_is_still_read() -> None:
    """Its pre-check would otherwise be skipped as an unreadable rule."""
    text = """-- payhook: no-transaction
CREATE INDEX CONCURRENTLY IF NOT EXISTS a ON payhook.t (x); -- for the alert
CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS t_key /* the rule */
    ON payhook.t (tenant_id, x);
"""
    assert rules_in(text) == [UniqueRule("t_key", "payhook.t", ("tenant_id", "x"))]


def test_semicolons_inside_parentheses_do_not_split() -> None:
    text = """CREATE RULE log_insert AS ON INSERT TO t
    DO ALSO (INSERT INTO a VALUES (new.x); INSERT INTO b VALUES ((new.y)));
SELECT 1;
"""
    assert split_statements(text) == [
        "CREATE RULE log_insert AS ON INSERT TO t\n"
        "    DO ALSO (INSERT INTO a VALUES (new.x); INSERT INTO b VALUES ((new.y)))",
        "SELECT 1",
    ]


def test_a_begin_atomic_body_is_one_statement_as_psql_reads_it() -> None:
    text = """CREATE FUNCTION payhook.sign(x int) RETURNS int LANGUAGE sql
BEGIN ATOMIC
    SELECT 1;
    SELECT CASE WHEN x > 0 THEN 1 ELSE -1 END;
END;
CREATE INDEX CONCURRENTLY IF NOT EXISTS a ON payhook.t (x);
"""
    assert split_statements(text) == [
        "CREATE FUNCTION payhook.sign(x int) RETURNS int LANGUAGE sql\nBEGIN ATOMIC\n"
        "    SELECT 1;\n    SELECT CASE WHEN x > 0 THEN 1 ELSE -1 END;\nEND",
        "CREATE INDEX CONCURRENTLY IF NOT EXISTS a ON payhook.t (x)",
    ]


def test_a_transaction_begin_and_words_that_contain_begin_or_end_still_split() -> None:
    text = "BEGIN; SELECT begin_at, legend FROM t; COMMIT; SELECT E'\\'; end'"
    assert split_statements(text) == [
        "BEGIN",
        "SELECT begin_at, legend FROM t",
        "COMMIT",
        "SELECT E'\\'; end'",
    ]


def test_identifiers_fold_to_lower_case_unless_quoted() -> None:
    assert identifier("Tenant_Id") == "tenant_id"
    assert identifier('"Tenant_Id"') == "Tenant_Id"
    assert identifier('"say ""hi"""') == 'say "hi"'
    assert qualified('PayHook."Orders"') == 'payhook."Orders"'
    assert qualified('"payhook" . "orders"') == "payhook.orders"
    assert qualified('"orders\n"') == '"orders\n"', "a newline is part of the name"


def test_rules_name_the_columns_and_table_as_postgresql_reads_them() -> None:
    """An upper-case column would otherwise not be found, and the rule be
    skipped as one on a column the migration creates."""
    text = """
    CREATE UNIQUE INDEX CONCURRENTLY "Ex_Key" ON PayHook."Ex" (Tenant_Id, "Ref" DESC NULLS LAST);
    CREATE UNIQUE INDEX ON payhook.t (tenant_id, x);
    """
    assert rules_in(text) == [
        UniqueRule("Ex_Key", 'payhook."Ex"', ("tenant_id", "Ref")),
        UniqueRule("t_tenant_id_x_idx", "payhook.t", ("tenant_id", "x")),
    ]


def test_every_unique_rule_an_alter_table_adds_is_read_or_listed_as_unchecked() -> None:
    text = """
    ALTER TABLE payhook.u DROP CONSTRAINT IF EXISTS one, ADD CONSTRAINT one UNIQUE (tenant_id, a);
    ALTER TABLE ONLY payhook.u ADD UNIQUE NULLS NOT DISTINCT (tenant_id, b),
        ADD PRIMARY KEY (tenant_id, id);
    ALTER TABLE payhook.u ADD CONSTRAINT two UNIQUE USING INDEX two;
    ALTER TABLE payhook.u ADD COLUMN c text UNIQUE;
    ALTER TABLE payhook.u ADD CONSTRAINT three UNIQUE (tenant_id, lower(d));
    ALTER TABLE payhook."U" ADD UNIQUE (tenant_id, lower(d));
    """
    rules = all_rules_in(text)
    assert rules[:3] == [
        UniqueRule("one", "payhook.u", ("tenant_id", "a")),
        UniqueRule("u_tenant_id_b_key", "payhook.u", ("tenant_id", "b"), nulls_distinct=False),
        UniqueRule("u_pkey", "payhook.u", ("tenant_id", "id")),
    ]
    unchecked = rules[3:]
    assert [type(r) for r in unchecked] == [UncheckableRule] * 3
    assert isinstance(unchecked[0], UncheckableRule)
    assert "ADD COLUMN c text UNIQUE" in unchecked[0].reason
    assert [r.name for r in unchecked[1:]] == ["three", 'payhook."U"']


def test_a_do_block_s_own_rule_is_read_and_its_comments_and_strings_are_not() -> None:
    """In a comment or a string of the block's body it is at most a warning;
    the block's own ALTER TABLE is read, after nested dollar quotes too."""
    text = """DO $$
BEGIN
    -- Was: ALTER TABLE payhook.x ADD CONSTRAINT old_key UNIQUE (tenant_id, kind)
    /* CREATE UNIQUE INDEX gone ON payhook.x (tenant_id, a); */
    RAISE NOTICE $m$ don't -- $m$;
    IF NOT EXISTS (SELECT 1 FROM pg_constraint WHERE conname = 'x_key') THEN
        ALTER TABLE payhook.x ADD CONSTRAINT x_key UNIQUE (tenant_id, c);
    END IF;
END
$$;
"""
    assert all_rules_in(text) == [UniqueRule("x_key", "payhook.x", ("tenant_id", "c"))]
    (statement,) = statements(text)
    assert isinstance(statement.node, ast.DoStmt)
    code, strings = block_parts(statement.node)
    assert code == ["ALTER TABLE payhook.x ADD CONSTRAINT x_key UNIQUE (tenant_id, c)"]
    assert strings == [" don't -- ", "x_key"], "a comment is neither code nor a string"


def test_a_rule_in_a_string_is_listed_as_unchecked_never_checked() -> None:
    """Run through EXECUTE or a function, or only mentioned: no reader of SQL
    can tell which, so it is neither checked nor passed over in silence."""
    for text in (
        "DO $$ BEGIN EXECUTE 'CREATE UNIQUE INDEX dyn_key ON payhook.x (tenant_id, c)'; END $$;",
        "DO $$ BEGIN RAISE NOTICE 'ALTER TABLE payhook.x ADD UNIQUE (tenant_id, b)'; END $$;",
        """DO $$ BEGIN EXECUTE 'ALTER TABLE t ADD CONSTRAINT "my key" UNIQUE (a)'; END $$;""",
        "DO $$ BEGIN EXECUTE $e$ALTER TABLE t ADD COLUMN d int UNIQUE$e$; END $$;",
        "COMMENT ON TABLE payhook.x IS $c$ALTER TABLE payhook.x ADD UNIQUE (tenant_id, c)$c$;",
        "CREATE FUNCTION payhook.f() RETURNS void LANGUAGE sql AS $f$"
        " ALTER TABLE payhook.x ADD CONSTRAINT fn_key UNIQUE (tenant_id, c) $f$;",
    ):
        (rule,) = all_rules_in(text)
        assert isinstance(rule, UncheckableRule), text
        assert "written in a string" in rule.reason
        assert rules_in(text, strict=False) == [], "the runner checks nothing of it"


def test_unique_in_a_string_or_a_quoted_name_is_no_rule() -> None:
    text = """
    ALTER TABLE payhook.x ALTER COLUMN kind SET DEFAULT 'unique';
    ALTER TABLE payhook.x ADD CONSTRAINT kind_check CHECK (kind <> 'primary key');
    ALTER TABLE payhook.x RENAME CONSTRAINT a TO "unique";
    """
    assert all_rules_in(text) == []


def test_a_do_block_whose_body_is_a_quoted_string_is_read_as_a_dollar_quoted_one() -> None:
    """`''` (and in an E'' body `\\'`) quotes a string inside it; a LANGUAGE's
    name, quoted too, is not the body."""
    for text in (
        "DO 'BEGIN ALTER TABLE payhook.x ADD CONSTRAINT x_key UNIQUE (tenant_id, c);"
        " RAISE NOTICE ''CREATE UNIQUE INDEX no ON t (a); it''''s''; END';",
        "DO LANGUAGE 'plpgsql' E'BEGIN ALTER TABLE payhook.x ADD CONSTRAINT x_key UNIQUE"
        " (tenant_id, c);\\n RAISE NOTICE \\'CREATE UNIQUE INDEX no ON t (a); it''''s\\'; END';",
    ):
        (statement,) = statements(text)
        assert isinstance(statement.node, ast.DoStmt)
        code, strings = block_parts(statement.node)
        assert code == ["ALTER TABLE payhook.x ADD CONSTRAINT x_key UNIQUE (tenant_id, c)"]
        assert strings == ["CREATE UNIQUE INDEX no ON t (a); it's"]
        rule, mention = all_rules_in(text)
        assert rule == UniqueRule("x_key", "payhook.x", ("tenant_id", "c"))
        assert isinstance(mention, UncheckableRule)
        assert "written in a string" in mention.reason


def test_unicode_escaped_names_are_decoded_as_postgresql_decodes_them() -> None:
    assert identifier('U&"d\\0061t\\+000061"') == "data"
    assert identifier("u&\"d!0061t!+000061!!\" UESCAPE '!'") == "data!"
    assert identifier('U&"\\D83D\\DE00 ""q"" \\\\"') == '\U0001f600 "q" \\'
    assert identifier('U&"' + "\\00e9" * 40 + '"') == "\u00e9" * 31, "cut after decoding"
    assert qualified('U&"P\\0061y" . u&"T"') == '"Pay"."T"'


def test_a_unicode_escaped_name_neither_splits_a_statement_nor_is_misread() -> None:
    text = """ALTER TABLE U&"t\\0061;" ADD CONSTRAINT U&"k!0065y" UESCAPE '!' UNIQUE (a);
CREATE UNIQUE INDEX U&"i;;" UESCAPE ';' ON payhook.U&"t\\0061;" (U&"\\0061", b);
ALTER TABLE payhook.t ADD CONSTRAINT U&"k;;" UESCAPE ';' UNIQUE (U&"b;0061" UESCAPE ';');
"""
    assert len(split_statements(text)) == 3
    assert all_rules_in(text) == [
        UniqueRule("key", '"ta;"', ("a",)),
        UniqueRule("i;", 'payhook."ta;"', ("a", "b")),
        UniqueRule("k;", "payhook.t", ("ba",)),
    ]


def test_a_unicode_escaped_name_postgresql_would_refuse_is_listed_as_unchecked() -> None:
    """An escape it rejects, or an escape character it does not take: no name
    is guessed for it."""
    for name in (
        'U&"\\00"',
        'U&"\\0000"',
        'U&"\\D83Dx"',
        'U&"\\+110000"',
        "U&\"a!0061\" UESCAPE 'a'",
        "U&\"!0061\" UESCAPE '!!'",
    ):
        for text in (
            f"CREATE UNIQUE INDEX {name} ON payhook.t (a);",
            f"ALTER TABLE payhook.t ADD CONSTRAINT {name} UNIQUE (a);",
            f"ALTER TABLE {name} ADD UNIQUE (a);",
        ):
            (rule,) = all_rules_in(text)
            assert isinstance(rule, UncheckableRule), text


def test_an_escape_character_written_as_an_e_string_is_one_postgresql_takes() -> None:
    """Its lexer reads `E'!'` as the simple string `!`: PostgreSQL names the index `a`."""
    assert identifier("U&\"!0061\" UESCAPE E'!'") == "a"
    text = "CREATE UNIQUE INDEX U&\"!0061\" UESCAPE E'!' ON payhook.t (a);"
    assert all_rules_in(text) == [UniqueRule("a", "payhook.t", ("a",))]


def test_where_in_a_quoted_name_or_a_string_does_not_start_or_change_a_predicate() -> None:
    text = """
    CREATE UNIQUE INDEX k ON t (a) INCLUDE ("where", "nulls not distinct") WHERE b IS NULL;
    CREATE UNIQUE INDEX ON t (a) INCLUDE ("where");
    CREATE UNIQUE INDEX m ON t (a) WHERE note <> 'nulls not distinct';
    """
    assert all_rules_in(text) == [
        UniqueRule("k", "t", ("a",), predicate="b IS NULL"),
        UniqueRule("t_a_where_idx", "t", ("a",)),
        UniqueRule("m", "t", ("a",), predicate="note <> 'nulls not distinct'"),
    ]


def test_a_semicolon_in_a_quoted_constraint_name_does_not_hide_its_rule() -> None:
    (rule,) = all_rules_in('ALTER TABLE t ADD CONSTRAINT "a;b" UNIQUE (x);')
    assert rule == UniqueRule("a;b", "t", ("x",))


def test_a_rule_s_name_is_the_one_postgresql_keeps_and_reads_back_from_its_quoted_form() -> None:
    """Cut to 63 bytes, whole characters only, as PostgreSQL cuts it: the name
    `--rule` is matched with, however long the migration wrote it."""
    e = "\u00e9"  # two bytes
    text = f"""
    CREATE UNIQUE INDEX "Ex_{e * 40}" ON t (a);
    CREATE UNIQUE INDEX ON t ("{e * 40}");
    ALTER TABLE {"t" * 70} ADD UNIQUE (a);
    """
    rules = all_rules_in(text)
    assert [r.name for r in rules] == [f"Ex_{e * 30}", f"t_{e * 28}_idx", f"{'t' * 57}_a_key"]
    for rule in rules:
        assert identifier(quoted(rule.name)) == rule.name
    assert identifier(f'"Ex_{e * 40}"') == rules[0].name


def test_a_statement_postgresql_cannot_parse_is_listed_and_those_around_it_are_read() -> None:
    """PostgreSQL refuses a key on an expression in ALTER TABLE: no rule is
    guessed from it, it is listed under its name, and the rest is read."""
    text = """ALTER TABLE t ADD UNIQUE (a);
ALTER TABLE t ADD CONSTRAINT "my;key" UNIQUE (lower(b));
CREATE UNIQUE INDEX k ON t (c);
"""
    found = statements(text)
    assert [s.node is None for s in found] == [False, True, False]
    assert "syntax error" in found[1].error
    rules = all_rules_in(text)
    assert rules[0] == UniqueRule("t_a_key", "t", ("a",))
    assert isinstance(rules[1], UncheckableRule) and rules[1].name == "my;key"
    assert rules[2] == UniqueRule("k", "t", ("c",))


def test_what_is_not_one_name_is_refused_not_guessed() -> None:
    for text in ("a b", "lower(x)", "", "t.*", "a;b", "1abc"):
        with pytest.raises(UnreadableName):
            qualified(text)
    with pytest.raises(UnreadableName):
        identifier("payhook.t")
    assert qualified("Cat.S.T") == "cat.s.t"
    (rule,) = all_rules_in("ALTER TABLE cat.s.t ADD UNIQUE (x);")
    assert rule == UniqueRule("t_x_key", "cat.s.t", ("x",)), "database, schema and table"


def test_a_rule_in_a_loop_or_an_exception_block_of_a_do_body_is_read() -> None:
    text = """DO $$
DECLARE r record;
BEGIN
    FOR r IN SELECT 1 LOOP
        CREATE UNIQUE INDEX IF NOT EXISTS z ON t (a) WHERE a <> 'x';
    END LOOP;
EXCEPTION WHEN duplicate_table THEN
    ALTER TABLE t ADD CONSTRAINT y UNIQUE (b);
END $$;
"""
    assert all_rules_in(text) == [
        UniqueRule("z", "t", ("a",), predicate="a <> 'x'"),
        UniqueRule("y", "t", ("b",)),
    ]


def test_the_body_of_a_do_block_in_another_language_is_a_string() -> None:
    text = "DO LANGUAGE plpython3u $$ plpy.execute('ALTER TABLE t ADD UNIQUE (a)') $$;"
    (rule,) = all_rules_in(text)
    assert isinstance(rule, UncheckableRule) and "written in a string" in rule.reason
