"""Contracts of `payhook.compat`: what it relies on inside each library, still there.

Each test names the library and the internal it checks. A failure after an
upgrade means: adapt `payhook/compat.py` (and the test) to the new release,
then raise the library's pin in pyproject.toml. The last tests scan the
source: nowhere else does payhook touch another library's private names.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import warnings
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any, cast

import httpcore
import httpx
import pytest
from flask import Flask
from redis import Redis
from redis.asyncio.connection import Connection
from rq import Queue
from rq.callbacks import Callback
from rq.exceptions import DeserializationError
from rq.job import Job
from rq.serializers import JSONSerializer

from payhook import compat
from payhook.errors import IncompatibleDependency
from payhook.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("payhook", "ingress", "consumer", "outbox_worker", "control")
#: Files the scan leaves out: none; every touch goes through payhook.compat.
EXEMPT: frozenset[str] = frozenset()
#: Nothing listens there: a test that would reach Redis fails instead of passing.
NO_REDIS = "redis://127.0.0.1:1/0"


def changed(distribution: str, what: str) -> str:
    """The failure message of a contract: the library, its version, what changed."""
    return (
        f"{distribution} {version(distribution)} changed {what}, which payhook.compat "
        f"relies on: adapt payhook/compat.py to it before raising the pin of "
        f"{distribution} in pyproject.toml"
    )


def offline_redis() -> Redis:
    return Redis.from_url(NO_REDIS)


# -- redis-py -----------------------------------------------------------------


def test_redis_async_connection_has_a_writer_slot_empty_until_connected() -> None:
    connection = Connection(host="127.0.0.1", port=1)
    assert hasattr(connection, "_writer"), changed("redis", "the async connection's `_writer`")
    assert compat.writer_of(connection) is None, changed(
        "redis", "`_writer` before `connect()` (no longer None)"
    )


def test_redis_pipeline_keeps_queued_commands_as_args_and_options() -> None:
    pipe = offline_redis().pipeline()
    pipe.set("k", "v")
    pipe.hset("h", mapping={"field": 1})
    queued = compat.pipeline_commands(pipe)
    assert [args for args, _options in queued] == [("SET", "k", "v"), ("HSET", "h", "field", 1)], (
        changed("redis", "a pipeline's `command_stack`")
    )
    assert all(isinstance(options, dict) for _args, options in queued), changed(
        "redis", "the options of a pipeline's `command_stack`"
    )


# -- RQ -----------------------------------------------------------------------


def stored_hash(job: Job) -> dict[bytes, bytes]:
    """`job` as RQ stores its hash, encoded as redis-py would."""

    def encoded(value: Any) -> bytes:
        if isinstance(value, bytes):
            return value
        return value.encode() if isinstance(value, str) else str(value).encode()

    return {name.encode(): encoded(value) for name, value in job.to_dict().items()}


def restored(job: Job) -> Job:
    """A job read back from `job`'s hash, as a worker reads it."""
    read = Job(job.id, connection=offline_redis(), serializer=JSONSerializer)
    read.restore(stored_hash(job))
    return read


def test_rq_queue_takes_an_assumed_server_version_without_asking_redis() -> None:
    queue = Queue("q", connection=offline_redis(), serializer=JSONSerializer)
    compat.assume_redis_version(queue, (7, 0, 0))
    assert queue.get_redis_server_version() == (7, 0, 0), changed(
        "rq", "`Queue.redis_server_version`, the cached server version"
    )


def test_rq_restore_reads_callback_names_into_the_job() -> None:
    job = Job.create(
        "os.getcwd",
        connection=offline_redis(),
        serializer=JSONSerializer,
        on_success=Callback("os.getpid"),
        on_failure=Callback("os.getppid"),
        on_stopped=Callback("os.getuid"),
    )
    assert compat.rq_callback_names(job) == ("os.getpid", "os.getppid", "os.getuid"), changed(
        "rq", "where `Job.create` keeps callback names (`_success_callback_name`, ...)"
    )
    assert compat.rq_callback_names(restored(job)) == ("os.getpid", "os.getppid", "os.getuid"), (
        changed("rq", "where `Job.restore` reads callback names (`_success_callback_name`, ...)")
    )
    plain = Job.create("os.getcwd", connection=offline_redis(), serializer=JSONSerializer)
    assert not any(compat.rq_callback_names(restored(plain))), changed(
        "rq", "the callback names of a job without callbacks"
    )


def test_rq_restore_reads_dependency_ids_into_the_job() -> None:
    job = Job.create(
        "os.getcwd", connection=offline_redis(), serializer=JSONSerializer, depends_on=["a", "b"]
    )
    assert compat.rq_dependency_ids(restored(job)) == ["a", "b"], changed(
        "rq", "where `Job.restore` reads dependencies (`_dependency_ids`)"
    )
    plain = Job.create("os.getcwd", connection=offline_redis(), serializer=JSONSerializer)
    assert compat.rq_dependency_ids(restored(plain)) == [], changed(
        "rq", "the dependencies of a job without any"
    )


def test_rq_job_reads_its_data_in_deserialize_data() -> None:
    method = getattr(Job, "_deserialize_data", None)
    assert callable(method), changed("rq", "`Job._deserialize_data`, gone")
    assert list(inspect.signature(method).parameters) == ["self"], changed(
        "rq", "the signature of `Job._deserialize_data`"
    )


class Told(compat.JobWithDataHook):
    told = 0

    def on_unreadable_data(self) -> None:
        self.told += 1


@pytest.mark.parametrize("read", ["func_name", "instance", "args", "kwargs"])
def test_rq_job_with_data_hook_is_told_of_unreadable_data(read: str) -> None:
    job = Told(connection=offline_redis(), serializer=JSONSerializer)
    job.data = b"not json"
    with pytest.raises(DeserializationError):
        getattr(job, read)
    assert job.told == 1, changed("rq", f"how `Job.{read}` reads the data (`_deserialize_data`)")


def test_rq_job_with_data_hook_is_not_told_of_readable_data() -> None:
    job = cast(
        Told,
        Told.create("os.getcwd", args=[1], connection=offline_redis(), serializer=JSONSerializer),
    )
    job.data = job.data  # forget what was read, as a fetched job has
    assert (job.func_name, job.args, job.told) == ("os.getcwd", [1], 0), changed(
        "rq", "how a job reads its data (`_deserialize_data`)"
    )


# -- httpx and httpcore -------------------------------------------------------


class RefusingBackend(httpcore.NetworkBackend):
    """Refuses every connection, noting where it was asked to connect."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, int]] = []

    def connect_tcp(self, host: str, port: int, *args: Any, **kwargs: Any) -> Any:
        self.asked.append((host, port))
        raise httpcore.ConnectError("refused by the test")


def test_httpx_transport_keeps_an_httpcore_pool_in_pool() -> None:
    transport = httpx.HTTPTransport()
    pool = getattr(transport, "_pool", None)
    assert isinstance(pool, httpcore.ConnectionPool), changed(
        "httpx", "`HTTPTransport._pool`, httpcore's connection pool"
    )
    transport.close()


def test_httpx_transport_sends_through_the_pool_put_in_its_place() -> None:
    backend = RefusingBackend()
    transport = httpx.HTTPTransport()
    compat.replace_connection_pool(transport, httpcore.ConnectionPool(network_backend=backend))
    with pytest.raises(httpx.ConnectError):
        transport.handle_request(httpx.Request("GET", "http://payhook.invalid:8123/"))
    transport.close()
    assert backend.asked == [("payhook.invalid", 8123)], changed(
        "httpx", "how `HTTPTransport` sends a request (through `_pool`)"
    )


# -- pgserver -----------------------------------------------------------------


def postgres_server_class() -> Any:
    with warnings.catch_warnings():
        # platformdirs warns when XDG_RUNTIME_DIR is unset, as on most servers.
        warnings.simplefilter("ignore")
        from pgserver.postgres_server import PostgresServer
    return PostgresServer


def test_pgserver_changes_holders_under_its_class_lock() -> None:
    server_class = postgres_server_class()
    lock = compat.pgserver_lock(server_class)
    assert "_lock" in vars(server_class), changed("pgserver", "`PostgresServer._lock`")
    for method in ("acquire", "release", "__enter__", "__exit__"):
        assert hasattr(lock, method), changed("pgserver", f"`PostgresServer._lock` ({method})")
    for changing_holders in ("__init__", "_cleanup"):
        source = inspect.getsource(getattr(server_class, changing_holders))
        assert "with self._lock:" in source and "global_process_id_list" in source, changed(
            "pgserver", f"what `PostgresServer.{changing_holders}` does under `_lock`"
        )


def test_pgserver_lists_holders_in_the_file_compat_names() -> None:
    init = inspect.getsource(postgres_server_class().__init__)
    assert repr(compat.PGSERVER_HOLDERS) in init, changed(
        "pgserver", f"the file listing a server's holders ({compat.PGSERVER_HOLDERS})"
    )


# -- rq-dashboard -------------------------------------------------------------


def rq_dashboard_app() -> Flask:
    import rq_dashboard.web as web

    app = Flask(__name__)
    app.register_blueprint(web.blueprint)
    return app


def payhook_dashboard() -> Flask:
    from control.dashboard import create_app

    return create_app(Settings.from_env({}), "payhook", "secret")


def test_rq_dashboard_registers_every_endpoint_payhook_replaces() -> None:
    from control.dashboard import REFUSED

    shipped = rq_dashboard_app().view_functions
    replaced = {
        name
        for name, view in payhook_dashboard().view_functions.items()
        if name.startswith(f"{compat.RQ_DASHBOARD}.") and view is not shipped.get(name)
    }
    assert replaced >= set(REFUSED), "payhook's dashboard no longer replaces a refused view"
    assert replaced <= set(shipped), changed("rq-dashboard", "its endpoint names")


def test_payhook_views_take_the_url_variables_rq_dashboard_routes_give() -> None:
    shipped = rq_dashboard_app().view_functions
    payhook = payhook_dashboard()
    rules: dict[str, list[set[str]]] = {}
    for rule in payhook.url_map.iter_rules():
        rules.setdefault(rule.endpoint, []).append(set(rule.arguments) | set(rule.defaults or {}))
    for name, view in payhook.view_functions.items():
        if not name.startswith(f"{compat.RQ_DASHBOARD}.") or view is shipped.get(name):
            continue
        parameters = inspect.signature(view).parameters.values()
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
            continue
        taken = {p.name for p in parameters}
        for arguments in rules[name]:
            assert arguments == taken, changed(
                "rq-dashboard", f"the URL variables of {name} ({sorted(arguments)})"
            )


def test_rq_dashboard_connects_each_request_in_a_blueprint_hook() -> None:
    import rq_dashboard.web as web

    hooks = rq_dashboard_app().before_request_funcs.get(compat.RQ_DASHBOARD)
    assert hooks == [web.push_rq_connection], changed(
        "rq-dashboard", "its blueprint's before-request hook (`push_rq_connection`)"
    )
    replaced = payhook_dashboard().before_request_funcs[compat.RQ_DASHBOARD]
    assert web.push_rq_connection not in replaced


def test_rq_dashboard_views_use_the_configured_serializer_and_app_connection() -> None:
    import rq_dashboard.web as web

    assert hasattr(web.config, "serializer"), changed("rq-dashboard", "`web.config.serializer`")
    source = inspect.getsource(web)
    assert "serializer=config.serializer" in source, changed(
        "rq-dashboard", "how its views choose a serializer"
    )
    assert "current_app.redis_conn" in source, changed(
        "rq-dashboard", "where its views find their Redis connection (`app.redis_conn`)"
    )
    app = Flask(__name__)
    app.config["RQ_DASHBOARD_REDIS_URL"] = NO_REDIS
    redis = offline_redis()
    compat.give_rq_dashboard_connection(app, redis)
    assert app.redis_conn is redis  # type: ignore[attr-defined]
    assert app.config["RQ_DASHBOARD_REDIS_URL"] == (NO_REDIS,), changed(
        "rq-dashboard", "`web.setup_rq_connection`, which lists the instances' URLs"
    )


def test_rq_dashboard_helpers_payhook_views_call_are_there() -> None:
    """control.dashboard renders rq-dashboard's pages with its own helpers."""
    import rq_dashboard.web as web

    for name in ("pagination_window", "escape_format_instance_list"):
        assert callable(getattr(web, name, None)), changed("rq-dashboard", f"`web.{name}`")
    for name in ("rq_dashboard_version", "rq_version", "blueprint"):
        assert hasattr(web, name), changed("rq-dashboard", f"`web.{name}`")
    loader = web.blueprint.jinja_loader
    for template in ("rq_dashboard/jobs.html", "rq_dashboard/job.html"):
        source, _, _ = loader.get_source(Flask(__name__).jinja_env, template)
        assert "{% block content %}" in source, changed(
            "rq-dashboard", f"the template {template} (its content block)"
        )


def test_replacing_an_endpoint_rq_dashboard_lacks_is_refused() -> None:
    app = rq_dashboard_app()
    with pytest.raises(IncompatibleDependency, match=r"rq_dashboard\.no_such_view"):
        compat.replace_rq_dashboard_views(app, {"rq_dashboard.no_such_view": lambda: None})
    with pytest.raises(IncompatibleDependency, match="before-request"):
        compat.replace_rq_dashboard_before_request(Flask(__name__), [])


# -- nowhere else ---------------------------------------------------------------


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def is_ours(klass: type) -> bool:
    return klass.__module__.split(".")[0] in PACKAGES


def declared(node: ast.ClassDef) -> set[str]:
    """Names a class of ours makes its own: in its body, its `__slots__`, and
    the attributes its `__init__` sets on `self`."""
    names: set[str] = set()
    for statement in node.body:
        if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(statement.name)
        elif isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            names.add(statement.target.id)
        elif isinstance(statement, ast.Assign):
            for target in statement.targets:
                if not isinstance(target, ast.Name):
                    continue
                names.add(target.id)
                if target.id == "__slots__" and isinstance(statement.value, ast.Tuple | ast.List):
                    names.update(
                        item.value
                        for item in statement.value.elts
                        if isinstance(item, ast.Constant) and isinstance(item.value, str)
                    )
        if isinstance(statement, ast.FunctionDef) and statement.name == "__init__":
            names.update(
                target.attr
                for target in ast.walk(statement)
                if isinstance(target, ast.Attribute)
                and isinstance(target.ctx, ast.Store)
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
            )
    return names


def annotation_nodes(tree: ast.Module) -> Iterator[ast.expr]:
    for node in ast.walk(tree):
        if isinstance(node, ast.arg | ast.AnnAssign) and node.annotation is not None:
            yield node.annotation
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns:
            yield node.returns


def class_nodes(tree: ast.Module) -> Iterator[ast.ClassDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            yield node


def touches(source: str, filename: str, namespace: dict[str, Any]) -> list[str]:
    """Where `source` touches another library's private names: attributes,
    methods overridden or set, `getattr` by name, and private modules or
    names imported. `namespace` is the module's, to find its classes' bases."""
    tree = ast.parse(source, filename=filename)
    found: list[str] = []
    # Annotations are never run (`from __future__ import annotations`), and
    # mypy checks them against each upgrade: a private type there may stay.
    in_annotations = {
        id(inner) for annotation in annotation_nodes(tree) for inner in ast.walk(annotation)
    }

    def note(node: ast.AST, what: str) -> None:
        found.append(f"{filename}:{getattr(node, 'lineno', '?')}: {what}")

    for node in ast.walk(tree):
        if id(node) in in_annotations:
            continue
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in {"self", "cls"}):
                note(node, f"`.{node.attr}` of an object not its own class's")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in {"getattr", "setattr", "hasattr", "delattr"} and len(node.args) > 1:
                name = node.args[1]
                if isinstance(name, ast.Constant) and isinstance(name.value, str):
                    if is_private(name.value):
                        note(node, f"{node.func.id}(..., {name.value!r})")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] not in PACKAGES and parts[0] != "__future__":
                if any(is_private(part) for part in parts[1:]):
                    note(node, f"imports the private module {node.module}")
                for alias in node.names:
                    if is_private(alias.name):
                        note(node, f"imports {alias.name} from {node.module}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] not in PACKAGES and any(is_private(part) for part in parts[1:]):
                    note(node, f"imports the private module {alias.name}")

    for node in class_nodes(tree):
        klass = namespace.get(node.name)
        theirs: list[Any]
        if isinstance(klass, type):
            theirs = [
                base for base in klass.__mro__[1:] if not is_ours(base) and base is not object
            ]
            own = set().union(
                *(
                    OWN_NAMES.get((base.__module__, base.__qualname__), set())
                    for base in klass.__mro__
                    if is_ours(base)
                ),
                declared(node),
            )
        else:  # defined inside a function: judged by its body alone
            theirs = [b for b in node.bases if not ast.unparse(b) == "object"]
            own = declared(node)
        if not theirs:
            continue
        for member in sorted(declared(node)):
            owners = [
                base.__qualname__
                for base in theirs
                if isinstance(base, type) and member in vars(base)
            ]
            if is_private(member) and owners:
                note(node, f"{node.name} overrides {owners[0]}.{member}")
        for inner in ast.walk(node):
            if (
                isinstance(inner, ast.Attribute)
                and is_private(inner.attr)
                and isinstance(inner.value, ast.Name)
                and inner.value.id in {"self", "cls"}
                and inner.attr not in own
            ):
                note(inner, f"{node.name} uses `{inner.attr}`, not its own: another library's")
    return found


def package_files() -> Iterator[tuple[str, Path]]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT)
            module = ".".join(relative.with_suffix("").parts).removesuffix(".__init__")
            yield module, path


def own_names() -> dict[tuple[str, str], set[str]]:
    names: dict[tuple[str, str], set[str]] = {}
    for module, path in package_files():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                names[(module, node.name)] = declared(node)
    return names


#: Per class of ours (module, name), the names it makes its own.
OWN_NAMES = own_names()


def scan(path: Path, module: str) -> list[str]:
    namespace = vars(importlib.import_module(module))
    return touches(path.read_text(), str(path.relative_to(ROOT)), namespace)


def test_no_private_name_of_another_library_is_touched_outside_compat() -> None:
    found = [
        touch
        for module, path in package_files()
        if path != ROOT / "payhook" / "compat.py" and str(path.relative_to(ROOT)) not in EXEMPT
        for touch in scan(path, module)
    ]
    assert found == [], (
        "touch these through payhook/compat.py, with a contract test:\n" + "\n".join(found)
    )


SNIPPET = """
from rq.job import Job, _private_helper
from rq.worker import SimpleWorker
import httpx._transports


class Reading(Job):
    own: int = 0

    def __init__(self) -> None:
        self._mine = 1

    def _deserialize_data(self) -> None:
        super()._deserialize_data()

    def check(self) -> object:
        return self._mine, self._success_callback_name


class Working(SimpleWorker):
    def busy(self) -> None:
        self._state = "busy"


def writer(connection, transport, pool):
    transport._pool = pool
    return connection._writer, getattr(connection, "_reader")


def typed(sub: argparse._SubParsersAction) -> argparse._ActionsContainer:
    return sub
"""


def test_the_scan_finds_each_kind_of_touch() -> None:
    from rq.job import Job
    from rq.worker import SimpleWorker

    namespace: dict[str, Any] = {"Job": Job, "SimpleWorker": SimpleWorker}
    namespace["Reading"] = type("Reading", (Job,), {"__module__": "payhook.snippet"})
    namespace["Working"] = type("Working", (SimpleWorker,), {"__module__": "payhook.snippet"})
    found = "\n".join(touches(SNIPPET, "snippet.py", namespace))
    for expected in (
        "imports _private_helper from rq.job",
        "imports the private module httpx._transports",
        "Reading overrides Job._deserialize_data",
        "`._deserialize_data` of an object not its own class's",
        "Reading uses `_success_callback_name`, not its own",
        "Working uses `_state`, not its own",
        "`._pool` of an object",
        "`._writer` of an object",
        "getattr(..., '_reader')",
    ):
        assert expected in found, (expected, found)
    assert "_mine" not in found
    assert "argparse" not in found, "annotations are left to mypy"


def test_the_scan_sees_what_compat_touches() -> None:
    """Not vacuous on the real source: compat's own touches are found."""
    path = ROOT / "payhook" / "compat.py"
    found = "\n".join(scan(path, "payhook.compat"))
    for name in ("_writer", "_pool", "_lock", "_state", "_dependency_ids", "_deserialize_data"):
        assert name in found, name
