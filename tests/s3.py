"""A real S3 server for the tests: moto's, over HTTP on 127.0.0.1, in a thread of the test process
(its objects live as long as the process). Ray's workers, drivers in subprocesses and Lightning's
``ddp`` processes reach it as any S3 endpoint: by ``storage_options`` or by the ``AWS_*``
environment variables that botocore reads (``AWS_ENDPOINT_URL`` included).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

#: The credentials the server takes (moto checks none).
KEY, SECRET = "testing-key", "testing-secret-do-not-show"
REGION = "us-east-1"


@dataclass(frozen=True)
class S3:
    """A running server."""

    endpoint: str
    #: moto's server, where this process runs it.
    server: Any = field(default=None, repr=False, compare=False)

    def stop(self) -> None:
        """Stops the server (again: nothing); its objects stay in this process."""
        if self.server is not None and getattr(self.server, "_thread", None) is not None:
            self.server.stop()
            self.server._server.server_close()  # connections refused from now on
            self.server._thread = None

    @property
    def env(self) -> dict[str, str]:
        """The environment that points botocore (s3fs, boto3) at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_DEFAULT_REGION": REGION,
        }

    @property
    def storage_options(self) -> dict[str, Any]:
        """fsspec's (s3fs's) options for this server."""
        return {
            "key": KEY,
            "secret": SECRET,
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": REGION},
        }

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=KEY,
            aws_secret_access_key=SECRET,
            region_name=REGION,
        )

    def new_bucket(self, prefix: str = "test") -> str:
        """A new empty bucket's name."""
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        """The keys of the bucket's objects under ``prefix``, sorted."""
        client = self.client()
        keys: list[str] = []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            keys.extend(entry["Key"] for entry in page.get("Contents", []))
        return sorted(keys)

    def read(self, bucket: str, key: str) -> bytes:
        return self.client().get_object(Bucket=bucket, Key=key)["Body"].read()


@contextlib.contextmanager
def s3_server(port: int = 0) -> Iterator[S3]:
    """Starts moto's S3 server on ``port`` (0: a free one) of 127.0.0.1; stops it at the end.
    Servers of one process serve the same objects (moto keeps them in the process)."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    running = S3("", server)
    try:
        host, bound = server.get_host_and_port()
        running = S3(f"http://{host}:{bound}", server)
        yield running
    finally:
        running.stop()
