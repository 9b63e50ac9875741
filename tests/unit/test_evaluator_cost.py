"""What keeps the evaluator cheap and out of training's way: the channels-last forward, glibc keeping
freed blocks, the scheduling class, and the launcher keeping children in its session."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from ps_launcher.processes import ProcessGroup
from ps_ml.datasets import load_dataset
from ps_ml.models import FlatParameters, build_model
from ps_worker.evaluator import channels_last_forward, evaluate


@pytest.fixture(scope="module")
def data():
    return load_dataset("synthetic", seed=3, synthetic_train=64, synthetic_test=300)


@pytest.mark.parametrize("name", ["mlp", "lenet", "cnn1m"])
def test_the_channels_last_forward_measures_what_the_plain_one_does(name: str, data) -> None:
    model = build_model(name, seed=1)
    flat = FlatParameters(model)
    before = [p.detach().clone() for p in model.parameters()]
    fast = channels_last_forward(model)
    x, _ = data.test_batch(0, 64)
    with torch.inference_mode():
        assert torch.allclose(fast(x), model(x), atol=1e-5, rtol=1e-4)
    # the copy is laid out anew; the model and the evaluator's flat view of it are untouched
    assert all(p.is_contiguous() for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    params = np.random.default_rng(0).standard_normal(flat.numel).astype(np.float32)
    flat.load_(params)
    assert np.array_equal(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy(), params)
    acc_fast, loss_fast = evaluate(model, data, batch=64, channels_last=True)
    acc, loss = evaluate(model, data, batch=64, channels_last=False)
    assert acc_fast == acc
    assert loss_fast == pytest.approx(loss, rel=1e-5)
    assert model.training  # evaluate leaves the model as it found it (train mode)


def test_evaluation_runs_in_eval_mode_and_restores_the_callers_mode(data) -> None:
    """Dropout (or any layer with a training mode) must be off in the channels-last copy too: a
    copy taken in train mode would drop half the activations at random."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Dropout(0.5), nn.Flatten(),
                          nn.Linear(4 * 26 * 26, 10))
    plain = evaluate(model, data, channels_last=False)
    fast = evaluate(model, data, channels_last=True)
    assert fast[0] == plain[0] and fast[1] == pytest.approx(plain[1], rel=1e-5)
    assert evaluate(model, data) == fast                 # deterministic: no dropout anywhere
    assert model.training
    model.eval()
    evaluate(model, data)
    assert not model.training                            # the caller's mode, not train()


class _PlainLayoutOnly(nn.Module):
    """A layer that refuses the channels-last tensors the fast forward hands it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        if x.stride() != (c * h * w, h * w, w, 1):
            raise RuntimeError("plain layout only")
        return x * 2.0


def test_a_layer_that_fails_on_channels_last_tensors_falls_back_to_the_plain_forward(data) -> None:
    model = nn.Sequential(nn.Conv2d(1, 4, 3), _PlainLayoutOnly(), nn.Flatten(), nn.Linear(4 * 26 * 26, 10))
    with pytest.raises(RuntimeError, match="plain layout only"):
        with torch.inference_mode():
            channels_last_forward(model)(data.test_batch(0, 4)[0])
    assert evaluate(model, data, channels_last=True) == evaluate(model, data, channels_last=False)


def _autogroup_nice(pid: int) -> str:
    """"/autogroup-123 nice 0" -> "0"; "-" for a process outside any autogroup (the kernel's
    default group, as init and whatever runs in its session: the file reads empty there)."""
    fields = Path(f"/proc/{pid}/autogroup").read_text().split()
    return fields[-1] if fields else "-"


@pytest.mark.skipif(not Path("/proc/self/autogroup").exists(), reason="no autogroups on this kernel")
def test_lower_priority_leaves_a_shared_session_alone_and_lowers_its_own() -> None:
    """In the launcher's session it lowers only itself (SCHED_IDLE, nice 19); leading a session
    of its own it also lowers that session's autogroup."""
    code = textwrap.dedent("""
        import os, sys
        from ps_worker.evaluator import lower_priority
        lower_priority(19)
        group = open("/proc/self/autogroup").read().split()
        print(os.sched_getscheduler(0) == os.SCHED_IDLE, os.getpriority(os.PRIO_PROCESS, 0),
              group[-1] if group else "-")
    """)
    mine = _autogroup_nice(os.getpid())
    shared = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            check=True).stdout.split()
    assert shared == ["True", "19", mine]
    assert _autogroup_nice(os.getpid()) == mine
    alone = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                           check=True, start_new_session=True).stdout.split()
    assert alone[:2] == ["True", "19"]
    # A new session gets an autogroup of its own where the kernel makes them (the file then
    # reads "nice 19"); where it reads empty there is no group to lower.
    assert alone[2] in ("19", "-")
    if Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1":
        assert alone[2] == "19"


def test_launcher_children_lead_their_process_group_in_the_launchers_session(tmp_path: Path) -> None:
    group = ProcessGroup(tmp_path)
    child = group.start("probe", "http.server", ["0", "--bind", "127.0.0.1"])
    try:
        pid = child.proc.pid
        assert os.getpgid(pid) == pid                   # stop_all signals its whole group
        assert os.getsid(pid) == os.getsid(0)           # same autogroup: SCHED_IDLE holds
    finally:
        group.stop_all(grace_s=5.0)
    assert child.proc.returncode is not None
