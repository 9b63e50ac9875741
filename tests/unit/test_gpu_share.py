"""A worker's GPU share (CUDA MPS): when it is set, and the clear errors when it cannot be had."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest
import torch

from ps_common.config import ConfigError, load_config
from ps_common.errors import UsageError
from ps_common.scenario import ScenarioConfig, describe_worker
from ps_worker.gpu_share import PERCENT_VARIABLE, apply_sm_share, launch_env, mps_daemon_running, sm_share_env
from ps_worker.memory import choose_cuda_allocator
from ps_worker.worker import Worker

PIPE = Path("/tmp/nvidia-mps")


def test_a_cuda_worker_under_a_running_daemon_gets_the_variable():
    env = sm_share_env(25, device_type="cuda", cuda_initialized=False, daemon_running=True, pipe_directory=PIPE)
    assert env == {PERCENT_VARIABLE: "25"}


def test_no_share_sets_nothing_whatever_the_state():
    assert sm_share_env(None, device_type="cpu", cuda_initialized=True, daemon_running=False,
                        pipe_directory=PIPE) == {}


@pytest.mark.parametrize(("device", "initialized", "running", "says"), [
    ("cpu", False, True, "needs a CUDA worker"),
    ("cuda", False, False, "needs an MPS control daemon"),
    ("cuda", True, True, "already created its CUDA context"),
])
def test_a_share_that_cannot_be_had_is_refused(device, initialized, running, says):
    with pytest.raises(UsageError, match=says):
        sm_share_env(50, device_type=device, cuda_initialized=initialized, daemon_running=running,
                     pipe_directory=PIPE)


def test_the_daemon_is_found_by_its_control_pipe(tmp_path):
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    assert not mps_daemon_running(env)
    (tmp_path / "control").touch()
    assert mps_daemon_running(env)


def test_apply_on_a_cpu_worker_without_a_share_leaves_the_environment_alone():
    env: dict[str, str] = {}
    apply_sm_share(None, "cpu", env)
    assert env == {}
    with pytest.raises(UsageError, match="needs a CUDA worker"):
        apply_sm_share(30, "cpu", env)
    assert env == {}


@pytest.mark.parametrize("bad", [0, 101, 12.5])
def test_the_scenario_takes_a_whole_percentage(bad):
    with pytest.raises(pydantic.ValidationError):
        ScenarioConfig.model_validate({"workers": [{"gpu_sm_percent": bad}]})
    ok = ScenarioConfig.model_validate({"workers": [{}, {"gpu_sm_percent": 40}]})
    assert ok.for_worker(1).gpu_sm_percent == 40 and ok.for_worker(0).gpu_sm_percent is None
    assert "GPU SMs 40% [real, MPS]" in describe_worker(ok.for_worker(1), 1)


def test_a_share_on_cpu_workers_is_a_config_error():
    with pytest.raises(ConfigError, match=r"workers\[1\].gpu_sm_percent is a share of a GPU"):
        load_config(None, ["scenario.workers=[{}, {gpu_sm_percent: 50}]", "worker.device=cpu"], env={})


def test_a_worker_without_its_scenario_index_refuses_a_share():
    """MPS reads the share when the context is made, before the worker id exists."""
    cfg = load_config(None, ["scenario.workers=[{gpu_sm_percent: 50}]", "worker.device=auto"], env={})
    with pytest.raises(UsageError, match="--scenario-index"):
        Worker(cfg, "tcp://127.0.0.1:1")
    if not torch.cuda.is_available():  # auto is the CPU here
        with pytest.raises(UsageError, match="needs a CUDA worker"):
            Worker(cfg, "tcp://127.0.0.1:1", scenario_index=0)


def test_the_launch_environment_carries_the_share_or_nothing():
    assert launch_env(None) == {} and launch_env(25) == {PERCENT_VARIABLE: "25"}


def test_cuda_workers_get_expandable_segments_unless_the_user_chose():
    """Batch sizes that change fragment fixed segments (the H100 numbers in choose_cuda_allocator)."""
    env: dict[str, str] = {}
    assert choose_cuda_allocator(env) and env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    mine = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
    assert not choose_cuda_allocator(mine) and mine == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
    assert choose_cuda_allocator({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments: True,max_split_size_mb:64"})
