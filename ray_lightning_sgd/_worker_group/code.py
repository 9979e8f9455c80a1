"""The driver's own code on the workers: what the driver can import, every worker can import.

The driver's own modules are those it imported through the folders of its ``sys.path`` outside the
standard library and site-packages: a project folder added to ``sys.path`` by a script or notebook,
the script's folder, the working directory. :func:`snapshot` (driver side) finds them and describes
them as one :class:`DriverCode`, which travels in the worker group's config; :func:`adopt` runs on
each worker before anything of the driver's is unpickled:

- workers on the driver's node put the driver's own ``sys.path`` folders first on theirs, in the
  driver's order, so they import the very files the driver imported;
- when workers may run on other nodes (the cluster has several, or the driver is a Ray Client), the
  modules (each top-level package's folder, or a module's file) travel as one zip archive through
  Ray's object store; each node unpacks it once per content hash into a folder of its temporary
  directory, which those workers put first on their ``sys.path``.

(Ray's own ``py_modules`` would do the second part too, but before Ray 2.60 it takes local folders
only in ``ray.init``, not in an actor's options; the object store works the same on every Ray.)

The modules' files (path, modification time, size) are part of the description: when the driver's
code changes between two calls, warm workers, which imported the old code, are not reused.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import hashlib
import importlib
import io
import logging
import os
import shutil
import site
import stat
import sys
import sysconfig
import tempfile
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from ray_lightning_sgd.exceptions import ConfigurationError

log = logging.getLogger(__name__)

#: The most the driver ships of its own code to other nodes: more is data, not code.
SHIP_LIMIT_BYTES = 100 * 2**20
#: Modules that every worker has (they run this package) and that are never shipped.
_NEVER_SHIPPED = ("ray_lightning_sgd", "ray", "__main__", "__mp_main__")
#: Folders inside shipped packages that are never code.
_SKIPPED_FOLDERS = ("__pycache__", ".git", ".ipynb_checkpoints")


@dataclass(frozen=True)
class DriverCode:
    """The driver's own code, as the workers need it.

    Args:
        node_id: The driver's Ray node (None: a Ray Client driver, on no node of the cluster).
        sys_path: The driver's own ``sys.path`` folders, in its order.
        files: Each of the driver's own modules' files: path, modification time (ns), size.
        shipped: What goes to workers on other nodes (package folders and module files); empty
            when every worker runs on the driver's node.
        digest: The archive's content hash (its folder's name on each node); empty until the
            archive is made (:func:`with_archive`).
        archive: The archive (zip bytes) in Ray's object store; not compared: equal code is equal
            whatever copy of it the object store holds.
    """

    node_id: str | None
    sys_path: tuple[str, ...]
    files: tuple[tuple[str, int, int], ...]
    shipped: tuple[str, ...] = ()
    digest: str = ""
    archive: Any = field(default=None, compare=False, repr=False)
    #: How many of ``sys_path``'s folders come before the driver's installed packages (the rest
    #: come after them, as ``sys.path.append`` put them).
    in_front: int = 0

    def changed_files(self, older: DriverCode) -> list[str]:
        """The files that are new, gone or modified since ``older``."""
        return sorted({path for path, _, _ in set(self.files) ^ set(older.files)})


def snapshot(node_id: str | None, ship: bool) -> DriverCode:
    """Driver side: the driver's own code now.

    Args:
        node_id: The driver's Ray node (None: a Ray Client driver).
        ship: Whether workers may run on nodes other than the driver's: the modules then travel
            as an archive in Ray's object store (else the worker group makes it when it finds a
            worker elsewhere, see :func:`with_archive`).

    Raises:
        ConfigurationError: The code to ship is larger than :data:`SHIP_LIMIT_BYTES`.
    """
    libraries = _library_folders()
    resolved = _resolved(sys.path)
    in_libraries = [_under(folder, libraries) for folder in resolved]
    sys_path = tuple(f for f, library in zip(resolved, in_libraries, strict=True) if not library)
    first_library = in_libraries.index(True) if True in in_libraries else len(resolved)
    in_front = sum(1 for folder in resolved[:first_library] if folder in sys_path)
    # a copy: another thread may import while the walk runs (a collection during it may too)
    own = _own_modules(sys.modules.copy(), sys_path, libraries)
    files = []
    for path in own.values():
        try:
            stat = os.stat(path)
        except OSError:
            continue
        files.append((path, stat.st_mtime_ns, stat.st_size))
    code = DriverCode(
        node_id,
        sys_path,
        tuple(sorted(files)),
        tuple(_top_levels(own, sys_path)),
        in_front=in_front,
    )
    return with_archive(code) if ship else code


def with_archive(code: DriverCode) -> DriverCode:
    """Driver side: ``code`` with its shipped modules as one archive in Ray's object store.

    Raises:
        ConfigurationError: The code to ship is larger than :data:`SHIP_LIMIT_BYTES`.
    """
    if not code.shipped or code.archive is not None:
        return code
    digest, archive = _archive(code.shipped)
    return dataclasses.replace(code, digest=digest, archive=archive)


#: The last archive put into the object store: (its files' stats and session, digest, ref).
_last_archive: tuple[Any, str, Any] | None = None


def _archive(shipped: tuple[str, ...]) -> tuple[str, Any]:
    """Driver side: the shipped entries as one zip archive in Ray's object store, and its content
    hash; when none of the files changed since the last call, the archive already there."""
    import ray

    global _last_archive
    members = _members(shipped)
    context = ray.get_runtime_context()
    # an object lives as long as its cluster and its driver's connection: the same code in a new
    # session is put again
    key = (tuple(members), context.get_job_id(), context.get_node_id())
    if _last_archive is not None and _last_archive[0] == key:
        return _last_archive[1], _last_archive[2]
    buffer = io.BytesIO()
    digest = hashlib.sha256()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, path, _, _ in members:
            data = Path(path).read_bytes()
            digest.update(name.encode() + b"\0" + data + b"\0")
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            archive.writestr(info, data, zipfile.ZIP_DEFLATED)
    ref = ray.put(buffer.getvalue())
    _last_archive = (key, digest.hexdigest()[:16], ref)
    return _last_archive[1], ref


def _members(shipped: tuple[str, ...]) -> list[tuple[str, str, int, int]]:
    """(name in the archive, file, modification time in ns, size) of everything shipped;
    refuses more than the limit."""
    files: list[tuple[str, str]] = []
    for entry in shipped:
        if os.path.isfile(entry):
            files.append((os.path.basename(entry), entry))
            continue
        root = os.path.dirname(entry)
        for folder, dirs, names in os.walk(entry):
            dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_FOLDERS)
            for name in sorted(names):
                if not name.endswith((".pyc", ".pyo")):
                    path = os.path.join(folder, name)
                    files.append((os.path.relpath(path, root), path))
    members = []
    for name, path in files:
        stat = os.stat(path)
        members.append((name, path, stat.st_mtime_ns, stat.st_size))
    total = sum(size for *_, size in members)
    if total > SHIP_LIMIT_BYTES:
        sizes = {path: size for _, path, _, size in members}
        largest = sorted(sizes.items(), key=lambda item: -item[1])[:3]
        raise ConfigurationError(
            f"the driver's own code to ship to the workers ({', '.join(shipped)}) is "
            f"{total / 2**20:.0f} MiB, more than the limit of {SHIP_LIMIT_BYTES / 2**20:.0f} "
            f"MiB; largest files: {', '.join(f'{p} ({s / 2**20:.0f} MiB)' for p, s in largest)}. "
            "Move data out of the code's folders, or install the code on every node (pip "
            "install, a shared folder) and pass ship_driver_code=False"
        )
    return members


def adopt(code: DriverCode | None) -> None:
    """Runs on each worker, before anything of the driver's is unpickled. On the driver's node,
    the driver's own ``sys.path`` folders take the places they have on the driver: before the
    installed packages, or after them; on another node, the shipped modules' folder (unpacked once
    per node and content) comes first (the group's start makes the archive as soon as it sees a
    worker there; without one, nothing changes, and what cannot be imported says so later)."""
    import ray

    if code is None:
        return
    if code.node_id == ray.get_runtime_context().get_node_id():
        folders = [folder for folder in code.sys_path if os.path.isdir(folder)]
        front, back = folders[: code.in_front], folders[code.in_front :]
    elif code.archive is not None:
        front, back = [_unpacked(code)], []
    else:
        return
    rest = [entry for entry in sys.path if entry not in front and entry not in back]
    sys.path[:] = front + rest + back
    importlib.invalidate_caches()


def _unpacked(code: DriverCode) -> str:
    """Runs on a worker: the folder that holds the shipped modules on this node, in a folder of
    this user's own (mode 0700: no other user of the node can put code there)."""
    import ray

    root = _code_root()
    target = os.path.join(root, code.digest)
    if os.path.isdir(target):
        return target  # another worker of this node unpacked it, in this call or an earlier one
    staging = tempfile.mkdtemp(dir=root, prefix=f".{code.digest}-")
    try:
        with zipfile.ZipFile(io.BytesIO(ray.get(code.archive))) as archive:
            archive.extractall(staging)
        os.rename(staging, target)  # whole or not at all, for the workers that look meanwhile
    except OSError:
        if not os.path.isdir(target):
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone after a rename; a loser's copy
    return target


def _code_root() -> str:
    """Runs on a worker: the folder of this user's own where shipped code is unpacked, one per
    node (``ray_lightning_sgd-code-<uid>`` in the temporary folder); when that name is taken by
    something not this user's alone (another user can make it first in a shared ``/tmp``), a
    fresh private folder of this process's instead."""
    root = os.path.join(tempfile.gettempdir(), f"ray_lightning_sgd-code-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(root, 0o700)
    problem = _not_private(root)
    return root if problem is None else _private_fallback(root, problem)


def _not_private(folder: str) -> str | None:
    """Why ``folder`` is not a folder of this user's alone (no other user may put code in it),
    or None when it is one."""
    try:
        info = os.lstat(folder)  # a link is refused, not followed
    except OSError as err:
        return str(err)
    if not stat.S_ISDIR(info.st_mode):
        return "it is not a folder (a link or a file)"
    if info.st_uid != os.getuid():
        return f"it belongs to user id {info.st_uid}, not to this user ({os.getuid()})"
    if info.st_mode & 0o077:
        return f"its mode {info.st_mode & 0o777:o} lets other users write or read it"
    return None


@functools.cache  # one per process, removed when it exits normally
def _private_fallback(root: str, problem: str) -> str:
    folder = tempfile.mkdtemp(prefix=f"ray_lightning_sgd-code-{os.getuid()}-")
    atexit.register(shutil.rmtree, folder, True)
    log.warning(
        "%s cannot hold the driver's shipped code: %s. This worker unpacks it in %s instead "
        "(one copy per worker, not per node). To share one copy per node again, have %s "
        "removed (by its owner or root), or give the workers a temporary folder of your own: "
        "worker_env={'TMPDIR': <a folder only you can write>}",
        root,
        problem,
        folder,
        root,
    )
    return folder


@functools.cache
def _library_folders() -> tuple[str, ...]:
    """The folders of the standard library and of installed packages."""
    paths = sysconfig.get_paths()
    folders = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    folders.update(site.getsitepackages())
    folders.add(site.getusersitepackages())
    return tuple(os.path.realpath(f) for f in folders if f)


def _resolved(entries: Iterable[str]) -> list[str]:
    """``sys.path``'s folders as absolute real paths ('' is the current folder), each once."""
    seen: list[str] = []
    for entry in entries:
        folder = os.path.realpath(entry or os.curdir)
        if os.path.isdir(folder) and folder not in seen:
            seen.append(folder)
    return seen


def _under(path: str, folders: tuple[str, ...]) -> bool:
    return path in folders or path.startswith(_prefixes(folders))


@functools.cache
def _prefixes(folders: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(f.rstrip(os.sep) + os.sep for f in folders)


def _own_modules(
    modules: Mapping[str, ModuleType | None], folders: tuple[str, ...], libraries: tuple[str, ...]
) -> dict[str, str]:
    """The imported modules (name: real file path) that the driver found through its own
    ``sys.path`` ``folders``, outside the standard library and site-packages; modules loaded
    from a file by path (not importable by name anywhere) are not among them."""
    own = {}
    for name, module in modules.items():
        file = getattr(module, "__file__", None)
        if module is None or not file or name.split(".")[0] in _NEVER_SHIPPED:
            continue
        if _under(file, libraries):
            # an installed module, named by the folder's own path: no need to resolve its file
            # (a first launch would stat and resolve thousands of them: 0.2 s here)
            continue
        path = _real_file(file)
        if path is not None and _under(path, folders) and not _under(path, libraries):
            own[name] = path
    return own


@functools.cache
def _real_file(file: str) -> str | None:
    """A module's ``__file__`` as a real path; None for a file that does not exist (torch.ops
    names one it never had). Cached: each launch looks at every imported module (thousands)."""
    if not os.path.isabs(file) or not os.path.isfile(file):
        return None
    return os.path.realpath(file)


def _top_levels(own: Mapping[str, str], folders: tuple[str, ...]) -> list[str]:
    """What ships the modules: each top-level package's folder, or a top-level module's file."""
    shipped: list[str] = []
    for name in sorted({name.split(".")[0] for name in own}):
        top = sys.modules.get(name)
        entries = list(getattr(top, "__path__", None) or [])
        if not entries and name in own:
            entries = [own[name]]
        for entry in entries:
            path = os.path.realpath(str(entry))
            if _under(path, folders) and path not in shipped:
                shipped.append(path)
    return shipped
