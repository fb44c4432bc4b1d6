"""`payhook uniqueness check|resolve`: the unique rules of pending migrations
(`control.migrations`), checked or resolved on the live tables
(`control.uniqueness`)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import asdict

from control import audit
from control.migrations import LOCK_TIMEOUT, pending_migrations
from control.sqltext import identifier, qualified, quoted
from control.unique_rules import RuleError, UncheckableRule, UniqueRule, all_rules_in
from control.uniqueness import (
    CREATED_BY_MIGRATION,
    SESSION_OPTIONS,
    NotYetThere,
    check_rule,
    remaining_conflicts,
    resolve_rule,
)
from payhook.db import connect
from payhook.settings import Settings


def run(args: argparse.Namespace, settings: Settings) -> int:
    """`payhook uniqueness check|resolve`: one JSON line per rule; 1 while conflicts remain."""
    rules = _chosen_rules(args, settings)
    if not rules:
        print("no pending migration adds a unique rule to check", file=sys.stderr)
        return 0
    pending = not args.table
    remaining = False
    options = f"-c lock_timeout={LOCK_TIMEOUT} {SESSION_OPTIONS}"
    with connect(settings, "uniqueness", owner=True, options=options) as conn:
        for rule in rules:
            if isinstance(rule, UncheckableRule):
                print(
                    json.dumps({"rule": rule.name, "skipped": f"cannot be checked: {rule.reason}"})
                )
                continue
            try:
                if args.action == "check":
                    ignore = tuple(
                        identifier(c) for c in (args.ignore or "").split(",") if c.strip()
                    )
                    summary = check_rule(conn, rule, ignore).summary()
                    remaining |= summary["groups"] > 0
                else:
                    summary = asdict(resolve_rule(conn, rule))
                    left = remaining_conflicts(conn, rule)
                    summary["remaining"] = dict(left)
                    remaining |= bool(left)
                    audit.record(conn, "uniqueness_resolve", "rule", rule.name, result=summary)
            except NotYetThere:
                if not pending:
                    raise
                # As `migrate` does: no row can break a rule before its table
                # or column exists.
                summary = {"rule": rule.name, "skipped": CREATED_BY_MIGRATION}
            print(json.dumps(summary, default=str))
    return 1 if remaining else 0


def _chosen_rules(
    args: argparse.Namespace, settings: Settings
) -> list[UniqueRule | UncheckableRule]:
    if args.table:
        if not args.columns or not args.rule:
            raise RuleError("--table needs --columns and --rule (the index name)")
        columns = tuple(identifier(c) for c in args.columns.split(",") if c.strip())
        if not columns:
            raise RuleError("--columns: name at least one column, comma-separated")
        return [UniqueRule(identifier(args.rule), qualified(args.table), columns)]
    rules = [r for m in pending_migrations(settings) for r in all_rules_in(m.path.read_text())]
    wanted = None if args.rule is None else identifier(args.rule)
    chosen = [r for r in rules if wanted in (None, r.name)]
    if args.rule is not None and not chosen:
        pending = ", ".join(shlex.quote(quoted(r.name)) for r in rules) or "none"
        raise RuleError(f"--rule {args.rule}: no pending migration adds it (pending: {pending})")
    if args.rule is not None and isinstance(chosen[0], UncheckableRule):
        raise RuleError(f"--rule {args.rule}: cannot be checked: {chosen[0].reason}")
    return chosen
