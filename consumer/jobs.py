"""The name payhook's event jobs carry: `consumer.jobs.apply_event`.

The ingress enqueues every event as a job naming this function
(`payhook.queue.APPLY_EVENT`): it is what RQ's data model, `rq info`, the
dashboard and the dead-letter commands show. A consumer does not import and
call it: `PayhookJob` runs such a job on its worker's `Applier`
(`consumer/applier.py`), which owns the pool, the settings and the applier
thread. Called any other way, it refuses.
"""

from __future__ import annotations

from typing import Any

from payhook.errors import PayhookError


def apply_event(envelope: Any) -> dict[str, Any]:
    """Never run as such: a consumer runs this job on its `Applier`."""
    raise PayhookError("apply_event jobs run only in a payhook consumer, on its Applier")
