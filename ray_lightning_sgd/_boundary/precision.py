"""What each worker trains on: its hardware, and the precision plugin Lightning would pick there.

The driver's Trainer picks an accelerator and a precision plugin for the driver's machine, which is
often not the workers' kind (a laptop, notebook or head node without GPUs in front of GPU workers).
So the driver keeps what the user asked for (:class:`PrecisionRequest`), each worker detects its own
hardware (:class:`WorkerHardware`), and :func:`resolve_precision`, a pure function of the two, says
what Lightning would have chosen on that machine. :func:`make_plugin` builds that plugin from a
Lightning namespace's classes.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.amp import GradScaler

from ray_lightning_sgd.exceptions import ConfigurationError

#: Lightning's precision names (after its own normalisation of ``16``, ``"bf16"``, ...).
PRECISIONS = (
    "64-true",
    "32-true",
    "16-true",
    "bf16-true",
    "16-mixed",
    "bf16-mixed",
    "transformer-engine",
    "transformer-engine-float16",
)

Kind = Literal["full", "double", "half", "mixed", "transformer-engine", "plugin"]

#: The dtype a precision keeps the weights in, where it is not float32: Lightning's plugins for
#: these (half, double, FSDP's, Transformer Engine's) build the model in it under
#: ``Trainer.init_module`` and convert the model to it when a call sets up.
WEIGHTS_DTYPES = {
    "bf16-true": torch.bfloat16,
    "16-true": torch.float16,
    "64-true": torch.float64,
    "transformer-engine": torch.bfloat16,
    "transformer-engine-float16": torch.float16,
}


@dataclass(frozen=True)
class PrecisionRequest:
    """What the user asked the Trainer for, before the driver's machine changed any of it."""

    #: Lightning's precision name, e.g. ``"16-mixed"``.
    precision: str = "32-true"
    #: A precision plugin the user passed (``Trainer(plugins=[...])``): used as it is.
    plugin: Any = None
    #: The Trainer's ``accelerator`` argument as given (``"auto"``, ``"cpu"``, ``"gpu"``, ...).
    accelerator: str = "auto"
    #: Whether the driver that made ``plugin`` had no GPU: torch disables a GradScaler made
    #: there, which a GPU worker then makes again (one disabled where there was a GPU stays so).
    made_without_cuda: bool = False


class WorkerPrecisionBase:
    """Driver side: stands in for the precision plugin that each GPU worker builds for its own
    hardware; ``trainer.precision`` names the precision the user asked for."""

    def __init__(self, precision: str) -> None:
        super().__init__()
        self.precision = precision

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.precision!r}: built by each worker)"

    # as the plugin Lightning builds on a GPU rank 0: ``Trainer.init_module`` builds the model in
    # the precision's weights dtype on the driver too
    def tensor_init_context(self) -> AbstractContextManager:
        dtype = WEIGHTS_DTYPES.get(self.precision)
        return nullcontext() if dtype is None else _default_dtype(dtype)

    def module_init_context(self) -> AbstractContextManager:
        return self.tensor_init_context()


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@dataclass(frozen=True)
class WorkerHardware:
    """The device one worker trains on, and what it supports."""

    #: ``"cpu"`` or ``"cuda"``.
    device_type: str
    #: The device's name, for messages ("NVIDIA H200").
    name: str = "CPU"
    #: Whether the device computes in bfloat16 (every CPU does; CUDA from compute capability 8.0).
    bf16: bool = True
    #: Whether NVIDIA Transformer Engine can be imported in the worker.
    transformer_engine: bool = False

    @classmethod
    def detect(cls, device: torch.device) -> WorkerHardware:
        """Runs on each worker. Describes ``device``, the worker's own device."""
        transformer_engine = importlib.util.find_spec("transformer_engine") is not None
        if device.type != "cuda":
            return cls("cpu", transformer_engine=transformer_engine)
        major, minor = torch.cuda.get_device_capability(device)
        return cls(
            "cuda",
            name=f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})",
            bf16=torch.cuda.is_bf16_supported(),
            transformer_engine=transformer_engine,
        )

    def describe(self) -> str:
        return "CPUs" if self.device_type == "cpu" else f"CUDA GPUs ({self.name})"


@dataclass(frozen=True)
class PrecisionChoice:
    """The precision plugin a worker trains with: :func:`make_plugin` builds it."""

    #: The plugin's precision name.
    precision: str
    kind: Kind
    #: The device type the plugin's autocast runs on.
    device: str
    #: What Lightning would have told the user on that machine (it changed the precision).
    note: str | None = None
    #: A user's float16 plugin whose gradient scaler torch disabled on the driver (no GPU
    #: there): the GPU worker gives it a new one.
    new_scaler: bool = False


def resolve_precision(request: PrecisionRequest, hardware: WorkerHardware) -> PrecisionChoice:
    """Says what Lightning's accelerator connector picks for ``request`` on ``hardware``.

    Raises:
        ConfigurationError: The workers cannot train with that precision (bfloat16 on a GPU
            without it, Transformer Engine without CUDA or the package, bitsandbytes on CPUs).
    """
    device = hardware.device_type
    precision = request.precision
    if request.plugin is not None:
        if "Bitsandbytes" in type(request.plugin).__name__ and device != "cuda":
            raise ConfigurationError(
                f"plugins=[{type(request.plugin).__name__}(...)] runs on CUDA GPUs only, and the "
                f"workers are {hardware.describe()}; pass use_gpu=True to the strategy"
            )
        chosen = getattr(request.plugin, "precision", precision)
        scaler = getattr(request.plugin, "scaler", None)
        new_scaler = (
            device == "cuda"
            and chosen == "16-mixed"
            and request.made_without_cuda
            and isinstance(scaler, GradScaler)
            and not scaler.is_enabled()
        )
        return PrecisionChoice(chosen, "plugin", device, new_scaler=new_scaler)
    if precision not in PRECISIONS:
        raise ConfigurationError(
            f"precision={precision!r} is not one of Lightning's precisions: {', '.join(PRECISIONS)}"
        )
    if precision.startswith("bf16") and not hardware.bf16:
        raise ConfigurationError(
            f"precision={precision!r} needs bfloat16, which the workers' {hardware.describe()} "
            "lack; use precision='16-mixed' (float16 with a gradient scaler) or '32-true'"
        )
    if precision.startswith("transformer-engine"):
        if device != "cuda":
            raise ConfigurationError(
                f"precision={precision!r} runs on CUDA GPUs, and the workers are "
                f"{hardware.describe()}; pass use_gpu=True to the strategy"
            )
        if not hardware.transformer_engine:
            raise ConfigurationError(
                f"precision={precision!r} needs NVIDIA Transformer Engine on every worker, and "
                "a worker cannot import transformer_engine; pip install transformer_engine on "
                "every node (or in the runtime environment)"
            )
        return PrecisionChoice(precision, "transformer-engine", device)
    if precision == "32-true":
        return PrecisionChoice(precision, "full", device)
    if precision == "64-true":
        return PrecisionChoice(precision, "double", device)
    if precision in ("16-true", "bf16-true"):
        return PrecisionChoice(precision, "half", device)
    if precision == "16-mixed" and device == "cpu":
        return PrecisionChoice(
            "bf16-mixed",
            "mixed",
            device,
            note="precision='16-mixed' (float16 autocast) does not run on CPUs: the CPU workers "
            "train with precision='bf16-mixed', as Lightning does on a CPU; pass "
            "use_gpu=True to the strategy for float16 on GPUs",
        )
    return PrecisionChoice(precision, "mixed", device)


#: The precision plugins a strategy takes: Lightning's general ones, or FSDP's own.
Family = Literal["general", "fsdp"]


def matches(plugin: Any, choice: PrecisionChoice, plugins: Any, family: Family = "general") -> bool:
    """Whether ``plugin`` (of the namespace whose ``plugins`` module is given) is what ``choice``
    builds, so that a worker keeps it rather than build another. An FSDP plugin is always built
    again: one built on a driver without CUDA has its gradient scaler disabled, as has a
    user's plugin object, which the worker keeps with a scaler of its own."""
    if choice.kind == "plugin":
        return not choice.new_scaler
    if family == "fsdp":
        return False
    if getattr(plugin, "precision", None) != choice.precision:
        return False
    if choice.kind == "mixed":
        return isinstance(plugin, plugins.MixedPrecision) and plugin.device == choice.device
    expected = _plugin_class(choice.kind, plugins)
    return type(plugin) is expected


def make_plugin(
    choice: PrecisionChoice, request: PrecisionRequest, plugins: Any, family: Family = "general"
) -> Any:
    """Runs on each worker. The precision plugin for ``choice``, of the namespace whose
    ``plugins`` module (``pytorch_lightning.plugins`` or ``lightning.pytorch.plugins``) is given;
    for FSDP, its own plugin (as Lightning's connector builds for ``FSDPStrategy``)."""
    if choice.kind == "plugin":
        plugin = request.plugin
        if choice.new_scaler:
            plugin.scaler = _scaler_again(plugin.scaler, choice.device)
        return plugin
    if family == "fsdp":
        return plugins.FSDPPrecision(choice.precision)
    if choice.kind == "mixed":
        return plugins.MixedPrecision(choice.precision, choice.device)
    if choice.kind == "half":
        return plugins.HalfPrecision(choice.precision)
    if choice.kind == "transformer-engine":
        dtype = torch.float16 if choice.precision.endswith("float16") else torch.bfloat16
        return plugins.TransformerEnginePrecision(weights_dtype=dtype)
    return _plugin_class(choice.kind, plugins)()


def _scaler_again(scaler: Any, device: str) -> Any:
    """Runs on each worker. A scaler of ``scaler``'s class (FSDP's ``ShardedGradScaler``, say)
    for ``device``, with the settings ``scaler`` was made with where it kept them (torch keeps
    none in a scaler it disabled for want of the device: torch's defaults then)."""
    settings = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")
    kept = {name: getattr(scaler, f"_{name}") for name in settings if hasattr(scaler, f"_{name}")}
    if "device" in inspect.signature(type(scaler)).parameters:
        kept["device"] = device  # torch.cuda.amp.GradScaler has none: CUDA's, first is init_scale
    return type(scaler)(**kept)


def _plugin_class(kind: Kind, plugins: Any) -> type:
    return {
        "full": plugins.Precision,
        "double": plugins.DoublePrecision,
        "half": plugins.HalfPrecision,
        "mixed": plugins.MixedPrecision,
        "transformer-engine": plugins.TransformerEnginePrecision,
    }[kind]
