"""checkpoint_storage at launch: ``~`` expanded, and a folder that cannot be written refused on
the driver before Ray is touched. No cluster: the launch is stopped where it would connect."""

from __future__ import annotations

import importlib.util
import os
import subprocess

import pytest
import pytorch_lightning as pl

from ray_lightning_sgd import ConfigurationError, RaySGDStrategy
from ray_lightning_sgd._driver import launcher, storage
from tests.helpers import TinyModel, loader, quiet_trainer_kwargs


class _Connected(Exception):
    """The launch got as far as connecting to Ray."""


@pytest.fixture
def no_connect(monkeypatch):
    def connect() -> bool:
        raise _Connected

    monkeypatch.setattr(launcher.cluster, "connect", connect)


@pytest.fixture
def read_only_folder(tmp_path):
    """A real read-only file system (root ignores a folder's mode bits, so chmod proves
    nothing here)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def _fit(**strategy_kwargs) -> None:
    trainer = pl.Trainer(
        strategy=RaySGDStrategy(**strategy_kwargs),
        max_epochs=1,
        enable_checkpointing=False,
        **quiet_trainer_kwargs(),
    )
    trainer.fit(TinyModel(), loader())


@pytest.mark.parametrize("run_name", [None, "named"])
def test_an_unwritable_storage_fails_at_launch_naming_it(read_only_folder, no_connect, run_name):
    given = str(read_only_folder / "ckpts")
    with pytest.raises(ConfigurationError) as info:
        _fit(max_failures=2, checkpoint_storage=given, run_name=run_name)
    message = str(info.value)
    assert f"checkpoint_storage={given!r}" in message
    assert "Read-only file system" in message


def test_tilde_in_storage_is_the_drivers_home(tmp_path, monkeypatch, no_connect):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    strategy_kwargs = {"max_failures": 1, "checkpoint_storage": "~/ckpts"}
    with pytest.raises(_Connected):  # the storage passed its check
        _fit(**strategy_kwargs)
    assert sorted(os.listdir(home / "ckpts")) == []  # created, and the probe removed
    assert not (cwd / "~").exists()
    assert storage.run_folder("~/ckpts", "abc", None) == f"{home}/ckpts/run-abc"
    assert storage.run_folder("~/ckpts", "abc", "r") == f"{home}/ckpts/r"
    # the value as given reads back; a URI is left as it is
    assert RaySGDStrategy(**strategy_kwargs).checkpoint_storage == "~/ckpts"
    assert storage.resolve("s3://b/~x") == "s3://b/~x"


def test_a_uri_storage_is_probed_through_fsspec():
    import fsspec

    storage.check_writable("memory://ckpts/run", "memory://ckpts")
    assert fsspec.filesystem("memory").ls("/ckpts/run") == []  # made, probe removed


def test_storage_the_driver_cannot_reach_is_left_to_the_workers(
    read_only_folder, no_connect, monkeypatch
):
    """A URI whose fsspec package only the workers have, or any storage behind a Ray Client
    (the driver's disk is not the cluster's), is not probed on the driver."""
    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed here: the driver can open gs:// URIs")
    storage.check_writable("gs://bucket/runs", "gs://bucket/runs")  # no error: not checked
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    with pytest.raises(_Connected):  # the read-only folder is the cluster's business
        _fit(max_failures=2, checkpoint_storage=str(read_only_folder / "ckpts"))


@pytest.mark.parametrize("client", [False, True], ids=["local-driver", "ray-client"])
def test_a_named_run_on_a_uri_the_driver_cannot_open_fails_before_ray(
    no_connect, monkeypatch, client
):
    """The driver of a named run reads and writes its folder (run.json, the checkpoint a new
    driver resumes from): a URI whose package only the workers would have is refused before
    Ray is touched (before, a warning, then fsspec's ImportError after the connection)."""
    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed here: the driver can open gs:// URIs")
    if client:
        monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    with pytest.raises(
        ConfigurationError, match=r"checkpoint_storage='gs://bucket/runs' with a run_name.*gcsfs"
    ):
        _fit(max_failures=1, checkpoint_storage="gs://bucket/runs", run_name="digits")


def test_a_stores_root_uri_keeps_its_slashes(no_connect, tmp_path, monkeypatch):
    """``memory://`` (a store's root): its run folders are ``memory://<name>``; stripping the
    slashes gave ``memory:/<name>``, which fsspec reads as a local folder named ``memory:``."""
    import fsspec

    monkeypatch.chdir(tmp_path)
    assert storage.run_folder("memory://", "abc", "r") == "memory://r"
    assert storage.run_folder("file:///", "abc", None) == "file:///run-abc"
    # a folder whose name ends in ":" is no root
    assert storage.run_folder("memory://bucket/exp:", "abc", "r") == "memory://bucket/exp:/r"
    with pytest.raises(_Connected):  # the storage passed its check
        _fit(max_failures=1, checkpoint_storage="memory://", run_name="root-run")
    assert fsspec.filesystem("memory").exists("/root-run")
    assert os.listdir(tmp_path) == [], "no local folder made for a URI"
    fsspec.filesystem("memory").rm("/root-run", recursive=True)


def test_a_storage_fsspec_cannot_open_is_a_configuration_error():
    with pytest.raises(ConfigurationError, match=r"checkpoint_storage='s4://bucket/runs'"):
        storage.check_writable("s4://bucket/runs", "s4://bucket/runs")  # no such protocol


def test_a_named_run_on_a_local_path_behind_a_ray_client_is_warned_about(monkeypatch, caplog):
    import logging

    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    with caplog.at_level(logging.WARNING, logger="ray_lightning_sgd"):
        storage.check_storage("/mnt/runs", None)  # each launch's own folder: the workers' disk
        storage.check_storage("memory://bucket/runs", "digits")  # both reach a URI
        assert caplog.text == ""
        storage.check_storage("/mnt/runs", "digits")
    assert "run_name='digits'" in caplog.text and "behind a Ray Client" in caplog.text
    assert not os.path.exists("/mnt/runs/digits"), "nothing is made on the client's disk"
