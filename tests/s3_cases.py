"""A real S3 server for the object-storage tests: moto's server mode, as a process on 127.0.0.1.

`s3_server` (session fixture) starts `python -m moto.server` on a free port and sets the `AWS_*`
variables that boto3 / s3fs read (the endpoint, made-up credentials), so the code under test finds
the server the way it would find a real one. `bucket` (per test) creates a fresh bucket. Test
modules import both fixtures from here. Nothing in boto3 or s3fs is patched.
"""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

SECRET = "csd-test-secret-never-printed"  # the tests check that no output ever shows it
_buckets = itertools.count()


@dataclass
class S3Server:
    endpoint: str
    env: dict  # the AWS_* variables that point boto3 / s3fs at this server

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing",
                            aws_secret_access_key=self.env.get("AWS_SECRET_ACCESS_KEY", SECRET), region_name="us-east-1")

    def put_tree(self, local, url: str) -> None:
        """Upload every file under the local folder `local` below `url` (s3://bucket/prefix)."""
        from pathlib import Path

        bucket, _, prefix = url[len("s3://"):].partition("/")
        client = self.client()
        for path in sorted(Path(local).rglob("*")):
            if path.is_file():
                key = "/".join(p for p in (prefix, path.relative_to(local).as_posix()) if p)
                client.put_object(Bucket=bucket, Key=key, Body=path.read_bytes())

    def objects(self, url: str) -> dict[str, bytes]:
        """Every object under `url`, by its key relative to it."""
        bucket, _, prefix = url[len("s3://"):].partition("/")
        client, found = self.client(), {}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                key = item["Key"]
                found[key[len(prefix):].lstrip("/")] = client.get_object(Bucket=bucket, Key=key)["Body"].read()
        return found


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_moto(env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """Start `python -m moto.server` on a free port of 127.0.0.1 (`env`: more variables for it, e.g.
    INITIAL_NO_AUTH_ACTION_COUNT=0 to check credentials); returns (process, endpoint) once it listens."""
    port = _free_port()
    process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **(env or {})})
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"moto server did not start on port {port}") from None
            time.sleep(0.1)
    return process, f"http://127.0.0.1:{port}"


@contextmanager
def moto_server(secret: str = SECRET) -> Iterator[S3Server]:
    """moto's S3 server as a process (`start_moto`) with the AWS_* variables of this process pointing at it
    (credentials `testing` / `secret`) while the block runs; then the variables are restored, the server stopped."""
    process, endpoint = start_moto()
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": secret,
           "AWS_DEFAULT_REGION": "us-east-1"}
    before = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield S3Server(endpoint, env)
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        process.kill()
        process.wait()


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server as a process on 127.0.0.1 (a free port), with the AWS_* variables set for it."""
    with moto_server() as server:
        yield server


@pytest.fixture
def bucket(s3_server) -> str:
    """A new, empty bucket on the test server; returns its URL (`s3://csd-test-N`)."""
    name = f"csd-test-{os.getpid()}-{next(_buckets)}"
    s3_server.client().create_bucket(Bucket=name)
    return f"s3://{name}"
