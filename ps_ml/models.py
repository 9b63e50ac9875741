"""Model registry and flat parameter/gradient buffers.

The parameter server ships *parameters only* (one flat float32 vector), never
buffers, so every registered model is buffer-free: no BatchNorm (running
stats would be buffers), no dropout (keeps training deterministic so BSP can
be checked against a single-process reference). :func:`build_model` rejects a
model with buffers.

Models take ``(B, 1, 28, 28)`` images and return ``(B, num_classes)`` logits.
Parameter counts with 10 classes: ``mlp`` 101,770; ``lenet`` 80,042;
``cnn1m`` 1,199,882 (big enough that communication shows up).

:class:`FlatParameters` rebinds a model's parameters and gradients as views
into two contiguous 1-D tensors, so a whole gradient is one zero-copy buffer
for the wire and a whole parameter update is one memcpy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from ps_common.errors import UsageError
from ps_common.registry import Registry

log = logging.getLogger(__name__)

ModelFactory = Callable[..., nn.Module]
#: Factories ``f(num_classes=...) -> nn.Module`` by name; add one with ``@register_model(name)``.
MODEL_REGISTRY: Registry[ModelFactory] = Registry("model")
register_model = MODEL_REGISTRY.register
model_names = MODEL_REGISTRY.names


def build_model(name: str, *, seed: int, num_classes: int = 10) -> nn.Module:
    """Build a registered model on CPU with a deterministic init for ``seed``.

    The same ``(name, seed, num_classes)`` gives bit-identical parameters in
    every process. Only a forked copy of the CPU RNG is reseeded, so the
    caller's global RNG state (CPU and CUDA) is left untouched.
    """
    factory = MODEL_REGISTRY.get(name)
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        model = factory(num_classes=num_classes)
    _check_parameters_only(name, model)
    return model


def _check_parameters_only(name: str, model: nn.Module) -> None:
    buffers = [n for n, _ in model.named_buffers()]
    if buffers:
        raise UsageError(f"model {name!r} has buffers {buffers}; the parameter server ships parameters only")
    bad = [n for n, p in model.named_parameters() if p.dtype != torch.float32]
    if bad:
        raise UsageError(f"model {name!r} has non-float32 parameters {bad}")


def count_parameters(model: nn.Module) -> int:
    """Total number of parameter elements (what goes over the wire)."""
    return sum(p.numel() for p in model.parameters())


@register_model("mlp")
def _mlp(num_classes: int = 10) -> nn.Module:
    """784-128-classes MLP (~102k parameters)."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(28 * 28, 128),
        nn.ReLU(),
        nn.Linear(128, num_classes),
    )


@register_model("lenet")
def _lenet(num_classes: int = 10) -> nn.Module:
    """LeNet-5 style CNN, widened to ~80k parameters."""
    return nn.Sequential(
        nn.Conv2d(1, 8, kernel_size=5, padding=2),  # 8x28x28
        nn.ReLU(),
        nn.MaxPool2d(2),  # 8x14x14
        nn.Conv2d(8, 20, kernel_size=5),  # 20x10x10
        nn.ReLU(),
        nn.MaxPool2d(2),  # 20x5x5
        nn.Flatten(),
        nn.Linear(20 * 5 * 5, 128),
        nn.ReLU(),
        nn.Linear(128, 84),
        nn.ReLU(),
        nn.Linear(84, num_classes),
    )


@register_model("cnn1m")
def _cnn1m(num_classes: int = 10) -> nn.Module:
    """Two-conv CNN with ~1.2M parameters, dominated by the 9216->128 layer."""
    return nn.Sequential(
        nn.Conv2d(1, 32, kernel_size=3),  # 32x26x26
        nn.ReLU(),
        nn.Conv2d(32, 64, kernel_size=3),  # 64x24x24
        nn.ReLU(),
        nn.MaxPool2d(2),  # 64x12x12
        nn.Flatten(),
        nn.Linear(64 * 12 * 12, 128),
        nn.ReLU(),
        nn.Linear(128, num_classes),
    )


@register_model("mlp10m")
def _mlp10m(num_classes: int = 10) -> nn.Module:
    """784-12600-classes MLP (~10.0M parameters): the data-plane benchmark's 40 MB model."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(28 * 28, 12600),
        nn.ReLU(),
        nn.Linear(12600, num_classes),
    )


class FlatParameters:
    """Rebinds a model's parameters and grads as views into two flat float32 tensors.

    After construction ``model.parameters()`` (in order) are slices of
    ``params`` and their ``.grad`` slices of ``grads``; autograd accumulates
    into the existing ``.grad`` in place, so ``grads`` holds the whole
    gradient after ``backward()``. Rules that keep the views alive:

    * zero gradients with :meth:`zero_grad_`, never ``optimizer.zero_grad()``
      / ``model.zero_grad()`` (their default ``set_to_none=True`` detaches
      ``.grad`` from the buffer);
    * no ``backward(create_graph=True)`` (it replaces ``.grad`` out of place);
    * do not reassign ``p.data`` or move the model after wrapping.

    :meth:`is_bound` checks all this. On CUDA the buffers live on the model's
    device; :meth:`params_numpy`/:meth:`grads_numpy` then raise and
    :meth:`grads_to_host` copies into a (preferably pinned) host buffer.
    """

    def __init__(self, model: nn.Module) -> None:
        plist = list(model.parameters())
        if not plist:
            raise ValueError("model has no parameters")
        devices = {p.device for p in plist}
        if len(devices) != 1:
            raise ValueError(f"parameters span several devices: {devices}")
        if any(p.dtype != torch.float32 for p in plist):
            raise ValueError("FlatParameters needs float32 parameters")
        self.model = model
        self.device: torch.device = plist[0].device
        self.numel: int = sum(p.numel() for p in plist)
        self.params: torch.Tensor = torch.empty(self.numel, dtype=torch.float32, device=self.device)
        self.grads: torch.Tensor = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        self._parameters = plist
        self._host_staging: torch.Tensor | None = None
        self._bind(plist)

    def _bind(self, plist: list[nn.Parameter]) -> None:
        offset = 0
        with torch.no_grad():
            for p in plist:
                n = p.numel()
                pview = self.params[offset:offset + n].view_as(p)
                pview.copy_(p)
                p.data = pview
                p.grad = self.grads[offset:offset + n].view_as(p)
                offset += n

    def is_bound(self) -> bool:
        """True while every parameter and grad is still a view into the flat buffers."""
        return all(
            _inside(p, self.params) and p.grad is not None and _inside(p.grad, self.grads)
            for p in self._parameters
        )

    def zero_grad_(self) -> None:
        """Zero the flat gradient in place (grads stay bound)."""
        self.grads.zero_()

    def load_(self, flat: np.ndarray | torch.Tensor) -> None:
        """Copy a full flat parameter vector into the model (one memcpy on CPU).

        Accepts read-only numpy arrays (e.g. ``np.frombuffer`` of a message).
        """
        if isinstance(flat, torch.Tensor):
            self._check_size(flat.numel())
            with torch.no_grad():
                self.params.copy_(flat.reshape(-1))
            return
        arr = np.asarray(flat).reshape(-1)
        self._check_size(arr.size)
        if self.device.type == "cpu":
            self.params.numpy()[:] = arr  # numpy-side copy: no writable-array warning
            return
        staging = self._staging()
        staging.numpy()[:] = arr
        self.params.copy_(staging)

    def params_numpy(self) -> np.ndarray:
        """Zero-copy numpy view of the flat parameters (CPU only)."""
        self._require_cpu("params_numpy")
        return self.params.numpy()

    def grads_numpy(self) -> np.ndarray:
        """Zero-copy numpy view of the flat gradient (CPU only)."""
        self._require_cpu("grads_numpy")
        return self.grads.numpy()

    def grads_to_host(self, out: np.ndarray) -> np.ndarray:
        """Copy the flat gradient into the float32 host buffer ``out`` and return it."""
        return self._to_host(self.grads, out)

    def params_to_host(self, out: np.ndarray) -> np.ndarray:
        """Copy the flat parameters into the float32 host buffer ``out`` and return it."""
        return self._to_host(self.params, out)

    def new_host_buffer(self) -> np.ndarray:
        """A float32 host array of ``numel`` elements, pinned when the model is on CUDA."""
        pin = self.device.type == "cuda"
        return torch.empty(self.numel, dtype=torch.float32, pin_memory=pin).numpy()

    def _to_host(self, src: torch.Tensor, out: np.ndarray) -> np.ndarray:
        if out.dtype != np.float32 or out.size != self.numel or not out.flags.c_contiguous:
            raise ValueError(f"out must be a C-contiguous float32 array of {self.numel} elements")
        if not out.flags.writeable:
            raise ValueError("out must be writable")
        torch.from_numpy(out.reshape(-1)).copy_(src)
        return out

    def _staging(self) -> torch.Tensor:
        if self._host_staging is None:
            self._host_staging = torch.empty(
                self.numel, dtype=torch.float32, pin_memory=self.device.type == "cuda"
            )
        return self._host_staging

    def _check_size(self, size: int) -> None:
        if size != self.numel:
            raise ValueError(f"expected {self.numel} elements, got {size}")

    def _require_cpu(self, what: str) -> None:
        if self.device.type != "cpu":
            raise RuntimeError(f"{what}() needs a CPU model (model is on {self.device}); use grads_to_host()")


def _inside(t: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether ``t``'s memory lies within ``base``'s memory."""
    start = base.data_ptr()
    end = start + base.numel() * base.element_size()
    return start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= end
