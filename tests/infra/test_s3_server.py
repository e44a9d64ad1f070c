"""infra/s3-local.sh: the local S3 server the remote tests and users share runs, enforces its credentials, and stops
with its process group."""
from __future__ import annotations

import os

import botocore.exceptions
import pytest

from tests.servers import start_s3_server


def test_the_session_server_stores_objects_and_refuses_a_wrong_secret(s3_server, s3_bucket):
    s3_server.client().put_object(Bucket=s3_bucket, Key="a/b.txt", Body=b"payload")
    assert s3_server.client().get_object(Bucket=s3_bucket, Key="a/b.txt")["Body"].read() == b"payload"
    with pytest.raises(botocore.exceptions.ClientError, match="SignatureDoesNotMatch"):
        s3_server.client(secret_key="not-the-secret").put_object(Bucket=s3_bucket, Key="c", Body=b"x")
    keys = [o["Key"] for o in s3_server.client().list_objects_v2(Bucket=s3_bucket).get("Contents", [])]
    assert keys == ["a/b.txt"]


def test_a_stopped_server_leaves_no_process_behind(tmp_path):
    server = start_s3_server(tmp_path / "data")
    pgid = server.process.pid
    server.stop()
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)
