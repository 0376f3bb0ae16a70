"""The deployment recipes parse, and every command they run is a real `specq` command with real options.

There is no container engine or cluster here, so nothing is started: docker-compose.yml, the Dockerfile,
.env.example and deploy/k8s/*.yaml are read, and each specq command line in them is parsed by specq's own
click command (`make_context`: options, types, required arguments), and its options are checked against
`specq <command> --help`.
"""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest
import yaml

from specq.layout import missing_parts
from specq.queue import CHUNK_QUEUE_KEY
from tests.docker_context import build_image_files, final_workdir
from tests.services import invoke

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
_VAR = re.compile(r"\$\{([A-Z0-9_]+)(?::([-?])([^}]*))?\}")


def env_example() -> dict[str, str]:
    values = {}
    for line in (ROOT / ".env.example").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


def interpolate(text: str, env: dict[str, str]) -> str:
    """docker compose's ${VAR}, ${VAR:-default} and ${VAR:?error}, from .env.example."""
    return _VAR.sub(lambda m: env.get(m.group(1)) or (m.group(3) if m.group(2) == "-" else ""), text)


def check_specq_command(args: list[str]) -> None:
    """`args` (what follows `specq`) names a real command and parses with its real options."""
    from specq.cli.main import _register, cli

    _register()
    if args == ["--help"]:
        assert invoke(["--help"]).exit_code == 0
        return
    words = [a for a in args if not a.startswith("-")]
    command: click.Command = cli
    path: list[str] = []
    while isinstance(command, click.Group):  # `db upgrade`: walk down the groups
        name = words.pop(0)
        assert name in command.commands, f"specq has no command {' '.join([*path, name])!r}"
        path.append(name)
        command = command.commands[name]
    rest = args[len(path) :]
    help_text = invoke([*path, "--help"]).output
    for option in (a.split("=")[0] for a in rest if a.startswith("--")):
        assert option in help_text, f"`specq {' '.join(path)}` has no option {option}"
    with command.make_context(" ".join(path), list(rest)) as _ctx:  # raises on a bad option or value
        pass


def load_compose() -> dict:
    return yaml.safe_load(interpolate((ROOT / "docker-compose.yml").read_text(), env_example()))


def test_compose_services_volumes_healthchecks_gpu() -> None:
    compose = load_compose()
    services = compose["services"]
    assert {"redis", "postgres", "migrate", "worker-gpu0", "worker-gpu1", "worker-cpu", "autoscaler"} <= set(services)
    for name in ("redis", "postgres"):
        assert services[name]["healthcheck"]["test"], name
        volume = services[name]["volumes"][0].split(":")[0]
        assert volume in compose["volumes"], name  # a named volume: the data outlives the container
    assert services["migrate"]["command"] == ["db", "upgrade"]
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in ("worker-gpu0", "worker-gpu1", "autoscaler"):
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"], name
    # static workers each get their own GPU, and run instead of the autoscaler (profiles apart)
    assert [
        services[f"worker-gpu{i}"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for i in (0, 1)
    ] == [["0"], ["1"]]
    assert services["autoscaler"]["profiles"] == ["autoscale"]
    assert services["worker-gpu0"]["profiles"] == ["static"] and services["worker-cpu"]["profiles"] == ["cpu"]
    assert "deploy" not in services["worker-cpu"]
    for name in ("worker-gpu0", "worker-cpu", "autoscaler"):
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
        assert services[name]["command"][-2:] == ["--metrics-host", "0.0.0.0"], name
    # one image build
    assert [name for name, s in services.items() if "build" in s] == ["migrate"] and (ROOT / "Dockerfile").exists()
    # credentials reach specq as URLs in the environment, built from .env
    env = services["worker-gpu0"]["environment"]
    assert env["SPECQ_DATABASE_URL"].startswith("postgresql+psycopg://") and env["SPECQ_BROKER_URL"].startswith(
        "redis://"
    )


def test_compose_commands_are_real_specq_commands() -> None:
    commands = [s["command"] for s in load_compose()["services"].values() if str(s.get("image")).startswith("specq")]
    assert len(commands) >= 6
    for args in commands:
        check_specq_command([str(a) for a in args])


def test_env_example_defines_every_variable_the_compose_file_uses() -> None:
    used = {m.group(1) for m in _VAR.finditer((ROOT / "docker-compose.yml").read_text()) if m.group(2) != "-"}
    assert used <= set(env_example()), used - set(env_example())


def test_dockerfile_runs_specq(tmp_path) -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["specq"]' in text and "USER specq" in text
    # the parts come from specq's own list (specq/layout.py), not a second one here: the image's copy of
    # the context holds each (tests/test_image_install.py installs it and imports every module)
    image = build_image_files(ROOT, ROOT / "Dockerfile", tmp_path / "image")
    assert missing_parts(image / final_workdir(ROOT / "Dockerfile").lstrip("/") / "specq") == []


def k8s_documents() -> list[dict]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def by_kind(kind: str) -> list[dict]:
    return [d for d in k8s_documents() if d["kind"] == kind]


def test_k8s_worker_deployment() -> None:
    (deployment,) = by_kind("Deployment")
    assert "replicas" not in deployment["spec"]  # KEDA owns the count; an apply must not reset it
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["fsGroup"] == 1000
    assert pod["terminationGracePeriodSeconds"] >= 300  # one batch of long completions
    (container,) = pod["containers"]
    assert container["command"] == ["specq"] and container["args"][0] == "worker"
    check_specq_command(container["args"])
    for kind in ("requests", "limits"):
        assert container["resources"][kind]["nvidia.com/gpu"] == 1
    assert container["envFrom"][0]["secretRef"]["name"] == "specq-services"
    assert container["args"][-2:] == ["--metrics-host", "0.0.0.0"]
    alive = next(e["value"] for e in container["env"] if e["name"] == "SPECQ_ALIVE_FILE")
    assert alive in " ".join(container["livenessProbe"]["exec"]["command"])
    assert alive in " ".join(container["readinessProbe"]["exec"]["command"])


def test_k8s_migration_job() -> None:
    (job,) = by_kind("Job")
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    (image,) = kustomization["images"]
    # named per release: a re-release creates a new Job instead of colliding with the old one's template
    assert job["metadata"]["name"] == "specq-migrate-" + image["newTag"].replace(".", "-")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["image"] == image["name"]
    assert container["args"] == ["db", "upgrade"]
    check_specq_command(container["args"])


def test_keda_scales_the_worker_on_the_queue_list() -> None:
    (scaled,) = by_kind("ScaledObject")
    (deployment,) = by_kind("Deployment")
    spec = scaled["spec"]
    assert spec["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert spec["minReplicaCount"] == 0  # scale to zero
    redis_trigger = next(t for t in spec["triggers"] if t["type"] == "redis")
    assert redis_trigger["metadata"]["listName"] == CHUNK_QUEUE_KEY
    postgres_trigger = next(t for t in spec["triggers"] if t["type"] == "postgresql")
    assert "total - completed - failed" in postgres_trigger["metadata"]["query"]
    auths = {d["metadata"]["name"] for d in by_kind("TriggerAuthentication")}
    assert {t["authenticationRef"]["name"] for t in spec["triggers"]} <= auths


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    present = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml", "secret.example.yaml"}
    assert listed == present


@pytest.mark.parametrize("bad", [["worker", "--devise", "cpu"], ["autoscale", "--max", "2"], ["nope"]])
def test_the_checker_catches_mistakes(bad: list[str]) -> None:
    with pytest.raises((AssertionError, click.UsageError)):
        check_specq_command(bad)
