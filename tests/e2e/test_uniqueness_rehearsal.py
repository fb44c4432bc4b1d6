"""The unique-rule rehearsal, scaled down, with real consumer processes: correctness only."""

from __future__ import annotations

from pathlib import Path

import pytest
from redis import Redis

from bench.uniqueness_rehearsal import Plan, rehearse
from payhook.settings import Settings


@pytest.mark.slow
def test_unique_rule_built_while_consumers_run_loses_no_event(
    settings: Settings, redis_conn: Redis, tmp_path: Path
) -> None:
    plan = Plan(rows=50_000, copies=20, workers=2, rate=40, warmup=0.5, baseline=1.5, after=1)
    figures = rehearse(settings, redis_conn, tmp_path, plan)
    assert figures.problems() == []
    assert figures.events > 0 and figures.lost == 0
    assert figures.failed_jobs == figures.consumer_errors == 0
    assert figures.conflicts_found == {"redelivery": 20}
    assert figures.quarantined == 20
    assert figures.index_valid and figures.constrained
