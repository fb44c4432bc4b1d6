"""The Kubernetes manifests (`deploy/kubernetes`), checked offline.

- `kubectl kustomize` builds the base and the example overlay; without
  kubectl the tests fail and say to run `scripts/kubectl.sh`;
- every object built validates against the Kubernetes API's schemas
  (kubernetes-validate, strict: an unknown field fails) of Kubernetes 1.30,
  the oldest release the manifests use fields of, and 1.37;
- the ScaledObject and its TriggerAuthentication validate against KEDA's CRD
  schemas (`tests/fixtures/keda`, see its SOURCES.md), unknown fields refused
  as the API server's strict field validation refuses them;
- the invariants the manifests keep: every container non-root, with a
  read-only root filesystem and no privilege escalation; a
  PodDisruptionBudget for every Deployment; the consumers' grace period above
  the job timeout; the ingress's probes on /healthz and /readyz; credentials
  reaching pods only from the Secret `payhook`, the owner's database URL only
  the migration Job; KEDA watching the list of the queue payhook uses; the
  commands, replicas, labels, resources and Services.
"""

from __future__ import annotations

import copy
import functools
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from packaging.version import Version
from redis import Redis

from control.cli import build_parser
from payhook.queue import events_queue
from payhook.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
KEDA_CRDS = ROOT / "tests" / "fixtures" / "keda"
BUILDS = ("base", "overlays/example")
#: The oldest Kubernetes the manifests need (the preStop `sleep` action is on
#: by default from 1.30), and the newest kubernetes-validate 1.37 knows.
KUBERNETES_VERSIONS = ("1.30", "1.37")
#: The Deployments, with their replicas (as compose.yaml runs them).
DEPLOYMENTS = {
    "payhook-ingress": ("ingress", 2),
    "payhook-consumer": ("consumer", 3),
    "payhook-outbox-worker": ("outbox-worker", 2),
    "payhook-dashboard": ("dashboard", 1),
}
#: Environment variables that carry credentials: from the Secret, never literal.
CREDENTIALS = {"DATABASE_URL", "REDIS_URL", "PAYHOOK_SECRETS_KEY", "PAYHOOK_DASHBOARD_PASSWORD"}
SECRET = "payhook"
OWNER_KEY = "DATABASE_OWNER_URL"

Manifest = dict[str, Any]


@functools.cache
def _kustomize(folder: str) -> tuple[Manifest, ...]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is not installed: run scripts/kubectl.sh (as root) to install it")
    done = subprocess.run(
        [kubectl, "kustomize", str(KUBERNETES / folder)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if done.returncode != 0:
        version = subprocess.run(
            [kubectl, "version", "--client"], capture_output=True, text=True, check=False
        )
        pytest.fail(
            f"kubectl kustomize {folder}:\n{done.stderr}\n{version.stdout}"
            "the manifests build with kustomize v2 (Debian's kubectl 1.20) and newer"
        )
    return tuple(item for item in yaml.safe_load_all(done.stdout) if item)


def build(folder: str) -> list[Manifest]:
    """The objects `kubectl kustomize deploy/kubernetes/FOLDER` prints, a fresh copy."""
    return copy.deepcopy(list(_kustomize(folder)))


def overlay() -> list[Manifest]:
    return build("overlays/example")


def of_kind(objects: list[Manifest], kind: str) -> list[Manifest]:
    return [item for item in objects if item["kind"] == kind]


def named(objects: list[Manifest], kind: str, name: str) -> Manifest:
    [found] = [item for item in of_kind(objects, kind) if item["metadata"]["name"] == name]
    return found


def pod_specs(objects: list[Manifest]) -> Iterator[tuple[str, Manifest]]:
    """Every pod template: a Deployment's or a Job's, with the owner's name."""
    for item in objects:
        if item["kind"] in {"Deployment", "Job"}:
            yield item["metadata"]["name"], item["spec"]["template"]


def containers(pod: Manifest) -> list[Manifest]:
    spec = pod["spec"]
    found: list[Manifest] = spec["containers"] + spec.get("initContainers", [])
    return found


def selects(selector: Manifest, labels: dict[str, str]) -> bool:
    assert set(selector) == {"matchLabels"}, "only matchLabels selectors are checked here"
    return all(labels.get(key) == value for key, value in selector["matchLabels"].items())


def environment(objects: list[Manifest], container: Manifest) -> dict[str, str]:
    """The literal settings a container gets: its ConfigMaps' and its own `value`s."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            config = named(objects, "ConfigMap", source["configMapRef"]["name"])
            env |= {source.get("prefix", "") + k: v for k, v in config["data"].items()}
    env |= {item["name"]: item["value"] for item in container.get("env", []) if "value" in item}
    return env


def the_container(objects: list[Manifest], deployment: str) -> Manifest:
    found: list[Manifest] = named(objects, "Deployment", deployment)["spec"]["template"]["spec"][
        "containers"
    ]
    assert len(found) == 1, deployment
    return found[0]


def settings_of(objects: list[Manifest], deployment: str) -> Settings:
    """What `Settings.from_env` makes of a Deployment's literal settings."""
    return Settings.from_env(environment(objects, the_container(objects, deployment)))


# -- building and schemas ----------------------------------------------------------


@pytest.mark.parametrize("folder", BUILDS)
def test_kustomize_builds_every_object(folder: str) -> None:
    objects = build(folder)
    kinds = sorted((item["kind"], item["metadata"]["name"]) for item in objects)
    expected = {
        ("ServiceAccount", "payhook"),
        ("Job", "payhook-migrate"),
        ("Service", "payhook-ingress"),
        ("Service", "payhook-dashboard"),
        ("HorizontalPodAutoscaler", "payhook-ingress"),
        ("ScaledObject", "payhook-consumer"),
        ("TriggerAuthentication", "payhook-redis"),
        *(("Deployment", name) for name in DEPLOYMENTS),
        *(("PodDisruptionBudget", name) for name in DEPLOYMENTS),
    }
    if folder != "base":
        expected |= {("Namespace", "payhook"), ("Secret", SECRET)}
    [config] = of_kind(objects, "ConfigMap")
    assert config["metadata"]["name"].startswith("payhook-")
    assert set(kinds) - {("ConfigMap", config["metadata"]["name"])} == expected
    assert len(kinds) == len(set(kinds))


def test_the_base_holds_no_secret_and_the_overlay_sets_namespace_and_image() -> None:
    assert not of_kind(build("base"), "Secret")
    objects = overlay()
    for item in objects:
        if item["kind"] != "Namespace":
            assert item["metadata"]["namespace"] == "payhook", item["metadata"]["name"]
    images = {c["image"] for _, pod in pod_specs(objects) for c in containers(pod)}
    assert images == {"registry.example.com/payhook:0.2.0"}
    assert {c["image"] for _, pod in pod_specs(build("base")) for c in containers(pod)} == {
        "payhook"
    }


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("folder", BUILDS)
def test_every_object_validates_against_the_kubernetes_api(folder: str, version: str) -> None:
    known = kubernetes_validate.latest_version()
    assert Version(known) >= Version(version), (
        f"kubernetes-validate {kubernetes_validate.__version__} has schemas up to {known}: "
        "pip install 'kubernetes-validate>=1.37'"
    )
    errors: list[str] = []
    for item in build(folder):
        if item["apiVersion"].startswith("keda.sh/"):
            continue  # KEDA's own schemas, below
        where = f"{item['kind']}/{item['metadata']['name']}"
        try:
            kubernetes_validate.validate(item, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            path = ".".join(str(part) for part in error.path)
            errors.append(f"{where}: {path}: {error.message}")
        except kubernetes_validate.SchemaNotFoundError as error:
            errors.append(f"{where}: {error.message}")
    assert not errors, "\n".join(errors)


def _strict(schema: Any) -> Any:
    """The schema with unknown fields refused wherever it lists the known ones."""
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {key: _strict(value) for key, value in schema.items()}
    if (
        "properties" in strict
        and "additionalProperties" not in strict
        and not strict.get("x-kubernetes-preserve-unknown-fields", False)
    ):
        strict["additionalProperties"] = False
    return strict


def keda_schema(kind: str) -> Manifest:
    """The openAPIV3Schema of KEDA's CRD for `kind`, version v1alpha1."""
    path = KEDA_CRDS / f"keda.sh_{kind.lower()}s.yaml"
    crd = yaml.safe_load(path.read_text())
    assert crd["spec"]["names"]["kind"] == kind
    [version] = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    schema: Manifest = _strict(version["schema"]["openAPIV3Schema"])
    return schema


def keda_errors(item: Manifest) -> list[str]:
    validator = jsonschema.Draft202012Validator(keda_schema(item["kind"]))
    return sorted(
        f"{'.'.join(str(part) for part in error.absolute_path)}: {error.message}"
        for error in validator.iter_errors(item)
    )


@pytest.mark.parametrize("folder", BUILDS)
def test_the_keda_objects_validate_against_kedas_crds(folder: str) -> None:
    objects = build(folder)
    keda = [item for item in objects if item["apiVersion"].startswith("keda.sh/")]
    assert sorted(item["kind"] for item in keda) == ["ScaledObject", "TriggerAuthentication"]
    for item in keda:
        assert item["apiVersion"] == "keda.sh/v1alpha1"
        assert keda_errors(item) == [], item["kind"]
    # The check refuses what the API server would.
    scaled = copy.deepcopy(named(objects, "ScaledObject", "payhook-consumer"))
    scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behaviour"] = {}
    scaled["spec"]["triggers"][0].pop("type")
    assert len(keda_errors(scaled)) == 2


# -- invariants -----------------------------------------------------------------------


@pytest.mark.parametrize("folder", BUILDS)
def test_every_container_runs_non_root_read_only_without_privilege_escalation(
    folder: str,
) -> None:
    pods = list(pod_specs(build(folder)))
    assert {name for name, _ in pods} == {*DEPLOYMENTS, "payhook-migrate"}
    for name, pod in pods:
        spec = pod["spec"]
        pod_context = spec["securityContext"]
        assert pod_context["runAsNonRoot"] is True, name
        assert pod_context["runAsUser"] == 10001 and pod_context["runAsGroup"] == 10001, name
        for container in containers(pod):
            context = pod_context | container.get("securityContext", {})
            where = f"{name}/{container['name']}"
            assert context["runAsNonRoot"] is True, where
            assert context["runAsUser"] == 10001, where
            assert context["readOnlyRootFilesystem"] is True, where
            assert context["allowPrivilegeEscalation"] is False, where
            assert context.get("privileged", False) is False, where
            assert context["capabilities"]["drop"] == ["ALL"], where
            assert not context["capabilities"].get("add"), where
            assert context["seccompProfile"]["type"] == "RuntimeDefault", where


@pytest.mark.parametrize("folder", BUILDS)
def test_every_pod_has_tmp_and_no_token_nor_service_variables(folder: str) -> None:
    """/tmp is the image's WORKDIR, writable on an emptyDir. Without
    `enableServiceLinks: false` the Service payhook-dashboard would set
    PAYHOOK_DASHBOARD_PORT=tcp://..., which the dashboard refuses."""
    objects = build(folder)
    assert named(objects, "ServiceAccount", "payhook")["automountServiceAccountToken"] is False
    for name, pod in pod_specs(objects):
        spec = pod["spec"]
        assert spec["serviceAccountName"] == "payhook", name
        assert spec["automountServiceAccountToken"] is False, name
        assert spec["enableServiceLinks"] is False, name
        volumes = {volume["name"]: volume for volume in spec["volumes"]}
        for container in containers(pod):
            [tmp] = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
            assert "emptyDir" in volumes[tmp["name"]], name
            assert not tmp.get("readOnly", False), name


@pytest.mark.parametrize("folder", BUILDS)
def test_every_deployment_has_a_disruption_budget_selecting_it(folder: str) -> None:
    objects = build(folder)
    budgets = of_kind(objects, "PodDisruptionBudget")
    for deployment in of_kind(objects, "Deployment"):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        name = deployment["metadata"]["name"]
        mine = [b for b in budgets if selects(b["spec"]["selector"], labels)]
        assert len(mine) == 1, name
        [budget] = mine
        assert budget["spec"].get("maxUnavailable") == 1 or (
            budget["spec"].get("minAvailable") == 1 and deployment["spec"]["replicas"] > 1
        ), name
    # and each budget selects one Deployment's pods, no other pods
    for budget in budgets:
        chosen = [
            name
            for name, pod in pod_specs(objects)
            if selects(budget["spec"]["selector"], pod["metadata"]["labels"])
        ]
        assert len(chosen) == 1 and chosen[0] in DEPLOYMENTS, budget["metadata"]["name"]


@pytest.mark.parametrize("folder", BUILDS)
def test_consumers_grace_period_outlasts_the_job_timeout(folder: str) -> None:
    """The ingress writes its PAYHOOK_JOB_TIMEOUT into each job; the consumer
    runs it under that. A warm shutdown lets the job in hand finish."""
    objects = build(folder)
    consumer = settings_of(objects, "payhook-consumer").job_timeout
    ingress = settings_of(objects, "payhook-ingress").job_timeout
    assert consumer == ingress
    grace = named(objects, "Deployment", "payhook-consumer")["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"
    ]
    assert grace > consumer, (grace, consumer)
    graces = {
        name: named(objects, "Deployment", name)["spec"]["template"]["spec"].get(
            "terminationGracePeriodSeconds", 30
        )
        for name in DEPLOYMENTS
    }
    assert graces["payhook-outbox-worker"] >= 45
    assert graces["payhook-ingress"] == 30


@pytest.mark.parametrize("folder", BUILDS)
def test_probes_hit_healthz_and_readyz_and_workers_have_none(folder: str) -> None:
    objects = build(folder)

    def http(container: Manifest, probe: str) -> tuple[str, int]:
        action = container[probe]["httpGet"]
        [port] = [
            p for p in container["ports"] if action["port"] in (p["name"], p["containerPort"])
        ]
        return action["path"], port["containerPort"]

    ingress = the_container(objects, "payhook-ingress")
    assert http(ingress, "livenessProbe") == ("/healthz", 8000)
    assert http(ingress, "readinessProbe") == ("/readyz", 8000)
    assert http(ingress, "startupProbe") == ("/healthz", 8000)
    dashboard = the_container(objects, "payhook-dashboard")
    assert http(dashboard, "livenessProbe") == ("/healthz", 9181)
    assert http(dashboard, "readinessProbe") == ("/healthz", 9181)
    for worker in ("payhook-consumer", "payhook-outbox-worker"):
        container = the_container(objects, worker)
        assert not {"ports", "livenessProbe", "readinessProbe", "startupProbe"} & set(container)


@pytest.mark.parametrize("folder", BUILDS)
def test_credentials_reach_pods_only_from_the_secret(folder: str) -> None:
    objects = build(folder)
    for config in of_kind(objects, "ConfigMap"):
        assert not (CREDENTIALS | {OWNER_KEY}) & set(config["data"])
        assert not [value for value in config["data"].values() if "://" in value]
    for name, pod in pod_specs(objects):
        assert not [v for v in pod["spec"]["volumes"] if "secret" in v or "projected" in v]
        for container in containers(pod):
            where = f"{name}/{container['name']}"
            for source in container.get("envFrom", []):
                # every key of the Secret would reach the pod, the owner's URL too
                assert "secretRef" not in source, where
            env = {item["name"]: item for item in container.get("env", [])}
            for item in env.values():
                if "valueFrom" in item and "secretKeyRef" in item["valueFrom"]:
                    assert item["valueFrom"]["secretKeyRef"]["name"] == SECRET, where
                if "value" in item:
                    assert item["name"] not in CREDENTIALS | {OWNER_KEY}, where
                    assert "://" not in item["value"], where
            for variable in CREDENTIALS & set(env):
                assert "secretKeyRef" in env[variable]["valueFrom"], f"{where} {variable}"
            keys = {
                item["valueFrom"]["secretKeyRef"]["key"]: item["name"]
                for item in env.values()
                if "secretKeyRef" in item.get("valueFrom", {})
            }
            if name == "payhook-migrate":
                # the migration runs as the schema's owner
                assert keys == {
                    OWNER_KEY: "DATABASE_URL",
                    "PAYHOOK_SECRETS_KEY": "PAYHOOK_SECRETS_KEY",
                }
            else:
                assert OWNER_KEY not in keys, where
                assert all(key == variable for key, variable in keys.items()), where
    for name in ("payhook-ingress", "payhook-consumer", "payhook-outbox-worker"):
        variables = {item["name"] for item in the_container(objects, name)["env"]}
        assert {"DATABASE_URL", "REDIS_URL", "PAYHOOK_SECRETS_KEY"} <= variables, name
    variables = {item["name"] for item in the_container(objects, "payhook-dashboard")["env"]}
    assert {"DATABASE_URL", "REDIS_URL", "PAYHOOK_DASHBOARD_PASSWORD"} <= variables


def test_the_example_secret_holds_every_key_the_manifests_read() -> None:
    objects = overlay()
    secret = named(objects, "Secret", SECRET)
    read = {
        item["valueFrom"]["secretKeyRef"]["key"]
        for _, pod in pod_specs(objects)
        for container in containers(pod)
        for item in container.get("env", [])
        if "secretKeyRef" in item.get("valueFrom", {})
    }
    auth = named(objects, "TriggerAuthentication", "payhook-redis")["spec"]["secretTargetRef"]
    assert all(ref["name"] == SECRET for ref in auth)
    read |= {ref["key"] for ref in auth}
    assert set(secret["stringData"]) == read
    assert all(
        "CHANGE-ME" in value
        for key, value in secret["stringData"].items()
        if key != "REDIS_ADDRESS"
    )


@pytest.mark.parametrize("folder", BUILDS)
def test_keda_scales_consumers_on_the_list_of_the_events_queue(folder: str) -> None:
    objects = build(folder)
    settings = settings_of(objects, "payhook-consumer")
    connection = Redis()  # never connects: the queue's key is a name
    try:
        key = events_queue(connection, settings).key
    finally:
        connection.close()
    assert key == "rq:queue:" + Settings.from_env({}).queue == "rq:queue:payhook-events"
    scaled = named(objects, "ScaledObject", "payhook-consumer")["spec"]
    assert scaled["scaleTargetRef"]["name"] == "payhook-consumer"
    assert named(objects, "Deployment", scaled["scaleTargetRef"]["name"])
    assert (scaled["minReplicaCount"], scaled["maxReplicaCount"]) == (2, 20)
    [trigger] = scaled["triggers"]
    assert trigger["type"] == "redis"
    assert trigger["metadata"]["listName"] == key
    assert int(trigger["metadata"]["listLength"]) > 0
    assert named(objects, "TriggerAuthentication", trigger["authenticationRef"]["name"])
    behavior = scaled["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] > 0


@pytest.mark.parametrize("folder", BUILDS)
def test_the_ingress_scales_on_cpu(folder: str) -> None:
    objects = build(folder)
    hpa = named(objects, "HorizontalPodAutoscaler", "payhook-ingress")["spec"]
    target = hpa["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "payhook-ingress")
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 10)
    [metric] = hpa["metrics"]
    assert metric["resource"]["name"] == "cpu"
    assert metric["resource"]["target"]["type"] == "Utilization"
    # Utilization is of the request: the ingress must have one
    assert the_container(objects, "payhook-ingress")["resources"]["requests"]["cpu"]


@pytest.mark.parametrize("folder", BUILDS)
def test_commands_replicas_and_labels(folder: str) -> None:
    objects = build(folder)
    parser = build_parser()
    for item in objects:
        assert item["metadata"]["labels"]["app.kubernetes.io/name"] == "payhook", item["kind"]
    for name, pod in pod_specs(objects):
        [container] = pod["spec"]["containers"]
        args = parser.parse_args(container["args"])
        assert args.command == container["args"][0], name
        component = pod["metadata"]["labels"]["app.kubernetes.io/component"]
        assert component == container["args"][0] == container["name"], name
        assert pod["metadata"]["labels"]["app.kubernetes.io/name"] == "payhook", name
        assert "command" not in container, name  # the image's entrypoint, `payhook`
    for name, (component, replicas) in DEPLOYMENTS.items():
        deployment = named(objects, "Deployment", name)
        assert deployment["spec"]["replicas"] == replicas, name
        assert deployment["metadata"]["labels"]["app.kubernetes.io/component"] == component
        assert deployment["spec"]["selector"]["matchLabels"] == {
            "app.kubernetes.io/name": "payhook",
            "app.kubernetes.io/component": component,
        }
    assert parser.parse_args(the_container(objects, "payhook-dashboard")["args"]).host == "0.0.0.0"
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    for name, (component, replicas) in DEPLOYMENTS.items():
        assert compose[component].get("deploy", {}).get("replicas", 1) == replicas, name


@pytest.mark.parametrize("folder", BUILDS)
def test_every_container_requests_and_limits_cpu_and_memory(folder: str) -> None:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}

    def memory(value: str) -> int:
        return int(value[:-2]) * units[value[-2:]]

    for name, pod in pod_specs(build(folder)):
        for container in containers(pod):
            resources = container["resources"]
            assert set(resources["requests"]) == set(resources["limits"]) == {"cpu", "memory"}
            request = memory(resources["requests"]["memory"])
            limit = memory(resources["limits"]["memory"])
            assert request <= limit <= 4 * request, name


@pytest.mark.parametrize("folder", BUILDS)
def test_services_reach_their_pods(folder: str) -> None:
    objects = build(folder)
    for name, port, target in (("payhook-ingress", 80, 8000), ("payhook-dashboard", 9181, 9181)):
        service = named(objects, "Service", name)["spec"]
        assert service["type"] == "ClusterIP", name
        [entry] = service["ports"]
        pods = [
            pod
            for _, pod in pod_specs(objects)
            if selects({"matchLabels": service["selector"]}, pod["metadata"]["labels"])
        ]
        assert len(pods) == 1, name
        [container] = pods[0]["spec"]["containers"]
        [named_port] = [p for p in container["ports"] if p["name"] == entry["targetPort"]]
        assert (entry["port"], named_port["containerPort"]) == (port, target), name


@pytest.mark.parametrize("folder", BUILDS)
def test_the_migration_job_runs_once_and_is_cleaned_up(folder: str) -> None:
    job = named(build(folder), "Job", "payhook-migrate")["spec"]
    assert job["template"]["spec"]["restartPolicy"] == "Never"
    assert 0 < job["backoffLimit"] <= 6
    assert job["ttlSecondsAfterFinished"] > 0
    [container] = job["template"]["spec"]["containers"]
    assert container["args"] == ["migrate"]
