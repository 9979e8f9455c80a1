"""Every private Ray or Lightning name in ray_lightning_sgd._compat still exists where we expect it.

When one of these fails after an upgrade, the message names the attribute that moved.
"""

from __future__ import annotations

import ray._private.ray_constants as ray_constants
from pytorch_lightning.strategies.launchers import launcher as lightning_launcher

from ray_lightning_sgd import _compat


def test_ray_loopback_constant_exists():
    assert hasattr(ray_constants, "ENABLE_RAY_CLUSTER"), (
        "ray._private.ray_constants.ENABLE_RAY_CLUSTER moved; update _compat.bind_local_ray_to_loopback"
    )
    assert ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR == _compat._RAY_LOOPBACK_ENV, (
        "ray._private.ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR changed its name"
    )


def test_lightning_launcher_interface_exists():
    assert hasattr(lightning_launcher, "_Launcher"), (
        "pytorch_lightning.strategies.launchers.launcher._Launcher moved; update _compat.Launcher"
    )
    abstract = set(getattr(_compat.Launcher, "__abstractmethods__", ()))
    assert abstract == {"launch", "kill", "is_interactive_compatible"}, (
        f"Lightning's _Launcher now asks for {sorted(abstract)}; RayLauncher implements "
        "launch, kill and is_interactive_compatible"
    )
