"""payhook.outcomes: one home for the outcome and kind names, and how a CHECK is read."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from consumer import rules
from control.cli import build_parser
from payhook import outcomes
from payhook.outcomes import (
    ANOMALY_KINDS,
    EXCEPTION_KINDS,
    QUIET_OUTCOMES,
    RECEIPT_OUTCOMES,
    REFUSED_OUTCOMES,
    RESOLVING_OUTCOMES,
    listed_names,
)


def test_every_name_has_a_one_line_meaning() -> None:
    for names in (RECEIPT_OUTCOMES, ANOMALY_KINDS):
        for name, meaning in names.items():
            assert name.isidentifier() and name == name.lower(), name
            assert meaning and "\n" not in meaning, name


def test_the_groups_are_parts_of_the_lists_they_name() -> None:
    assert set(EXCEPTION_KINDS) | set(QUIET_OUTCOMES) | {"processing", "applied"} == set(
        RECEIPT_OUTCOMES
    )
    assert not set(EXCEPTION_KINDS) & set(QUIET_OUTCOMES)
    assert REFUSED_OUTCOMES < set(ANOMALY_KINDS)
    assert RESOLVING_OUTCOMES < set(RECEIPT_OUTCOMES) - set(EXCEPTION_KINDS)


def test_the_lists_cannot_be_changed_at_run_time() -> None:
    with pytest.raises(TypeError):
        EXCEPTION_KINDS["refund_pending"] = "x"  # type: ignore[index]


def test_the_consumer_takes_its_lists_from_the_kernel() -> None:
    assert rules.EXCEPTION_OUTCOMES == set(EXCEPTION_KINDS)
    assert rules.REFUSED_OUTCOMES is outcomes.REFUSED_OUTCOMES
    assert rules.RESOLVING_OUTCOMES is outcomes.RESOLVING_OUTCOMES


@pytest.mark.parametrize(
    ("command", "kinds"), [("exceptions", EXCEPTION_KINDS), ("anomalies", ANOMALY_KINDS)]
)
def test_the_cli_filters_by_every_kind_and_no_other(
    command: str, kinds: Mapping[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    parser = build_parser()
    for kind in kinds:
        assert parser.parse_args([command, "list", "--kind", kind]).kind == kind
    with pytest.raises(SystemExit):
        parser.parse_args([command, "list", "--kind", "refund_pending"])
    assert "[--kind {" + ",".join(sorted(kinds)) + "}]" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("definition", "names"),
    [
        (
            "CHECK ((outcome = ANY (ARRAY['processing'::text, 'applied'::text])))",
            {"processing", "applied"},
        ),
        ("CHECK ((kind = ANY (ARRAY['a'::text, 'b''c'::text]))) NOT VALID", {"a", "b'c"}),
        ("CHECK ((kind = 'only'::text))", {"only"}),
        ("CHECK ((kind <> ''::text))", None),
        ("CHECK ((kind = ANY (ARRAY['a'::text]) OR (kind IS NULL)))", None),
        ("CHECK ((kind = ANY (ARRAY['a'::character varying])))", None),
        ("CHECK ((kind = ANY (ARRAY['a'::text]))) AND ((kind = 'b'::text))", None),
    ],
)
def test_a_check_is_read_as_its_list_of_names_or_not_at_all(
    definition: str, names: set[str] | None
) -> None:
    assert listed_names(definition) == names
