"""Object storage on localhost for the tests of workdirs in buckets: moto's S3 server and
gcp-storage-emulator, each a process of its own started by the tests that need it. Nothing
reaches the internet: the clients are pointed at them by the standard environment
(`AWS_ENDPOINT_URL`, `STORAGE_EMULATOR_HOST`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

AWS = {  # moto takes any keys unless told to check them (`bad_keys`)
    "AWS_ACCESS_KEY_ID": "mptrain-test",
    "AWS_SECRET_ACCESS_KEY": "mptrain-test",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _serving(command: list[str], url: str, env: dict | None = None) -> Iterator[None]:
    proc = subprocess.Popen(
        command, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(url, timeout=1).close()
                break
            except urllib.error.HTTPError:
                break  # it answers
            except OSError:
                assert proc.poll() is None, f"{command[2]} did not start"
                assert time.monotonic() < deadline, f"{command[2]} did not answer in 60 s"
                time.sleep(0.1)
        yield
    finally:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def s3(check_keys: bool = False) -> Iterator[dict[str, str]]:
    """moto's S3 server; yields the environment that points boto3 at it. `check_keys`: it
    refuses every key (none is registered with its IAM), as S3 refuses wrong credentials."""
    port = free_port()
    env = {"INITIAL_NO_AUTH_ACTION_COUNT": "0"} if check_keys else {}
    command = [sys.executable, "-c", "from moto.server import main; main()", "-p", str(port)]
    with _serving(command, f"http://127.0.0.1:{port}/moto-api/", env):
        yield {**AWS, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}


@contextlib.contextmanager
def gcs() -> Iterator[dict[str, str]]:
    """gcp-storage-emulator, in memory; yields the environment that points the client at it."""
    port = free_port()
    command = [sys.executable, "-c", "from gcp_storage_emulator.__main__ import main; main()"]
    command += ["start", "--port", str(port), "--in-memory"]
    with _serving(command, f"http://127.0.0.1:{port}/storage/v1/b"):
        yield {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}"}


def make_bucket(env: dict[str, str], name: str) -> None:
    """Creates bucket `name` on the server `env` points at."""
    with patched_env(env):
        if "AWS_ENDPOINT_URL" in env:
            import boto3

            boto3.client("s3").create_bucket(Bucket=name)
        else:
            from google.auth.credentials import AnonymousCredentials
            from google.cloud import storage

            storage.Client(project="test", credentials=AnonymousCredentials()).create_bucket(name)


@contextlib.contextmanager
def patched_env(env: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def objects(env: dict[str, str], url: str, read: bool = True) -> dict[str, bytes | None]:
    """Every object under `url` (`s3://BUCKET/PATH` or `gs://...`), by key relative to it, read
    with the store's own client (not mptrain's); `read=False`: the keys alone (None each)."""
    scheme, _, rest = url.partition("://")
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.strip("/") + "/"
    with patched_env(env):
        if scheme == "s3":
            import boto3

            client = boto3.client("s3")
            pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
            keys = [o["Key"] for page in pages for o in page.get("Contents", ())]
            get = lambda key: client.get_object(Bucket=bucket, Key=key)["Body"].read()
        else:
            from google.auth.credentials import AnonymousCredentials
            from google.cloud import storage

            client = storage.Client(project="test", credentials=AnonymousCredentials())
            keys = [b.name for b in client.list_blobs(bucket, prefix=prefix)]
            get = lambda key: client.bucket(bucket).blob(key).download_as_bytes()
        return {key[len(prefix) :]: get(key) if read else None for key in keys}


def download(env: dict[str, str], url: str, folder) -> Path:
    """The objects under `url` written as files under `folder` (`objects`)."""
    folder = Path(folder)
    for relative, data in objects(env, url).items():
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        (folder / relative).write_bytes(data)
    return folder
