"""How the flat parameter vector is partitioned over server shards."""

from __future__ import annotations


def partition(num_params: int, num_shards: int) -> list[tuple[int, int]]:
    """Contiguous [start, stop) ranges of the flat float32 vector, balanced in bytes.

    Ranges may cut through a tensor: shards see a flat vector, not tensors, so the split is as
    even as it can be (sizes differ by at most one element) whatever the model's shapes.
    """
    if num_shards < 1:
        raise ValueError("num_shards must be >= 1")
    if num_params < num_shards:
        raise ValueError(f"cannot split {num_params} parameters over {num_shards} shards")
    base, extra = divmod(num_params, num_shards)
    ranges, start = [], 0
    for k in range(num_shards):
        stop = start + base + (1 if k < extra else 0)
        ranges.append((start, stop))
        start = stop
    return ranges
