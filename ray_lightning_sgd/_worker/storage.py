"""Runs on rank 0: the check, from its own node, that ``checkpoint_storage`` can be written, before
any training. The driver checked it from its machine; the workers run where its credentials,
endpoint or package may be missing (Ray processes started without the driver's environment), and
without this check they found out at the first resume checkpoint, an epoch later."""

from __future__ import annotations

import socket

from ray_lightning_sgd import _files
from ray_lightning_sgd.exceptions import ConfigurationError


def check_storage_from_worker(folder: str) -> None:
    """Runs on rank 0 before a ``fit`` trains: creates ``folder`` (this launch's folder of
    ``checkpoint_storage``) and a probe file in it, and removes the probe.

    Raises:
        ConfigurationError: It cannot be done here, naming the storage, the node, what failed
            and the fix (never the storage's options: they may hold secrets).
    """
    try:
        _files.probe(folder)
    except Exception as err:  # ImportError, OSError, a backend's own (botocore's NoCredentials)
        host = socket.gethostname()
        raise ConfigurationError(
            f"checkpoint_storage: rank 0 (on {host}) cannot write {folder}: "
            f"{type(err).__name__}: {err}. The driver could; the workers' processes lack what "
            "it has. Give the storage's settings to the strategy, storage_options={...} (fsspec "
            "options: credentials, client_kwargs={'endpoint_url': ...}, a profile), or "
            "worker_env={...} (AWS_*, GOOGLE_*, AZURE_* variables), and install the storage's "
            "fsspec package (s3fs, gcsfs, adlfs) on every node"
        ) from err
