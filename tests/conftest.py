"""Fixtures over real PostgreSQL and Redis.

A session fixture migrates a template database; each test that writes gets
its own `CREATE DATABASE ... TEMPLATE` copy. Redis tests use their own db
number, flushed before and after. A missing service fails the test loudly.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest
import structlog
from psycopg import sql
from redis import Redis

from consumer.handler import Runtime
from control.migrations import apply_migrations
from payhook.db import Row, connect, create_pool
from payhook.settings import Settings
from tests.factories import TEST_SECRETS_KEY, Factory

#: Server the tests create their databases on.
PG_SERVER = os.environ.get("PAYHOOK_TEST_PG", "postgresql://postgres@127.0.0.1:5432")
#: This process's place in a parallel run (pytest-xdist's `gw0`, `gw1`, ...; 0 alone).
WORKER_INDEX = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)


def _redis_test_url() -> str:
    """`PAYHOOK_TEST_REDIS` (db 15 by default), one database lower per
    parallel worker: each worker owns and flushes its own."""
    base, _, db = os.environ.get("PAYHOOK_TEST_REDIS", "redis://127.0.0.1:6379/15").rpartition("/")
    number = int(db) - WORKER_INDEX
    if number < 0:
        raise RuntimeError(f"PAYHOOK_TEST_REDIS: no Redis database left for worker {WORKER_INDEX}")
    return f"{base}/{number}"


#: Redis database the tests own and flush.
REDIS_TEST_URL = _redis_test_url()
TEMPLATE = f"payhook_test_template_{os.getpid()}"


def _admin() -> psycopg.Connection[tuple[object, ...]]:
    return psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True, connect_timeout=5)


def test_settings(database: str, **extra: str) -> Settings:
    env = {
        "DATABASE_URL": f"{PG_SERVER}/{database}",
        "REDIS_URL": REDIS_TEST_URL,
        # A queue of its own per test: a stray worker of another run cannot take its jobs.
        "PAYHOOK_QUEUE": f"payhook-test-{database}",
        "PAYHOOK_SECRETS_KEY": TEST_SECRETS_KEY,
    } | extra
    return Settings.from_env(env)


test_settings.__test__ = False  # type: ignore[attr-defined]


#: Packages whose module-level loggers a test may leave bound to its own stream.
OUR_PACKAGES = ("payhook", "control", "consumer", "ingress", "outbox_worker")


@pytest.fixture(autouse=True)
def _logging_from_its_defaults() -> Iterator[None]:
    """A test that runs a process's wiring in-process (an app factory, a
    command's `run`) configures structlog to write to the stream pytest
    captured for it, and the module-level loggers it used keep that stream
    (`cache_logger_on_first_use`), even once the test put structlog's
    defaults back. After every test, structlog is at its defaults and those
    loggers forget what they cached, so a later test on the same worker does
    not log into a closed stream."""
    yield
    if structlog.is_configured():
        structlog.reset_defaults()
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] not in OUR_PACKAGES:
            continue
        for value in list(vars(module).values()):
            if type(value).__name__ == "BoundLoggerLazyProxy":
                vars(value).pop("bind", None)


@pytest.fixture(scope="session")
def template_db() -> Iterator[str]:
    with _admin() as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(TEMPLATE))
        )
    apply_migrations(test_settings(TEMPLATE))
    yield TEMPLATE
    with _admin() as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(TEMPLATE))
        )


@contextmanager
def created_database(template: str) -> Iterator[str]:
    """A migrated database copied from `template`, dropped afterwards."""
    name = f"payhook_test_{uuid.uuid4().hex[:12]}"
    with _admin() as conn:
        conn.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(template)
            )
        )
    try:
        yield name
    finally:
        with _admin() as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


@pytest.fixture
def database(template_db: str) -> Iterator[str]:
    """A fresh, migrated database of this test's own."""
    with created_database(template_db) as name:
        yield name


@pytest.fixture
def redis_conn() -> Iterator[Redis]:
    conn = Redis.from_url(REDIS_TEST_URL)
    conn.flushdb()
    yield conn
    conn.flushdb()
    conn.close()


@pytest.fixture
def settings(database: str, redis_conn: Redis) -> Settings:
    return test_settings(database)


@pytest.fixture
def conn(settings: Settings) -> Iterator[psycopg.Connection[Row]]:
    """The owner's connection, which row-level security does not restrict:
    tests seed and inspect every tenant's rows through it."""
    with connect(settings, "test", owner=True) as connection:
        yield connection


@pytest.fixture
def app_conn(settings: Settings) -> Iterator[psycopg.Connection[Row]]:
    """A connection as the processes and commands hold one: as
    `payhook_app`, under row-level security."""
    with connect(settings, "test") as connection:
        yield connection


@pytest.fixture
def factory(conn: psycopg.Connection[Row]) -> Factory:
    return Factory(conn)


@pytest.fixture
def runtime(settings: Settings, redis_conn: Redis) -> Iterator[Runtime]:
    """What a consumer's jobs run with, over the test's database and Redis."""
    pool = create_pool(settings, "test", size=6)
    pool.open(wait=True)
    yield Runtime(settings=settings, pool=pool, redis=redis_conn)
    pool.close()
