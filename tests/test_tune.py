"""Ray Tune: each trial is a Lightning run whose workers use the trial's own placement group."""

from __future__ import annotations

import pytest
import pytorch_lightning as pl
import ray
import torch
from ray import tune

from ray_lightning_sgd import ConfigurationError, RaySGDStrategy, ResourcesUnavailableError
from ray_lightning_sgd.tune import TuneReportCallback
from ray_lightning_sgd.worker_group import bundles_for_workers
from tests.conftest import leftovers
from tests.helpers import TinyModel, tiny_ray_data


def _strategy() -> RaySGDStrategy:
    # a quarter CPU a worker: the two trials of the grid run at once on the session's 2 CPUs,
    # and Ray Data's tasks, which feed them, have the other CPU
    return RaySGDStrategy(num_workers=2, num_cpus_per_worker=0.25, reuse_workers=False)


def _trial(config: dict) -> None:
    pl.seed_everything(0)
    placement = ray.util.get_current_placement_group()
    assert placement is not None, "Tune runs the trial inside its placement group"
    model = TinyModel()
    model.lr = config["lr"]
    trainer = pl.Trainer(
        strategy=_strategy(),
        accelerator="cpu",
        max_epochs=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            TuneReportCallback({"acc": "val_acc", "loss": "val_loss"}, save_checkpoints=True)
        ],
    )
    # the trial streams its data from Ray Data datasets that the trial (the run's driver) made
    trainer.fit(model, datamodule=tiny_ray_data())
    # the workers ran in the trial's group: no group of ours was made
    assert leftovers()[1] == []


def test_a_tuner_runs_trials_with_the_strategy(free_cluster, tmp_path):
    resources = _strategy().tune_resources()
    assert resources.bundles == [{"CPU": 0.25}, {"CPU": 0.25}]  # the trial's own process: nothing
    assert resources.head_bundle_is_empty
    tuner = tune.Tuner(
        tune.with_resources(_trial, resources),
        param_space={"lr": tune.grid_search([0.05, 0.2])},
        tune_config=tune.TuneConfig(metric="loss", mode="min"),
        run_config=tune.RunConfig(storage_path=str(tmp_path), name="tiny", verbose=0),
    )
    results = tuner.fit()
    assert not results.errors, results.errors
    assert len(results) == 2
    for result in results:
        assert result.metrics["training_iteration"] == 3  # one report per validation, no sanity
        assert 0.0 <= result.metrics["acc"] <= 1.0
        history = result.metrics_dataframe
        assert list(history["training_iteration"]) == [1, 2, 3]
    best = results.get_best_result()
    assert best.metrics["loss"] == min(r.metrics["loss"] for r in results)
    with best.checkpoint.as_directory() as folder:
        path = f"{folder}/checkpoint.ckpt"
        state = torch.load(path, weights_only=False)
        assert state["global_step"] == 3 * 6 and state["epoch"] == 2  # the last validation's
        assert isinstance(TinyModel.load_from_checkpoint(path), TinyModel)
    assert leftovers() == ([], [])


def test_a_trial_the_cluster_cannot_hold_is_refused_at_once(free_cluster):
    with pytest.raises(ResourcesUnavailableError, match="cannot place 8 workers"):
        RaySGDStrategy(num_workers=8).tune_resources()


def test_a_head_bundle_is_checked_and_counted_beside_the_workers(free_cluster):
    # the session's cluster: one node of 2 CPUs
    two = RaySGDStrategy(num_workers=2)
    assert two.tune_resources().required_resources == {"CPU": 2.0}  # the head asks nothing
    with pytest.raises(ResourcesUnavailableError, match=r"beside the head bundle \{'CPU': 1.0\}"):
        two.tune_resources(head_bundle={"CPU": 1})
    one = RaySGDStrategy(num_workers=1)
    assert one.tune_resources(head_bundle={"CPU": 1}).bundles == [{"CPU": 1.0}] * 2
    with pytest.raises(ResourcesUnavailableError, match="no node has the head bundle"):
        one.tune_resources(head_bundle={"CPU": 64})
    for bad, named in (({"cpu": 1}, "'CPU'"), ("CPU", "dict of Ray resources"),
                       ({"CPU": 0}, "at least 0.0001"), ({"CPU": True}, "at least")):  # fmt: skip
        with pytest.raises(ConfigurationError, match=named):
            one.tune_resources(head_bundle=bad)


def test_bundles_of_an_enclosing_group_are_chosen_or_refused():
    head_and_two = [{"CPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}]
    assert bundles_for_workers(head_and_two, {"CPU": 1, "GPU": 1}, 2) == [1, 2]
    assert bundles_for_workers(head_and_two, {"CPU": 1}, 2) == [1, 2]
    with pytest.raises(ResourcesUnavailableError, match="tune_resources"):
        bundles_for_workers(head_and_two, {"CPU": 1, "GPU": 1}, 3)
    # an elastic group takes the largest of its sizes that the trial's group holds
    assert bundles_for_workers(head_and_two, {"CPU": 1, "GPU": 1}, (4, 2, 1)) == [1, 2]
    assert bundles_for_workers(head_and_two, {"CPU": 1}, (4, 3, 2)) == [0, 1, 2]
    with pytest.raises(ResourcesUnavailableError, match="4 workers need 4 bundles"):
        bundles_for_workers(head_and_two, {"CPU": 1}, (8, 4))


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"on": "test_end"}, "on='test_end'"),
        ({"on": None}, "on=None"),
        ({"on": 5}, "on=5"),
        ({"metrics": 5}, "metrics=5"),
        ({"metrics": ["acc", 1]}, "metrics="),
        ({"metrics": {"acc": 1}}, "metrics="),
        ({"save_checkpoints": "no"}, "save_checkpoints"),
        ({"filename": "a/b.ckpt"}, "filename='a/b.ckpt'"),
        ({"filename": "/tmp/abs.ckpt"}, "filename='/tmp/abs.ckpt'"),
        ({"filename": ""}, "filename=''"),
        ({"filename": None}, "filename=None"),
        ({"filename": ".."}, "filename='..'"),
    ],
)
def test_report_arguments_are_checked_where_the_callback_is_made(kwargs, named):
    """Not at its first report, on a worker, mid-training (an absolute filename would have put
    the checkpoint outside Tune's folder, and Tune would have got an empty one)."""
    with pytest.raises(ConfigurationError) as info:
        TuneReportCallback(**kwargs)
    assert named in str(info.value)


def test_report_arguments_take_any_collection_of_names():
    callback = TuneReportCallback(metrics={"acc"}, on={"validation_end", "train_epoch_end"})
    assert callback._metrics == {"acc": "acc"}
    assert callback._on == {"validation_end", "train_epoch_end"}
    assert TuneReportCallback(metrics=(n for n in ["a", "b"]))._metrics == {"a": "a", "b": "b"}
