"""A worker's share of a GPU's streaming multiprocessors, for real: CUDA MPS.

Several worker processes on one GPU without MPS time-slice it: each one's compute grows with
every other one's batch, so one GPU cannot stand in for several of different speeds. Under an MPS
control daemon (``nvidia-cuda-mps-control -d``) the processes run side by side, and each client
may be held to a percentage of the SMs (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``, read when the
process creates its CUDA context): a worker at 25% is a real slower GPU, with its own saturation
curve, not a sleep after each pass. ``scenario.workers[i].gpu_sm_percent`` sets it.

The decision is pure (:func:`sm_share_env`); :func:`apply_sm_share` reads the process's state
and sets the variable, and must run before anything creates the CUDA context.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Mapping, MutableMapping

from ps_common.errors import UsageError

log = logging.getLogger(__name__)

#: Where MPS clients find the daemon unless ``CUDA_MPS_PIPE_DIRECTORY`` says otherwise.
DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"
PERCENT_VARIABLE = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"


def mps_pipe_directory(env: Mapping[str, str]) -> Path:
    return Path(env.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIRECTORY)


def mps_daemon_running(env: Mapping[str, str]) -> bool:
    """The control daemon makes a ``control`` pipe in its directory and removes it on exit."""
    return (mps_pipe_directory(env) / "control").exists()


def sm_share_env(percent: int | None, *, device_type: str, cuda_initialized: bool,
                 daemon_running: bool, pipe_directory: Path) -> dict[str, str]:
    """The variables this worker's process must carry for ``percent`` (empty: nothing to set),
    or a :class:`UsageError` that says why it cannot be had."""
    if percent is None:
        return {}
    if device_type != "cuda":
        raise UsageError(f"gpu_sm_percent={percent} needs a CUDA worker (worker.device is {device_type!r})")
    if not daemon_running:
        raise UsageError(f"gpu_sm_percent={percent} needs an MPS control daemon for this GPU, and none "
                         f"answers at {pipe_directory} (start one with `nvidia-cuda-mps-control -d`, "
                         "or set CUDA_MPS_PIPE_DIRECTORY to where it runs)")
    if cuda_initialized:
        raise UsageError(f"gpu_sm_percent={percent}: this process already created its CUDA context, "
                         "and MPS reads the SM share only when the context is created")
    return launch_env(percent)


def launch_env(percent: int | None) -> dict[str, str]:
    """What a launcher puts in a worker's environment, so the share is there from the process's
    first CUDA call on (the worker checks the rest: :func:`apply_sm_share`)."""
    return {} if percent is None else {PERCENT_VARIABLE: str(int(percent))}


def apply_sm_share(percent: int | None, device_type: str,
                   env: MutableMapping[str, str] = os.environ) -> None:
    """Hold this process to ``percent`` of the GPU's SMs (None: leave it as it is)."""
    import torch

    want = sm_share_env(percent, device_type=device_type, cuda_initialized=torch.cuda.is_initialized(),
                        daemon_running=mps_daemon_running(env), pipe_directory=mps_pipe_directory(env))
    for key, value in want.items():
        if env.get(key) not in (None, value):
            log.info("%s=%s from the environment replaced by the scenario's %s", key, env[key], value)
        env[key] = value
    if want:
        log.info("GPU share: %s%% of the SMs (CUDA MPS)", want[PERCENT_VARIABLE])
