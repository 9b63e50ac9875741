"""Server-side optimizers over a shard's flat float32 slice (numpy, torch.optim semantics)."""

from __future__ import annotations

import numpy as np

from ps_common.config import OptimizerConfig


class SGD:
    """SGD with momentum, weight decay and Nesterov, matching ``torch.optim.SGD`` (dampening 0).

    ``step`` returns a NEW parameter array instead of updating in place: older arrays may still
    be referenced by zero-copy sends in flight, and must never change under them.
    """

    def __init__(self, cfg: OptimizerConfig, size: int) -> None:
        self.lr = cfg.lr
        self.momentum = cfg.momentum
        self.weight_decay = cfg.weight_decay
        self.nesterov = cfg.nesterov
        self.buf = np.zeros(size, dtype=np.float32) if cfg.momentum else None
        self._has_buf = False
        self._scratch = np.empty(size, dtype=np.float32)

    def step(self, params: np.ndarray, grad: np.ndarray, lr_scale: float = 1.0) -> np.ndarray:
        d = grad
        if self.weight_decay:
            d = np.multiply(params, np.float32(self.weight_decay), out=self._scratch)
            d += grad
        if self.buf is not None:
            if self._has_buf:
                self.buf *= np.float32(self.momentum)
                self.buf += d
            else:
                np.copyto(self.buf, d)
                self._has_buf = True
            if self.nesterov:
                d = np.add(d, np.float32(self.momentum) * self.buf, out=self._scratch)
            else:
                d = self.buf
        out = np.multiply(d, np.float32(-self.lr * lr_scale))
        out += params
        return out

    def state_arrays(self) -> dict[str, np.ndarray]:
        return {"momentum_buffer": self.buf} if self.buf is not None and self._has_buf else {}

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        buf = arrays.get("momentum_buffer")
        if self.buf is not None and buf is not None:
            if buf.shape != self.buf.shape:
                raise ValueError(f"momentum buffer of shape {buf.shape}, expected {self.buf.shape}")
            np.copyto(self.buf, buf)
            self._has_buf = True
        elif self.buf is not None:
            self.buf.fill(0.0)
            self._has_buf = False
