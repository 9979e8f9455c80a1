"""Packing what the launcher sends between driver and workers: tensor storages out of band.

Torch pickles a CPU tensor by writing its storage with ``torch.save`` into a bytes object, which
Ray's serializer then copies again; the receiving side reads the bytes back with ``torch.load``. For a
Trainer carrying a large dataset, or a model's weights coming back, those copies are most of the
transfer. :func:`pack` pickles an object with cloudpickle but hands every CPU tensor's storage to
pickle as an out-of-band buffer, which Ray writes into its object store once; :func:`unpack` copies
each storage once into fresh, writable memory owned by the receiving process. Tensors that shared a
storage (views, tied weights) share one again after the trip.

Ray object refs and actor handles inside the object are not pickled here: they travel in
:class:`Packed` itself, so that Ray's serializer sees them and counts their references. Objects
both sides hold (a Trainer, its model) can travel by name instead (``shared``): the receiving side
puts its own object of that name in their place. Objects of the types named by ``set_aside``
(Ray Data's datasets) are left out and listed in :attr:`Packed.set_aside`; the receiving side
puts one object of its own in the place of each (``replacements``), for example its rank's shard.

Anything else (GPU, sparse or quantized tensors, tensor subclasses, tensors with Python attributes)
falls back to torch's own pickling, unchanged; with ``cpu=True`` plain GPU tensors travel as CPU
tensors first.
"""

from __future__ import annotations

import io
import pickle
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import ray
import torch
from lightning_utilities.core.apply_func import apply_to_collection
from ray import cloudpickle

_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


class Packed(NamedTuple):
    """A packed object: the pickle stream, its out-of-band buffers and the Ray objects it holds."""

    data: bytes
    #: One buffer per distinct tensor storage: ``PickleBuffer`` when packed, and whatever buffer
    #: Ray hands back (a read-only view of its object store) after a trip through Ray.
    buffers: list[Any]
    ray_objects: list[Any]
    #: The objects left out (see :func:`pack`'s ``set_aside``), in the order of their places.
    set_aside: tuple[Any, ...] = ()


def pack(
    obj: Any,
    shared: dict[int, str] | None = None,
    cpu: bool = False,
    set_aside: tuple[type, ...] = (),
) -> Packed:
    """Pickles ``obj`` with cloudpickle, tensor storages out of band.

    Args:
        obj: What to pickle.
        shared: Objects (by ``id``) that are pickled as their name: :func:`unpack` takes the
            receiving side's object of that name.
        cpu: Whether tensors on other devices travel as CPU tensors (for a driver without them).
        set_aside: Types whose objects are not pickled but listed in ``Packed.set_aside`` (each
            object once, however often it is referred to); :func:`unpack` takes replacements.
    """
    file = io.BytesIO()
    buffers: list[pickle.PickleBuffer] = []
    pickler = _Pickler(file, buffers, shared or {}, cpu, set_aside)
    pickler.dump(obj)
    return Packed(file.getvalue(), buffers, pickler.ray_objects, tuple(pickler.set_aside))


def in_band(packed: Packed) -> Packed:
    """``packed`` with its buffers copied into ``bytes``: for a receiver that pickles what it
    gets once more (a Ray Client's server cannot pickle the buffers Ray hands back)."""
    return packed._replace(buffers=[bytes(memoryview(b)) for b in packed.buffers])


def unpack(
    packed: Packed,
    copy: bool = True,
    shared: dict[str, Any] | None = None,
    replacements: Sequence[Any] = (),
) -> Any:
    """Rebuilds what :func:`pack` packed; every tensor owns a writable copy of its storage.

    With ``copy=False`` the tensors are views of the buffers instead, which after a trip through
    Ray are Ray's shared object store: read them (to copy them elsewhere), never write them.
    ``shared`` maps the names :func:`pack` gave shared objects to this side's objects; a name it
    lacks raises ``KeyError``. ``replacements`` take the places of the objects :func:`pack` set
    aside, one each, in their order.
    """
    unpickler = _Unpickler(
        io.BytesIO(packed.data), packed.buffers, packed.ray_objects, copy, shared or {},
        replacements,
    )  # fmt: skip
    return unpickler.load()


#: Reductions that :func:`pack` tries first on every object that is no tensor: each returns an
#: object's reduction, or None to leave it to cloudpickle (see :func:`register_reduction`).
_reductions: list[Callable[[Any], Any]] = []


def register_reduction(reduce: Callable[[Any], Any]) -> None:
    """Adds a reduction for other libraries' objects that must not travel as they are (the
    compat layer registers them, keeping their private names there)."""
    if reduce not in _reductions:
        _reductions.append(reduce)


class _Pickler(cloudpickle.CloudPickler):
    def __init__(
        self,
        file: io.BytesIO,
        buffers: list[pickle.PickleBuffer],
        shared: dict[int, str],
        cpu: bool,
        set_aside: tuple[type, ...],
    ) -> None:
        super().__init__(file, protocol=5, buffer_callback=buffers.append)
        self.ray_objects: list[Any] = []
        #: The objects set aside, in the order of their places, and each one's place by id.
        self.set_aside: list[Any] = []
        self._aside_places: dict[int, int] = {}
        self._set_aside_types = set_aside
        self._shared = shared
        self._cpu = cpu
        # one _Storage per distinct storage, so that pickle's memo shares it between its tensors
        self._storages: dict[int, _Storage] = {}

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, (ray.ObjectRef, ray.actor.ActorHandle)):
            self.ray_objects.append(obj)
            return len(self.ray_objects) - 1
        if self._set_aside_types and isinstance(obj, self._set_aside_types):
            place = self._aside_places.setdefault(id(obj), len(self.set_aside))
            if place == len(self.set_aside):
                self.set_aside.append(obj)
            return ("aside", place)
        name = self._shared.get(id(obj))
        return None if name is None else ("shared", name)

    def reducer_override(self, obj: Any) -> Any:
        kind = type(obj)
        if self._cpu and kind in _PLAIN_TENSOR_TYPES and obj.device.type not in ("cpu", "meta"):
            moved = obj.detach().cpu().requires_grad_(obj.requires_grad)
            if kind is torch.nn.Parameter:
                moved = torch.nn.Parameter(moved, requires_grad=obj.requires_grad)
            obj = moved
        if type(obj) in _PLAIN_TENSOR_TYPES and _is_plain_cpu_tensor(obj):
            return self._reduce_tensor(obj)
        for reduce in _reductions:
            reduced = reduce(obj)
            if reduced is not None:
                return reduced
        return super().reducer_override(obj)

    def _reduce_tensor(self, tensor: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
        storage = tensor.untyped_storage()
        if storage.nbytes():
            key = storage.data_ptr()
            ref = self._storages.get(key)
            if ref is None:
                ref = self._storages[key] = _Storage(storage)
        else:  # empty storages have no address to tell them apart by
            ref = _Storage(storage)
        return _rebuild_tensor, (
            ref,
            tensor.dtype,
            tensor.storage_offset(),
            tuple(tensor.size()),
            tensor.stride(),
            tensor.requires_grad,
            type(tensor) is torch.nn.Parameter,
        )


class _Unpickler(pickle.Unpickler):
    def __init__(
        self,
        file: io.BytesIO,
        buffers: list[Any],
        ray_objects: list[Any],
        copy: bool,
        shared: dict[str, Any],
        replacements: Sequence[Any],
    ) -> None:
        super().__init__(file, buffers=buffers)
        self._ray_objects = ray_objects
        self._copy = copy
        self._shared = shared
        self._replacements = replacements

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and pid[0] == "aside":
            return self._replacements[pid[1]]
        if isinstance(pid, tuple):
            return self._shared[pid[1]]
        return self._ray_objects[pid]

    def find_class(self, module: str, name: str) -> Any:
        if not self._copy and module == __name__ and name == _rebuild_storage.__name__:
            return _view_storage
        return super().find_class(module, name)


def _is_plain_cpu_tensor(tensor: torch.Tensor) -> bool:
    return (
        tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not tensor.is_quantized
        and not tensor.is_conj()
        and not tensor.is_neg()
        # torch refuses to pickle these; its own path raises its own error
        and (tensor.is_leaf or not tensor.requires_grad)
        # Python attributes on a tensor travel only with torch's pickling
        and not tensor.__dict__
    )


class _Storage:
    """Sending side: one tensor storage, pickled as one out-of-band buffer."""

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self._storage = storage

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        storage = self._storage
        as_bytes = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
        return _rebuild_storage, (pickle.PickleBuffer(as_bytes.numpy().data),)


def _rebuild_storage(buffer: Any) -> torch.UntypedStorage:
    source = _bytes_tensor(buffer)
    return torch.empty(len(source), dtype=torch.uint8).copy_(source).untyped_storage()


def _view_storage(buffer: Any) -> torch.UntypedStorage:
    return _bytes_tensor(buffer).untyped_storage()


def _bytes_tensor(buffer: Any) -> torch.Tensor:
    with warnings.catch_warnings():
        # torch warns that Ray's read-only buffers are read-only; they are only read
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.frombuffer(buffer, dtype=np.uint8))


def _rebuild_tensor(
    storage: torch.UntypedStorage,
    dtype: torch.dtype,
    offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    requires_grad: bool,
    parameter: bool,
) -> torch.Tensor:
    tensor = torch.empty(0, dtype=dtype).set_(storage, offset, size, stride)
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad) if requires_grad else tensor


def to_cpu(data: Any) -> Any:
    """``data`` with every tensor detached and on the CPU (a driver may have no GPU to unpickle
    CUDA tensors onto)."""
    return apply_to_collection(data, torch.Tensor, lambda t: t.detach().cpu())
