"""Delivery ids: random version 4 UUIDs, never handed out twice, in a forked child either."""

from __future__ import annotations

import os
import uuid

from ingress import ids


def test_delivery_ids_are_canonical_random_uuids() -> None:
    drawn = [ids.delivery_id() for _ in range(3 * ids.BATCH + 7)]  # across refills
    assert len(set(drawn)) == len(drawn)
    for text in drawn:
        parsed = uuid.UUID(text)
        assert str(parsed) == text
        assert parsed.version == 4
        assert parsed.variant == uuid.RFC_4122


def test_a_forked_child_does_not_hand_out_its_parents_next_ids() -> None:
    ids.delivery_id()  # the buffer holds BATCH - 1 ids not yet handed out
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        try:
            os.write(write, "".join(ids.delivery_id() for _ in range(4)).encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as pipe:
        child = pipe.read().decode()
    parent = "".join(ids.delivery_id() for _ in range(4))
    assert len(child) == len(parent) == 4 * 36
    assert not {child[i : i + 36] for i in range(0, len(child), 36)} & {
        parent[i : i + 36] for i in range(0, len(parent), 36)
    }
