"""halstm.torch on CUDA tensors against torch.nn on the CPU (fp32; cuDNN's
packed path differs from fp32 by up to 4e-4 on an H100) loaded with the
same state dict; streams; tensors stay on the device."""
import copy
import subprocess
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
import halstm.torch as hnn  # noqa: E402
from helpers import H, I, assert_close, record_wavefronts, weighted_loss  # noqa: E402

# cell, layers, bidirectional, packed, I, H, T, B
CASES = [("lstm", 2, True, True, I, H, 7, 5), ("lstm", 1, False, False, I, H, 1, 1),
         ("gru", 2, False, True, I, H, 7, 5), ("rnn_tanh", 1, True, True, I, H, 7, 5),
         ("lstm", 1, False, True, 64, 256, 20, 48), ("gru", 1, True, True, 64, 256, 20, 48)]
PEERS = {"lstm": (hnn.LSTM, torch.nn.LSTM), "gru": (hnn.GRU, torch.nn.GRU),
         "rnn_tanh": (hnn.RNN, torch.nn.RNN)}


def _losses(module, x, lengths):
    inp = x if lengths is None else torch.nn.utils.rnn.pack_padded_sequence(
        x, lengths, enforce_sorted=False)
    y, hn = module(inp)
    out = y if lengths is None else y.data
    return out, hn if isinstance(hn, tuple) else (hn,), weighted_loss(y, hn)


@pytest.mark.parametrize("cell,layers,bidir,packed,i,h,T,B", CASES)
def test_cuda_matches_torch(cell, layers, bidir, packed, i, h, T, B):
    mine, theirs = PEERS[cell]
    torch.manual_seed(0)
    ref = theirs(i, h, num_layers=layers, bidirectional=bidir)
    m = mine(i, h, num_layers=layers, bidirectional=bidir).cuda()
    m.load_state_dict(ref.state_dict())
    x = torch.randn(T, B, i)
    lengths = torch.randint(1, T + 1, (B,), generator=torch.Generator().manual_seed(1)) \
        if packed else None
    got, want = [], []
    for module, into in ((m, got), (ref, want)):
        xi = x.to(next(module.parameters()).device).requires_grad_()
        out, hn, loss = _losses(module, xi, lengths)
        loss.backward()
        into += [out.detach(), *[a.detach() for a in hn], xi.grad]
        into += [p.grad for p in module.parameters()]
    assert got[0].device.type == "cuda"
    for k, (a, b) in enumerate(zip(got, want)):
        assert_close(f"result {k}", a.cpu(), b.cpu(), rtol=2e-4)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_cuda_cells_step_by_step_match_torch(cell):
    """LSTMCell and GRUCell on CUDA tensors, five steps (each a one-step
    time loop, launched directly) under no_grad and with gradients, against
    torch.nn's cell on the CPU with the same state dict."""
    ours_cls, peer_cls = {"lstm": (hnn.LSTMCell, torch.nn.LSTMCell),
                          "gru": (hnn.GRUCell, torch.nn.GRUCell)}[cell]
    torch.manual_seed(0)
    peer = peer_cls(I, H)
    ours = ours_cls(I, H).cuda()
    ours.load_state_dict(peer.state_dict())
    xs = torch.randn(5, 3, I)

    def steps(module, device):
        state, outs = None, []
        for x in xs.to(device):
            state = module(x, state)
            outs += list(state) if isinstance(state, tuple) else [state]
        return outs

    with torch.no_grad():
        for k, (got, want) in enumerate(zip(steps(ours, "cuda"), steps(peer, "cpu"))):
            assert_close(f"no_grad output {k}", got.cpu(), want, rtol=2e-4)
    got, want = steps(ours, "cuda"), steps(peer, "cpu")
    sum(o.sum() for o in got).backward()
    sum(o.sum() for o in want).backward()
    for k, (a, b) in enumerate(zip(got, want)):
        assert_close(f"output {k}", a.detach().cpu(), b.detach(), rtol=2e-4)
    for (name, a), b in zip(ours.named_parameters(), peer.parameters()):
        assert_close(f"d{name}", a.grad.cpu(), b.grad, rtol=2e-4)


@pytest.mark.parametrize("given", [False, True])
def test_cuda_projection_matches_torch(given):
    torch.manual_seed(0)
    ref = torch.nn.LSTM(I, H, num_layers=2, bidirectional=True, proj_size=I)
    m = hnn.LSTM(I, H, num_layers=2, bidirectional=True, proj_size=I).cuda()
    m.load_state_dict(ref.state_dict())
    x = torch.randn(7, 5, I)
    lengths = torch.tensor([7, 2, 5, 1, 7])
    hx = (torch.randn(4, 5, I), torch.randn(4, 5, H)) if given else None
    got, want = [], []
    for module, into in ((m, got), (ref, want)):
        dev = next(module.parameters()).device
        xi = x.to(dev).requires_grad_()
        hi = None if hx is None else tuple(a.to(dev).requires_grad_() for a in hx)
        inp = torch.nn.utils.rnn.pack_padded_sequence(xi, lengths, enforce_sorted=False)
        y, hn = module(inp, hi)
        w = torch.linspace(-1, 1, y.data.numel(), device=dev).reshape(y.data.shape)
        ((y.data * w).sum() + sum((a * a).sum() for a in hn)).backward()
        into += [y.data.detach(), *[a.detach() for a in hn], xi.grad]
        into += [p.grad for p in module.parameters()] + ([a.grad for a in hi] if hi else [])
    for k, (a, b) in enumerate(zip(got, want)):
        assert_close(f"result {k}", a.cpu(), b.cpu(), rtol=2e-4)


def test_runs_on_the_current_stream():
    m = hnn.LSTM(I, H, num_layers=2).cuda()
    x = torch.randn(7, 3, I, device="cuda")
    want = m(x)[0].detach()       # (its graph freed: backward below runs on s)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            got, _ = m(x)
            got.sum().backward()
    torch.cuda.current_stream().wait_stream(s)
    assert torch.equal(got, want)


def _step(m, x):
    """A forward+backward of m on x (_losses): y, the final states, x's and
    every parameter's gradient."""
    m.zero_grad()
    xi = x.clone().requires_grad_()
    out, hn, loss = _losses(m, xi, None)
    loss.backward()
    return [out.detach(), *[a.detach() for a in hn], xi.grad] + [p.grad for p in m.parameters()]


GPUS = list(range(torch.cuda.device_count())) or [0]


@pytest.mark.parametrize("gpu", GPUS)
def test_each_gpu_matches_torch(gpu):
    """A layer whose tensors are on cuda:N runs there (in GPU N's context,
    on its current stream) whatever the current device is (another GPU
    where there is one): results as torch.nn's on the CPU, on cuda:N, and
    bitwise the same from its captured graphs on later calls."""
    torch.manual_seed(0)
    ref = torch.nn.LSTM(I, H, num_layers=2, bidirectional=True)
    device = torch.device("cuda", gpu)
    m = hnn.LSTM(I, H, num_layers=2, bidirectional=True).to(device)
    m.load_state_dict(ref.state_dict())
    x = torch.randn(7, 5, I)
    other = (gpu + 1) % torch.cuda.device_count()
    with torch.cuda.device(other):
        runs = [_step(m, x.to(device)) for _ in range(3)]
    want = _step(ref, x)
    for k, (a, b) in enumerate(zip(runs[0], want)):
        assert a.device == device, f"result {k} on {a.device}"
        assert_close(f"result {k}", a.cpu(), b, rtol=2e-4)
    for run in runs[1:]:
        for a, b in zip(run, runs[0]):
            assert torch.equal(a, b)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_in_turn_give_the_same_results():
    """One library runs on two GPUs in turn (its graphs, cuBLAS handles and
    Halide's loaded kernels per GPU): the same inputs give bitwise the same
    results on both, every time."""
    torch.manual_seed(0)
    m0 = hnn.LSTM(64, 256, num_layers=2).to("cuda:0")
    m1 = copy.deepcopy(m0).to("cuda:1")
    x = torch.randn(20, 16, 64)
    for _ in range(3):
        a, b = _step(m0, x.to("cuda:0")), _step(m1, x.to("cuda:1"))
        for k, (u, v) in enumerate(zip(a, b)):
            assert v.device == torch.device("cuda:1")
            assert torch.equal(u.cpu(), v.cpu()), f"result {k}"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_process_on_gpu_1_retains_no_context_on_gpu_0():
    code = ("import torch, halstm.torch as hnn, halstm.cuda as hc\n"
            "m = hnn.GRU(8, 16).to('cuda:1')\n"
            "m(torch.randn(3, 2, 8, device='cuda:1'))[0].sum().backward()\n"
            "print(sorted(hc.driver()._contexts))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "[1]"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_data_parallel_matches_one_gpu():
    """torch.nn.DataParallel over two GPUs (a thread a replica, each in its
    GPU's context, at the same time): output and every gradient as one
    GPU's over the whole batch (the replicas' weight gradients are summed
    in another order: parity tolerance)."""
    torch.manual_seed(0)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = hnn.LSTM(I, H, num_layers=2, batch_first=True, bidirectional=True)
            self.head = torch.nn.Linear(2 * H, 3)

        def forward(self, x):
            return self.head(self.rnn(x)[0])

    m = Model().cuda(0)
    x = torch.randn(6, 9, I, device="cuda:0")
    runs = []
    for model in (m, torch.nn.DataParallel(m, device_ids=[0, 1])):
        m.zero_grad()
        y = model(x)
        y.square().sum().backward()
        runs.append([y.detach()] + [p.grad.clone() for p in m.parameters()])
    for k, (a, b) in enumerate(zip(*runs)):
        assert_close(f"result {k}", b.cpu(), a.cpu(), rtol=1e-4)


def test_torch_func_on_cuda_matches_eager():
    """torch.func.grad and vmap(grad) (per-sample gradients) of a
    bidirectional layer on CUDA tensors as eager autograd's, row by row."""
    torch.manual_seed(0)
    m = hnn.LSTM(I, H, num_layers=2, bidirectional=True).cuda()
    params = {k: v.detach() for k, v in m.named_parameters()}
    x = torch.randn(7, 3, I, device="cuda")

    def loss(p, xi):
        return torch.func.functional_call(m, p, (xi,))[0].square().sum()

    per_row = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 1))(params, x)
    for b in range(3):
        want = torch.autograd.grad(m(x[:, b])[0].square().sum(), list(m.parameters()))
        for (k, _), w in zip(m.named_parameters(), want):
            assert_close(f"d {k} of row {b}", per_row[k][b].cpu(), w.cpu(), rtol=2e-4)


def test_layernorm_cell_on_cuda_matches_cpu():
    torch.manual_seed(0)
    m = hnn.Recurrent("layernorm_lstm", I, H, num_layers=2, bidirectional=True)
    g = m.to("cuda")
    c = hnn.Recurrent("layernorm_lstm", I, H, num_layers=2, bidirectional=True)
    c.load_state_dict({k: v.cpu() for k, v in g.state_dict().items()})
    x = torch.randn(7, 5, I)
    lengths = torch.tensor([7, 2, 5, 1, 7])
    res = []
    for module, dev in ((g, "cuda"), (c, "cpu")):
        out, hn, loss = _losses(module, x.to(dev), lengths)
        loss.backward()
        res.append([out.detach().cpu()] + [p.grad.cpu() for p in module.parameters()])
    for k, (a, b) in enumerate(zip(*res)):
        assert_close(f"result {k}", a, b, rtol=2e-4)


def test_bidirectional_directions_run_beside_each_other():
    """The reverse direction runs on a side stream with its own library
    instance (lane 1); repeated forward+backward without a host sync gives
    bitwise the same results each time (no race between the streams), and
    the leaves' gradients come back on the stream that made them (torch
    warns otherwise)."""
    torch.manual_seed(0)
    m = hnn.GRU(64, 256, num_layers=2, bidirectional=True).cuda()
    x = torch.randn(30, 16, 64, device="cuda")
    h0 = torch.randn(4, 16, 256, device="cuda")
    runs = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(4):
            m.zero_grad()
            xi, hi = x.clone().requires_grad_(), h0.clone().requires_grad_()
            y, hn = m(xi, hi)
            w = torch.linspace(-1, 1, y.numel(), device="cuda").reshape(y.shape)
            ((y * w).sum() + (hn * hn).sum()).backward()
            runs.append([y.detach().clone(), hn.detach().clone(), xi.grad.clone(), hi.grad.clone()]
                        + [p.grad.clone() for p in m.parameters()])
    assert not [w for w in seen if "stream" in str(w.message)], [str(w.message) for w in seen]
    for run in runs[1:]:
        for a, b in zip(run, runs[0]):
            assert torch.equal(a, b)
    assert any(spec.endswith("|1") for spec, _, target in hnn.kernels._libs if "cuda" in target)


@pytest.mark.parametrize("cell,layers,given,batch_first,finals_only,dropout",
                         [("lstm", 2, False, False, False, 0), ("lstm", 3, True, True, False, 0),
                          ("gru", 2, True, False, False, 0), ("lstm", 2, True, False, True, 0),
                          ("layernorm_lstm", 2, False, False, False, 0),
                          ("lstm", 3, False, False, False, 0.3), ("gru", 2, True, True, False, 0.5)])
def test_layers_as_a_wavefront_match_in_turn(cell, layers, given, batch_first, finals_only,
                                             dropout, monkeypatch):
    """A CUDA stack as a wavefront of 3 chunks (halstm.wavefront, _Stack):
    outputs and every gradient those of the layers in turn (with dropout:
    the same masks, drawn the same way, B*H = 185 floats off 16-byte
    alignment), run on a stream other than the default one, bitwise the
    same when repeated (no race between the lanes), and no warning of a
    gradient's stream."""
    torch.manual_seed(0)
    m = hnn.Recurrent(cell, I, H, num_layers=layers, batch_first=batch_first,
                      dropout=dropout).cuda()
    T, B = 8, 5
    x = torch.randn(*((B, T) if batch_first else (T, B)), I, device="cuda")
    hx = [torch.randn(layers, B, H, device="cuda") for _ in m._states] if given else None
    seen = record_wavefronts(monkeypatch)

    def step():
        m.zero_grad()
        torch.manual_seed(7)                    # (the dropout masks)
        xi = x.clone().requires_grad_()
        hi = None if hx is None else [a.clone().requires_grad_() for a in hx]
        y, hn = m(xi, None if hi is None else hi[0] if len(hi) == 1 else tuple(hi))
        hn = hn if isinstance(hn, tuple) else (hn,)
        loss = sum((f * f).sum() for f in hn) if finals_only else weighted_loss(y, hn)
        loss.backward()
        return ([y.detach().clone(), *[a.detach().clone() for a in hn], xi.grad]
                + [p.grad.clone() for p in m.parameters()] + ([a.grad for a in hi] if hi else []))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    runs = []
    with warnings.catch_warnings(record=True) as caught, torch.cuda.stream(side):
        warnings.simplefilter("always")
        monkeypatch.setenv("HALSTM_WAVEFRONT_CHUNKS", "1")
        want = step()
        monkeypatch.setenv("HALSTM_WAVEFRONT_CHUNKS", "3")
        for _ in range(3):
            runs.append(step())
    torch.cuda.current_stream().wait_stream(side)
    assert seen["forward"] == [3] * 3
    assert not [w for w in caught if "stream" in str(w.message)], [str(w.message) for w in caught]
    for run in runs[1:]:
        for a, b in zip(run, runs[0]):
            assert torch.equal(a, b)
    for k, (a, b) in enumerate(zip(runs[0], want)):
        assert_close(f"result {k}", a.cpu(), b.cpu(), rtol=1e-4)
    torch.manual_seed(7)                 # (the same masks)
    with torch.no_grad():                # no_grad: the same forward, nothing saved
        y = m(x, None if hx is None else hx[0] if len(hx) == 1 else tuple(hx))[0]
    assert seen["forward"] == [3] * 4
    assert_close("no_grad y", y.cpu(), runs[0][0].cpu(), rtol=1e-5)


def test_compile_reduce_overhead_matches_eager():
    """torch.compile(mode="reduce-overhead") records the layers' kernels
    into torch's CUDA graph (warm-up, recording, replays): outputs and
    gradients as eager, for a new input at every step (a replay that
    skipped the kernels would return the last step's)."""
    torch.manual_seed(0)
    m = hnn.LSTM(64, 256, num_layers=2).cuda()
    compiled = torch.compile(m, mode="reduce-overhead")

    def step(model, x):
        m.zero_grad(set_to_none=False)
        y, (h, c) = model(x)
        ((y * y).sum() + h.sum() + c.sum()).backward()
        return [y.detach().clone()] + [p.grad.clone() for p in m.parameters()]

    for _ in range(5):
        x = torch.randn(20, 16, 64, device="cuda")
        want = step(m, x)
        got = step(compiled, x)
        for k, (a, b) in enumerate(zip(got, want)):
            assert_close(f"result {k}", a.cpu(), b.cpu())


def test_autocast_bf16_runs_the_bf16_kernels():
    """Inside torch.autocast("cuda", dtype=torch.bfloat16) a float32 module
    computes as precision="bf16", forward and backward, bitwise; outputs
    and gradients float32."""
    torch.manual_seed(0)
    m = hnn.LSTM(64, 256).cuda()
    m16 = hnn.LSTM(64, 256, precision="bf16").cuda()
    m16.load_state_dict(m.state_dict())
    x = torch.randn(20, 48, 64, device="cuda")
    runs = []
    for module, autocast in ((m, True), (m16, False), (m, False)):
        module.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            y, _, loss = _losses(module, x, None)
            loss.backward()
            if autocast:
                assert module(x.bfloat16())[0].dtype == torch.float32
        assert y.dtype == torch.float32
        runs.append([y.detach(), *[p.grad for p in module.parameters()]])
    for k, (a, b) in enumerate(zip(runs[0], runs[1])):
        assert torch.equal(a, b), k
    assert not torch.equal(runs[0][0], runs[2][0])
