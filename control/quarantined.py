"""`payhook quarantine list|show|purge`: the jobs consumers set aside (`payhook.quarantine`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TextIO

from redis import Redis

from payhook.quarantine import all_ids, find, list_jobs, purge, show


def run(
    action: str,
    args: Any,
    redis: Redis,
    queue: str,
    out: TextIO,
    purged: Callable[[list[str], int], None] | None = None,
) -> int:
    """`payhook quarantine list|show|purge`: JSON lines; 1 when an id is not quarantined."""
    if action == "list":
        for entry in list_jobs(redis, queue, args.limit):
            print(json.dumps(entry.to_json()), file=out)
        return 0
    ids = [(given, find(redis, queue, given)) for given in args.job_ids]
    missing = [given for given, job_id in ids if job_id is None]
    for given in missing:
        print(json.dumps({"job_id": given, "error": "not quarantined"}), file=out)
    if action == "show":
        for _, job_id in ids:
            shown = show(redis, queue, job_id) if job_id is not None else None
            if shown is not None:
                entry, fields = shown
                print(json.dumps(entry.to_json() | {"fields": fields}), file=out)
        return 1 if missing else 0
    chosen = all_ids(redis, queue) if args.all else [j for _, j in ids if j is not None]
    count = purge(redis, queue, chosen)
    if purged is not None:
        purged([str(j) for j in chosen], count)
    print(json.dumps({"purged": count}), file=out)
    return 1 if missing else 0
