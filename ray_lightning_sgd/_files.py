"""Files that a later run reads, written whole or not at all: each goes to a temporary name in
its own folder and is renamed into place once complete (a rename within a folder is atomic on
local and most shared file systems; on object stores, fsspec's ``mv`` is a copy, then a delete).

A temporary name starts with a dot and ends with :data:`TEMP_SUFFIX`: no pattern of ours matches
it, and :func:`remove_leftovers` finds what a killed writer left.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import uuid
from typing import Any

log = logging.getLogger(__name__)

#: How every temporary name of ours ends.
TEMP_SUFFIX = ".writing"


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


def is_local(filesystem: Any) -> bool:
    """Whether an fsspec file system is the local one (where ``os`` calls apply)."""
    protocol = filesystem.protocol
    return "file" in (protocol if isinstance(protocol, tuple | list) else (protocol,))


def publish(filesystem: Any, temp_path: str, final_path: str) -> None:
    """Renames a complete temporary file into place (paths of an fsspec file system), durably:
    on a local file system the file and then its folder are synced, so that after a crash the
    name holds the whole file."""
    if not is_local(filesystem):
        if not _moves_by_copy(filesystem):
            filesystem.mv(temp_path, final_path)  # the store's own rename
            return
        # fsspec's generic mv: a copy (an object store's is whole or nothing), then a delete of
        # the temporary file; a delete refused (a bucket without delete permission, a transient
        # error) leaves the published file whole: no reason to fail its writer
        filesystem.copy(temp_path, final_path, on_error="raise")
        try:
            filesystem.rm(temp_path)
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


def _moves_by_copy(filesystem: Any) -> bool:
    """Whether an fsspec file system's ``mv`` is fsspec's generic one (a copy, then a delete),
    as on object stores, rather than a rename of the store's own."""
    from fsspec.asyn import AsyncFileSystem
    from fsspec.spec import AbstractFileSystem

    generic = (AbstractFileSystem.mv, AsyncFileSystem.mv)
    return getattr(type(filesystem), "mv", None) in generic


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
    import fsspec

    filesystem, path = fsspec.core.url_to_fs(uri)
    folder, _, name = path.rstrip("/").rpartition("/")
    temp = f"{folder}/{temp_name(name)}" if folder else temp_name(name)
    mode = "wb" if isinstance(data, bytes) else "w"
    text: dict[str, Any] = {} if mode == "wb" else {"newline": ""}
    # a local file through the OS: fsspec's cached local file system stays in a transaction
    # after a write inside one failed (fsspec 2025.12, after Lightning's save hit a full disk),
    # and its later writes then go to files of its own, never to ``temp``
    opener: Any = open if is_local(filesystem) else filesystem.open
    try:
        with opener(temp, mode, **text) as file:
            file.write(data)
        publish(filesystem, temp, path)
    except BaseException:
        with contextlib.suppress(Exception):
            if filesystem.exists(temp):
                filesystem.rm(temp)
        raise


def remove_leftovers(folder: str, starting: str = ".") -> list[str]:
    """Removes the temporary files that killed writers left in ``folder`` (names that start
    with ``starting`` and end with :data:`TEMP_SUFFIX`); returns their paths. Call it only
    where no other writer of the folder runs."""
    import fsspec

    filesystem, path = fsspec.core.url_to_fs(folder)
    removed: list[str] = []
    try:
        entries = filesystem.ls(path, detail=False) if filesystem.exists(path) else []
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
                filesystem.rm(str(entry))
            except FileNotFoundError:
                continue
            except Exception as err:  # noqa: BLE001 - OSError locally, the backend's own remotely
                log.warning("Could not remove the unfinished file %s: %s", entry, err)
                continue
            removed.append(str(entry))
    return removed
