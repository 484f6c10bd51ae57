"""Which artifact of a bundle a call runs: the exact bucket, else the smallest bucket its batch pads into, else
the main (dynamic) artifact. Pure logic; tests/e2e/test_report.py runs real bundles."""

from __future__ import annotations

from client.buckets import choose, covers

BUCKETS = [[[1, 16]], [[8, 16]], [[32, 16]]]


def test_exact_bucket_wins():
    assert choose(BUCKETS, [[8, 16]]) == (1, False)


def test_smallest_bucket_the_batch_pads_into():
    assert choose(BUCKETS, [[5, 16]]) == (1, True)
    assert choose(BUCKETS, [[9, 16]]) == (2, True)
    assert choose(list(reversed(BUCKETS)), [[2, 16]]) == (1, True)  # by size, not by position


def test_no_bucket_fits():
    assert choose(BUCKETS, [[33, 16]]) is None  # larger than every bucket
    assert choose(BUCKETS, [[4, 12]]) is None  # another non-batch dim
    assert choose(BUCKETS, [[5, 16]], pad=False) is None


def test_multi_input_buckets_pad_one_shared_batch():
    two = [[[4, 3], [4]], [[16, 3], [16]]]
    assert choose(two, [[10, 3], [10]]) == (1, True)
    assert choose(two, [[3, 3], [5]]) is None  # the inputs disagree on the batch


def test_main_spec_covers_a_range():
    spec = [{"name": "x", "dtype": "float32", "shape": [{"min": 1, "max": 16}, 16]}]
    assert covers(spec, [[16, 16]]) and not covers(spec, [[17, 16]]) and not covers(spec, [[4, 8]])
