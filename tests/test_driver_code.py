"""The driver's own code on the workers: a module the driver imports only through a folder it put
on ``sys.path`` trains on the workers, and a change to it between two calls reaches them. Across
nodes, and the error without shipping: tests/test_multinode.py.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import textwrap
from pathlib import Path

import pytest
import pytorch_lightning as pl
import ray

from ray_lightning_sgd import ConfigurationError, RaySGDStrategy
from ray_lightning_sgd._worker_group import code
from tests.helpers import loader, quiet_trainer_kwargs

MODULE = textwrap.dedent(
    """
    from tests.helpers import TinyModel

    VALUE = {value}

    class EditedModel(TinyModel):
        def training_step(self, batch, batch_idx):
            self.log("value", float(VALUE), sync_dist=True, reduce_fx="min")
            return super().training_step(batch, batch_idx)
    """
)


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A folder of the user's own code, on the driver's sys.path only (as a notebook's
    ``sys.path.insert(0, "../src")`` puts it), with one module that defines the model."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "edited_model.py").write_text(MODULE.format(value=1))
    monkeypatch.syspath_prepend(str(src))
    yield src
    sys.modules.pop("edited_model", None)


def _fit(module, **strategy_kwargs) -> pl.Trainer:
    trainer = pl.Trainer(
        strategy=RaySGDStrategy(num_workers=2, **strategy_kwargs),
        max_epochs=1,
        enable_checkpointing=False,
        **quiet_trainer_kwargs(),
    )
    trainer.fit(module.EditedModel(), loader())
    return trainer


def test_a_module_on_the_drivers_sys_path_reaches_the_workers_and_so_do_its_edits(
    ray_cluster, project, caplog
):
    import edited_model

    # (without shipping, a worker's error names the module, its node and the fix: the two-node
    # test in tests/test_multinode.py shows it)
    assert _fit(edited_model).callback_metrics["value"] == 1.0
    # edited between two calls, as in a notebook: the warm workers imported the old code
    (project / "edited_model.py").write_text(MODULE.format(value=2))
    stat = os.stat(project / "edited_model.py")
    os.utime(project / "edited_model.py", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    edited_model = importlib.reload(edited_model)
    with caplog.at_level(logging.WARNING, logger="ray_lightning_sgd"):
        assert _fit(edited_model).callback_metrics["value"] == 2.0
    assert "The driver's code changed" in caplog.text and "edited_model.py" in caplog.text


def test_the_snapshot_holds_the_drivers_own_code_only(ray_cluster, project):
    import edited_model  # noqa: F401

    local = code.snapshot("node-a", ship=False)
    assert local.sys_path[0] == os.path.realpath(project) and local.archive is None
    files = [path for path, _, _ in local.files]
    assert os.path.realpath(project / "edited_model.py") in files
    # installed packages and this package are never the driver's own code
    assert not [f for f in files if "site-packages" in f or "/ray_lightning_sgd/" in f], files
    ships = code.snapshot("node-a", ship=True)
    shipped = ships.shipped
    assert os.path.realpath(project / "edited_model.py") in shipped
    assert os.path.realpath(Path(__file__).parent) in shipped  # the tests package: a folder
    assert not [p for p in shipped if os.path.basename(p) in ("torch", "ray_lightning_sgd")]
    # the same code again: the archive already in the object store, equal descriptions
    again = code.snapshot("node-a", ship=True)
    assert again == ships and again.archive is ships.archive and len(ships.digest) == 16


def test_code_too_large_to_ship_is_refused_with_its_size(tmp_path, monkeypatch):
    package = tmp_path / "bigproject"
    package.mkdir()
    (package / "__init__.py").write_text("")
    with open(package / "data.bin", "wb") as data:  # sparse: no disk is used
        data.truncate(code.SHIP_LIMIT_BYTES + 2**20)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("bigproject")
    try:
        # the total counts the other code shipped with it (this tests folder: half a MiB)
        with pytest.raises(
            ConfigurationError,
            match=r"is 10[12] MiB, more than the limit of 100 MiB; largest files: \S*"
            r"bigproject/data\.bin \(101 MiB\)",
        ):
            code.snapshot("node-a", ship=True)
        # nothing is shipped within one node: nothing to refuse
        assert code.snapshot("node-a", ship=False).archive is None
    finally:
        sys.modules.pop("bigproject", None)


def test_workers_of_the_drivers_node_keep_its_folders_before_or_after_the_packages(
    ray_cluster, tmp_path, monkeypatch
):
    front, back = tmp_path / "front", tmp_path / "back"
    front.mkdir()
    back.mkdir()
    monkeypatch.setattr(sys, "path", [str(front), *sys.path, str(back)])
    snapshot = code.snapshot(ray.get_runtime_context().get_node_id(), ship=False)
    assert snapshot.sys_path[0] == str(front) and snapshot.sys_path[-1] == str(back)
    # a worker's sys.path, as Ray starts it: the driver's folders take their places in it
    monkeypatch.setattr(sys, "path", ["/worker/site-packages"])
    code.adopt(snapshot)
    assert sys.path[0] == str(front) and sys.path[-1] == str(back)
    assert sys.path.index("/worker/site-packages") < sys.path.index(str(back))


def test_a_code_folder_taken_by_another_user_is_bypassed(tmp_path, monkeypatch, caplog):
    """Another user made the node's code folder first (a shared sticky /tmp): this user cannot
    remove it, so the worker unpacks into a private folder of its own, with a warning."""
    import io
    import stat
    import tempfile
    import zipfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    taken = tmp_path / f"ray_lightning_sgd-code-{os.getuid()}"
    taken.mkdir(mode=0o777)
    if os.getuid() == 0:
        os.chown(taken, 65534, 65534)  # nobody's
    else:
        taken.chmod(0o777)  # open to every user: as unsafe
    packed = io.BytesIO()
    with zipfile.ZipFile(packed, "w") as archive:
        archive.writestr("shipped_mod.py", "VALUE = 1\n")
    monkeypatch.setattr(ray, "get", lambda ref: packed.getvalue())
    shipped = code.DriverCode("node", (), (), digest="d1", archive=object())
    try:
        with caplog.at_level(logging.WARNING, logger=code.__name__):
            folder = Path(code._unpacked(shipped))
        root = folder.parent
        assert root != taken and (folder / "shipped_mod.py").read_text() == "VALUE = 1\n"
        info = root.stat()
        assert info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) == 0o700
        assert list(taken.iterdir()) == []
        assert str(taken) in caplog.text and "worker_env={'TMPDIR'" in caplog.text
    finally:
        code._private_fallback.cache_clear()  # its folder is this test's
