"""Runs on rank 0: the check, from its own node, that ``checkpoint_storage`` can be written, before
any training. The driver checked it from its machine; the workers run where its credentials,
endpoint or package may be missing (Ray processes started without the driver's environment), and
without this check they found out at the first resume checkpoint, an epoch later."""

from __future__ import annotations

import logging
import socket
import time

from ray_lightning_sgd import _files
from ray_lightning_sgd.exceptions import ConfigurationError

log = logging.getLogger(__name__)

#: How often the check is tried (a store's transient error, a throttled request) before it fails.
_TRIES = 3


def check_storage_from_worker(folder: str) -> None:
    """Runs on rank 0 before a ``fit`` trains: creates ``folder`` (this launch's folder of
    ``checkpoint_storage``) and a probe file in it, and removes the probe.

    Raises:
        ConfigurationError: It cannot be done here, naming the storage, the node, what failed
            and the fix (never the storage's options: they may hold secrets).
    """
    failed: Exception | None = None
    for attempt in range(1, _TRIES + 1):
        try:
            _files.probe(folder)
            return
        except ImportError as err:  # no package: no point in trying again
            failed = err
            break
        except Exception as err:  # noqa: BLE001 - OSError, a backend's own (NoCredentials...)
            failed = err
            if attempt < _TRIES:
                log.info("Rank 0 could not write %s (%s); trying again", folder, err)
                time.sleep(attempt)
    if failed is not None:
        host = socket.gethostname()
        raise ConfigurationError(
            f"checkpoint_storage: rank 0 (on {host}) cannot write {folder}: "
            f"{type(failed).__name__}: {failed}. The driver could; the workers' processes lack what "
            "it has. Give the storage's settings to the strategy, storage_options={...} (fsspec "
            "options: credentials, client_kwargs={'endpoint_url': ...}, a profile), or "
            "worker_env={...} (AWS_*, GOOGLE_*, AZURE_* variables), and install the storage's "
            "fsspec package (s3fs, gcsfs, adlfs) on every node"
        ) from failed
