"""Docker cannot run here, so check what the Dockerfile and docker-compose.yml name really exists."""

from __future__ import annotations

import importlib
import json
import re
import shlex
from pathlib import Path
from urllib.parse import urlsplit

import click
import pytest
import typer
import yaml

import client.cli
import service.__main__
import worker.__main__

ROOT = Path(__file__).resolve().parents[2]


def _dockerfile() -> tuple[list[str], dict[str, list[str]]]:
    text = (ROOT / "Dockerfile").read_text()
    lines = [ln for ln in re.sub(r"\\\n", " ", text).splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    stages: dict[str, list[str]] = {}
    current = None
    for ln in lines:
        m = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", ln, re.I)
        if m:
            current = m.group(1)
            stages[current] = []
        elif current:
            stages[current].append(ln)
    return lines, stages


def _check_command(argv: list[str]) -> None:
    """Every command an image or service runs must exist in this repo."""
    exe = argv[0]
    scripts = {"aotc": client.cli.app, "aotc-server": service.__main__.app, "aotc-worker": worker.__main__.app}
    if exe in scripts:
        command = typer.main.get_command(scripts[exe])
        if exe == "aotc":
            assert isinstance(command, click.Group) and argv[1] in command.commands, f"aotc has no {argv[1]!r}"
            command = command.commands[argv[1]]
            argv = argv[1:]
        command.make_context(exe, argv[1:])  # its flags parse
    elif exe == "uvicorn":
        target = next(a for a in argv[1:] if ":" in a and not a.startswith("-"))
        module, attr = target.split(":")
        assert callable(getattr(importlib.import_module(module), attr))
        assert "--factory" in argv  # create_app is a factory
    elif exe == "python":
        assert argv[1] == "-c"
        compile(argv[2], "<healthcheck>", "exec")
    elif exe in ("redis-server", "redis-cli", "CMD", "server"):  # server: SeaweedFS's `weed server -s3`
        pass
    elif exe.startswith("--config.file="):  # prometheus: flags to the image's own entrypoint
        pass
    else:
        raise AssertionError(f"unknown command {argv}")


def test_dockerfile_stages_copy_and_commands_exist():
    lines, stages = _dockerfile()
    assert {"base", "api", "worker"} <= set(stages)
    for ln in lines:
        if ln.startswith("COPY"):
            for src in shlex.split(ln)[1:-1]:
                if not src.startswith("--"):
                    assert (ROOT / src).exists(), f"Dockerfile copies missing {src}"
        if ln.startswith("RUN pip install -r"):
            assert (ROOT / ln.split()[-1]).exists()
        for instr in ("CMD", "HEALTHCHECK"):
            if ln.startswith(instr):
                argv = json.loads(ln[ln.index("["):])
                _check_command(argv)
    # The API image never gets torch: its lock has none of it.
    api_lock = (ROOT / "requirements-api.lock").read_text().lower()
    assert "torch" not in api_lock and "triton" not in api_lock
    assert "torch==" in (ROOT / "requirements-worker.lock").read_text()


def test_compose_services_build_real_stages_and_run_real_commands():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    _, stages = _dockerfile()
    services = compose["services"]
    assert {"redis", "api", "worker-gpu", "worker-cpu"} <= set(services)
    assert "--appendonly" in services["redis"]["command"] and "yes" in services["redis"]["command"]
    reservation = services["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert reservation["capabilities"] == ["gpu"]
    for name, svc in services.items():
        if "build" in svc:
            assert svc["build"]["target"] in stages, f"{name} builds unknown stage {svc['build']['target']}"
            assert svc["environment"]["AOTC_REDIS_URL"].startswith("redis://redis:")
        _check_command(svc["command"])
        for dep in svc.get("depends_on", {}):
            assert dep in services


def test_compose_prometheus_scrapes_the_api_metrics():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    prometheus = compose["services"]["prometheus"]
    config_file = prometheus["command"][0].split("=", 1)[1]
    mounted = {c["target"]: c["source"] for c in prometheus["configs"]}
    config = yaml.safe_load(compose["configs"][mounted[config_file]]["content"])
    api_port = compose["services"]["api"]["command"][compose["services"]["api"]["command"].index("--port") + 1]
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == [f"api:{api_port}"]


def _interpolated(value: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:?message} and $$ as `docker compose` reads them, with a missing VAR an error."""
    def one(m: re.Match[str]) -> str:
        name, _, message = m.group(1).partition(":?")
        if not env.get(name):
            raise ValueError(message or f"{name} is not set")
        return env[name]

    return re.sub(r"\$\{([^}]+)\}", one, value).replace("$$", "$")


def test_compose_redis_requires_a_password_that_the_api_and_workers_read_from_a_secret():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    redis_svc = services["redis"]
    command = redis_svc["command"]
    assert not any("requirepass" in a or "masterauth" in a for a in command), "a password on the command line"
    assert "ports" not in redis_svc, "Redis must not be published outside the compose network"

    # redis-server's first argument is a config file that compose mounts, and that file requires a password.
    conf = command[1]
    assert command[0] == "redis-server" and conf.endswith(".conf")
    mounted = {c["target"]: c["source"] for c in redis_svc.get("configs", [])}
    assert conf in mounted, f"redis-server reads {conf}, which compose does not mount"
    content = compose["configs"][mounted[conf]]["content"]
    m = re.search(r'^requirepass\s+"(\$\{(\w+)[^}]*\})"\s*$', content, re.M)
    assert m, f"Redis runs open: no requirepass in {conf}:\n{content}"
    password_var = m.group(2)
    # Without the variable, compose refuses to start (rather than run Redis with an empty password).
    with pytest.raises(ValueError, match=".env"):
        _interpolated(content, {})
    assert _interpolated(content, {password_var: "s3cret"}).strip() == 'requirepass "s3cret"'

    # The same variable is the secret the API and the workers read through AOTC_REDIS_PASSWORD_FILE.
    secrets = {name: spec for name, spec in compose["secrets"].items() if spec.get("environment") == password_var}
    assert secrets, f"no secret carries {password_var}"
    clients = [name for name, svc in services.items() if "build" in svc]
    assert {"api", "worker-gpu", "worker-cpu"} <= set(clients)
    for name in clients:
        svc = services[name]
        env = svc["environment"]
        assert urlsplit(env["AOTC_REDIS_URL"]).password is None, f"{name}: a password in AOTC_REDIS_URL"
        secret = Path(env["AOTC_REDIS_PASSWORD_FILE"])
        assert secret.parent == Path("/run/secrets") and secret.name in secrets, name
        assert secret.name in svc["secrets"], f"{name} reads {secret} but is not given the secret"

    # The health check authenticates (a bare `redis-cli ping` gets NOAUTH from a locked Redis).
    check = " ".join(redis_svc["healthcheck"]["test"])
    assert "REDISCLI_AUTH" in check and "/run/secrets/" in check and "PONG" in check
    assert any(s in redis_svc["secrets"] for s in secrets)

    # .env.example documents the variable, and .env (where the real one goes) is never committed.
    example = (ROOT / ".env.example").read_text()
    assert re.search(rf"^{password_var}=", example, re.M)
    assert ".env" in (ROOT / ".gitignore").read_text().split()


def test_compose_runs_the_api_with_keys_and_prometheus_scrapes_with_the_admin_key():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services, secrets = compose["services"], compose["secrets"]
    api = services["api"]
    key_file = Path(api["environment"]["AOTC_ADMIN_KEY_FILE"])  # auth on: the API refuses requests without a key
    assert key_file.parent == Path("/run/secrets") and key_file.name in api["secrets"]
    assert secrets[key_file.name] == {"environment": "AOTC_ADMIN_KEY"}
    assert "AOTC_ADMIN_KEY" not in api["environment"]  # never in the environment `docker inspect` shows
    assert re.search(r"^AOTC_ADMIN_KEY=", (ROOT / ".env.example").read_text(), re.M)
    assert "--insecure" not in api["command"]

    prometheus = services["prometheus"]
    config = yaml.safe_load(compose["configs"]["prometheus"]["content"])
    (job,) = config["scrape_configs"]
    assert job["authorization"] == {"type": "Bearer", "credentials_file": str(key_file)}
    assert key_file.name in prometheus["secrets"]

    # Workers keep their signing key on a volume: a recreated container signs with the key clients pinned.
    for name in ("worker-gpu", "worker-cpu"):
        data = services[name]["environment"]["AOTC_DATA_DIR"]
        assert any(v.split(":")[1] == data and v.split(":")[0] in compose["volumes"]
                   for v in services[name]["volumes"]), name


def test_compose_restarts_redis_the_api_and_the_workers_when_they_exit():
    # Docker's healthchecks restart nothing: a process that dies (a Redis crash, an API process or a worker that
    # exits) comes back only through a restart policy.
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    for name in ("redis", "api", "worker-gpu", "worker-cpu"):
        assert services[name].get("restart") == "unless-stopped", name
