"""The trained weights on the driver: models built on the meta device (the pattern of Lightning's
tensor-parallel example: ``trainer.init_module(empty_init=True)``, parallelised in
``configure_model``, initialised in ``on_train_start``) get them, for FSDP2, tensor parallelism
and DDP; with ``return_weights=False`` they stay in the cluster."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from ray_lightning_sgd import RayModelParallelStrategy, RaySGDStrategy, _compat
from ray_lightning_sgd._driver.results import load_weights
from tests.helpers import quiet_trainer_kwargs
from tests.sharded_models import full_weights

VOCAB, DIM, SEQ = 32, 16, 8
needs_cpu_fsdp2 = pytest.mark.skipif(
    _compat.torch.cpu_fsdp2_problem(torch.__version__) is not None,
    reason=str(_compat.torch.cpu_fsdp2_problem(torch.__version__)),
)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, 4 * DIM, bias=False)
        self.w2 = nn.Linear(4 * DIM, DIM, bias=False)

    def forward(self, x):
        return x + self.w2(nn.functional.relu(self.w1(x)))


class TinyTransformer(nn.Module):
    """Embedding, two feed-forward blocks, an output layer, a persistent buffer (as the
    example's rotary ``freqs_cis``) that ``init_weights`` computes, and one that the state dict
    leaves out (``persistent=False``, as Hugging Face's rotary ``inv_freq``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(DIM, VOCAB, bias=False)
        self.register_buffer("scale", torch.empty(DIM))
        self.register_buffer("shift", torch.empty(DIM), persistent=False)

    def reset_parameters(self) -> None:
        """What Lightning's materialisation calls for this module's own buffer."""
        with torch.no_grad():
            self.scale.fill_(1.0)
            self.shift.zero_()

    def init_weights(self) -> None:
        torch.manual_seed(0)
        with torch.no_grad():
            for module in (self.embed, *self.blocks, self.out):
                for parameter in module.parameters():
                    nn.init.normal_(parameter, std=0.1)
            self.scale.copy_(torch.linspace(0.5, 1.5, DIM))
            self.shift.copy_(torch.linspace(-0.1, 0.1, DIM))

    def forward(self, tokens):
        x = self.embed(tokens) * self.scale + self.shift
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class SaveRankZeroWeights(pl.Callback):
    """Every rank takes part in gathering the whole weights at the end of ``fit``; rank 0 saves
    them: what the driver's model must hold afterwards."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def on_fit_end(self, trainer, pl_module):
        if trainer.strategy.__class__.__name__.startswith("RaySGD"):
            weights = pl_module.state_dict()
        else:
            weights = full_weights(pl_module)
        if trainer.global_rank == 0:
            torch.save({k: v.detach().cpu().clone() for k, v in weights.items()}, self.path)


class MetaLlama(pl.LightningModule):
    """As ``Llama3`` in Lightning's ``examples/pytorch/tensor_parallel/train.py``, small."""

    def __init__(self, materialise: bool = False, shard: bool = True) -> None:
        super().__init__()
        self.materialise = materialise  # DDP trains no meta tensors: the model does it itself
        self.shard = shard  # False: the strategy wraps the model itself (FSDP1)
        self.model = TinyTransformer()

    def configure_model(self):
        if self.materialise:
            self.model.to_empty(device=self.device)
            self.model.init_weights()
            return
        if not self.shard:
            return
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        tp, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        if tp.size() > 1:
            for block in self.model.blocks:
                plan = {"w1": ColwiseParallel(), "w2": RowwiseParallel()}
                parallelize_module(block, tp, plan)
        if dp.size() > 1:
            for block in self.model.blocks:
                fully_shard(block, mesh=dp)
            fully_shard(self.model, mesh=dp)

    def on_train_start(self) -> None:
        if not self.materialise:
            self.model.init_weights()

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        logits = self.model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _tokens() -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(1)
    data = torch.randint(0, VOCAB, (64, SEQ + 1), generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=8)


def _fit_on_meta(strategy, tmp_path: Path, empty_init: bool = True, **trainer_kwargs):
    trainer = pl.Trainer(
        strategy=strategy,
        max_epochs=1,
        callbacks=[SaveRankZeroWeights(tmp_path / "rank0.pt")],
        default_root_dir=tmp_path,
        **{"enable_checkpointing": False, **trainer_kwargs},
        **quiet_trainer_kwargs(),
    )
    if empty_init:
        with trainer.init_module(empty_init=True):
            model = MetaLlama()
    else:
        with torch.device("meta"):
            model = MetaLlama(materialise=True)
    assert all(t.is_meta for t in model.state_dict().values())
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # "copying ... to a meta parameter is a no-op"
        trainer.fit(model, _tokens())
    return trainer, model


def _assert_rank_zeros_weights(model: nn.Module, tmp_path: Path) -> None:
    ours = model.state_dict()
    assert not [k for k, v in ours.items() if v.is_meta], "tensors left on the meta device"
    assert all(type(v) is torch.Tensor and v.device.type == "cpu" for v in ours.values())
    rank_zero = torch.load(tmp_path / "rank0.pt")
    assert set(ours) == set(rank_zero)
    for key, value in ours.items():
        assert torch.equal(value, rank_zero[key]), key
    # trained: the weights moved from what init_weights set
    initial = TinyTransformer()
    initial.init_weights()
    assert not torch.equal(ours["model.out.weight"], initial.out.weight.detach())
    assert torch.equal(ours["model.scale"], initial.scale)
    # the buffer the state dict leaves out is rank 0's too, not left on the meta device (the next
    # call would send it so, and a sharded strategy would initialise the whole model anew)
    assert not model.model.shift.is_meta and torch.equal(model.model.shift, initial.shift)
    # and the driver's model runs
    assert model.model(torch.zeros(1, SEQ, dtype=torch.long)).shape == (1, SEQ, VOCAB)


@needs_cpu_fsdp2
@pytest.mark.parametrize(
    ("data_parallel", "tensor_parallel"), [(2, 1), (1, 2)], ids=["fsdp2", "tensor_parallel"]
)
def test_a_model_built_on_the_meta_device_gets_its_trained_weights(
    ray_cluster, tmp_path, data_parallel, tensor_parallel
):
    strategy = RayModelParallelStrategy(
        num_workers=2, data_parallel_size=data_parallel, tensor_parallel_size=tensor_parallel
    )
    _, model = _fit_on_meta(strategy, tmp_path)
    _assert_rank_zeros_weights(model, tmp_path)


def test_a_ddp_model_built_on_the_meta_device_gets_its_trained_weights(ray_cluster, tmp_path):
    _, model = _fit_on_meta(RaySGDStrategy(num_workers=2), tmp_path, empty_init=False)
    _assert_rank_zeros_weights(model, tmp_path)


@needs_cpu_fsdp2
def test_with_return_weights_false_the_weights_stay_in_the_cluster(ray_cluster, tmp_path):
    strategy = RayModelParallelStrategy(
        num_workers=2, data_parallel_size=2, tensor_parallel_size=1, return_weights=False,
        save_distributed_checkpoint=False,  # one file that rank 0 writes
    )  # fmt: skip
    trainer, model = _fit_on_meta(strategy, tmp_path, enable_checkpointing=True)
    # the driver's model did not receive them: still on the meta device
    assert all(t.is_meta for t in model.state_dict().values())
    # the rest of rank 0's results did: state, steps, metrics
    assert trainer.state.finished and trainer.global_step == 64 // 8 // 2
    assert trainer.callback_metrics["train_loss"] > 0
    # what the call saved came back: the checkpoint holds rank 0's trained weights
    best = trainer.checkpoint_callback.best_model_path
    assert best and Path(best).is_file()
    saved = torch.load(best, weights_only=False)["state_dict"]
    rank_zero = torch.load(tmp_path / "rank0.pt")
    assert set(saved) == set(rank_zero)
    for key, value in rank_zero.items():
        assert torch.equal(saved[key], value), key


def test_a_ddp_model_keeps_its_weights_with_return_weights_false(ray_cluster):
    from ray_lightning_sgd.exceptions import ConfigurationError
    from tests.helpers import TinyModel, loader

    assert RaySGDStrategy(num_workers=1).return_weights is True
    with pytest.raises(ConfigurationError, match=r"return_weights must be True or False, got 0"):
        RaySGDStrategy(num_workers=1, return_weights=0)  # type: ignore[arg-type]
    pl.seed_everything(0)
    model = TinyModel()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = pl.Trainer(
        strategy=RaySGDStrategy(num_workers=2, return_weights=False), max_epochs=1,
        enable_checkpointing=False, **quiet_trainer_kwargs(),
    )  # fmt: skip
    trainer.fit(model, loader())
    assert trainer.global_step == 96 // 8 // 2 and trainer.state.finished
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert trainer.optimizers == []  # no optimizer state came back either
    # the default brings them back
    trainer = pl.Trainer(
        strategy=RaySGDStrategy(num_workers=2), max_epochs=1, enable_checkpointing=False,
        **quiet_trainer_kwargs(),
    )  # fmt: skip
    trainer.fit(model, loader())
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert len(trainer.optimizers) == 1


def test_meta_tensors_take_the_loaded_weights_and_those_left_are_named():
    class WithBuffers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(3, 2)
            self.register_buffer("kept", torch.zeros(2))
            self.register_buffer("transient", torch.zeros(2), persistent=False)

    with torch.device("meta"):
        model = WithBuffers()
    trained = WithBuffers()
    state = {k: v + 1 for k, v in trained.state_dict().items()}
    with pytest.warns(RuntimeWarning, match=r"still has tensors on the meta device.*transient"):
        load_weights(model, state)
    assert not model.layer.weight.is_meta and isinstance(model.layer.weight, nn.Parameter)
    assert model.layer.weight.requires_grad
    assert torch.equal(model.kept, trained.kept + 1)
    # owned copies: the loaded tensors may view Ray's object store
    assert model.layer.weight.data_ptr() != state["layer.weight"].data_ptr()

    # tied weights stay one tensor, with rank 0's values
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(4, 3)
            self.out = nn.Linear(3, 4, bias=False)
            self.out.weight = self.embed.weight

    with torch.device("meta"):
        tied = Tied()
    values = {k: v + 1 for k, v in Tied().state_dict().items()}
    load_weights(tied, values)
    assert tied.out.weight is tied.embed.weight and not tied.embed.weight.is_meta
    assert torch.equal(tied.embed.weight, values["embed.weight"])
    assert len(list(tied.parameters())) == 1
    # rank 0's buffers that the state dict leaves out come too: assigned where on the meta device
    # (owned copies), copied in place where not
    # (one rank 0 has and the driver's model has not, made by a hook on the workers only, is
    # left out without a word, as the state dict leaves it out)
    sent = {"transient": torch.full((2,), 7.0), "mask_made_in_setup": torch.ones(3)}
    with torch.device("meta"):
        model = WithBuffers()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_weights(model, state, sent)
    assert torch.equal(model.transient, sent["transient"])
    assert model.transient.data_ptr() != sent["transient"].data_ptr()
    held = WithBuffers()
    transient = held.transient
    load_weights(held, state, sent)
    assert held.transient is transient and torch.equal(transient, sent["transient"])
    # a model off the meta device loads in place, its parameters the same objects
    plain = WithBuffers()
    weight = plain.layer.weight
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_weights(plain, state)
    assert plain.layer.weight is weight and torch.equal(weight, state["layer.weight"])


def test_the_drivers_tensors_take_the_dtype_rank_0_trained_in():
    """Under a "true" precision Lightning's plugin converts rank 0's model (the driver's under
    ddp) in place: the driver's float32 tensors take rank 0's dtype, parameters staying the same
    objects (an optimizer made on the driver keeps them), tied ones one tensor; a layer rank 0
    kept in float32 (a hook's choice) stays so; integer buffers keep theirs."""

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(4, 3)
            self.out = nn.Linear(3, 4, bias=False)
            self.out.weight = self.embed.weight
            self.norm = nn.LayerNorm(3)
            self.register_buffer("scale", torch.ones(3))
            self.register_buffer("steps", torch.zeros((), dtype=torch.long))
            self.register_buffer("shift", torch.zeros(3), persistent=False)

    rank_zero = Mixed().to(torch.bfloat16)
    rank_zero.norm.float()
    state = {k: v + 1 for k, v in rank_zero.state_dict().items()}
    model = Mixed()
    weight = model.embed.weight
    load_weights(model, state, {"shift": torch.full((3,), 2.0, dtype=torch.bfloat16)})
    assert model.embed.weight is weight and model.out.weight is weight
    assert weight.dtype == torch.bfloat16 and torch.equal(weight, state["embed.weight"])
    assert model.norm.weight.dtype == torch.float32
    assert model.scale.dtype == torch.bfloat16 and torch.equal(model.scale, state["scale"])
    assert model.steps.dtype == torch.long
    assert model.shift.dtype == torch.bfloat16 and torch.equal(model.shift, torch.full((3,), 2.0))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16, torch.float32}


def test_a_modules_extra_state_loads_with_the_weights():
    """A module's extra state (``get_extra_state``: any object, Transformer Engine's layers keep
    theirs so) comes with rank 0's weights and reaches ``set_extra_state``."""

    class WithExtra(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(2, 2)
            self.extra = {"calls": 0}

        def get_extra_state(self) -> dict:
            return self.extra

        def set_extra_state(self, state: dict) -> None:
            self.extra = dict(state)

    rank_zero = WithExtra()
    rank_zero.extra = {"calls": 3}
    state = rank_zero.state_dict()
    assert state["_extra_state"] == {"calls": 3}
    model = WithExtra()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_weights(model, state)
    assert model.extra == {"calls": 3}
    assert torch.equal(model.layer.weight, rank_zero.layer.weight)
