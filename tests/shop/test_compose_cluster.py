"""docker-compose.cluster.yml, on top of docker-compose.yml: the shop on a six-node Redis
Cluster, scalable web and workers behind one load balancer, and a distributed Locust (Docker is
not run).

The stack is the two files merged as compose merges them (`merged_stack`: maps key by key,
volumes by their path in the container, anything else replaced); where Debian's
docker-compose is installed (`make compose`), its `config` merges and validates them for real.
"""

from __future__ import annotations

import ast
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.shop.test_compose import check_entry_points, django_commands, shell_commands

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_FILE = "docker-compose.cluster.yml"
APP_SERVICES = ("web", "worker", "beat")
SCALED = ("web", "worker", "locust-worker")
DOCKER_COMPOSE = shutil.which("docker-compose")

pytestmark = pytest.mark.embedded_smoke


def _load(name: str) -> dict:
    return yaml.safe_load((ROOT / name).read_text())


def _target(volume: str) -> str:
    return volume.split(":")[1]


def _merge(base, override):
    """`override` read on top of `base` as compose reads a second -f file, for what these files
    hold: maps merged key by key, a service's volumes by their path in the container, any other
    value replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for key, value in override.items():
            if key == "volumes" and isinstance(value, list):
                by_target = {_target(volume): volume for volume in base.get(key, [])}
                by_target.update({_target(volume): volume for volume in value})
                merged[key] = list(by_target.values())
            else:
                merged[key] = _merge(base[key], value) if key in base else value
        return merged
    return override


def merged_stack() -> dict:
    return _merge(_load("docker-compose.yml"), _load(CLUSTER_FILE))


@pytest.fixture(scope="module")
def plain() -> dict:
    return _load("docker-compose.yml")["services"]


@pytest.fixture(scope="module")
def override() -> dict:
    return _load(CLUSTER_FILE)["services"]


@pytest.fixture(scope="module")
def stack() -> dict:
    return merged_stack()["services"]


def _env(service: dict) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {key: str(value) for key, value in env.items()}


def _node_names(services: dict) -> list[str]:
    return sorted(name for name in services if re.fullmatch(r"redis-node-\d+", name))


def _flags(command: list[str]) -> dict[str, str]:
    """`--name value` pairs of a command line."""
    return {
        word: command[index + 1]
        for index, word in enumerate(command[:-1])
        if word.startswith("--") and not command[index + 1].startswith("--")
    }


def _cluster_nodes_setting(services: dict) -> list[str]:
    return [f"{name}:6379" for name in _node_names(services)]


# ------------------------------------------------------------------------------ the cluster


def test_six_cluster_enabled_nodes_persist_no_data_and_report_their_health(override):
    nodes = _node_names(override)
    assert len(nodes) == 6, nodes
    for name in nodes:
        node = override[name]
        assert node["image"] == "redis:7-alpine"
        command = node["command"]
        assert command[0] == "redis-server"
        flags = _flags(command)
        assert flags["--cluster-enabled"] == "yes", name
        assert flags["--save"] == "" and flags["--appendonly"] == "no", name
        assert node["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"], name
        assert not node.get("ports") and not node.get("container_name"), name


def test_the_job_forms_the_cluster_from_every_node_once_they_are_healthy(override):
    job = override["redis-cluster"]
    assert job["image"] == "redis:7-alpine"
    assert job["restart"] == "no"  # one shot: it exits 0 and stays down
    nodes = _node_names(override)
    assert {name: dependency["condition"] for name, dependency in job["depends_on"].items()} == {
        name: "service_healthy" for name in nodes
    }
    # it forms the cluster out of the very nodes the app is told about
    assert _env(job)["REDIS_CLUSTER_NODES"].split(",") == _cluster_nodes_setting(override)
    # and runs the script it mounts, which asks for one replica per master
    source, target = job["volumes"][0].split(":")[:2]
    assert shell_commands(job["command"]) == [["sh", target]]
    script = (ROOT / source).read_text()
    create = next(
        line for line in script.splitlines() if line.startswith("redis-cli --cluster create")
    )
    assert "--cluster-replicas 1" in create and "--cluster-yes" in create, create
    assert "$REDIS_CLUSTER_NODES" in script or "${REDIS_CLUSTER_NODES" in script


# ------------------------------------------------------------------------------ the app on it


@pytest.mark.parametrize("name", APP_SERVICES)
def test_app_services_name_every_node_and_a_broker_of_their_own(stack, name):
    service = stack[name]
    env = _env(service)
    assert sorted(env["REDIS_CLUSTER_NODES"].split(",")) == _cluster_nodes_setting(stack)
    # Celery's Redis transport cannot use a cluster: RabbitMQ is the broker
    assert re.fullmatch(r"amqp://[^@]+@rabbitmq:5672/.*", env["CELERY_BROKER_URL"])
    depends = service["depends_on"]
    for job in ("redis-cluster", "migrate"):
        assert depends[job]["condition"] == "service_completed_successfully", job
    for dependency in ("postgres", "rabbitmq"):
        assert depends[dependency]["condition"] == "service_healthy"
    # the rest of the service is docker-compose.yml's: same image, command, database (web's
    # command binding a port for the balancer where docker-compose.yml's binds the socket its
    # one proxy shares)
    plain = _load("docker-compose.yml")["services"][name]
    assert _unbound(service["command"]) == _unbound(plain["command"])
    assert service["image"] == plain["image"]
    assert env["DATABASE_URL"] == _env(plain)["DATABASE_URL"]


def _unbound(command: list[str]) -> str:
    """A service's command without where its web server binds (a port, or a unix socket)."""
    script = " ".join(command)
    script = re.sub(r" --host \S+ --port \S+", "", script)
    return re.sub(r" --uds \S+", "", script)


def test_the_database_is_migrated_once_before_the_app_starts(stack):
    job = stack["migrate"]
    assert "manage.py migrate" in check_entry_points(job["command"], django_commands())
    assert job["restart"] == "no"
    assert job["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    # the app's database, from the app's image
    assert _env(job)["DATABASE_URL"] == _env(stack["web"])["DATABASE_URL"]
    assert (job["build"], job["image"]) == (stack["web"]["build"], stack["web"]["image"])


def _shop_settings(env: dict[str, str]) -> subprocess.CompletedProcess:
    """The settings the shop builds from `env`, read by the shop itself."""
    code = (
        "import json, django; django.setup(); from django.conf import settings; "
        "from inventory.redis_client import cluster_nodes, is_cluster; "
        "print(json.dumps({'cluster': is_cluster(), 'broker': settings.CELERY_BROKER_URL, "
        "'nodes': [f'{n.host}:{n.port}' for n in cluster_nodes(settings.REDIS_CLUSTER_NODES)]}))"
    )
    keep = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("DJANGO_", "REDIS_", "CELERY_"))
    }
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**keep, **env, "DJANGO_SETTINGS_MODULE": "shop.settings"},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_shop_takes_the_cluster_setting_and_refuses_it_without_the_broker(stack):
    env = _env(stack["web"])
    env["DJANGO_SECRET_KEY"] = secrets.token_urlsafe(50)
    env["FLASHSALE_API_TOKEN"] = secrets.token_urlsafe(32)
    done = _shop_settings(env)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["cluster"] is True
    assert seen["nodes"] == env["REDIS_CLUSTER_NODES"].split(",")
    assert seen["broker"] == env["CELERY_BROKER_URL"]
    # without a broker of its own the shop does not start: the stack must name one
    del env["CELERY_BROKER_URL"]
    refused = _shop_settings(env)
    assert refused.returncode != 0
    assert "CELERY_BROKER_URL" in refused.stderr


# ------------------------------------------------------------------------------ scaling


@pytest.mark.parametrize("name", SCALED)
def test_scaled_services_have_no_container_name_and_no_host_port(stack, name):
    # `--scale NAME=N` starts N containers: a fixed name or host port would clash
    assert "container_name" not in stack[name]
    assert not stack[name].get("ports"), stack[name].get("ports")


def _directives(conf: str) -> dict[str, str]:
    return dict(
        line.strip().rstrip(";").split(None, 1)
        for line in conf.splitlines()
        if line.strip().endswith(";") and not line.strip().startswith("#")
    )


def test_the_load_balancer_is_the_only_published_app_port_and_resolves_every_replica(stack):
    published = {name: service["ports"] for name, service in stack.items() if service.get("ports")}
    assert published == {
        "proxy": ["8000:80"],
        "grafana": ["127.0.0.1:3000:3000"],
        "locust-master": ["127.0.0.1:8089:8089"],
    }
    proxy = stack["proxy"]
    assert proxy["image"].startswith("nginx:")
    assert proxy["depends_on"]["web"]["condition"] == "service_healthy"
    # the cluster's site replaces nginx.conf, not beside it (the web socket's volume, which
    # docker-compose.yml mounts, stays mounted, unused: the replicas listen on a port)
    (source,) = [
        volume.split(":")[0]
        for volume in proxy["volumes"]
        if volume.split(":")[1] == "/etc/nginx/conf.d/default.conf"
    ]
    assert Path(source).name == "nginx-cluster.conf"
    conf = (ROOT / source).read_text()
    directives = _directives(conf)
    # Docker's DNS, asked again as requests come: every replica, including later ones
    assert re.fullmatch(r"127\.0\.0\.11 valid=\d+s( ipv6=off)?", directives["resolver"])
    variable = re.fullmatch(r"http://(\$\w+)", directives["proxy_pass"]).group(1)
    web_port = stack["web"]["expose"][0]
    assert directives["set"] == f"{variable} web:{web_port}"
    assert "upstream" not in re.sub(r"#.*", "", conf)  # no address fixed at start
    # and the same server as docker-compose.yml's proxy: slow clients stop at nginx
    plain = _directives((ROOT / "deploy" / "nginx.conf").read_text())
    for name in sorted(set(plain) - {"server", "keepalive", "proxy_pass"}):
        assert directives.get(name) == plain[name], name
    assert "location = /metrics" in conf


# ------------------------------------------------------------------------------ Locust


def _locustfile_defines_a_user_and_the_options(path: Path, options: set[str]) -> None:
    tree = ast.parse(path.read_text(), filename=str(path))
    users = [
        node.name
        for node in tree.body
        if isinstance(node, ast.ClassDef)
        and any(getattr(base, "id", "").endswith("User") for base in node.bases)
    ]
    assert users, f"{path.relative_to(ROOT)} defines no Locust user"
    declared = {
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "attr", "") == "add_argument"
        and node.args
        and isinstance(node.args[0], ast.Constant)
    }
    assert options <= declared, options - declared


def _ignored_by_docker(relative: str) -> bool:
    patterns = [
        line.strip().rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    parts = Path(relative).parts
    return any(
        Path(*parts[: index + 1]).match(pattern)
        for pattern in patterns
        for index in range(len(parts))
    )


def test_locust_master_and_workers_run_the_locustfile_from_the_app_image(stack):
    master, worker = stack["locust-master"], stack["locust-worker"]
    for service in (master, worker):
        assert service["image"] == stack["web"]["image"]
        assert service.get("build") == stack["web"]["build"]
    master_argv, worker_argv = master["command"], worker["command"]
    for argv in (master_argv, worker_argv):
        assert argv[:3] == ["locust", "-f", argv[2]]
        locustfile = argv[2]
        assert (ROOT / locustfile).is_file() and not _ignored_by_docker(locustfile), locustfile
    master_flags = _flags(master_argv)
    custom = {flag for flag in master_flags if flag not in ("--host", "--users", "--spawn-rate")}
    _locustfile_defines_a_user_and_the_options(ROOT / master_argv[2], custom)
    assert "--master" in master_argv and "--worker" in worker_argv
    assert worker_argv[2] == master_argv[2]
    # workers find the master by its service name; the master floods the load balancer
    assert _flags(worker_argv)["--master-host"] == "locust-master"
    host = master_flags["--host"]
    assert host == "http://proxy"
    assert "proxy" in _env(stack["web"])["DJANGO_ALLOWED_HOSTS"].split(",")
    assert _env(master)["FLASHSALE_API_TOKEN"].startswith("${FLASHSALE_API_TOKEN:?")


def test_every_dependency_is_a_service_of_the_stack(stack):
    # docker-compose's `config` does not check this; `up` would stop on it
    for name, service in stack.items():
        depends = service.get("depends_on", {})
        assert set(depends) <= set(stack), (name, set(depends) - set(stack))


def test_every_new_command_names_a_real_entry_point(override):
    commands = django_commands()
    for service in override.values():
        for command in (service.get("command"), service.get("healthcheck", {}).get("test")):
            if command:
                check_entry_points(command, commands)


# ------------------------------------------------------------------------------ plain stack


def test_plain_compose_up_starts_none_of_the_cluster_services(plain, override):
    # compose reads docker-compose.override.yml (or compose.override.yaml) by itself; this file
    # is read only when named with -f
    assert CLUSTER_FILE not in {
        "docker-compose.override.yml",
        "docker-compose.override.yaml",
        "compose.override.yml",
        "compose.override.yaml",
    }
    added = set(override) - set(plain)
    assert added == {
        *_node_names(override),
        "redis-cluster",
        "migrate",
        "locust-master",
        "locust-worker",
    }
    for name in APP_SERVICES:
        assert "REDIS_CLUSTER_NODES" not in _env(plain[name]), name
        assert "redis-cluster" not in plain[name]["depends_on"], name
    assert plain["proxy"]["volumes"] == [
        "./deploy/nginx.conf:/etc/nginx/conf.d/default.conf:ro",
        "web-socket:/run/flashsale",
    ]


# ------------------------------------------------------------------------------ docker-compose


def _docker_compose(tmp_path: Path, *files: str, env: dict[str, str]):
    """`docker-compose config` on these files, as a user's `docker compose` reads them.

    Debian's docker-compose (1.29) predates the top-level `name:` key, so it reads a copy of
    docker-compose.yml without that one line (the project name is passed with -p instead);
    everything else is the files as they are."""
    base = (ROOT / "docker-compose.yml").read_text()
    without_name, removed = re.subn(r"(?m)^name: flashsale\n", "", base)
    assert removed == 1, "docker-compose.yml's name changed: update this test"
    (tmp_path / "docker-compose.yml").write_text(without_name)
    paths = [tmp_path / "docker-compose.yml", *(ROOT / name for name in files)]
    # Only `env` is seen: not this shell's variables, nor a developer's .env beside the files.
    (tmp_path / "empty.env").write_text("")
    keep = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("DJANGO_", "FLASHSALE_", "COMPOSE_"))
    }
    return subprocess.run(
        [DOCKER_COMPOSE, "--project-directory", str(ROOT), "-p", "flashsale"]
        + ["--env-file", str(tmp_path / "empty.env")]
        + [argument for path in paths for argument in ("-f", str(path))]
        + ["config"],
        env={**keep, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


SECRETS = {"DJANGO_SECRET_KEY": "compose-test-key", "FLASHSALE_API_TOKEN": "compose-test-token"}

needs_docker_compose = pytest.mark.skipif(
    DOCKER_COMPOSE is None, reason="no docker-compose on this machine (make compose)"
)


@needs_docker_compose
def test_docker_compose_validates_the_plain_stack_unchanged(tmp_path, plain):
    done = _docker_compose(tmp_path, env=SECRETS)
    assert done.returncode == 0, done.stderr
    services = yaml.safe_load(done.stdout)["services"]
    assert set(services) == set(plain)
    assert "REDIS_CLUSTER_NODES" not in services["web"]["environment"]
    # and it refuses to run without the secrets, as compose does
    refused = _docker_compose(tmp_path, env={})
    assert refused.returncode != 0 and "DJANGO_SECRET_KEY" in refused.stderr


@needs_docker_compose
def test_docker_compose_validates_and_merges_the_cluster_stack_as_these_tests_do(tmp_path):
    done = _docker_compose(tmp_path, CLUSTER_FILE, env=SECRETS)
    assert done.returncode == 0, done.stderr
    services = yaml.safe_load(done.stdout)["services"]
    expected = merged_stack()["services"]
    assert set(services) == set(expected)
    for name in (*APP_SERVICES, "redis-cluster"):
        real, ours = services[name], expected[name]
        assert (
            real["environment"]["REDIS_CLUSTER_NODES"] == ours["environment"]["REDIS_CLUSTER_NODES"]
        )
        assert real["depends_on"] == ours["depends_on"], name
    for name in APP_SERVICES:
        real_env = {key: str(value) for key, value in services[name]["environment"].items()}
        ours_env = _env(expected[name])
        ours_env.update(SECRETS)
        ours_env["DJANGO_HTTPS"] = "0"
        assert real_env == ours_env, name
    sources = [
        Path(volume["source"] if isinstance(volume, dict) else volume.split(":")[0]).name
        for volume in services["proxy"]["volumes"]
    ]
    assert sorted(sources) == ["nginx-cluster.conf", "web-socket"]
    for name in SCALED:
        assert "container_name" not in services[name] and not services[name].get("ports")
