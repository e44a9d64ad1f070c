"""S3 remotes against a real SeaweedFS with credentials enforced: `arlflow remote` (DVC's remote on S3) and
`arlflow pool export/import s3://...`. Credentials live in the environment only: never in .dvc/config, never printed;
a refused or unreachable server is one clear line and nothing written; a push the server cut off completes on retry
with every object whole. (The round trip of a finished pipeline is tests/flows/test_pipeline_e2e.py's.)"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from typer.testing import CliRunner

from datapool.store import DataPool
from flows.pool_cli import pool_app
from flows.remote_cli import S3Error, dvc_environment, local_target
from tests.datapool.records_helpers import full_trajectory
from tests.servers import S3Server, start_s3_server

DVC = [sys.executable, "-m", "dvc"]
GIT_USER = ["-c", "user.name=arlflow-test", "-c", "user.email=test@arlflow.invalid"]


def remote(root: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`arlflow remote ARGS` (flows.remote_cli) in ``root``, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "flows.remote_cli", *args], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)


def dvc_project(root: Path, files: dict[str, bytes]) -> Path:
    """A git + DVC project whose ``data/`` folder (``files``) DVC tracks, committed to git."""
    (root / "data").mkdir(parents=True)
    for name, content in files.items():
        (root / "data" / name).write_bytes(content)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    for command in (["init", "-q"], ["config", "core.analytics", "false"], ["add", "-q", "data"]):
        subprocess.run([*DVC, *command], cwd=root, check=True)
    return root


def commit(root: Path) -> None:
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    subprocess.run(["git", *GIT_USER, "commit", "-qm", "run"], cwd=root, check=True)


def keys(server: S3Server, bucket: str) -> list[str]:
    return [o["Key"] for o in server.client().list_objects_v2(Bucket=bucket).get("Contents", [])]


def without_aws(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return {**env, "AWS_EC2_METADATA_DISABLED": "true", **extra}  # no instance-metadata lookups off EC2


def test_remote_add_writes_url_and_endpoint_only_and_refuses_credentials(tmp_path):
    root = dvc_project(tmp_path, {"a.txt": b"a"})
    config = root / ".dvc" / "config"
    before = config.read_text()
    env = without_aws(AWS_ACCESS_KEY_ID="AKIAEXAMPLE", AWS_SECRET_ACCESS_KEY="s3cr3t-value")
    for args, message in [(["s3://AKIAEXAMPLE:s3cr3t-value@bucket/run"], "carries credentials"),
                          (["s3://bucket/run", "--endpoint", "http://key:s3cr3t-value@127.0.0.1:1"],
                           "carries credentials"),
                          (["s3://bucket/run?X-Amz-Credential=s3cr3t-value"], "query"),
                          (["gs://bucket/run"], "not an s3:// URL")]:
        refused = remote(root, "add", *args, env=env)
        assert refused.returncode == 2 and message in refused.stderr, refused.stderr
        assert "s3cr3t-value" not in refused.stdout + refused.stderr
    assert config.read_text() == before

    added = remote(root, "add", "s3://bucket/runs/one", "--endpoint", "http://127.0.0.1:8333", env=env)
    assert added.returncode == 0, added.stderr
    text = config.read_text()
    assert "url = s3://bucket/runs/one" in text and "endpointurl = http://127.0.0.1:8333" in text
    assert "remote = storage" in text and "s3cr3t" not in text and "AKIA" not in text
    again = remote(root, "add", "s3://bucket/runs/two", env=env)  # AWS S3 now: the old endpoint goes
    assert again.returncode == 0 and "(AWS S3)" in again.stdout
    assert "endpointurl" not in config.read_text() and "s3://bucket/runs/two" in config.read_text()


def test_remote_show_says_which_credentials_are_set_never_their_values(tmp_path, s3_server, s3_bucket):
    root = dvc_project(tmp_path, {"a.txt": b"a"})
    env = s3_server.env()
    assert remote(root, "add", f"s3://{s3_bucket}/run", "--endpoint", s3_server.endpoint, env=env).returncode == 0
    shown = remote(root, "show", "--check", env=env)
    assert shown.returncode == 0, shown.stderr
    assert f"remote: storage -> s3://{s3_bucket}/run" in shown.stdout
    assert f"endpoint: {s3_server.endpoint} (.dvc/config)" in shown.stdout
    assert "AWS_ACCESS_KEY_ID set, AWS_SECRET_ACCESS_KEY set, AWS_SESSION_TOKEN not set" in shown.stdout
    assert "check: reachable, credentials accepted" in shown.stdout
    assert s3_server.secret_key not in shown.stdout + shown.stderr

    refused = remote(root, "show", "--check", env=s3_server.env(AWS_SECRET_ACCESS_KEY="not-the-secret"))
    assert refused.returncode == 1 and "refused the credentials" in refused.stderr, refused.stderr
    assert "not-the-secret" not in refused.stdout + refused.stderr
    unset = remote(root, "show", env=without_aws())
    assert "AWS_ACCESS_KEY_ID not set, AWS_SECRET_ACCESS_KEY not set" in unset.stdout

    # a key someone put into the DVC config is flagged (by name), not printed
    subprocess.run([*DVC, "remote", "modify", "--local", "storage", "secret_access_key", "leaked-value"], cwd=root,
                   check=True)
    warned = remote(root, "show", env=env)
    assert "holds secret_access_key for remote 'storage'" in warned.stderr and "leaked-value" not in warned.stderr


def test_push_with_wrong_or_missing_credentials_or_no_server_fails_clearly_and_writes_nothing(
        tmp_path, s3_server, s3_bucket):
    root = dvc_project(tmp_path, {"a.bin": os.urandom(50_000), "b.bin": os.urandom(50_000)})
    env = s3_server.env()
    assert remote(root, "add", f"s3://{s3_bucket}/run", "--endpoint", s3_server.endpoint, env=env).returncode == 0

    wrong = remote(root, "push", env=s3_server.env(AWS_SECRET_ACCESS_KEY="not-the-secret"))
    assert wrong.returncode == 2, wrong.stderr
    assert "dvc push not started" in wrong.stderr and "refused the credentials" in wrong.stderr
    assert "AWS_SECRET_ACCESS_KEY" in wrong.stderr and "Traceback" not in wrong.stderr
    missing = remote(root, "push", env=without_aws())
    assert missing.returncode == 2 and "no AWS credentials" in missing.stderr, missing.stderr
    # DVC's own push with the wrong secret also writes nothing (but says only "unexpected error - Forbidden")
    plain = subprocess.run([*DVC, "push"], cwd=root, env=s3_server.env(AWS_SECRET_ACCESS_KEY="not-the-secret"),
                           capture_output=True, text=True)
    assert plain.returncode != 0
    assert keys(s3_server, s3_bucket) == []

    subprocess.run([*DVC, "remote", "modify", "storage", "endpointurl", "http://127.0.0.1:9"], cwd=root, check=True)
    down = remote(root, "pull", env=env)
    assert down.returncode == 2 and "cannot reach the S3 endpoint http://127.0.0.1:9" in down.stderr, down.stderr

    subprocess.run([*DVC, "remote", "modify", "storage", "endpointurl", s3_server.endpoint], cwd=root, check=True)
    pushed = remote(root, "push", env=env)
    assert pushed.returncode == 0, pushed.stdout + pushed.stderr
    assert len(keys(s3_server, s3_bucket)) == 3  # the two files and the folder's listing


def test_push_creates_a_missing_bucket_only_when_asked(tmp_path, s3_server):
    root = dvc_project(tmp_path, {"a.bin": b"a" * 1000})
    env = s3_server.env()
    bucket = f"arlflow-new-{os.getpid()}-{time.monotonic_ns() % 10**6}"
    assert remote(root, "add", f"s3://{bucket}/run", "--endpoint", s3_server.endpoint, env=env).returncode == 0
    refused = remote(root, "push", env=env)
    assert refused.returncode == 2 and "does not exist" in refused.stderr and "--create-bucket" in refused.stderr
    created = remote(root, "push", "--create-bucket", env=env)
    assert created.returncode == 0 and f"created bucket {bucket}" in created.stderr, created.stderr
    assert len(keys(s3_server, bucket)) == 2


@pytest.mark.slow
def test_a_push_cut_off_by_the_server_completes_on_retry_with_every_object_whole(tmp_path):
    server = start_s3_server(tmp_path / "s3")
    try:
        bucket = "arlflow-cut"
        server.client().create_bucket(Bucket=bucket)
        files = {f"part_{i:03d}.bin": os.urandom(2_000_000) for i in range(100)}  # 200 MB: a push outlasts the polling
        root = dvc_project(tmp_path / "project", files)
        env = server.env()
        assert remote(root, "add", f"s3://{bucket}/run", "--endpoint", server.endpoint, env=env).returncode == 0
        push = subprocess.Popen([sys.executable, "-m", "flows.remote_cli", "push"], cwd=root, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while len(stored := keys(server, bucket)) < 3:
            assert push.poll() is None and time.monotonic() < deadline, "the push ended before the server was cut"
            time.sleep(0.05)
        server.stop()
        assert len(stored) < len(files), "the push finished before the server was cut: push more data"
        _, err = push.communicate(timeout=300)
        assert push.returncode != 0
        assert "dvc push stopped part-way" in err and "cannot reach the S3 endpoint" in err, err[-2000:]
        assert "rerun `arlflow remote push`" in err

        server = start_s3_server(server.data_dir, secret_key=server.secret_key, port=urlsplit(server.endpoint).port)
        env = server.env()
        for key in keys(server, bucket):  # every object that made it is whole: DVC names it by its content's md5
            body = server.client().get_object(Bucket=bucket, Key=key)["Body"].read()
            assert hashlib.md5(body).hexdigest() == "".join(key.split("/")[-2:]).removesuffix(".dir"), key
        retry = remote(root, "push", env=env)
        assert retry.returncode == 0, retry.stdout + retry.stderr
        in_sync = subprocess.run([*DVC, "status", "-c", "--json"], cwd=root, env=env, capture_output=True, text=True)
        assert in_sync.returncode == 0 and in_sync.stdout.strip() == "{}", in_sync.stdout + in_sync.stderr

        commit(root)
        clone = tmp_path / "clone"
        subprocess.run(["git", "clone", "-q", str(root), str(clone)], check=True)
        pulled = remote(clone, "pull", env=env)
        assert pulled.returncode == 0, pulled.stdout + pulled.stderr
        for name, content in files.items():
            assert hashlib.md5((clone / "data" / name).read_bytes()).digest() == hashlib.md5(content).digest(), name
    finally:
        server.stop()


def test_dvc_runs_with_arlflows_retries_unless_the_environment_or_the_aws_profile_sets_them(tmp_path, monkeypatch):
    """botocore's default (legacy mode, 5 attempts, exponential backoff) kept the cut-off push above retrying each
    file for 90 s; arlflow's own 2 standard attempts reported it in about 8 s."""
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "absent"))
    env = dvc_environment(environ={"PATH": "/bin"})
    assert (env["AWS_MAX_ATTEMPTS"], env["AWS_RETRY_MODE"], env["PATH"]) == ("2", "standard", "/bin")
    mine = dvc_environment(environ={"AWS_MAX_ATTEMPTS": "9"})
    assert (mine["AWS_MAX_ATTEMPTS"], mine["AWS_RETRY_MODE"]) == ("9", "standard")

    config = tmp_path / "config"
    config.write_text("[default]\nretry_mode = adaptive\n[profile patient]\nmax_attempts = 7\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    default = dvc_environment(environ={})
    assert default["AWS_MAX_ATTEMPTS"] == "2" and "AWS_RETRY_MODE" not in default  # the profile's retry_mode holds
    patient = dvc_environment("patient", environ={})
    assert "AWS_MAX_ATTEMPTS" not in patient and patient["AWS_RETRY_MODE"] == "standard"
    by_variable = dvc_environment(environ={"AWS_PROFILE": "patient"})
    assert "AWS_MAX_ATTEMPTS" not in by_variable
    assert dvc_environment("no-such-profile", environ={})["AWS_MAX_ATTEMPTS"] == "2"  # DVC reports the profile


# ----------------------------------------------------------------------------------------------- pool exports
runner = CliRunner()


def pool_with_trajectories(path: Path) -> str:
    url = f"sqlite:///{path}"
    second = full_trajectory("second")
    with DataPool(url) as pool:
        pool.add_trajectories([full_trajectory("first"), second])
        pool.curate("second", step_index=1, excluded=True)
    return url


def test_pool_export_to_s3_and_import_into_a_fresh_pool_gives_the_same_trajectories(tmp_path, s3_server, s3_bucket):
    url = pool_with_trajectories(tmp_path / "pool.db")
    target = f"s3://{s3_bucket}/pools/run-1/steps.parquet"
    exported = runner.invoke(pool_app, ["export", target, "--url", url, "--endpoint", s3_server.endpoint],
                             env=s3_server.env(AWS_ENDPOINT_URL="http://127.0.0.1:9"))  # --endpoint wins
    assert exported.exit_code == 0, exported.output
    assert f"wrote 4 steps to {target}" in exported.output
    assert keys(s3_server, s3_bucket) == ["pools/run-1/steps.parquet"]

    fresh = f"sqlite:///{tmp_path / 'fresh.db'}"
    imported = runner.invoke(pool_app, ["import", target, "--url", fresh], env=s3_server.env())  # AWS_ENDPOINT_URL
    assert imported.exit_code == 0, imported.output
    assert "imported 2 new trajectories" in imported.output
    with DataPool(url) as source, DataPool(fresh) as copy:
        for tid in ("first", "second"):
            a, b = source.get_trajectory(tid), copy.get_trajectory(tid)
            assert (a.env, a.round, a.episode_return, a.won, a.status) == (b.env, b.round, b.episode_return, b.won,
                                                                            b.status)
            assert [(s.step_index, s.prompt_ids, s.response_ids, s.logprobs, s.reward) for s in a.steps] == \
                   [(s.step_index, s.prompt_ids, s.response_ids, s.logprobs, s.reward) for s in b.steps]
        assert copy.curation_of("second")["steps"][1]["excluded"] is True
        assert b.metadata == {"imported_from": "steps.parquet"}


def test_pool_export_and_import_with_wrong_credentials_write_nothing(tmp_path, s3_server, s3_bucket):
    url = pool_with_trajectories(tmp_path / "pool.db")
    target = f"s3://{s3_bucket}/pools/steps.parquet"
    wrong = s3_server.env(AWS_SECRET_ACCESS_KEY="not-the-secret")
    refused = runner.invoke(pool_app, ["export", target, "--url", url], env=wrong)
    assert refused.exit_code == 2 and "nothing written" in refused.output and "refused the credentials" in \
        refused.output, refused.output
    assert "not-the-secret" not in refused.output and keys(s3_server, s3_bucket) == []
    folder = runner.invoke(pool_app, ["export", f"s3://{s3_bucket}/pools/", "--url", url], env=s3_server.env())
    assert folder.exit_code == 2 and "names no object" in folder.output and keys(s3_server, s3_bucket) == []

    assert runner.invoke(pool_app, ["export", target, "--url", url], env=s3_server.env()).exit_code == 0
    fresh = tmp_path / "fresh.db"
    refused = runner.invoke(pool_app, ["import", target, "--url", str(fresh)], env=wrong)
    assert refused.exit_code == 2 and "nothing imported" in refused.output, refused.output
    assert not fresh.exists()  # the object is fetched before the pool is opened (or created)
    missing = runner.invoke(pool_app, ["import", f"s3://{s3_bucket}/pools/nothing.parquet", "--url", str(fresh)],
                            env=s3_server.env())
    assert missing.exit_code == 2 and "no object at" in missing.output and not fresh.exists(), missing.output


@pytest.mark.slow
def test_an_export_cut_off_mid_upload_leaves_no_object(tmp_path, monkeypatch):
    """What `arlflow pool export s3://...` does with a finished file (flows.remote_cli.local_target), when the server
    dies during its multipart upload (64 MB: eight parts): an error saying so, and no object under the key."""
    server = start_s3_server(tmp_path / "s3")
    try:
        for name, value in server.env().items():
            if name.startswith("AWS_"):
                monkeypatch.setenv(name, value)
        bucket, client = "arlflow-cut-export", server.client()
        client.create_bucket(Bucket=bucket)
        failure: list[S3Error] = []

        def export() -> None:
            try:
                with local_target(f"s3://{bucket}/pools/steps.parquet") as local:
                    local.write_bytes(os.urandom(64_000_000))
            except S3Error as err:
                failure.append(err)

        thread = threading.Thread(target=export)
        thread.start()
        deadline = time.monotonic() + 120
        while not client.list_multipart_uploads(Bucket=bucket).get("Uploads"):
            assert thread.is_alive() and time.monotonic() < deadline, "the upload ended before the server was cut"
            time.sleep(0.02)
        server.stop()
        thread.join(120)
        assert failure and "cannot reach the S3 endpoint" in str(failure[0]), failure

        server = start_s3_server(server.data_dir, secret_key=server.secret_key, port=urlsplit(server.endpoint).port)
        assert keys(server, bucket) == []
    finally:
        server.stop()
