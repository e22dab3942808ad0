import pytest
import torch

from towers import make_parallel


def _quadratic_model(w):
    # Seed 004's model: features [x^2, x, 1], per-sample squared error.
    def model(x, y):
        f = torch.stack([x.square(), x, torch.ones_like(x)], 1)
        return (f @ w).squeeze(1).sub(y).square()

    return model


@pytest.mark.parametrize(("n", "towers_"), [(100, 2), (7, 3), (2, 4)])
def test_outputs_and_gradients_equal_the_unsplit_computation(n, towers_):
    torch.manual_seed(0)
    x = torch.empty(n).uniform_(-10, 10)
    y = 5 * x.square() + 3
    w1 = torch.randn(3, 1, requires_grad=True)
    w2 = w1.detach().clone().requires_grad_(True)

    plain = _quadratic_model(w1)(x=x, y=y)
    parallel = make_parallel(_quadratic_model(w2), towers_, x=x, y=y)
    torch.testing.assert_close(parallel, plain)
    plain.mean().backward()
    parallel.mean().backward()
    torch.testing.assert_close(w2.grad, w1.grad)


def test_tuple_and_dict_outputs_are_concatenated():
    def fn(a):
        return {"double": a * 2, "pair": (a + 1, a - 1)}

    out = make_parallel(fn, 3, a=torch.arange(5.0))
    assert out["double"].tolist() == [0, 2, 4, 6, 8]
    assert out["pair"][1].tolist() == [-1, 0, 1, 2, 3]


def test_device_list_runs_each_tower_on_its_device():
    seen = []

    def fn(x):
        seen.append(x.device.type)
        return x + 1

    out = make_parallel(fn, ["cpu", "cpu"], x=torch.zeros(4))
    assert seen == ["cpu", "cpu"] and out.tolist() == [1, 1, 1, 1]


def test_scalar_output_is_refused_with_advice():
    with pytest.raises(ValueError, match="reduction='none'"):
        make_parallel(lambda x: x.sum(), 2, x=torch.ones(4))


def test_bad_arguments():
    with pytest.raises(ValueError, match="devices must be >= 1"):
        make_parallel(lambda x: x, 0, x=torch.ones(2))
    with pytest.raises(ValueError, match="at least one keyword input"):
        make_parallel(lambda: None, 2)
    with pytest.raises(ValueError, match="share their dim-0 size"):
        make_parallel(lambda x, y: x, 2, x=torch.ones(3), y=torch.ones(4))
