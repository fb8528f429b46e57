"""An object store (s3://bucket/prefix, gs://..., az://...) in the few operations checkpoints need.

S3 and S3-compatible stores go through boto3, which finds credentials and the endpoint where the
AWS tools do (AWS_ACCESS_KEY_ID / AWS_PROFILE / ~/.aws/credentials / an instance role, and
AWS_ENDPOINT_URL for MinIO, Ceph and the like). Other stores go through fsspec and need its
package for them (gcsfs for gs://, adlfs for az://), which find their credentials the same way.
Every failure is a StoreError: one line that names the URL and what is wrong.
"""

import hashlib
import json
import posixpath
import shutil
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import fsspec

from trainkit.run.extras import require


class StoreError(Exception):
    """The store cannot be reached, refuses the credentials, or has no such bucket; the message is one line."""


class StoreConflict(StoreError):
    """Someone else changed an object between our read and our conditional write."""


class ObjectStore:
    """Objects under one URL prefix, named relative to it."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def read(self, name: str) -> tuple[bytes, str] | None:
        """The object's bytes and its version tag, or None when there is no such object."""
        raise NotImplementedError

    def write(self, name: str, data: bytes, replacing: str | None) -> str:
        """Write a small object only if it is still the version `replacing` (None: only if absent); its new tag."""
        raise NotImplementedError

    def upload(self, local: Path, name: str) -> None:
        """Copy a file in; others see the object only once every byte has arrived."""
        raise NotImplementedError

    def download(self, name: str, local: Path) -> None:
        """Copy an object out; FileNotFoundError if there is none."""
        raise NotImplementedError

    def names(self, folder: str) -> list[str]:
        """The names of the objects in `folder`, relative to this store's URL."""
        raise NotImplementedError

    def delete(self, name: str) -> None:
        raise NotImplementedError

    def check(self, writable: bool) -> None:
        """Raise a StoreError now, before training, if the store could not be read (or written)."""
        self.names("")
        if writable:
            probe = f".write-test-{_unique()}"
            self.write(probe, b"", replacing=None)
            self.delete(probe)

    def read_json(self, name: str) -> tuple[dict[str, Any], str] | None:
        found = self.read(name)
        return None if found is None else (json.loads(found[0]), found[1])

    def where(self, name: str) -> str:
        return f"{self.url}/{name}"


class S3Store(ObjectStore):
    def __init__(self, url: str, timeout: float) -> None:
        super().__init__(url)
        boto3 = require("boto3", f"the checkpoint store {url}")
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        parsed = urlparse(self.url)
        self.bucket, self.prefix = parsed.netloc, parsed.path.strip("/")
        config = Config(connect_timeout=timeout, read_timeout=timeout, retries={"mode": "standard", "max_attempts": 3})
        self.client = boto3.session.Session().client("s3", config=config)
        self.transfer = TransferConfig(multipart_threshold=64 * 2**20, multipart_chunksize=64 * 2**20)

    def read(self, name: str) -> tuple[bytes, str] | None:
        with self._explained(name):
            try:
                found = self.client.get_object(Bucket=self.bucket, Key=self._key(name))
            except self.client.exceptions.NoSuchKey:
                return None
            return found["Body"].read(), found["ETag"]

    def write(self, name: str, data: bytes, replacing: str | None) -> str:
        condition = {"IfNoneMatch": "*"} if replacing is None else {"IfMatch": replacing}
        with self._explained(name):
            return self.client.put_object(Bucket=self.bucket, Key=self._key(name), Body=data, **condition)["ETag"]

    def upload(self, local: Path, name: str) -> None:
        # Large files go up in parts; S3 shows the object only once the last part is in.
        with self._explained(name):
            self.client.upload_file(str(local), self.bucket, self._key(name), Config=self.transfer)

    def download(self, name: str, local: Path) -> None:
        with self._explained(name):
            self.client.download_file(self.bucket, self._key(name), str(local), Config=self.transfer)

    def names(self, folder: str) -> list[str]:
        prefix = self._key(folder)
        prefix = prefix + "/" if prefix and not prefix.endswith("/") else prefix
        with self._explained(folder):
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
            keys = [entry["Key"] for page in pages for entry in page.get("Contents", [])]
        return [key[len(self.prefix) :].lstrip("/") for key in keys]

    def delete(self, name: str) -> None:
        with self._explained(name):
            self.client.delete_object(Bucket=self.bucket, Key=self._key(name))

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}".strip("/") if self.prefix else name

    @contextmanager
    def _explained(self, name: str) -> Iterator[None]:
        from boto3.exceptions import S3UploadFailedError
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        where = self.where(name) if name else self.url
        try:
            yield
        except NoCredentialsError:
            raise StoreError(
                f"{where}: no credentials for the store (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or"
                " AWS_PROFILE, or write ~/.aws/credentials)"
            ) from None
        except ClientError as error:
            code = error.response.get("Error", {}).get("Code", "")
            if code in ("PreconditionFailed", "ConditionalRequestConflict", "412", "409"):
                raise StoreConflict(f"{where} was changed by someone else meanwhile") from None
            if code in ("404", "NoSuchKey"):
                raise FileNotFoundError(f"{where}: no such object") from None
            if code == "NoSuchBucket":
                raise StoreError(f"{where}: bucket {self.bucket} does not exist") from None
            if code in ("AccessDenied", "403", "Forbidden"):
                raise StoreError(f"{where}: access denied (the credentials may not read or write there)") from None
            raise StoreError(f"{where}: {code or 'error'}: {_first_line(error)}") from None
        except (BotoCoreError, S3UploadFailedError) as error:
            endpoint = self.client.meta.endpoint_url
            raise StoreError(f"{where}: cannot reach the store at {endpoint} ({_first_line(error)})") from None


class FsspecStore(ObjectStore):
    """gs://, az:// and any other store fsspec knows. Its conditional write is only as good as the
    filesystem's: most have none, so two jobs writing the same location are not detected."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url)
        except (ImportError, ValueError) as error:
            raise StoreError(f"{self.url}: {_first_line(error)}") from None

    def read(self, name: str) -> tuple[bytes, str] | None:
        with self._explained(name):
            try:
                data = self.fs.cat_file(self._path(name))
            except FileNotFoundError:
                return None
        return data, _tag(data)

    def write(self, name: str, data: bytes, replacing: str | None) -> str:
        current = self.read(name)
        if (current[1] if current else None) != replacing:
            raise StoreConflict(f"{self.where(name)} was changed by someone else meanwhile")
        with self._explained(name):
            self.fs.makedirs(posixpath.dirname(self._path(name)), exist_ok=True)  # a local or mounted directory
            self.fs.pipe_file(self._path(name), data)
        return _tag(data)

    def upload(self, local: Path, name: str) -> None:
        with self._explained(name):
            self.fs.makedirs(posixpath.dirname(self._path(name)), exist_ok=True)
            self.fs.put_file(str(local), self._path(name))

    def download(self, name: str, local: Path) -> None:
        with self._explained(name), self.fs.open(self._path(name), "rb") as source, open(local, "wb") as target:
            shutil.copyfileobj(source, target, 2**22)

    def names(self, folder: str) -> list[str]:
        with self._explained(folder):
            try:
                found = self.fs.find(self._path(folder))
            except FileNotFoundError:
                return []
        root = self.root.rstrip("/")
        return [path[len(root) :].lstrip("/") for path in found]

    def delete(self, name: str) -> None:
        with self._explained(name):
            self.fs.rm_file(self._path(name))

    def _path(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    @contextmanager
    def _explained(self, name: str) -> Iterator[None]:
        try:
            yield
        except (FileNotFoundError, StoreError):
            raise
        except Exception as error:
            raise StoreError(f"{self.where(name)}: {_first_line(error)}") from None


def open_store(url: str, timeout: float) -> ObjectStore:
    """The store at `url`; `timeout` seconds for each request to it."""
    if urlparse(url).scheme == "s3":
        return S3Store(url, timeout)
    return FsspecStore(url)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _tag(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


def _unique() -> str:
    # Not the host and pid: containers sharing the host's network share its name, and their first processes a pid.
    return f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
