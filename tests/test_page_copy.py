"""copy_page_set: one-pass page copies (runs coalesced on both sides), exact bytes, bounds refused untouched."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsakv.cache import page_copy
from dsakv.cache.page_copy import copy_page_set, page_runs


def test_page_runs_coalesce_on_both_sides():
    d, s, n = page_runs([4, 5, 6, 9, 10, 2], [0, 1, 2, 3, 5, 6])
    assert d.tolist() == [4, 9, 10, 2] and s.tolist() == [0, 3, 5, 6] and n.tolist() == [3, 1, 1, 1]
    with pytest.raises(ValueError, match="2 source pages but 1 destination pages"):
        page_runs([0], [0, 1])


@pytest.mark.parametrize("threads", [1, 2])
def test_copy_page_set_exact_bytes(threads):
    g = torch.Generator().manual_seed(0)
    src_a = torch.randint(0, 256, (8, 24), dtype=torch.uint8, generator=g)
    src_b = torch.randint(0, 256, (8, 40), dtype=torch.uint8, generator=g)
    dst_a = torch.zeros(6, 24, dtype=torch.uint8)
    wide = torch.zeros(6, 100, dtype=torch.uint8)  # a page_first row: dst_b is a strided column slice of it
    dst_b = wide[:, 30:70]
    src_ids, dst_ids = [1, 2, 3, 7, 0], [5, 0, 1, 2, 4]
    moved = copy_page_set([(dst_a, src_a), (dst_b, src_b)], torch.tensor(dst_ids), np.array(src_ids), threads=threads)
    assert moved == 5 * (24 + 40)
    for d, s in zip(dst_ids, src_ids, strict=True):
        assert torch.equal(dst_a[d], src_a[s]) and torch.equal(dst_b[d], src_b[s])
    assert int(dst_a[3].count_nonzero()) == 0 and int(wide[:, :30].count_nonzero()) == 0
    assert int(wide[:, 70:].count_nonzero()) == 0


def test_copy_page_set_refuses_out_of_range_ids_untouched():
    src = torch.ones(4, 16, dtype=torch.uint8)
    dst = torch.zeros(4, 16, dtype=torch.uint8)
    other = torch.zeros(2, 16, dtype=torch.uint8)
    with pytest.raises(IndexError, match="destination page ids span 0..3 but the destination buffer has pages 0..1"):
        copy_page_set([(dst, src), (other, src)], [0, 3], [0, 1])
    assert int(dst.count_nonzero()) == 0  # checked before any byte moved
    with pytest.raises(IndexError, match="source page ids span -1..0"):
        copy_page_set([(dst, src)], [0, 1], [-1, 0])
    with pytest.raises(ValueError, match="destination pages of 8 bytes but source pages of 16"):
        copy_page_set([(torch.zeros(4, 8, dtype=torch.uint8), src)], [0], [0])
    assert page_copy.COPY_THREADS == 1
