"""Dockerfile, docker-compose.yml and clients/: what can be checked without a Docker engine."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx
import pytest
import yaml

from server.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent


def with_defaults(args: list[str]) -> list[str]:
    """Substitute compose's ${VAR:-default} with the default, as compose does when VAR is unset."""
    return [re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", a) for a in args]


def test_compose_file_declares_gpu_health_ports_and_profiles():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    gpu = services["harpoon"]
    device = gpu["deploy"]["resources"]["reservations"]["devices"][0]
    assert device == {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
    assert gpu["ports"] == ["8000:8000"]
    assert "/health" in " ".join(gpu["healthcheck"]["test"]) and gpu["restart"] == "unless-stopped"
    assert {"HARPOON_MODEL", "HF_TOKEN"} <= set(gpu["environment"])
    assert any(v.endswith(":/models:ro") for v in gpu["volumes"]) and any(":/cache" in v for v in gpu["volumes"])
    for name in ("harpoon", "harpoon-cpu"):
        command = with_defaults(services[name]["command"])
        assert command[:2] == ["harpoon", "serve"]
        args = build_parser().parse_args(command[2:])  # the container's command is a valid CLI call
        assert args.host == "0.0.0.0" and args.port == 8000
    assert services["harpoon-cpu"]["profiles"] == ["cpu"] and "deploy" not in services["harpoon-cpu"]
    loadtest = services["loadtest"]
    assert loadtest["profiles"] == ["loadtest"]
    assert loadtest["depends_on"]["harpoon"]["condition"] == "service_healthy"
    assert loadtest["command"][:3] == ["python", "-m", "loadtest.serve"]
    assert "./results:/results" in loadtest["volumes"]


def test_the_replicas_profile_puts_one_replica_per_gpu_behind_a_health_checking_router():
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    replicas = [name for name, service in services.items() if service.get("profiles") == ["replicas"]
                and name != "router"]
    assert replicas == ["replica-1", "replica-2"]
    gpus = []
    for name in replicas:
        command = with_defaults(services[name]["command"])
        assert command[:2] == ["harpoon", "serve"] and build_parser().parse_args(command[2:]).port == 8000
        gpus += services[name]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
        assert "/health" in " ".join(services[name]["healthcheck"]["test"])
    assert gpus == ["0", "1"]  # one GPU each
    router = services["router"]
    assert router["depends_on"] == {name: {"condition": "service_healthy"} for name in replicas}
    command = with_defaults(router["command"])
    assert command[:3] == ["python", "-m", "sglang_router.launch_router"]
    urls = command[command.index("--worker-urls") + 1:command.index("--policy")]
    assert urls == [f"http://{name}:8000" for name in replicas] and router["ports"] == ["8000:8000"]
    try:
        from sglang_router.launch_router import parse_router_args
    except ImportError:
        return  # the router is an optional extra: its own parser checks the rest where it is installed
    args = parse_router_args(command[3:])
    assert args.policy == "cache_aware" and args.health_check_endpoint == "/health"
    assert args.worker_urls == urls and args.health_failure_threshold == 3


def test_docker_compose_config_parses():
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not installed (.ci/run installs Debian's)")
    out = subprocess.run(["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "config"], capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "nvidia" in out.stdout


def test_dockerfile_lints_clean_and_runs_the_cli():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    out = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    text = (ROOT / "Dockerfile").read_text()
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.MULTILINE).group(1))
    assert cmd[:2] == ["harpoon", "serve"] and build_parser().parse_args(cmd[2:]).host == "0.0.0.0"
    assert re.search(r"^USER 1000", text, re.MULTILINE) and "EXPOSE 8000" in text and "HEALTHCHECK" in text
    # Dependencies are installed before the sources are copied, so source edits keep the cached layers.
    assert text.index("requirements.lock") < text.index("COPY engine")
    assert "torch==2.13.0" in text and ".venv" in (ROOT / ".dockerignore").read_text()


def test_the_lock_pins_every_runtime_dependency():
    """The image installs docker/requirements.lock and then Harpoon without dependencies: a dependency added to
    pyproject.toml but not to the lock is missing there (as xgrammar, aiohttp and httptools once were)."""
    def name(requirement: str) -> str:
        return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")

    wanted = {name(r) for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    lines = (ROOT / "docker" / "requirements.lock").read_text().splitlines()
    pinned = {line.split("==")[0] for line in lines if line and not line.startswith("#")}
    assert all("==" in line for line in lines if line and not line.startswith("#"))
    assert wanted - {"torch", "triton"} <= pinned, sorted(wanted - {"torch", "triton"} - pinned)


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server


def test_python_clients(server):
    sys.path.insert(0, str(ROOT))
    from clients.chat import Chat
    from clients.openai_sdk import run

    out = run(f"{server.base_url}/v1", "unused")
    assert "Paris" in out["completion"] and out["stream"] and out["chat"]
    assert json.loads(out["json"]).keys() == {"city", "country"}

    from openai import OpenAI

    chat = Chat(OpenAI(base_url=f"{server.base_url}/v1", api_key="unused"), "SmolLM2-135M-Instruct",
                system="You are terse.", max_tokens=24, temperature=0)  # greedy: the answer is known
    first = "".join(chat.ask("What is the capital of France?"))
    assert "Paris" in first and len(chat.history) == 3
    second = "".join(chat.ask("And of Italy?"))
    assert second and [m["role"] for m in chat.history] == ["system", "user", "assistant", "user", "assistant"]

    # Cancelling mid-answer (what Ctrl-C does) keeps the partial answer and frees the server's request.
    chat.max_tokens = 400
    answer = chat.ask("Write a long story about a dragon.")
    partial = [next(answer), next(answer)]
    answer.close()
    assert chat.history[-1] == {"role": "assistant", "content": "".join(partial)}
    deadline = time.monotonic() + 10
    while server.metrics()["harpoon:num_requests_running"] != 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_curl_scripts(server):
    env = {"BASE_URL": server.base_url, "PATH": "/usr/bin:/bin"}

    def run(script: str) -> str:
        return subprocess.run(["bash", str(ROOT / "clients" / "curl" / script)], env=env, capture_output=True,
                              text=True, check=True, timeout=120).stdout

    assert "Paris" in json.loads(run("completion.sh"))["choices"][0]["text"]
    assert run("stream.sh").rstrip().endswith("data: [DONE]")
    assert json.loads(run("chat.sh"))["choices"][0]["message"]["content"]
    assert httpx.get(f"{server.base_url}/health").status_code == 200
