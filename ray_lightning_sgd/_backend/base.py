"""The backend interface: hooks that set up a distributed framework on a worker group.

A backend is purely functional. It holds no state: what it needs comes from its config (a frozen
dataclass that names the backend class) and from the worker group it is given.
"""

from __future__ import annotations

from dataclasses import dataclass

from ray_lightning_sgd._worker_group.group import WorkerGroup


@dataclass(frozen=True)
class BackendConfig:
    """Configuration of a backend. Subclasses add fields and name their backend class."""

    @property
    def backend_cls(self) -> type[Backend]:
        """The backend class whose hooks act on this config."""
        return Backend


class Backend:
    """Hooks run by the executor around a worker group's life. The base class does nothing."""

    def on_start(self, worker_group: WorkerGroup, backend_config: BackendConfig) -> None:
        """Driver side: sets the framework up on every worker, after the group has started."""

    def on_shutdown(self, worker_group: WorkerGroup, backend_config: BackendConfig) -> None:
        """Driver side: tears the framework down on every worker, before the group stops.

        It must return within a bounded time even if workers are stuck: the executor kills the
        workers right after it.
        """
