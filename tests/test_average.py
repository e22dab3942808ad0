import numpy as np
import pytest
import torch

from towers import average_gradients


def test_seed_walkthrough_three_variables_on_four_towers():
    # Seed 000's walk-through: 3 variables, 4 GPUs, each gradient averaged over the tower axis and
    # paired with tower 0's variable.
    variables = [torch.zeros(2), torch.zeros(3, 2), torch.zeros(1)]
    tower_grads = [
        [(torch.full_like(v, float(10 * t + i)), v) for i, v in enumerate(variables)]
        for t in range(4)
    ]
    averaged = average_gradients(tower_grads)
    assert len(averaged) == 3
    for i, (grad, var) in enumerate(averaged):
        assert var is variables[i]
        expected = torch.stack([tower_grads[t][i][0] for t in range(4)]).mean(0)
        torch.testing.assert_close(grad, expected)
        assert grad.shape == variables[i].shape


def test_weights_give_the_full_batch_gradient_for_uneven_shards():
    torch.manual_seed(0)
    w = torch.randn(3, requires_grad=True)
    x, y = torch.randn(11, 3), torch.randn(11)

    def grad_of(xs, ys):
        (g,) = torch.autograd.grad(((xs @ w - ys) ** 2).mean(), w)
        return g

    full = grad_of(x, y)
    shards = [(0, 5), (5, 9), (9, 11)]
    tower_grads = [[(grad_of(x[a:b], y[a:b]), w)] for a, b in shards]
    averaged = average_gradients(tower_grads, weights=[b - a for a, b in shards])
    torch.testing.assert_close(averaged[0][0], full, rtol=1e-5, atol=1e-6)
    unweighted = average_gradients(tower_grads)[0][0]
    assert not torch.allclose(unweighted, full, rtol=1e-3)  # why the weights matter


def test_none_gradients():
    a, b = torch.zeros(2), torch.zeros(2)
    towers_ = [[(None, a), (torch.tensor([2.0, 4.0]), b)], [(None, a), (None, b)]]
    (ga, va), (gb, vb) = average_gradients(towers_)
    assert ga is None and va is a and vb is b
    torch.testing.assert_close(gb, torch.tensor([1.0, 2.0]))  # None counts as zero


def test_zero_weight_tower_is_ignored():
    v = torch.zeros(1)
    out = average_gradients([[(torch.tensor([3.0]), v)], [(torch.tensor([100.0]), v)]], [2, 0])
    torch.testing.assert_close(out[0][0], torch.tensor([3.0]))


def test_numpy_gradients():
    out = average_gradients([[(np.array([1.0, 2.0]), "w")], [(np.array([3.0, 4.0]), "w")]])
    np.testing.assert_allclose(out[0][0], [2.0, 3.0])
    assert out[0][1] == "w"


def test_mismatched_variable_count_names_the_tower():
    v = torch.zeros(2)
    with pytest.raises(ValueError, match=r"tower 1 has 2 .* tower 0 has 1"):
        average_gradients([[(torch.ones(2), v)], [(torch.ones(2), v), (torch.ones(2), v)]])


def test_mismatched_shapes_name_tower_and_variable():
    with pytest.raises(ValueError, match=r"tower 2, variable 0 \(shape \[3\]\)"):
        average_gradients(
            [[(torch.ones(2), torch.zeros(2))]] * 2 + [[(torch.ones(3), torch.zeros(3))]]
        )
    v = torch.zeros(2)
    with pytest.raises(ValueError, match=r"tower 1, variable 0.*gradient has shape \[3\]"):
        average_gradients([[(torch.ones(2), v)], [(torch.ones(3), v)]])


def test_mismatched_variable_names():
    with pytest.raises(ValueError, match="tower 1 has variable 'b' where tower 0 has 'a'"):
        average_gradients([[(np.ones(1), "a")], [(np.ones(1), "b")]])


@pytest.mark.parametrize(
    ("weights", "message"),
    [([1.0], "got 1 weights for 2 towers"), ([1, -1], "weight of tower 1"), ([0, 0], "all tower")],
)
def test_bad_weights(weights, message):
    v = torch.zeros(1)
    with pytest.raises(ValueError, match=message):
        average_gradients([[(torch.ones(1), v)], [(torch.ones(1), v)]], weights)


def test_empty_input():
    with pytest.raises(ValueError, match="empty"):
        average_gradients([])
