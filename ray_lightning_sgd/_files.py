"""Files that a later run reads, written whole or not at all: each goes to a temporary name in
its own folder and is renamed into place once complete (a rename within a folder is atomic on
local and most shared file systems; on object stores, fsspec's ``mv`` is a copy, then a delete).

A temporary name starts with a dot and ends with :data:`TEMP_SUFFIX`: no pattern of ours matches
it, and :func:`remove_leftovers` finds what a killed writer left.

Every file system of ours comes from :func:`filesystem`, which gives a storage the fsspec options
(endpoint, credentials, a profile) that the strategy's ``storage_options`` registered for it with
:func:`use_storage_options`: on the driver at launch, on each worker from its payload. They are
secrets: never logged, never written.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

log = logging.getLogger(__name__)

#: How every temporary name of ours ends.
TEMP_SUFFIX = ".writing"
#: How the names of the files that check a folder can be written start.
PROBE_PREFIX = ".ray_lightning_sgd-probe-"


class StorageOptions(dict[str, Any]):
    """A storage's fsspec options, which may hold secrets: a dict whose ``repr`` shows its keys
    only (a Payload's or a config's repr, a log line, an error)."""

    def __repr__(self) -> str:
        return f"StorageOptions(keys={sorted(self)}, values hidden)"

    __str__ = __repr__


#: The fsspec options of the storages this process reads and writes, by each storage's root.
_storage_options: dict[str, dict[str, Any]] = {}


def use_storage_options(root: str, options: Mapping[str, Any] | None) -> None:
    """Gives every path under ``root`` (a URI, or a local path) the fsspec ``options`` from now
    on in this process (None or empty: none)."""
    key = root.rstrip("/") or root
    if options:
        _storage_options[key] = dict(options)
    else:
        _storage_options.pop(key, None)


def storage_options(uri: str) -> dict[str, Any]:
    """The fsspec options registered for the storage that holds ``uri`` (the longest root of
    :func:`use_storage_options` that contains it), or {}."""
    found = ""
    for root in _storage_options:
        inside = uri == root or uri.startswith(root if root.endswith("/") else root + "/")
        if inside and len(root) > len(found):
            found = root
    return dict(_storage_options[found]) if found else {}


def filesystem(uri: str) -> tuple[Any, str]:
    """The fsspec file system of a path or URI, with its storage's options, and the path on it."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(uri, **storage_options(uri))
    return fs, str(path)


#: The prefixes of the environment variables that each protocol's fsspec package reads
#: (credentials, endpoints, regions, profiles).
STORAGE_ENV_PREFIXES: dict[str, tuple[str, ...]] = {
    "s3": ("AWS_",),
    "s3a": ("AWS_",),
    "gs": ("GOOGLE_", "GCS_"),
    "gcs": ("GOOGLE_", "GCS_"),
    "az": ("AZURE_",),
    "abfs": ("AZURE_",),
    "abfss": ("AZURE_",),
    "adl": ("AZURE_",),
}


def env_prefixes(uris: list[str]) -> tuple[str, ...]:
    """The prefixes of the environment variables that the storages of ``uris`` read (paths
    and URIs; chained URLs such as ``simplecache::s3://...`` by each part)."""
    found: set[str] = set()
    for uri in uris:
        for part in uri.split("::"):
            protocol, separator, _ = part.partition("://")
            if separator:
                found.update(STORAGE_ENV_PREFIXES.get(protocol.lower(), ()))
    return tuple(sorted(found))


def probe(folder: str) -> None:
    """Creates ``folder`` (a local path or fsspec URI) and an empty file in it, and removes
    the file: raises what the storage raises where either cannot be done. The file's name is a
    temporary one of ours: a prober killed before it removes it leaves one that the next writer
    of the folder removes (:func:`remove_leftovers`)."""
    fs, path = filesystem(folder)
    fs.makedirs(path, exist_ok=True)
    probe_path = f"{path.rstrip('/')}/{PROBE_PREFIX}{uuid.uuid4().hex[:12]}{TEMP_SUFFIX}"
    with fs.open(probe_path, "wb") as file:
        file.write(b"")
    try:
        fs.rm(probe_path)
    except Exception as err:  # noqa: BLE001 - the storage works; a stray empty file is no error
        log.warning("Could not remove the probe file %s: %s", probe_path, err)


def temp_name(name: str, unique: bool = True) -> str:
    """A temporary name for ``name`` in the same folder (the same on every call when not
    ``unique``: for a file whose writer is known to be alone)."""
    tag = f".{uuid.uuid4().hex[:8]}" if unique else ""
    return f".{name}{tag}{TEMP_SUFFIX}"


def child(folder: str, name: str) -> str:
    """``name`` inside ``folder`` (a local path or an fsspec URI), one slash between: a URI of
    a store's root keeps its ``://`` (``memory://`` gives ``memory://name``; stripping its
    slashes would give ``memory:/name``, which fsspec reads as a local path)."""
    protocol, separator, rest = folder.partition("://")
    if separator and not rest.strip("/"):  # a store's root: "memory://", "file:///"
        return f"{protocol}{separator}{rest}{name}"
    return f"{folder.rstrip('/')}/{name}"


def is_local(fs: Any) -> bool:
    """Whether an fsspec file system is the local one (where ``os`` calls apply)."""
    protocol = fs.protocol
    return "file" in (protocol if isinstance(protocol, tuple | list) else (protocol,))


def publish(fs: Any, temp_path: str, final_path: str) -> None:
    """Renames a complete temporary file into place (paths of an fsspec file system), durably:
    on a local file system the file and then its folder are synced, so that after a crash the
    name holds the whole file."""
    if not is_local(fs):
        if not _moves_by_copy(fs):
            fs.mv(temp_path, final_path)  # the store's own rename
            return
        # fsspec's generic mv: a copy (an object store's is whole or nothing), then a delete of
        # the temporary file; a delete refused (a bucket without delete permission, a transient
        # error) leaves the published file whole: no reason to fail its writer
        fs.copy(temp_path, final_path, on_error="raise")
        try:
            fs.rm(temp_path)
        except Exception as err:  # noqa: BLE001 - whatever the backend raises
            log.warning("Could not remove the temporary file %s once copied: %s", temp_path, err)
        return
    fd = os.open(temp_path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as err:  # some FUSE and CIFS mounts sync nothing for a read-only descriptor
        if err.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)
    os.replace(temp_path, final_path)
    _sync_folder(os.path.dirname(final_path) or ".")


def _moves_by_copy(fs: Any) -> bool:
    """Whether an fsspec file system's ``mv`` is fsspec's generic one (a copy, then a delete),
    as on object stores, rather than a rename of the store's own."""
    from fsspec.asyn import AsyncFileSystem
    from fsspec.spec import AbstractFileSystem

    generic = (AbstractFileSystem.mv, AsyncFileSystem.mv)
    return getattr(type(fs), "mv", None) in generic


def _sync_folder(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # a folder that cannot be opened (some platforms): the rename stands as it is
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(uri: str, data: str | bytes) -> None:
    """Writes ``data`` to ``uri`` (a path or fsspec URI) whole or not at all; a failed write
    (a full disk) leaves the file as it was and no temporary file."""
    fs, path = filesystem(uri)
    mode = "wb" if isinstance(data, bytes) else "w"
    text: dict[str, Any] = {} if mode == "wb" else {"newline": ""}
    # a local file through the OS: fsspec's cached local file system stays in a transaction
    # after a write inside one failed (fsspec 2025.12, after Lightning's save hit a full disk),
    # and its later writes then go to files of its own, never to ``temp``
    opener: Any = open if is_local(fs) else fs.open
    with _published(fs, path) as temp, opener(temp, mode, **text) as file:
        file.write(data)


@contextlib.contextmanager
def _published(fs: Any, path: str) -> Iterator[str]:
    """Yields a temporary name beside ``path`` (on file system ``fs``) to write; renames it
    into place when the block ends, or removes it when the block or the rename fails."""
    folder, _, name = path.rstrip("/").rpartition("/")
    temp = f"{folder}/{temp_name(name)}" if folder else temp_name(name)
    try:
        yield temp
        publish(fs, temp, path)
    except BaseException:
        with contextlib.suppress(Exception):
            if fs.exists(temp):
                fs.rm(temp)
        raise


def upload(local_path: str, uri: str) -> None:
    """Copies the local file ``local_path`` to ``uri`` (a path or fsspec URI) whole or not at
    all: to an object store straight under its name (an object appears only once its upload is
    complete, and a failed one leaves nothing), elsewhere under a temporary name of its folder,
    renamed into place once complete (see :func:`publish`)."""
    fs, path = filesystem(uri)
    if not is_local(fs) and _moves_by_copy(fs):
        fs.put_file(local_path, path)
        return
    with _published(fs, path) as temp:
        if is_local(fs):
            import shutil

            os.makedirs(os.path.dirname(temp) or ".", exist_ok=True)
            shutil.copyfile(local_path, temp)
        else:
            fs.put_file(local_path, temp)


def remove_leftovers(folder: str, starting: str = ".") -> list[str]:
    """Removes the temporary files that killed writers left in ``folder`` (names that start
    with ``starting`` and end with :data:`TEMP_SUFFIX`); returns their paths. Call it only
    where no other writer of the folder runs."""
    fs, path = filesystem(folder)
    removed: list[str] = []
    try:
        entries = fs.ls(path, detail=False) if fs.exists(path) else []
    except (FileNotFoundError, NotADirectoryError):
        return removed
    except Exception as err:  # noqa: BLE001 - a listing refused or failed (a network error)
        # leftovers are a cleanliness matter: their writer's work goes on without it
        log.warning("Could not list %s for unfinished files: %s", folder, err)
        return removed
    for entry in entries:
        name = str(entry).rstrip("/").rsplit("/", 1)[-1]
        if name.startswith(starting) and name.endswith(TEMP_SUFFIX):
            try:
                fs.rm(str(entry))
            except FileNotFoundError:
                continue
            except Exception as err:  # noqa: BLE001 - OSError locally, the backend's own remotely
                log.warning("Could not remove the unfinished file %s: %s", entry, err)
                continue
            removed.append(str(entry))
    return removed
