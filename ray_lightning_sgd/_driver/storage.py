"""Driver side: where a run's resume checkpoints go, and whether that place can be written.

``checkpoint_storage`` is a local path or an fsspec URI. A local path is made absolute on the
driver (``~`` expanded, as Lightning does for ``dirpath`` and ``default_root_dir``): the workers
then write the same folder wherever their current directory or home is. Before any worker starts,
:func:`check_writable` creates the folder and a probe file in it, so that a read-only or missing
mount is an error at launch naming the argument, not an ``OSError`` on rank 0 after an epoch.
"""

from __future__ import annotations

import logging
import os

from ray_lightning_sgd import _compat, _files
from ray_lightning_sgd.exceptions import ConfigurationError

log = logging.getLogger(__name__)


def resolve(storage: str) -> str:
    """``storage`` as the workers use it: a URI as given, a local path absolute with ``~``
    expanded (on the driver)."""
    if "://" in storage:
        return storage
    return os.path.abspath(os.path.expanduser(storage))


def check_writable(folder: str, given: str, named: bool = False) -> None:
    """Driver side, before any worker starts: creates ``folder`` (a local path or fsspec URI)
    and a probe file in it, and removes the probe.

    Args:
        folder: The folder of ``checkpoint_storage`` that rank 0 will write.
        given: The ``checkpoint_storage`` the user gave, for the message.
        named: A named run's folder, which the driver itself reads and writes (its lock,
            ``run.json``, the checkpoint a new driver resumes from): a URI whose package only
            the workers have is refused then.

    Raises:
        ConfigurationError: The folder cannot be created or written, naming ``checkpoint_storage``,
            its value and the error.
    """
    try:
        _files.probe(folder)
    except ImportError as err:  # the URI's package may be on the workers only: they write it
        if named:
            raise ConfigurationError(
                f"checkpoint_storage={given!r} with a run_name: the driver reads and writes the "
                f"run's folder (run.json, the checkpoint a new driver resumes from), and this "
                f"one cannot open the URI: {err}. Install that package where the driver runs "
                "(and on every worker's node)"
            ) from err
        log.warning(
            "checkpoint_storage=%r is not checked on the driver, which lacks its package (%s); "
            "every worker's node needs it",
            given,
            err,
        )
        return
    except Exception as err:  # an unknown protocol (ValueError), a client that cannot start,
        # OSError locally; fsspec's backends raise their own kinds
        raise _unwritable(given, folder, err) from err


def _unwritable(given: str, folder: str, err: BaseException) -> ConfigurationError:
    where = "" if folder == given else f" ({folder})"
    return ConfigurationError(
        f"checkpoint_storage={given!r}{where} cannot be written: {type(err).__name__}: {err}. "
        "Give a folder that the driver and every worker's node can create and write (a shared "
        "file system, or an fsspec URI such as s3://bucket/runs with its package installed), "
        "or leave checkpoint_storage out to keep resume checkpoints on the driver's node"
    )


def run_folder(storage: str | None, run_id: str, run_name: str | None) -> str | None:
    """The run's folder of ``checkpoint_storage``: a named run's, which a new driver finds, or
    this launch's own: runs that share the storage (Tune trials) never overwrite each other's
    resume checkpoints."""
    if storage is None:
        return None
    # a local path means the same folder to the driver and its workers
    storage = resolve(storage)
    return _files.child(storage, run_name if run_name is not None else f"run-{run_id}")


def check_storage(given: str, run_name: str | None) -> None:
    """Driver side, before Ray is touched: raises unless the folder rank 0 will write can be
    created and written (a named run's own folder; else the storage, where each launch makes
    one). Not from a Ray Client (connected, or about to be), whose machine's disk is not the
    cluster's, but for a named run on a URI (its driver reads and writes the run's folder)."""
    if _compat.ray.driver_is_a_client() or os.environ.get("RAY_ADDRESS", "").startswith("ray://"):
        local = "://" not in given or given.startswith("file://")
        if run_name is not None and local:
            log.warning(
                "run_name=%r with checkpoint_storage=%r behind a Ray Client: this machine keeps "
                "the run's lock and run.json in that folder and looks there for its checkpoints, "
                "which the workers write on their own machines. Unless both reach the same "
                "folder (a shared mount), each new driver starts the run over: give a URI both "
                "reach (s3://..., gs://...).",
                run_name, given,
            )  # fmt: skip
        if run_name is None or local:
            return
        # a named run's driver reads and writes its folder itself, from this machine
    root = resolve(given)
    folder = root if run_name is None else _files.child(root, run_name)
    check_writable(folder, given, named=run_name is not None)
