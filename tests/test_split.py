import numpy as np
import pytest
import torch

from towers import split
from towers.core.split import shard_sizes


def test_sizes_differ_by_at_most_one_larger_first():
    for total in range(0, 30):
        for n in range(1, 7):
            sizes = shard_sizes(total, n)
            assert sum(sizes) == total
            assert max(sizes) - min(sizes) <= 1
            assert sizes == sorted(sizes, reverse=True)


def test_contiguous_shards_reassemble_the_batch():
    x = torch.arange(10)
    shards = split(x, 3)
    assert [s.tolist() for s in shards] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert torch.equal(torch.cat(shards), x)


def test_nested_structures_keep_their_shape():
    batch = {"x": torch.randn(7, 3), "pair": (torch.arange(7), [torch.ones(7, 2)])}
    shards = split(batch, 2)
    assert len(shards) == 2
    assert shards[0]["x"].shape == (4, 3) and shards[1]["x"].shape == (3, 3)
    assert isinstance(shards[1]["pair"], tuple) and isinstance(shards[1]["pair"][1], list)
    assert shards[1]["pair"][0].tolist() == [4, 5, 6]
    assert torch.equal(torch.cat([s["x"] for s in shards]), batch["x"])


def test_numpy_leaves_are_batch_like():
    shards = split((np.arange(5), torch.arange(5)), 2)
    assert shards[0][0].tolist() == [0, 1, 2] and shards[1][1].tolist() == [3, 4]


def test_fewer_samples_than_towers_gives_empty_trailing_shards():
    shards = split(torch.arange(3), 5)
    assert [len(s) for s in shards] == [1, 1, 1, 0, 0]
    assert sum(len(s) > 0 for s in shards) == 3


def test_mismatched_sizes_name_the_tensors():
    with pytest.raises(ValueError, match=r"share their dim-0 size.*\[0\]: 4.*\[1\]: 5"):
        split((torch.zeros(4), torch.zeros(5)), 2)


@pytest.mark.parametrize("bad", [(torch.zeros(4), "labels"), (torch.zeros(4), None), 3.0])
def test_non_batch_leaves_are_refused(bad):
    with pytest.raises(ValueError, match="cannot be split along a batch dimension"):
        split(bad, 2)


def test_scalar_tensor_is_refused():
    with pytest.raises(ValueError, match="0-dim"):
        split(torch.tensor(1.0), 2)


def test_bad_tower_count():
    with pytest.raises(ValueError, match=">= 1"):
        split(torch.zeros(4), 0)
    with pytest.raises(TypeError):
        split(torch.zeros(4), 2.0)
