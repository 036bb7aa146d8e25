"""Checks of halstm.reference: finite differences (float64) and, if available, PyTorch."""
import numpy as np
import pytest

from halstm import reference as ref
from helpers import GATES, assert_close


def make_params(rng, cell, I, H, L, bias=True):
    params = {}
    for k in range(L):
        inp = I if k == 0 else H
        params[f"weight_ih_l{k}"] = rng.uniform(-0.7, 0.7, (GATES[cell] * H, inp))
        params[f"weight_hh_l{k}"] = rng.uniform(-0.7, 0.7, (GATES[cell] * H, H))
        if bias:
            params[f"bias_ih_l{k}"] = rng.uniform(-0.5, 0.5, GATES[cell] * H)
            params[f"bias_hh_l{k}"] = rng.uniform(-0.5, 0.5, GATES[cell] * H)
    return params


def make_problem(cell, T, B, I, H, L, bias=True, states=True, seed=0):
    """Random params, inputs, (optional) initial states and loss weights R*."""
    rng = np.random.default_rng(seed)
    params = make_params(rng, cell, I, H, L, bias)
    x = rng.standard_normal((T, B, I))
    hx = None
    if states:
        h0 = 0.5 * rng.standard_normal((L, B, H))
        c0 = 0.5 * rng.standard_normal((L, B, H))
        hx = (h0, c0) if cell == "lstm" else h0
    R = dict(y=rng.standard_normal((T, B, H)), h=rng.standard_normal((L, B, H)),
             c=rng.standard_normal((L, B, H)))
    return params, x, hx, R


def loss(cell, params, x, hx, R):
    """L = sum(y*Ry) + sum(h_n*Rh) (+ sum(c_n*Rc) for lstm)."""
    if cell == "lstm":
        y, (h_n, c_n), _ = ref.forward(cell, params, x, hx)
        return np.sum(y * R["y"]) + np.sum(h_n * R["h"]) + np.sum(c_n * R["c"])
    y, h_n, _ = ref.forward(cell, params, x, hx)
    return np.sum(y * R["y"]) + np.sum(h_n * R["h"])


def analytic_grads(cell, params, x, hx, R):
    _, _, cache = ref.forward(cell, params, x, hx)
    dc_n = R["c"] if cell == "lstm" else None
    return ref.backward(cell, cache, R["y"], R["h"], dc_n)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
@pytest.mark.parametrize("case", [
    dict(T=4, B=2, I=3, H=5, L=2, bias=True, states=True),
    dict(T=1, B=1, I=3, H=5, L=1, bias=False, states=False),
])
def test_gradients_match_finite_differences(cell, case):
    T, B, I, H, L = (case[k] for k in "TBIHL")
    params, x, hx, R = make_problem(cell, T, B, I, H, L, case["bias"], case["states"])
    grads = analytic_grads(cell, params, x, hx, R)

    expected = set(params) | {"input", "h0"} | ({"c0"} if cell == "lstm" else set())
    assert set(grads) == expected

    # hx=None means zero states: differentiate wrt explicit zero arrays instead.
    if hx is None:
        zeros = lambda: np.zeros((L, B, H))
        hx = (zeros(), zeros()) if cell == "lstm" else zeros()
    targets = dict(params, input=x)
    if cell == "lstm":
        targets["h0"], targets["c0"] = hx
    else:
        targets["h0"] = hx

    f = lambda: loss(cell, params, x, hx, R)
    for name, arr in targets.items():
        assert grads[name].shape == arr.shape, name
        num = ref.numeric_grad(f, arr)
        assert_close(name, grads[name], num, rtol=1e-6, atol=0)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_float32_inputs_stay_float32(cell):
    params, x, hx, R = make_problem(cell, T=3, B=2, I=3, H=5, L=2)
    f32 = lambda a: a.astype(np.float32)
    params = {k: f32(v) for k, v in params.items()}
    hx = tuple(map(f32, hx)) if cell == "lstm" else f32(hx)
    out = ref.forward(cell, params, f32(x), hx)
    assert out[0].dtype == np.float32
    grads = ref.backward(cell, out[2], f32(R["y"]))
    assert all(g.dtype == np.float32 for g in grads.values())


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_matches_torch(cell):
    torch = pytest.importorskip("torch")
    T, B, I, H, L = 4, 2, 3, 5, 2
    params, x, hx, R = make_problem(cell, T, B, I, H, L, seed=1)

    exact = dict(rtol=1e-12, atol=1e-12, per_element=True)     # float64 on both sides
    cls = torch.nn.LSTM if cell == "lstm" else torch.nn.GRU
    mod = cls(I, H, num_layers=L).double()
    mod.load_state_dict({k: torch.from_numpy(v) for k, v in params.items()})
    tx = torch.from_numpy(x).requires_grad_()
    if cell == "lstm":
        th = tuple(torch.from_numpy(a).requires_grad_() for a in hx)
        ty, (th_n, tc_n) = mod(tx, th)
        y, (h_n, c_n), cache = ref.forward(cell, params, x, hx)
        assert_close("c_n", c_n, tc_n.detach().numpy(), **exact)
    else:
        th = torch.from_numpy(hx).requires_grad_()
        ty, th_n = mod(tx, th)
        y, h_n, cache = ref.forward(cell, params, x, hx)
    assert_close("y", y, ty.detach().numpy(), **exact)
    assert_close("h_n", h_n, th_n.detach().numpy(), **exact)

    tl = (ty * torch.from_numpy(R["y"])).sum() + (th_n * torch.from_numpy(R["h"])).sum()
    if cell == "lstm":
        tl = tl + (tc_n * torch.from_numpy(R["c"])).sum()
    tl.backward()
    grads = ref.backward(cell, cache, R["y"], R["h"], R["c"] if cell == "lstm" else None)

    torch_grads = {k: p.grad.numpy() for k, p in mod.named_parameters()}
    torch_grads["input"] = tx.grad.numpy()
    if cell == "lstm":
        torch_grads["h0"], torch_grads["c0"] = th[0].grad.numpy(), th[1].grad.numpy()
    else:
        torch_grads["h0"] = th.grad.numpy()
    assert set(grads) == set(torch_grads)
    for name, tg in torch_grads.items():
        assert_close(name, grads[name], tg, rtol=1e-8, atol=0)
