"""The shared tier's object store: the S3 API through boto3, so any S3 serves (AWS, SeaweedFS, MinIO, Ceph RGW).

`ObjectStore` is the small port the shared tier needs (get with a size cap, put, exists, delete); `S3Objects` is
its one implementation. boto3 is imported only when a store is opened (the `s3` extra), and every failure it
raises comes out as `ObjectStoreError`, so nothing above this module knows botocore. Credentials come from boto3's
own chain: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN), a profile, or a pod's role.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Literal, Protocol

log = logging.getLogger(__name__)


class ObjectStoreError(Exception):
    """The object store could not be asked, or refused (unreachable, timeout, denied, no such bucket)."""


class ObjectTooLargeError(ObjectStoreError):
    """An object is larger than the reader allows; it was not downloaded."""


class ObjectStore(Protocol):
    """Named byte objects in one bucket; implementations must be safe across threads."""

    def get(self, name: str, max_bytes: int) -> bytes | None:
        """The object's bytes; None when there is none; `ObjectTooLargeError` when it has more than `max_bytes`."""
        ...

    def put(self, name: str, data: bytes) -> None: ...

    def exists(self, name: str) -> bool: ...

    def delete(self, name: str) -> None: ...

    def url(self, name: str) -> str:
        """Where the object is, for log lines (`s3://bucket/name`)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class S3Config:
    """Where the objects are and how long a call may take."""

    endpoint_url: str
    bucket: str
    region: str | None = None  # None: AWS_REGION / AWS_DEFAULT_REGION, else us-east-1 (S3 servers ignore it)
    addressing: Literal["path", "virtual"] = "path"  # path: http://host/bucket/name (SeaweedFS, MinIO)
    timeout_s: float = 5.0  # connect and read timeout of one call
    max_connections: int = 16


# A missing object or bucket as S3 reports it (GetObject's NoSuchKey, HeadObject's bare 404).
_ABSENT_CODES = frozenset({"NoSuchKey", "404", "NotFound"})


class S3Objects:
    """An `ObjectStore` over one S3 bucket. One boto3 client, shared by threads (clients are thread-safe)."""

    def __init__(self, config: S3Config) -> None:
        try:
            import boto3  # the `s3` extra: only a deployment with the shared tier needs it
            import botocore.config
            import botocore.exceptions
        except ImportError as err:
            raise RuntimeError("the shared KV tier (KVSTITCH_S3_URL) needs boto3: pip install 'kvstitch[s3]'") from err

        self.config = config
        self._errors = (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError)
        self._client_error = botocore.exceptions.ClientError
        client_config = botocore.config.Config(
            connect_timeout=config.timeout_s,
            read_timeout=config.timeout_s,
            retries={"max_attempts": 2, "mode": "standard"},  # a miss recomputes: no long retry loops
            max_pool_connections=config.max_connections,
            s3={"addressing_style": config.addressing},
        )
        session = boto3.session.Session(botocore_session=_botocore_session())
        region = config.region or session.region_name or "us-east-1"
        self._client: Any = session.client(
            "s3", endpoint_url=config.endpoint_url, region_name=region, config=client_config
        )

    def url(self, name: str) -> str:
        return f"s3://{self.config.bucket}/{name}"

    def get(self, name: str, max_bytes: int) -> bytes | None:
        try:
            response = self._client.get_object(Bucket=self.config.bucket, Key=name)
        except self._client_error as err:
            if _code(err) in _ABSENT_CODES:
                return None
            raise ObjectStoreError(f"GET {self.url(name)}: {err}") from err
        except self._errors as err:
            raise ObjectStoreError(f"GET {self.url(name)}: {err}") from err
        body = response["Body"]
        try:
            length = int(response.get("ContentLength", -1))
            if length > max_bytes:
                raise ObjectTooLargeError(f"{self.url(name)} holds {length} bytes, more than the {max_bytes} allowed")
            data: bytes = body.read(max_bytes + 1)  # a server that lied about the length still stops here
        except self._errors as err:
            raise ObjectStoreError(f"GET {self.url(name)}: {err}") from err
        finally:
            body.close()
        if len(data) > max_bytes:
            raise ObjectTooLargeError(f"{self.url(name)} holds more than the {max_bytes} bytes allowed")
        return data

    def put(self, name: str, data: bytes) -> None:
        try:
            self._client.put_object(Bucket=self.config.bucket, Key=name, Body=data)
        except self._errors as err:
            raise ObjectStoreError(f"PUT {self.url(name)}: {err}") from err

    def exists(self, name: str) -> bool:
        try:
            self._client.head_object(Bucket=self.config.bucket, Key=name)
        except self._client_error as err:
            if _code(err) in _ABSENT_CODES:
                return False
            raise ObjectStoreError(f"HEAD {self.url(name)}: {err}") from err
        except self._errors as err:
            raise ObjectStoreError(f"HEAD {self.url(name)}: {err}") from err
        return True

    def delete(self, name: str) -> None:
        try:
            self._client.delete_object(Bucket=self.config.bucket, Key=name)
        except self._errors as err:
            raise ObjectStoreError(f"DELETE {self.url(name)}: {err}") from err

    def ensure_bucket(self) -> bool:
        """Create the bucket when it does not exist; True when it is there now. Failures are logged, not raised:
        the tier then counts each call's error and the service runs on without it."""
        bucket = self.config.bucket
        try:
            self._client.head_bucket(Bucket=bucket)
            return True
        except self._client_error as err:
            if _code(err) not in _ABSENT_CODES and _code(err) != "NoSuchBucket":
                log.warning("shared KV tier: cannot reach bucket %s: %s", bucket, err)
                return False
        except self._errors as err:
            log.warning("shared KV tier: cannot reach bucket %s: %s", bucket, err)
            return False
        try:
            self._client.create_bucket(Bucket=bucket, **self._location())
        except self._errors as err:
            log.warning("shared KV tier: cannot create bucket %s: %s", bucket, err)
            return False
        log.info("shared KV tier: created bucket %s", bucket)
        return True

    def _location(self) -> dict[str, Any]:
        region = self._client.meta.region_name
        if region in (None, "us-east-1"):
            return {}
        return {"CreateBucketConfiguration": {"LocationConstraint": region}}

    def close(self) -> None:
        self._client.close()


_loader_lock = threading.Lock()
_loader: Any = None


def _botocore_session() -> Any:
    """A fresh botocore session (credentials resolved anew from the environment) sharing one loader of the service
    models, which parsing anew costs 0.2-0.5 s per client."""
    import botocore.loaders
    import botocore.session

    global _loader
    with _loader_lock:
        if _loader is None:
            _loader = botocore.loaders.create_loader()
        session = botocore.session.Session()
        session.register_component("data_loader", _loader)
    return session


def _code(err: Any) -> str:
    return str(err.response.get("Error", {}).get("Code", ""))
