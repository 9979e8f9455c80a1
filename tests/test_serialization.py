"""Packing for the launcher: tensors out of band, shared storages kept shared, fallbacks intact."""

from __future__ import annotations

import pickle

import pytest
import pytorch_lightning as pl
import ray
import torch
from torch import nn

from ray_lightning_sgd import RaySGDStrategy
from ray_lightning_sgd._serialization import pack, unpack
from tests.helpers import TinyModel, loader, quiet_trainer_kwargs


class Tagged(torch.Tensor):
    """A tensor subclass: it must travel through torch's own pickling."""


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(4, 5),
        torch.randn(4, 5).t(),  # not contiguous
        torch.arange(20.0)[7:13],  # an offset into a bigger storage
        torch.randn(3, 3).to(torch.bfloat16),
        torch.tensor([True, False, True]),
        torch.randint(-(2**40), 2**40, (6,)),
        torch.randn(2, 2, dtype=torch.complex64),
        torch.empty(0, 3),
        torch.tensor(3.5),
    ],
    ids=["float", "transposed", "offset", "bfloat16", "bool", "int64", "complex", "empty", "0-d"],
)
def test_tensors_round_trip_exactly(tensor):
    packed = pack({"t": tensor})
    got = unpack(packed)["t"]
    assert got.dtype == tensor.dtype and got.shape == tensor.shape
    assert got.stride() == tensor.stride() and got.storage_offset() == tensor.storage_offset()
    assert torch.equal(got, tensor)
    assert (
        got.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr() or not got.numel()
    )


def test_storages_travel_out_of_band_once_each():
    base = torch.randn(256, 1024)  # 1 MiB
    packed = pack([base, base[10:20], base.t(), torch.ones(3)])
    assert len(packed.buffers) == 2  # one per distinct storage, views included
    assert sum(b.raw().nbytes for b in packed.buffers) == base.nbytes + 12
    assert len(packed.data) < 4096, "tensor bytes went into the pickle stream"


def test_views_share_their_storage_again_and_own_it():
    base = torch.zeros(4, 4)
    got_base, got_view = unpack(pack([base, base[1]]))
    got_base[1, 2] = 7.0
    assert got_view[2] == 7.0, "a view no longer shares its base's storage"
    assert base[1, 2] == 0.0, "the unpacked tensor writes into the original"
    got_base.add_(1)  # writable memory of its own


def test_parameters_keep_their_type_grad_flag_and_ties():
    encoder, decoder = nn.Linear(4, 4), nn.Linear(4, 4)
    decoder.weight = encoder.weight  # tied weights
    frozen = nn.Parameter(torch.ones(2), requires_grad=False)
    got_enc, got_dec, got_frozen = unpack(pack([encoder, decoder, frozen]))
    assert got_dec.weight is got_enc.weight
    assert isinstance(got_enc.weight, nn.Parameter) and got_enc.weight.requires_grad
    assert isinstance(got_frozen, nn.Parameter) and not got_frozen.requires_grad
    assert torch.equal(got_enc.weight, encoder.weight)
    leaf = torch.ones(3, requires_grad=True)
    assert unpack(pack(leaf)).requires_grad


def test_what_the_fast_path_does_not_cover_goes_through_torch():
    tagged = torch.ones(3).as_subclass(Tagged)
    with_attribute = torch.ones(2)
    with_attribute.note = "kept"  # type: ignore[attr-defined]
    sparse = torch.eye(3).to_sparse()
    got_tagged, got_attribute, got_sparse = unpack(pack([tagged, with_attribute, sparse]))
    assert type(got_tagged) is Tagged and torch.equal(got_tagged, tagged)
    assert got_attribute.note == "kept"
    assert got_sparse.is_sparse and torch.equal(got_sparse.to_dense(), torch.eye(3))
    non_leaf = torch.ones(2, requires_grad=True) * 2
    got, expected = unpack(pack(non_leaf)), pickle.loads(pickle.dumps(non_leaf))
    assert (got.requires_grad, got.is_leaf) == (expected.requires_grad, expected.is_leaf)
    assert torch.equal(got, expected)


def test_unpack_without_copy_views_the_buffers():
    tensor = torch.arange(8.0)
    packed = pack(tensor)
    view = unpack(packed, copy=False)
    assert torch.equal(view, tensor)
    buffer = packed.buffers[0].raw()
    assert view.data_ptr() == torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()


def test_a_packed_object_is_itself_picklable():
    # a Packed nested in a Packed (the model's state inside rank 0's results) and a Packed sent
    # without a buffer callback (in band) both come back whole
    inner = pack({"w": torch.randn(5)})
    outer = unpack(pack({"inner": inner}))
    assert torch.equal(unpack(outer["inner"])["w"], unpack(inner)["w"])
    assert torch.equal(
        unpack(pickle.loads(pickle.dumps(inner, protocol=5)))["w"], unpack(inner)["w"]
    )


class RefModel(TinyModel):
    """Holds an ObjectRef; on the workers, the object it names must be there."""

    def __init__(self, ref: ray.ObjectRef) -> None:
        super().__init__()
        self.refs = [ref]

    def on_train_start(self) -> None:
        assert torch.equal(ray.get(self.refs[0]), torch.arange(5.0)), "the ObjectRef lost its data"


def test_object_refs_in_the_trainer_travel_through_ray(ray_cluster):
    model = RefModel(ray.put(torch.arange(5.0)))
    trainer = pl.Trainer(
        strategy=RaySGDStrategy(num_workers=2),
        accelerator="cpu",
        max_epochs=1,
        enable_checkpointing=False,
        **quiet_trainer_kwargs(),
    )
    trainer.fit(model, loader())
    assert trainer.global_step > 0
