"""infra/prefect.yaml deployments work against a real `prefect server start` on loopback with a process worker."""
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tasks.config import params_to_dict, parse_params

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prefect(*args: str, env: dict, cwd: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    result = subprocess.run([str(BIN / "prefect"), *args], env=env, cwd=cwd, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"prefect {' '.join(args)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    return result


def test_every_stage_and_the_pipeline_are_deployable():
    """One deployment per flow of flows/pipeline.py, each pointing at that flow with parameters it accepts."""
    import flows.pipeline

    deployments = yaml.safe_load((REPO / "infra" / "prefect.yaml").read_text())["deployments"]
    flows_deployed = {}
    for deployment in deployments:
        path, name = deployment["entrypoint"].split(":")
        assert path == "flows/pipeline.py" and deployment["work_pool"]["name"] == "arlflow-process", deployment
        flow = getattr(flows.pipeline, name)
        flow.validate_parameters(deployment["parameters"])  # raises on a parameter the flow does not take
        assert deployment["name"] == f"arlflow-{flow.name}"
        flows_deployed[flow.name] = flow
    assert flows_deployed == {**flows.pipeline.STAGE_FLOWS, "pipeline": flows.pipeline.pipeline_flow}


@pytest.mark.slow
def test_bootstrap_deployment_runs_on_a_process_worker(tmp_path):
    project = tmp_path / "project"
    for name in ["envs", "agents", "models", "tasks", "skills", "datapool", "flows", "infra"]:
        shutil.copytree(REPO / name, project / name, ignore=shutil.ignore_patterns("__pycache__"))
    tiny = parse_params({"bootstrap": {"train_scenarios": 16, "heldout_scenarios": 4, "tokenizer_corpus_episodes": 16,
                                       "tiny": {"hidden_size": 32, "intermediate_size": 64}},
                         "rollout": {"scenarios_per_round": 4}, "warmstart": {"demo_scenarios": 16}})
    (project / "params.yaml").write_text(yaml.safe_dump(params_to_dict(tiny)))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_API_URL=f"http://127.0.0.1:{port}/api", ARLFLOW_ROOT=str(project),
               PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", COLUMNS="250")
    server = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                              env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "prefect server did not become healthy in 90 s"
                time.sleep(1)
        prefect("work-pool", "create", "arlflow-process", "--type", "process", env=env, cwd=project)
        prefect("--no-prompt", "deploy", "--all", "--prefect-file", "infra/prefect.yaml", env=env, cwd=project)
        prefect("deployment", "run", "bootstrap/arlflow-bootstrap", env=env, cwd=project)
        prefect("worker", "start", "--pool", "arlflow-process", "--run-once", env=env, cwd=project, timeout=300)
        runs = prefect("flow-run", "ls", env=env, cwd=project).stdout
        assert "COMPLETED" in runs and "FAILED" not in runs, runs
        assert (project / "artifacts" / "policies" / "base" / "config.json").exists()
        assert len((project / "data" / "scenarios" / "heldout.jsonl").read_text().splitlines()) == 4
    finally:
        server.terminate()
        server.wait(timeout=30)
