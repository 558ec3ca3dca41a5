"""Buckets of object storage, `s3://BUCKET/PATH` and `gs://BUCKET/PATH`, as a run's workdir
reads and writes them: list, get, put (conditionally: a lease), upload, download, delete.

S3 through boto3 (the extra `mptrain[s3]`), any S3-compatible store (MinIO, R2, moto) by
`AWS_ENDPOINT_URL`, credentials from the standard chain (`AWS_ACCESS_KEY_ID`, profiles, instance
roles); GCS through google-cloud-storage (`mptrain[gcs]`), application default credentials, or
an emulator by `STORAGE_EMULATOR_HOST`. Each object has a version: S3's ETag, GCS's generation;
a conditional put writes only where the object is absent (`if_absent`) or still at a version
read before (`if_version`): S3's `If-None-Match`/`If-Match`, GCS's `ifGenerationMatch`.

`open(url)` checks, before anything is written, that the endpoint answers, the credentials are
taken and the bucket exists: where not, one `WorkdirError` line (exit 2) naming the URL and the
cause. A failed read or write later is a `StorageError` (exit 1) naming the object.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from mptrain import errors

SCHEMES = ("s3", "gs")
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://([^/]*)/?(.*)$")
_EXTRA = {"s3": ("boto3", "s3"), "gs": ("google.cloud.storage", "gcs")}


def scheme(path: str | os.PathLike) -> str | None:
    """The scheme of a URL (`s3`, `gs`, `hdfs`, ...), or None for a path."""
    found = _URL.match(os.fspath(path))
    return found.group(1) if found else None


def parse(url: str, flag: str = "--workdir") -> tuple[str, str, str]:
    """`(scheme, bucket, prefix)` of `s3://BUCKET/PATH` or `gs://BUCKET/PATH` (the prefix without
    slashes at its ends); a `ConfigError` naming `flag` for another scheme or no bucket."""
    found = _URL.match(url)
    if found is None or found.group(1) not in SCHEMES:
        kind = found.group(1) if found else "no"
        raise errors.ConfigError(
            f"{flag}={url}: a {kind}:// URL; mptrain reads and writes runs in a local or shared "
            "folder, s3://BUCKET/PATH or gs://BUCKET/PATH"
        )
    name, prefix = found.group(2), found.group(3).strip("/")
    if not name:
        raise errors.ConfigError(f"{flag}={url}: no bucket; give {found.group(1)}://BUCKET/PATH")
    return found.group(1), name, prefix


@dataclasses.dataclass(frozen=True)
class Object:
    size: int
    version: str  # S3's ETag, GCS's generation: changes with every write


class Bucket:
    """The objects under one URL's prefix; keys are relative to it (`checkpoints/3/meta`)."""

    def __init__(self, url: str, name: str, prefix: str, flag: str = "--workdir"):
        self.url, self.name, self.prefix = url.rstrip("/"), name, prefix
        self.flag = flag  # what named the URL, in errors

    def key(self, relative: str) -> str:
        return f"{self.prefix}/{relative}" if self.prefix else relative

    def where(self, relative: str = "") -> str:
        return f"{self.url}/{relative}" if relative else self.url

    def relative(self, key: str) -> str:
        return key[len(self.prefix) + 1 :] if self.prefix else key

    # each backend: check, list, get, put, upload, download, delete


class S3(Bucket):
    def __init__(self, url: str, name: str, prefix: str, flag: str = "--workdir"):
        super().__init__(url, name, prefix, flag)
        import boto3
        import botocore.config
        import botocore.exceptions

        self._errors = botocore.exceptions
        config = botocore.config.Config(
            retries={"max_attempts": 4, "mode": "standard"}, connect_timeout=10, read_timeout=60
        )
        self._client = boto3.client("s3", config=config)
        self.endpoint = self._client.meta.endpoint_url

    def check(self) -> None:
        try:
            self._client.head_bucket(Bucket=self.name)
        except self._errors.NoCredentialsError:
            raise _refused(self, "no AWS credentials (set AWS_ACCESS_KEY_ID and "
                           "AWS_SECRET_ACCESS_KEY, or a profile)") from None  # fmt: skip
        except self._errors.EndpointConnectionError:
            raise _refused(self, f"cannot reach the endpoint {self.endpoint}") from None
        except self._errors.ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            if code in ("404", "NoSuchBucket"):
                raise _refused(self, f"no bucket {self.name!r} at {self.endpoint}") from None
            if code in ("403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied"):
                raise _refused(self, f"the credentials were refused ({code}) at "
                               f"{self.endpoint}") from None  # fmt: skip
            raise _refused(self, f"{code}: {errors.first_line(e)}") from None

    def list(self) -> dict[str, Object]:
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.name, Prefix=self.key("")
        )
        with self._failing(""):
            return {
                self.relative(o["Key"]): Object(o["Size"], o["ETag"])
                for page in pages
                for o in page.get("Contents", ())
            }

    def get(self, relative: str) -> tuple[bytes, str] | None:
        try:
            found = self._client.get_object(Bucket=self.name, Key=self.key(relative))
        except self._errors.ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise _failed(self, relative, e) from e
        return found["Body"].read(), found["ETag"]

    def put(self, relative: str, data: bytes, *, if_absent=False, if_version=None) -> str | None:
        """Writes `data`; returns its version, or None where the condition did not hold."""
        condition = {"IfNoneMatch": "*"} if if_absent else {}
        condition |= {"IfMatch": if_version} if if_version else {}
        try:
            put = self._client.put_object(
                Bucket=self.name, Key=self.key(relative), Body=data, **condition
            )
        except self._errors.ClientError as e:
            code = e.response.get("Error", {}).get("Code")
            if condition and code in ("PreconditionFailed", "ConditionalRequestConflict", "412"):
                return None
            raise _failed(self, relative, e) from e
        return put["ETag"]

    def upload(self, path: Path, relative: str) -> str:
        with self._failing(relative):  # in parts, in parallel, past 8 MiB
            self._client.upload_file(os.fspath(path), self.name, self.key(relative))
            return self._client.head_object(Bucket=self.name, Key=self.key(relative))["ETag"]

    def download(self, relative: str, path: Path) -> None:
        with self._failing(relative):
            self._client.download_file(self.name, self.key(relative), os.fspath(path))

    def delete(self, relative: str) -> None:
        with self._failing(relative):
            self._client.delete_object(Bucket=self.name, Key=self.key(relative))

    def _failing(self, relative: str):
        return _Failing(self, relative, (self._errors.BotoCoreError, self._errors.ClientError))


class GCS(Bucket):
    def __init__(self, url: str, name: str, prefix: str, flag: str = "--workdir"):
        super().__init__(url, name, prefix, flag)
        import google.api_core.exceptions
        import google.auth.exceptions
        from google.cloud import storage

        self._errors, self._auth = google.api_core.exceptions, google.auth.exceptions
        emulator = os.environ.get("STORAGE_EMULATOR_HOST")
        self.endpoint = emulator or "https://storage.googleapis.com"
        try:
            if emulator:  # no credentials there; a project the emulator ignores
                from google.auth.credentials import AnonymousCredentials

                client = storage.Client(project="mptrain", credentials=AnonymousCredentials())
            else:
                client = storage.Client()
        except (self._auth.DefaultCredentialsError, ValueError, OSError) as e:
            why = e.args[0] if e.args and isinstance(e.args[0], str) else errors.first_line(e)
            raise _refused(self, f"no Google credentials ({why})") from None
        self._bucket = client.bucket(name)

    def check(self) -> None:
        import requests
        from google.cloud.storage.retry import DEFAULT_RETRY

        try:  # retried for 20 s, not the client's 120
            if not self._bucket.exists(timeout=10, retry=DEFAULT_RETRY.with_timeout(20)):
                raise _refused(self, f"no bucket {self.name!r} at {self.endpoint}")
        except (self._errors.Forbidden, self._errors.Unauthorized, self._auth.GoogleAuthError) as e:
            raise _refused(
                self, f"the credentials were refused ({errors.first_line(e)[:120]})"
            ) from None
        except (requests.exceptions.ConnectionError, self._errors.RetryError) as e:
            cause = e.__cause__ if isinstance(e, self._errors.RetryError) else e
            if not isinstance(cause, requests.exceptions.ConnectionError):
                raise _refused(self, errors.first_line(e)[:200]) from None
            raise _refused(self, f"cannot reach the endpoint {self.endpoint}") from None

    def list(self) -> dict[str, Object]:
        with self._failing(""):
            blobs = self._bucket.client.list_blobs(self._bucket, prefix=self.key(""))
            return {self.relative(b.name): Object(b.size, str(b.generation)) for b in blobs}

    def get(self, relative: str) -> tuple[bytes, str] | None:
        try:  # the generation read first, then that generation's bytes
            blob = self._bucket.get_blob(self.key(relative))
            if blob is None:
                return None
            generation = blob.generation
            data = blob.download_as_bytes(if_generation_match=generation)
        except self._errors.NotFound:
            return None
        except Exception as e:
            raise _failed(self, relative, e) from e
        return data, str(generation)

    def put(self, relative: str, data: bytes, *, if_absent=False, if_version=None) -> str | None:
        """Writes `data`; returns its version, or None where the condition did not hold."""
        blob = self._bucket.blob(self.key(relative))
        match = 0 if if_absent else (int(if_version) if if_version else None)
        try:
            blob.upload_from_string(data, if_generation_match=match)
        except self._errors.PreconditionFailed:
            return None
        except Exception as e:
            raise _failed(self, relative, e) from e
        return str(blob.generation)

    def upload(self, path: Path, relative: str) -> str:
        blob = self._bucket.blob(self.key(relative))
        with self._failing(relative):  # resumable, in chunks, past 8 MiB
            blob.upload_from_filename(os.fspath(path))
        return str(blob.generation)

    def download(self, relative: str, path: Path) -> None:
        with self._failing(relative):
            self._bucket.blob(self.key(relative)).download_to_filename(os.fspath(path))

    def delete(self, relative: str) -> None:
        try:
            self._bucket.blob(self.key(relative)).delete()
        except self._errors.NotFound:
            pass
        except Exception as e:
            raise _failed(self, relative, e) from e

    def _failing(self, relative: str):
        return _Failing(self, relative, (Exception,))


class _Failing:
    """Within the block, an error of the bucket's library is one `StorageError` naming the
    object (`_failed`)."""

    def __init__(self, bucket: Bucket, relative: str, kinds: tuple):
        self.bucket, self.relative, self.kinds = bucket, relative, kinds

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if error is not None and isinstance(error, self.kinds):
            raise _failed(self.bucket, self.relative, error) from error


def _failed(bucket: Bucket, relative: str, error: BaseException) -> errors.StorageError:
    return errors.StorageError(
        f"could not reach {bucket.where(relative)}: {type(error).__name__}: "
        f"{errors.first_line(error)[:200]}"
    )


def _refused(bucket: Bucket, why: str) -> errors.WorkdirError:
    return errors.WorkdirError(f"{bucket.flag}={bucket.url}: {why}; nothing was written")


def open(url: str, flag: str = "--workdir") -> Bucket:
    """The bucket of `url`, checked (the module doc): its library imported (a missing extra is
    a `ConfigError` naming it), the endpoint reached, the credentials taken, the bucket there."""
    kind, name, prefix = parse(url, flag)
    module, extra = _EXTRA[kind]
    try:
        __import__(module)
    except ImportError:
        raise errors.ConfigError(
            f"{flag}={url}: {kind}:// needs {module.split('.')[0]}: pip install 'mptrain[{extra}]'"
        ) from None
    bucket = (S3 if kind == "s3" else GCS)(url, name, prefix, flag)
    bucket.check()
    return bucket
