"""docker-compose.yml and the Dockerfile stay in step with the project (Docker is not run).

Every command the services run must name a real entry point of this checkout: the web server's
`module:attr`, Celery's `-A` app and `manage.py` commands are resolved from the source files
(parsed, not imported: no database or settings needed).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import secrets
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from shop.processes.serve import stop_timeout
from shop.processes.servers import GRANIAN_THREADS, granian_command

ROOT = Path(__file__).resolve().parents[2]
APP_ENV = {
    "DATABASE_URL",
    "REDIS_URL",
    "CELERY_BROKER_URL",
    "DJANGO_SECRET_KEY",
    "DJANGO_DEBUG",
    "DJANGO_ALLOWED_HOSTS",
}

pytestmark = pytest.mark.embedded_smoke


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


# ----------------------------------------------------------------------- resolving entry points


def module_file(dotted: str) -> Path | None:
    """The source file of a project module, found without importing anything."""
    base = ROOT.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def top_level_names(tree: ast.Module) -> dict[str, ast.AST]:
    """Names bound at module level (assignments, defs, classes, imports) -> binding node."""
    names: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names[target.id] = node
        elif isinstance(node, ast.AnnAssign | ast.AugAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = node
    return names


def assert_module_attr(spec: str) -> None:
    module, _, attr = spec.partition(":")
    assert attr, f"{spec!r} is not module:attr"
    path = module_file(module)
    assert path is not None, (
        f"{spec}: no module {module} in the project (expected {module.replace('.', '/')}.py)"
    )
    assert attr in top_level_names(parse(path)), f"{spec}: {path.name} does not define {attr}"


def is_celery_call(node: ast.AST) -> bool:
    value = getattr(node, "value", None)
    if not isinstance(value, ast.Call):
        return False
    func = value.func
    name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
    return name == "Celery"


def assert_celery_app(app: str) -> None:
    if ":" in app:  # -A package.module:attr
        module, _, attr = app.partition(":")
        path = module_file(module)
        assert path is not None, f"celery -A {app}: no module {module}"
        binding = top_level_names(parse(path)).get(attr)
        assert binding is not None and is_celery_call(binding), f"{path}: {attr} is not Celery()"
        return
    # -A package: Celery looks for package.celery and the app the package exports from it.
    package_init = module_file(app)
    assert package_init is not None and package_init.name == "__init__.py", f"no package {app}"
    celery_py = package_init.parent / "celery.py"
    assert celery_py.is_file(), f"celery -A {app}: {celery_py.relative_to(ROOT)} is missing"
    apps = {
        name: node
        for name, node in top_level_names(parse(celery_py)).items()
        if is_celery_call(node)
    }
    assert apps, f"{celery_py.relative_to(ROOT)} defines no Celery(...) app"
    for name, node in apps.items():
        main = node.value.args[0] if node.value.args else None
        assert isinstance(main, ast.Constant) and main.value == app, (
            f"{celery_py.relative_to(ROOT)}: {name} = Celery(...) is not named {app!r}"
        )
    exported = [
        alias.name
        for node in parse(package_init).body
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module == "celery"
        for alias in node.names
    ]
    assert set(exported) & set(apps), (
        f"{package_init.relative_to(ROOT)} must import the Celery app ({', '.join(apps)}) "
        f"from .celery; it imports {exported or 'nothing'} from it"
    )


def django_commands() -> set[str]:
    spec = importlib.util.find_spec("django")
    assert spec is not None and spec.submodule_search_locations
    django_dir = Path(next(iter(spec.submodule_search_locations)))
    folders = [django_dir / "core" / "management" / "commands"]
    folders += django_dir.glob("contrib/*/management/commands")
    folders += ROOT.glob("*/management/commands")
    return {
        path.stem for folder in folders for path in folder.glob("*.py") if path.stem != "__init__"
    }


def shell_commands(command) -> list[list[str]]:
    """Each simple command a compose `command` / healthcheck `test` runs, as argv lists."""
    if isinstance(command, str):
        command = ["sh", "-c", command]
    if command and command[0] in ("CMD", "CMD-SHELL"):
        command = command[1:] if command[0] == "CMD" else ["sh", "-c", *command[1:]]
    if len(command) >= 3 and command[0] in ("sh", "bash", "/bin/sh") and command[1] == "-c":
        script = command[2].replace("$$", "$")
        return [
            argv[1:] if argv[:1] == ["exec"] else argv
            for part in re.split(r"&&|\|\||;|\n", script)
            if (argv := shlex.split(part))
        ]
    return [list(command)]


def check_entry_points(command, commands: set[str]) -> set[str]:
    """Assert every project entry point named in `command` resolves; return the kinds seen."""
    seen = set()
    for argv in shell_commands(command):
        words = argv
        if Path(words[0]).name.startswith("python"):  # python manage.py ..., python -m celery
            words = words[1:]
            if words[:1] == ["-m"]:
                words = words[1:]
        program = Path(words[0]).name if words else ""
        if program in ("gunicorn", "granian"):
            apps = [w for w in words[1:] if ":" in w and not w.startswith("-")]
            assert apps, f"{program} without module:attr in {argv}"
            assert_module_attr(apps[0])
            if "--log-config" in words:
                config = words[words.index("--log-config") + 1]
                assert (ROOT / config).is_file(), f"{program}'s --log-config {config} is missing"
            seen.add(program)
        elif program == "celery":
            flag = next((i for i, w in enumerate(words) if w in ("-A", "--app")), None)
            inline = [w.split("=", 1)[1] for w in words if w.startswith("--app=")]
            assert flag is not None or inline, f"celery without -A in {argv}"
            assert_celery_app(inline[0] if inline else words[flag + 1])
            seen.add("celery")
        elif program == "shop.serve":  # python -m shop.serve: the supervisor of make serve
            assert (ROOT / "shop" / "serve.py").is_file(), "shop/serve.py is missing"
            seen.add(program)
        elif program == "manage.py":
            assert (ROOT / "manage.py").is_file(), "manage.py is missing"
            name = next(w for w in words[1:] if not w.startswith("-"))
            assert name in commands, f"manage.py {name}: no such Django command"
            seen.add(f"manage.py {name}")
    return seen


# ------------------------------------------------------------------------------------- tests


def test_services_exist_with_healthchecks(services):
    assert {"postgres", "redis", "rabbitmq", "proxy", "web", "worker"} <= set(services)
    for name in ("postgres", "redis", "rabbitmq", "proxy", "web", "worker"):
        test = services[name].get("healthcheck", {}).get("test")
        assert test, f"{name} has no healthcheck"
    assert services["postgres"]["image"].startswith("postgres:16")
    assert "pg_isready" in " ".join(services["postgres"]["healthcheck"]["test"])
    assert services["redis"]["image"] == "redis:7-alpine"
    assert "redis-cli ping" in " ".join(services["redis"]["healthcheck"]["test"])
    web_check = " ".join(services["web"]["healthcheck"]["test"])
    assert "/run/flashsale/web.sock" in web_check and "/healthz" in web_check
    assert "inspect ping" in " ".join(services["worker"]["healthcheck"]["test"])


@pytest.mark.parametrize("name", ["web", "worker"])
def test_app_services_wait_for_healthy_postgres_redis_and_rabbitmq(services, name):
    depends = services[name]["depends_on"]
    for dependency in ("postgres", "redis", "rabbitmq"):
        assert depends[dependency]["condition"] == "service_healthy", (name, dependency)


@pytest.mark.parametrize("name", ["web", "worker"])
def test_app_services_get_their_configuration_from_the_environment(services, name):
    env = services[name]["environment"]
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    assert APP_ENV <= set(env), APP_ENV - set(env)
    assert str(env["DJANGO_DEBUG"]) in ("0", "False", "false")
    assert "@postgres:5432/" in env["DATABASE_URL"]
    assert env["REDIS_URL"].startswith("redis://redis:6379")
    # RabbitMQ is the broker: a killed worker's tasks come back without waiting for a sweep
    assert re.fullmatch(r"amqp://[^@]+@rabbitmq:5672/.*", env["CELERY_BROKER_URL"])
    # no default secret: compose refuses to start without one (`${VAR:?message}`)
    assert re.fullmatch(r"\$\{DJANGO_SECRET_KEY:\?[^}]+\}", env["DJANGO_SECRET_KEY"])


def test_web_and_worker_share_one_image(services):
    web, worker = services["web"], services["worker"]
    assert web.get("build") == worker.get("build")
    assert web.get("image") == worker.get("image")
    assert web.get("build") or web.get("image")
    build = web.get("build")
    if build is not None:
        context = build if isinstance(build, str) else build.get("context", ".")
        dockerfile = (
            "Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")
        )
        assert (ROOT / context / dockerfile).is_file()


def test_web_runs_the_web_server_under_its_supervisor_on_a_socket_the_proxy_shares(
    services, compose
):
    # The supervisor of make serve (it migrates, and starts granian again if its main process
    # dies while the old workers answer what they hold), the web server alone; init reaps
    # the workers a dead main process leaves. One accept queue for every worker
    # (docs/decisions/0024): a unix socket, on a volume that web and proxy mount, nginx's one
    # upstream.
    web = services["web"]
    assert check_entry_points(web["command"], django_commands()) == {"shop.serve"}
    (server,) = shell_commands(web["command"])
    assert "--web-only" in server and web["init"] is True, web
    socket_path = server[server.index("--uds") + 1]
    assert "--port" not in server and "expose" not in web, server
    # what it runs there: granian's workers sharing the socket, taking no more connections
    # than they have threads
    granian = granian_command(
        host="127.0.0.1", port=8000, workers=2, threads=GRANIAN_THREADS, uds=Path(socket_path)
    )
    check_entry_points(granian, django_commands())
    assert granian[granian.index("--uds") + 1] == socket_path
    assert granian[granian.index("--backpressure") + 1] == str(GRANIAN_THREADS)
    assert granian[granian.index("--blocking-threads") + 1] == str(GRANIAN_THREADS)
    mounts = {
        service: dict(volume.split(":")[:2] for volume in services[service]["volumes"])
        for service in ("web", "proxy")
    }
    directory = str(Path(socket_path).parent)
    shared = {volume for volume, target in mounts["web"].items() if target == directory}
    assert shared and shared == {
        volume for volume, target in mounts["proxy"].items() if target == directory
    }, mounts
    assert shared <= set(compose["volumes"])
    conf = (ROOT / "deploy" / "nginx.conf").read_text()
    assert re.findall(r"^\s*server (\S+);", conf, re.MULTILINE) == [f"unix:{socket_path}"]
    # and no pool of kept connections, each of which would belong to one worker
    assert not re.findall(r"^\s*keepalive ", conf, re.MULTILINE)


def test_web_is_given_longer_to_stop_than_its_supervisor_gives_the_server(services):
    # docker compose stop: SIGTERM, then SIGKILL after stop_grace_period (10 s unless set); the
    # supervisor waits up to `stop_timeout` (with web's checkout deadline) for granian's workers
    # to answer what they hold
    grace = services["web"]["stop_grace_period"]
    assert re.fullmatch(r"\d+s", grace), grace
    environment = {name: str(value) for name, value in services["web"]["environment"].items()}
    assert int(grace[:-1]) > stop_timeout(environment)


def test_no_service_runs_a_sale_writer(services):
    # Every checkout is answered by the web service that received it: nothing else sells
    assert set(services) >= {"web", "worker", "beat"}
    assert "writer" not in services
    for name, service in services.items():
        assert "FLASHSALE_SALE_WRITER" not in (service.get("environment") or {}), name


def test_only_nginx_is_published_and_it_buffers_requests_for_the_web_server(services):
    # the web server's worker threads are never reachable by a slow client directly (Grafana is, on
    # this machine's loopback only)
    published = {name for name, service in services.items() if service.get("ports")}
    assert published == {"proxy", "grafana"}, published
    assert services["grafana"]["ports"] == ["127.0.0.1:3000:3000"]
    proxy = services["proxy"]
    assert proxy["image"].startswith("nginx:")
    assert [str(port) for port in proxy["ports"]] == ["8000:80"]
    assert proxy["depends_on"]["web"]["condition"] == "service_healthy"
    source, target = proxy["volumes"][0].split(":")[:2]
    assert target == "/etc/nginx/conf.d/default.conf"
    conf = (ROOT / source).read_text()
    public = conf[: conf.index("# /metrics for Prometheus")]
    directives = dict(
        line.strip().rstrip(";").split(None, 1)
        for line in public.splitlines()
        if line.strip().endswith(";") and not line.strip().startswith("#")
    )
    assert directives["listen"] == "80"
    assert directives["proxy_pass"] == "http://flashsale_web"
    for timeout in ("client_header_timeout", "client_body_timeout", "send_timeout"):
        assert int(directives[timeout].rstrip("s")) <= 30, (timeout, directives[timeout])
    assert directives["proxy_request_buffering"] == directives["proxy_buffering"] == "on"


def test_beat_runs_the_celery_app_from_the_same_image(services):
    commands = django_commands()
    assert "celery" in check_entry_points(services["beat"]["command"], commands)
    assert "beat" in services["beat"]["command"]
    assert services["beat"]["image"] == services["worker"]["image"]
    assert services["beat"]["depends_on"] == services["worker"]["depends_on"]


def test_worker_runs_the_celery_app(services):
    commands = django_commands()
    assert "celery" in check_entry_points(services["worker"]["command"], commands)
    assert "celery" in check_entry_points(services["worker"]["healthcheck"]["test"], commands)


def test_every_service_command_names_a_real_entry_point(services):
    commands = django_commands()
    for service in services.values():
        for command in (service.get("command"), service.get("healthcheck", {}).get("test")):
            if command:
                check_entry_points(command, commands)


def test_dockerfile_installs_requirements_and_runs_as_non_root():
    lines = [
        line.strip()
        for line in (ROOT / "Dockerfile").read_text().replace("\\\n", " ").splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    instructions = [(line.split()[0].upper(), line.split(None, 1)[1]) for line in lines]
    assert instructions[0] == ("FROM", "python:3.11-slim")
    copies = [args for op, args in instructions if op == "COPY"]
    assert any("requirements.txt" in args.split() for args in copies), copies
    assert any(args.split()[0] == "." for args in copies), "the project is not copied"
    runs = " ".join(args for op, args in instructions if op == "RUN")
    assert re.search(r"pip install (.* )?-r requirements\.txt", runs), runs
    users = [args for op, args in instructions if op == "USER"]
    assert users and users[-1] not in ("root", "0"), "the image must not run as root"
    # The Dockerfile's own CMD must name real entry points too.
    cmd = [args for op, args in instructions if op == "CMD"]
    if cmd:
        argv = yaml.safe_load(cmd[-1]) if cmd[-1].startswith("[") else cmd[-1]
        check_entry_points(argv, django_commands())


def test_dockerignore_keeps_local_state_out_of_the_image():
    ignored = {
        line.strip().rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".git", ".venv", ".data"} <= ignored


def _compose_app_env(services) -> dict[str, str]:
    env = services["web"]["environment"]
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {key: str(value) for key, value in env.items()}


def _manage(env: dict[str, str], *arguments: str) -> subprocess.CompletedProcess:
    keep = {key: value for key, value in os.environ.items() if not key.startswith("DJANGO_")}
    return subprocess.run(
        [sys.executable, "manage.py", *arguments],
        cwd=ROOT,
        env={**keep, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_check_deploy_is_clean_for_compose_behind_tls(services):
    env = _compose_app_env(services)
    env["DJANGO_SECRET_KEY"] = secrets.token_urlsafe(50)
    env["DJANGO_HTTPS"] = "1"
    done = _manage(env, "check", "--deploy", "--fail-level", "WARNING")
    assert done.returncode == 0, done.stderr + done.stdout
    assert "no issues" in done.stdout
    # and over plain HTTP it says exactly what is missing, nothing else
    env["DJANGO_HTTPS"] = "0"
    plain = _manage(env, "check", "--deploy")
    found = set(re.findall(r"security\.W\d+", plain.stderr + plain.stdout))
    assert found == {"security.W004", "security.W008", "security.W012", "security.W016"}, found


def test_the_web_app_refuses_to_serve_without_a_secret_key(services):
    env = _compose_app_env(services)
    del env["DJANGO_SECRET_KEY"]
    load = "import shop.wsgi"
    refused = subprocess.run(
        [sys.executable, "-c", load], cwd=ROOT, env={**os.environ, **env, "DJANGO_SECRET_KEY": ""},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode != 0
    assert "DJANGO_SECRET_KEY is not set" in refused.stderr
    served = subprocess.run(
        [sys.executable, "-c", load], cwd=ROOT,
        env={**os.environ, **env, "DJANGO_SECRET_KEY": secrets.token_urlsafe(50)},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert served.returncode == 0, served.stderr
    # commands and workers do without one
    assert _manage({**env, "DJANGO_SECRET_KEY": ""}, "check").returncode == 0


def test_prometheus_scrapes_web_with_the_token_and_grafana_has_the_dashboard(services):
    prometheus = services["prometheus"]
    assert prometheus["image"].startswith("prom/prometheus:")
    source, target = prometheus["volumes"][0].split(":")[:2]
    config = yaml.safe_load((ROOT / source).read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    job = jobs["flashsale-web"]
    # through the proxy's metrics port (its public one answers /metrics 404), which compose
    # publishes nowhere
    assert job["static_configs"][0]["targets"] == ["proxy:9000"]
    assert "9000" not in " ".join(str(port) for port in services["proxy"]["ports"])
    # and the worker's own port, which its service sets (on the compose network only)
    app_env = _compose_app_env(services)
    worker_target = f"worker:{app_env['FLASHSALE_WORKER_METRICS_PORT']}"
    assert jobs["flashsale-worker"]["static_configs"][0]["targets"] == [worker_target]
    assert app_env["FLASHSALE_WORKER_METRICS_HOST"] == "0.0.0.0"
    assert job["metrics_path"] == "/metrics" and job["authorization"]["type"] == "Bearer"
    # the command writes the token where the scrape reads it, then runs Prometheus on the config
    command = " ".join(prometheus["command"])
    assert job["authorization"]["credentials_file"] in command
    assert f"--config.file={target}" in command
    assert "FLASHSALE_API_TOKEN" in prometheus["environment"]
    assert "FLASHSALE_API_TOKEN" in services["web"]["environment"]
    conf = (ROOT / "deploy" / "nginx.conf").read_text()
    metrics_server = conf[conf.index("# /metrics for Prometheus") :]
    assert "listen 9000;" in metrics_server and "proxy_pass http://flashsale_web;" in metrics_server
    assert "location = /metrics" in conf

    grafana = services["grafana"]
    mounts = dict(volume.split(":")[:2] for volume in grafana["volumes"])
    provisioning = ROOT / next(src for src, dst in mounts.items() if dst.endswith("provisioning"))
    (datasource,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    assert datasource["url"] == "http://prometheus:9090"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "flashsale.yml").read_text())[
        "providers"
    ]
    dashboards = ROOT / next(
        src for src, dst in mounts.items() if dst == provider["options"]["path"]
    )
    dashboard = json.loads((dashboards / "flashsale.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == datasource["uid"], panel["title"]
