"""Object storage: where a URL (s3://bucket/path) points, whether the store answers, and the few object
calls that checkpoints and datasets need beyond what Streaming and Composer do themselves.

Streaming (datasets) and Composer (checkpoints, ``load_path``) talk to the store through boto3, which reads
``S3_ENDPOINT_URL`` (any S3-compatible store: MinIO, SeaweedFS, Ceph, R2...), ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY`` and ``AWS_DEFAULT_REGION`` (or a profile). What they do not do, and this module
does:

* ``check``: one quick call (HEAD on the bucket, short timeouts, no retries) before any model is built, so
  an endpoint that is down, a missing bucket or wrong credentials is one line naming the URL, the endpoint
  and what to check, not a botocore traceback after minutes of building, nor a hang in boto3's retries.
  s3:// only; gs://, oci:// and the rest are left to Streaming's and Composer's own clients.
* ``retrying``: object calls that ride out a store that is down for a while (a restart, a failover) and
  give up after ``budget`` seconds with the last error; boto3's own retries cover only a few seconds.
* ``sizes``, ``download``, ``upload``: through Composer's object store for the URL's scheme (s3, gs, oci).
"""

from __future__ import annotations

import math
import os
import time
import urllib.parse
from typing import Callable, TypeVar

from diffusion.errors import UsageError, spell

T = TypeVar("T")
RETRY_ENV = "OBJECT_STORE_RETRY_SECONDS"  # seconds an object call keeps retrying a store that does not answer
RETRY_BUDGET = 120.0  # its default
_MISSING = {"404", "NoSuchKey", "NoSuchBucket", "NotFound"}
_DENIED = {"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"}


def _code(error: BaseException) -> str:
    return str((getattr(error, "response", None) or {}).get("Error", {}).get("Code"))


def is_remote(path) -> bool:
    return "://" in str(path or "")


def split(url: str) -> tuple[str, str, str]:
    """(scheme, bucket, key) of ``scheme://bucket/key``."""
    parts = urllib.parse.urlparse(url)
    return parts.scheme, parts.netloc, parts.path.lstrip("/")


def endpoint() -> str:
    """The S3 endpoint boto3 talks to, as a person would name it."""
    return os.environ.get("S3_ENDPOINT_URL") or "AWS S3 (S3_ENDPOINT_URL is not set)"


def is_missing(error: BaseException) -> bool:
    """A missing object or bucket (not a store that is down)."""
    return isinstance(error, FileNotFoundError) or _code(error) in _MISSING


def _client(quick: bool):
    import boto3
    from botocore.config import Config

    config = Config(connect_timeout=3, read_timeout=10, retries={"max_attempts": 1, "mode": "standard"})
    # a new session each time: boto3's default one keeps the credentials it found first
    return boto3.session.Session().client(
        "s3", endpoint_url=os.environ.get("S3_ENDPOINT_URL"), config=config if quick else None
    )


def problem(error: BaseException, url: str) -> str:
    """What an object-store error means for ``url`` and what to check, in a few words."""
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

    _, bucket, _ = split(url)
    if isinstance(error, NoCredentialsError):
        return f"no credentials for {endpoint()}; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"
    if isinstance(error, ClientError):
        code = _code(error)
        if code == "NoSuchKey":
            return f"no such object at {endpoint()}"
        if code in ("404", "NoSuchBucket"):  # a HEAD on the bucket answers a bare 404
            return f"bucket {bucket!r} does not exist at {endpoint()}; create it, or fix the bucket name"
        if code in _DENIED:
            return (
                f"access denied by {endpoint()} ({code}); check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                f"(or AWS_PROFILE) and that they may read and write bucket {bucket!r}"
            )
        return f"{endpoint()} answered {code}: {error.response.get('Error', {}).get('Message') or error}"
    if isinstance(error, EndpointConnectionError) or "Connect" in type(error).__name__:
        return (
            f"cannot reach the object store at {endpoint()}; check S3_ENDPOINT_URL and that the store is up "
            "and reachable from this host"
        )
    first = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__} from {endpoint()}: {first[:200]}"


def check(url: str | None, key: str) -> None:
    """One HEAD on the bucket of ``url`` (s3:// only), or a one-line UsageError naming ``key`` (a config key
    or a positional argument: SRC, OUT), the URL, the endpoint and what to check. Seconds at most."""
    if not is_remote(url):
        return
    scheme, bucket, _ = split(url)
    if scheme != "s3":
        return
    if not bucket:
        raise UsageError(f"{spell(key)} {url!r} names no bucket; give s3://BUCKET/PATH")
    try:
        _client(quick=True).head_bucket(Bucket=bucket)
    except Exception as e:  # noqa: BLE001 - every way of not answering becomes one line
        raise UsageError(f"{spell(key)} {url}: {problem(e, url)}") from None


LOCATIONS = ("remote", "eval_remote", "save_folder", "load_path")  # the TrainConfig keys that may be URLs


def check_locations(cfg) -> None:
    """``check`` for every URL among a TrainConfig's LOCATIONS, before anything is built."""
    for key in LOCATIONS:
        check(getattr(cfg, key, None), key)


def retry_budget() -> float:
    """Seconds to keep retrying a store that does not answer: OBJECT_STORE_RETRY_SECONDS, else RETRY_BUDGET."""
    text = os.environ.get(RETRY_ENV, str(RETRY_BUDGET))
    try:
        return max(0.0, float(text))
    except ValueError:
        raise UsageError(f"{RETRY_ENV}={text!r} is not a number of seconds (default {RETRY_BUDGET:g})") from None


def retrying(call: Callable[[], T], what: str, budget: float | None = None) -> T:
    """``call()``, again while the store does not answer, for up to ``budget`` seconds (default
    ``retry_budget()``; 1, 2, 4... 10 s apart); a missing object or a refusal is raised at once, as is the
    last error when the budget is spent."""
    deadline, wait = time.monotonic() + (retry_budget() if budget is None else budget), 1.0
    while True:
        try:
            return call()
        except Exception as e:  # noqa: BLE001
            if is_missing(e) or _code(e) in _DENIED or time.monotonic() + wait > deadline:
                raise
            print(f"{what}: {problem(e, '')}; retrying in {wait:g} s", flush=True)
            time.sleep(wait)
            wait = min(10.0, wait * 2)


def download_attempts() -> int:
    """Streaming's ``download_retry`` (attempts per shard file, 1, 2, 4... s apart) that spans the retry budget."""
    return max(2, math.ceil(math.log2(retry_budget() + 1)) + 1)


def store(url: str):
    """Composer's object store for the bucket of ``url`` (s3, gs, oci...), objects named from the bucket root."""
    from composer.utils import maybe_create_object_store_from_uri

    scheme, bucket, _ = split(url)
    return maybe_create_object_store_from_uri(f"{scheme}://{bucket}")


def sizes(url: str) -> dict[str, int]:
    """Object name (relative to ``url``) -> size in bytes, for every object under the folder ``url`` (s3)."""
    _, bucket, key = split(url)
    prefix = key.rstrip("/") + "/" if key else ""
    out = {}
    for page in _client(quick=False).get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            out[item["Key"][len(prefix) :]] = item["Size"]
    return out


def download(url: str, local: str, budget: float | None = None) -> str:
    """``url`` into the file ``local`` (a missing object: FileNotFoundError); returns ``local``."""
    _, _, key = split(url)
    objects = store(url)
    retrying(lambda: objects.download_object(key, local, overwrite=True), f"download {url}", budget)
    return local


def upload(local: str, url: str, budget: float | None = None) -> None:
    """The file ``local`` to ``url`` (an S3 PUT is atomic: the object appears whole or not at all), then its
    size read back."""
    _, _, key = split(url)
    objects = store(url)
    retrying(lambda: objects.upload_object(key, local), f"upload {url}", budget)
    got = retrying(lambda: objects.get_object_size(key), f"upload {url}", budget)
    if got != os.path.getsize(local):
        raise OSError(f"{url} is {got:,} bytes after the upload, {os.path.getsize(local):,} were sent")


def delete(url: str) -> None:
    """Delete the object ``url`` (s3:// only: Composer's object stores have no delete; others are left)."""
    scheme, bucket, key = split(url)
    if scheme == "s3":
        retrying(lambda: _client(quick=False).delete_object(Bucket=bucket, Key=key), f"delete {url}")


def copy(src: str, dst: str) -> None:
    """Copy the object ``src`` to ``dst`` inside the store (s3:// only; boto3's managed copy, in parts above 5 GB,
    so nothing passes through this machine)."""
    _, bucket, key = split(src)
    _, to_bucket, to_key = split(dst)
    client = _client(quick=False)
    retrying(lambda: client.copy({"Bucket": bucket, "Key": key}, to_bucket, to_key), f"copy {src} to {dst}")
