"""halstm.torch against torch.nn.LSTM / GRU / RNN loaded with the same state
dict: outputs, final states and every gradient, over the layer options
(pairwise: each pair of options appears together in some case), plus
training, torch.compile, determinism and errors."""
import copy
import functools
import io
import os
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import halstm  # noqa: E402
import halstm.torch as hnn  # noqa: E402
from helpers import H, I, assert_close, host_has_bf16, record_wavefronts, weighted_loss  # noqa: E402

PEERS = {"lstm": (hnn.LSTM, torch.nn.LSTM, {}), "gru": (hnn.GRU, torch.nn.GRU, {}),
         "rnn_tanh": (hnn.RNN, torch.nn.RNN, {}),
         "rnn_relu": (hnn.RNN, torch.nn.RNN, {"nonlinearity": "relu"})}

# cell, layers, bidirectional, batch_first, hx given, input form, T, B, proj_size
CASES = [
    ("lstm", 1, False, False, False, "padded", 7, 3, 0),
    ("lstm", 2, True, True, True, "packed", 7, 5, 0),
    ("lstm", 3, False, True, True, "unbatched", 1, 1, 0),
    ("lstm", 2, True, False, False, "padded", 1, 1, 0),
    ("lstm", 1, True, False, True, "packed", 7, 4, 0),
    ("gru", 2, False, False, True, "packed", 7, 5, 0),
    ("gru", 1, True, True, False, "padded", 5, 1, 0),
    ("rnn_tanh", 2, True, False, True, "padded", 4, 3, 0),
    ("rnn_relu", 1, False, True, False, "packed", 7, 4, 0),
    # proj_size 13 = I: the layers above the first reuse the first's kernels
    ("lstm", 2, False, False, True, "padded", 7, 3, I),
    ("lstm", 2, True, True, True, "packed", 7, 5, I),
    ("lstm", 1, False, True, False, "packed", 7, 4, I),
    ("lstm", 3, True, False, True, "unbatched", 1, 1, I),
    ("lstm", 1, True, False, False, "padded", 1, 1, I),
]
LENGTHS = {5: [3, 7, 1, 5, 5], 4: [2, 7, 7, 4]}   # unsorted, by batch size (T = 7)


def _pair(cell, layers, bidirectional, batch_first, seed=0, proj_size=0):
    mine, theirs, kw = PEERS[cell]
    kw = kw | ({"proj_size": proj_size} if proj_size else {})
    torch.manual_seed(seed)
    ref = theirs(I, H, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first,
                 **kw)
    m = mine(I, H, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first, **kw)
    m.load_state_dict(ref.state_dict())
    return m, ref


def _squares_and_grads(module, x) -> list:
    """module's output y for x and, after a loss of sum(y * y), the
    gradients of x and of every parameter."""
    xi = x.clone().requires_grad_()
    y, _ = module(xi)
    (y * y).sum().backward()
    return [y.detach(), xi.grad] + [q.grad for q in module.parameters()]


def _finals(hn):
    return hn if isinstance(hn, tuple) else (hn,)


def _run(module, x, hx, form, lengths):
    """Output (as one tensor), finals, and the loss both modules minimise."""
    if form == "packed":
        x = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=module.batch_first,
                                                    enforce_sorted=False)
    y, hn = module(x, hx)
    out = y.data if form == "packed" else y
    w = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    loss = (out * w).sum() + sum((h * h).sum() for h in _finals(hn))
    return out, _finals(hn), loss


@pytest.mark.parametrize("cell,layers,bidir,batch_first,given,form,T,B,proj", CASES)
def test_matches_torch(cell, layers, bidir, batch_first, given, form, T, B, proj):
    m, ref = _pair(cell, layers, bidir, batch_first, proj_size=proj)
    D = 2 if bidir else 1
    g = torch.Generator().manual_seed(1)
    shape = (T, I) if form == "unbatched" else ((B, T, I) if batch_first else (T, B, I))
    x = torch.randn(shape, generator=g)
    lengths = torch.tensor(LENGTHS.get(B, [T] * B)) if form == "packed" else None
    hx = None
    if given:
        sizes = (proj or H, H)[:2 if cell == "lstm" else 1]          # h, c
        hx = tuple(torch.randn((layers * D, n) if form == "unbatched" else (layers * D, B, n),
                               generator=g, requires_grad=True) for n in sizes)
    results = []
    for module in (m, ref):
        xi = x.clone().requires_grad_()
        his = None if hx is None else tuple(h.detach().clone().requires_grad_() for h in hx)
        out, finals, loss = _run(module, xi, his if his is None or cell == "lstm" else his[0],
                                 form, lengths)
        loss.backward()
        grads = {"input": xi.grad} | {n: p.grad for n, p in module.named_parameters()}
        if his is not None:
            grads |= {f"hx{i}": h.grad for i, h in enumerate(his)}
        results.append((out, finals, grads))
    _assert_match(*results)


def _assert_match(got, want):
    """(output, finals, gradients by name) of halstm.torch and torch.nn."""
    (out, finals, grads), (want_out, want_finals, want_grads) = got, want
    assert_close("output", out.detach(), want_out.detach())
    for i, (a, b) in enumerate(zip(finals, want_finals)):
        assert_close(f"final state {i}", a.detach(), b.detach())
    assert grads.keys() == want_grads.keys()
    for k in want_grads:
        assert_close(f"d {k}", grads[k], want_grads[k])


@pytest.mark.parametrize("cell,layers,batch_first,given,finals_only",
                         [("lstm", 2, True, True, False), ("gru", 3, False, False, False),
                          ("lstm", 3, False, True, True)])
def test_a_stack_in_chunks_matches_torch(cell, layers, batch_first, given, finals_only,
                                         monkeypatch):
    """The wavefront's form of a stack (_Stack: the time loop in chunks,
    each a library call into the whole loop's arrays; on a GPU each layer
    on a stream of its own), here on the CPU: outputs, finals and every
    gradient as torch.nn's."""
    monkeypatch.setattr(hnn.modules._Recurrent, "_wavefront_chunks", lambda self, x, bs: 3)
    seen = record_wavefronts(monkeypatch)
    m, ref = _pair(cell, layers, False, batch_first)
    g = torch.Generator().manual_seed(1)
    T, B = 8, 3
    x = torch.randn((B, T, I) if batch_first else (T, B, I), generator=g)
    hx = tuple(torch.randn(layers, B, H, generator=g) for _ in m._states) if given else None
    results = []
    for module in (m, ref):
        xi = x.clone().requires_grad_()
        his = None if hx is None else tuple(h.clone().requires_grad_() for h in hx)
        y, hn = module(xi, his if his is None or cell == "lstm" else his[0])
        finals = _finals(hn)
        loss = sum((h * h).sum() for h in finals) if finals_only else weighted_loss(y, hn)
        loss.backward()
        grads = {"input": xi.grad} | {n: p.grad for n, p in module.named_parameters()}
        grads |= {f"hx{i}": h.grad for i, h in enumerate(his or ())}
        results.append((y, finals, grads))
    assert seen["forward"] == [3]
    _assert_match(*results)


def _in_chunks(monkeypatch, m, x, n: int, seed=None) -> list:
    """m's forward and backward (weighted_loss) over x in n chunks (1: the
    layers in turn): y, the finals, x's gradient, the parameters'; seed:
    torch's, set before the forward (its dropout masks)."""
    monkeypatch.setattr(hnn.modules._Recurrent, "_wavefront_chunks", lambda self, x, bs: n)
    m.zero_grad()
    if seed is not None:
        torch.manual_seed(seed)
    xi = x.clone().requires_grad_()
    y, hn = m(xi)
    weighted_loss(y, hn).backward()
    return ([y.detach(), *[a.detach() for a in _finals(hn)], xi.grad]
            + [p.grad for p in m.parameters()])


@pytest.mark.parametrize("cell,bias", [("layernorm_lstm", True), ("gru", False)])
def test_a_stack_in_chunks_matches_one_call(cell, bias, monkeypatch):
    """_Stack (chunks) against the layers in turn for a cell with vector
    parameters and for a stack without biases, on the CPU."""
    torch.manual_seed(0)
    m = hnn.Recurrent(cell, I, H, num_layers=2, bias=bias)
    x = torch.randn(8, 3, I)
    runs = [_in_chunks(monkeypatch, m, x, n) for n in (1, 3)]
    for k, (a, b) in enumerate(zip(*runs)):
        assert_close(f"result {k}", a, b, rtol=1e-5)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_a_stack_with_dropout_in_chunks_matches_one_call(cell, monkeypatch):
    """Dropout between layers in training: _Stack draws the masks the
    layers in turn draw (torch's generator, the same seed) and gives the
    same outputs and gradients; in eval mode none."""
    torch.manual_seed(0)
    m = getattr(hnn, cell.upper())(I, H, num_layers=3, dropout=0.5)
    x = torch.randn(8, 3, I)
    runs = [_in_chunks(monkeypatch, m.train(training), x, n, seed=7)
            for n, training in ((1, True), (3, True), (3, False))]
    for k, (a, b) in enumerate(zip(runs[1], runs[0])):
        assert_close(f"result {k}", a, b, rtol=1e-5)
    assert not torch.allclose(runs[2][0], runs[0][0], rtol=1e-3)     # (the masks acted)


@pytest.mark.parametrize("proj", [0, 5])
def test_state_dict_both_ways(proj):
    ref = torch.nn.LSTM(I, H, num_layers=2, bidirectional=True, proj_size=proj)
    m = hnn.LSTM(I, H, num_layers=2, bidirectional=True, proj_size=proj)
    assert list(m.state_dict()) == list(ref.state_dict())
    for k, v in m.state_dict().items():
        assert v.shape == ref.state_dict()[k].shape, k
    m.load_state_dict(ref.state_dict())
    back = torch.nn.LSTM(I, H, num_layers=2, bidirectional=True, proj_size=proj)
    back.load_state_dict(m.state_dict())
    for k, v in back.state_dict().items():
        assert torch.equal(v, ref.state_dict()[k]), k
    with pytest.raises(RuntimeError, match="weight_hh_l1_reverse"):
        hnn.LSTM(I, H, num_layers=2).load_state_dict(ref.state_dict())


def test_training_follows_torch():
    """50 Adam steps from the same weights on the same batches: the loss
    curves agree to 1e-3."""
    torch.manual_seed(3)
    start = torch.nn.LSTM(I, H, num_layers=2).state_dict()
    head_start = torch.nn.Linear(H, I).state_dict()
    data = torch.randn(4, 7, 3, I, generator=torch.Generator().manual_seed(4))

    def train(cls):
        rnn, head = cls(I, H, num_layers=2), torch.nn.Linear(H, I)
        rnn.load_state_dict(start)
        head.load_state_dict(head_start)
        opt = torch.optim.Adam(list(rnn.parameters()) + list(head.parameters()), lr=1e-2)
        losses = []
        for step in range(50):
            x = data[step % 4]
            y, _ = rnn(x)
            loss = torch.nn.functional.mse_loss(head(y[:-1]), x[1:])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return np.array(losses)
    mine, theirs = train(hnn.LSTM), train(torch.nn.LSTM)
    assert theirs[-1] < 0.8 * theirs[0]
    assert np.abs(mine - theirs).max() <= 1e-3 * np.abs(theirs).max()


@pytest.mark.parametrize("cell, hidden, proj, bidir", [
    ("lstm", H, 0, False), ("lstm", H, I, False), ("lstm", H, 0, True),
    ("layernorm_lstm", 4, 0, False)])     # (its row values: two saved channels at H = 4)
def test_compile_fullgraph_matches_eager(cell, hidden, proj, bidir):
    m = hnn.Recurrent(cell, I, hidden, num_layers=2, proj_size=proj, bidirectional=bidir)
    x = torch.randn(7, 3, I)
    hx = (torch.randn(2, 3, proj or hidden), torch.randn(2, 3, hidden)) if proj else None

    def step(model):
        y, (h, c) = model(x, hx)
        loss = (y * y).sum() + h.sum() + c.sum()
        loss.backward()
        return y.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}

    y, grads = step(m)
    m.zero_grad()
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    y2, grads2 = step(compiled)
    assert_close("compiled output", y2, y)
    for k in grads:
        assert_close(f"compiled d {k}", grads2[k], grads[k])


def test_torchscript_is_refused_by_name():
    model = torch.nn.Sequential(torch.nn.Linear(I, I), hnn.LSTM(I, H))
    with pytest.raises(TypeError, match="LSTM: halstm.torch layers .* TorchScript"):
        torch.jit.script(model)
    with pytest.raises(TypeError, match="GRUCell: halstm.torch layers"):
        torch.jit.script(hnn.GRUCell(I, H))


def test_export_runs_the_custom_operator_as_eager():
    """torch.export traces the layers to halstm::layer; the exported program
    gives eager's outputs on another input of the traced shape."""
    m = hnn.LSTM(I, H, num_layers=2, bidirectional=True).eval()
    program = torch.export.export(m, (torch.randn(7, 3, I),))
    assert "halstm.layer" in str(program.graph)
    x = torch.randn(7, 3, I)
    (y, (h, c)), (y_ref, (h_ref, c_ref)) = program.module()(x), m(x)
    for name, got, want in (("y", y, y_ref), ("h_n", h, h_ref), ("c_n", c, c_ref)):
        assert torch.equal(got, want), name


def test_compile_runs_a_packed_batch_eagerly():
    """A PackedSequence under torch.compile: a graph break, eager results
    (fullgraph=True refuses it)."""
    m = hnn.GRU(I, H, num_layers=2, bidirectional=True)
    x = torch.randn(7, 4, I)

    def step(model):
        packed = torch.nn.utils.rnn.pack_padded_sequence(x, LENGTHS[4], enforce_sorted=False)
        y, h = model(packed)
        (y.data.square().sum() + h.sum()).backward()
        return y.data.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}

    y, grads = step(m)
    m.zero_grad()
    y2, grads2 = step(torch.compile(m, backend="aot_eager"))
    assert torch.equal(y2, y)
    for k in grads:
        assert torch.equal(grads2[k], grads[k]), k
    torch._dynamo.reset()        # (else the compiled frames above are reused)
    with pytest.raises(Exception, match="PackedSequence eagerly"):
        torch.compile(m, fullgraph=True, backend="aot_eager")(
            torch.nn.utils.rnn.pack_padded_sequence(x, LENGTHS[4], enforce_sorted=False))


def test_deterministic():
    m = hnn.GRU(I, H, num_layers=2, bidirectional=True)
    x = torch.randn(7, 3, I)

    def once():
        m.zero_grad()
        xi = x.clone().requires_grad_()
        y, h = m(xi)
        (y.sum() + (h * h).sum()).backward()
        return [y, h, xi.grad] + [p.grad for p in m.parameters()]
    for a, b in zip(once(), once()):
        assert torch.equal(a, b)


@pytest.mark.filterwarnings("ignore:.*double precision")
@pytest.mark.parametrize("cell, form", [("lstm", "padded"), ("gru", "packed")])
def test_gradcheck(cell, form):
    """torch.autograd.gradcheck through the autograd function: the input,
    hx and every bias against central differences (fp32 kernels: eps 1e-3,
    tolerances to match; the weights are held to torch.nn's gradients by
    test_matches_torch)."""
    m = PEERS[cell][0](I, H, num_layers=2, bidirectional=True)
    names = [k for k, _ in m.named_parameters()]
    biases = [k for k in names if k.startswith("bias")]
    x = torch.randn(3, 2, I, requires_grad=True)
    hx = [torch.randn(4, 2, H, requires_grad=True) for _ in range(2 if cell == "lstm" else 1)]
    params = dict(m.named_parameters())

    def f(x, *rest):
        hs, bs = rest[:len(hx)], rest[len(hx):]
        inp = x
        if form == "packed":
            inp = torch.nn.utils.rnn.pack_padded_sequence(x, [2, 3], enforce_sorted=False)
        y, hn = torch.func.functional_call(m, params | dict(zip(biases, bs)),
                                           (inp, tuple(hs) if cell == "lstm" else hs[0]))
        return (y.data if form == "packed" else y,) + _finals(hn)
    inputs = (x, *hx, *(params[k].detach().clone().requires_grad_() for k in biases))
    assert torch.autograd.gradcheck(f, inputs, eps=1e-3, atol=1e-3, rtol=1e-2)


def _threads_chosen(monkeypatch, m, x) -> str:
    """hnn.kernels._threads after m(x) as the first CPU call of the process."""
    monkeypatch.setattr(hnn.kernels, "_threads", None)
    m(x)
    return hnn.kernels._threads


def test_cpu_kernels_run_on_torchs_openmp_team_where_it_spins(monkeypatch, request):
    """Where torch's OpenMP threads wait actively (no OMP_WAIT_POLICY=PASSIVE,
    two threads or more), the CPU kernels run on their team, with results
    bitwise those of their own threads and as many threads as torch's ops
    (unless HL_NUM_THREADS says); else (or HALSTM_TORCH_THREADS=own) on
    their own; a runtime that cannot be found warns once."""
    from halstm import openmp, runtime
    request.addfinalizer(functools.partial(runtime.share_openmp, runtime._openmp))
    monkeypatch.delenv("HALSTM_TORCH_THREADS", raising=False)
    request.addfinalizer(functools.partial(torch.set_num_threads, torch.get_num_threads()))
    torch.set_num_threads(4)
    m, x = hnn.LSTM(I, 41), torch.randn(80, 27, I)    # (a size of this test's own)
    monkeypatch.setenv("HL_NUM_THREADS", "3")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _threads_chosen(monkeypatch, m, x) == "own" and runtime._openmp is None
        own = m(x)[0]
        monkeypatch.delenv("OMP_WAIT_POLICY")
        assert _threads_chosen(monkeypatch, m, x) == "openmp"
        assert runtime._openmp == openmp.loaded()
        shared = m(x)[0]
        (lib, _), = [v for k, v in hnn.kernels._found.items()
                     if k[1] == "fwd" and k[2].type == "cpu" and k[0].startswith(f"lstm|{I}|41|")]
        assert lib.step_threads() == 3 and lib.steps_shared()
        assert torch.equal(own, shared)
        # the team is torch's whole pool (a smaller one would end its threads)
        torch.ones(1 << 20).exp()
        threads = len(os.listdir("/proc/self/task"))
        m(x)
        assert len(os.listdir("/proc/self/task")) == threads
        # without HL_NUM_THREADS the steps take torch's thread count
        monkeypatch.delenv("HL_NUM_THREADS")
        for n in (2, 3):
            torch.set_num_threads(n)
            m(x)
            assert lib.step_threads() == n and lib.steps_shared()
        torch.set_num_threads(4)
        monkeypatch.setenv("HL_NUM_THREADS", "3")
        monkeypatch.setenv("HALSTM_TORCH_THREADS", "own")
        runtime.share_openmp(None)
        assert _threads_chosen(monkeypatch, m, x) == "own" and runtime._openmp is None
    monkeypatch.setenv("HALSTM_TORCH_THREADS", "openmp")
    monkeypatch.setattr(openmp, "loaded", lambda prefer=(): None)
    with pytest.warns(hnn.PerformanceWarning, match="OMP_WAIT_POLICY=PASSIVE"):
        assert _threads_chosen(monkeypatch, m, x) == "own"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m(x)
    monkeypatch.setenv("HALSTM_TORCH_THREADS", "spin")
    with pytest.raises(ValueError, match="HALSTM_TORCH_THREADS: expected 'openmp' or 'own', "
                                         "got 'spin'"):
        _threads_chosen(monkeypatch, m, x)


def test_dropout_between_layers():
    m = hnn.LSTM(I, H, num_layers=2, dropout=0.5)
    ref = torch.nn.LSTM(I, H, num_layers=2, dropout=0.5)
    ref.load_state_dict(m.state_dict())
    x = torch.randn(7, 3, I)
    torch.manual_seed(5)
    a, _ = m(x)
    torch.manual_seed(5)
    b, _ = m(x)
    torch.manual_seed(6)
    c, _ = m(x)
    assert torch.equal(a, b) and not torch.equal(a, c)
    m.eval(), ref.eval()
    assert_close("eval output", m(x)[0].detach(), ref(x)[0].detach())


@pytest.mark.parametrize("cell, proj", [("layernorm_lstm", 0), ("peephole_lstm", I)])
def test_vector_cell_matches_numpy_module(cell, proj):
    """A cell with vector parameters through halstm.torch equals the numpy
    module (checked against the float64 reference in test_cells.py),
    forward and gradients; projected with a given hx, through each API's
    own projection code."""
    m = hnn.Recurrent(cell, I, H, proj_size=proj)
    ref = halstm.Recurrent(cell, I, H, proj_size=proj)
    with torch.no_grad():
        for p in m.parameters():
            p.uniform_(-0.5, 0.5)
    ref.load_state_dict({k: v.detach().numpy() for k, v in m.state_dict().items()})
    x = torch.randn(7, 3, I, requires_grad=True)
    hx = (torch.randn(1, 3, proj or H, requires_grad=True),
          torch.randn(1, 3, H, requires_grad=True)) if proj else None
    y, (h, c) = m(x, hx)
    (y.sum() + h.sum()).backward()
    want_y, (want_h, _) = ref(x.detach().numpy(),
                              None if hx is None else tuple(a.detach().numpy() for a in hx))
    dy = np.ones(want_y.shape, np.float32)
    want = ref.backward(dy, np.ones_like(want_h))
    assert_close("output", y.detach(), want_y)
    assert_close("d input", x.grad, want["input"])
    for n, p in m.named_parameters():
        assert_close(f"d {n}", p.grad, want[n])
    if hx is not None:
        assert_close("d h0", hx[0].grad, want["h0"])
        assert_close("d c0", hx[1].grad, want["c0"])


def test_a_cell_of_four_states_matches_the_numpy_module():
    """slstm (states h, c, n, m) through halstm.torch, two layers, every
    initial state given: outputs, final states and every gradient equal
    the numpy module's (checked against the float64 reference in
    test_cells.py)."""
    m = hnn.Recurrent("slstm", I, H, num_layers=2)
    ref = halstm.Recurrent("slstm", I, H, num_layers=2)
    ref.load_state_dict({k: v.detach().numpy() for k, v in m.state_dict().items()})
    x = torch.randn(6, 3, I, requires_grad=True)
    hx = tuple((torch.randn(2, 3, H).abs() + 0.5 if s == "n" else torch.randn(2, 3, H))
               .requires_grad_(True) for s in "hcnm")
    y, finals = m(x, hx)
    assert len(finals) == 4
    (y.sum() + sum((k + 2) * f.sum() for k, f in enumerate(finals))).backward()
    want_y, want_finals = ref(x.detach().numpy(), tuple(a.detach().numpy() for a in hx))
    want = ref.backward(np.ones(want_y.shape, np.float32),
                        *[np.full(f.shape, k + 2, np.float32) for k, f in enumerate(want_finals)])
    assert_close("output", y.detach(), want_y)
    for s, got, w in zip("hcnm", finals, want_finals):
        assert_close(f"{s}_n", got.detach(), w)
    assert_close("d input", x.grad, want["input"])
    for s, a in zip("hcnm", hx):
        assert_close(f"d {s}0", a.grad, want[f"{s}0"])
    for n, p in m.named_parameters():
        assert_close(f"d {n}", p.grad, want[n])


def test_compile_fullgraph_of_a_cell_of_four_states_matches_eager():
    """torch.compile(fullgraph=True) through halstm's custom operator with
    four states (slstm): outputs and gradients as eager."""
    m = hnn.Recurrent("slstm", I, H, num_layers=2)
    x = torch.randn(6, 3, I)

    def step(model):
        y, finals = model(x)
        (y.sum() + sum((f * f).sum() for f in finals)).backward()
        return y.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}

    y, grads = step(m)
    m.zero_grad()
    y2, grads2 = step(torch.compile(m, fullgraph=True, backend="aot_eager"))
    assert_close("compiled output", y2, y)
    for n, g in grads.items():
        assert_close(f"compiled d {n}", grads2[n], g)


def test_projected_layernorm_lstm_matches_its_steps():
    """A layer-norm LSTM with a projection (no peer ships one) against its
    steps composed in torch: the cell's step on tensors, h = W_hr m, one
    step at a time, autograd through both; hx given, two layers."""
    from halstm import cells
    from halstm.reference import torch_ops
    step = cells.definition("layernorm_lstm").step_function(torch_ops(torch))
    m = hnn.Recurrent("layernorm_lstm", I, H, num_layers=2, proj_size=I)
    with torch.no_grad():
        for p in m.parameters():
            p.uniform_(-0.5, 0.5)
    x = torch.randn(7, 3, I)
    hx = (torch.randn(2, 3, I), torch.randn(2, 3, H))

    def by_steps():
        inp, hs, cs = x, [], []
        for k in range(2):
            w = {n[:-3]: p for n, p in m.named_parameters() if n.endswith(f"_l{k}")}
            vec = {v: w[v] for v in ("bias", "ln_ih_weight", "ln_hh_weight", "ln_c_weight",
                                     "ln_c_bias")}
            h, c, ys = hx[0][k], hx[1][k], []
            for t in range(len(inp)):
                m_t, c = step(inp[t] @ w["weight_ih"].T, h @ w["weight_hh"].T, [h, c], vec)
                h = m_t @ w["weight_hr"].T
                ys.append(h)
            inp = torch.stack(ys)
            hs.append(h)
            cs.append(c)
        return inp, torch.stack(hs), torch.stack(cs)
    def mine():
        y, (h, c) = m(x, hx)
        return y, h, c
    results = []
    for run in (mine, by_steps):
        m.zero_grad()
        y, h, c = run()
        (y.sum() + (h * h).sum() + c.sum()).backward()
        results.append([y.detach(), h.detach(), c.detach()] + [p.grad.clone()
                                                               for p in m.parameters()])
    for k, (a, b) in enumerate(zip(*results)):
        assert_close(f"result {k}", a, b)


def test_module_conveniences():
    m = hnn.GRU(I, H, num_layers=2)
    m.flatten_parameters()
    x = torch.randn(5, 2, I)
    y, h = m(x)
    c = copy.deepcopy(m)
    assert_close("deepcopy output", c(x)[0].detach(), y.detach())
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    n = hnn.GRU(I, H, num_layers=2)
    n.load_state_dict(torch.load(buf))
    assert torch.equal(n(x)[0], y)
    with torch.no_grad():
        y2, _ = m(x)
    assert torch.equal(y2, y.detach())
    assert "num_layers=2" in repr(m)


def test_a_parametrized_weight_matches_torch():
    """weight_norm (torch.nn.utils.parametrizations) on a recurrent weight:
    the module reads the weight its parametrization makes (a property, not
    a parameter), and gradients reach the parametrization's own tensors,
    as with torch.nn.LSTM."""
    from torch.nn.utils import parametrizations
    torch.manual_seed(0)
    ref = torch.nn.LSTM(I, H, 2)
    m = hnn.LSTM(I, H, 2)
    m.load_state_dict(ref.state_dict())
    for mod in (ref, m):
        parametrizations.weight_norm(mod, "weight_hh_l0")
    x = torch.randn(4, 3, I)
    (y, (h, _)), (want_y, (want_h, _)) = m(x), ref(x)
    assert_close("y", y.detach(), want_y.detach())
    (y.sum() + h.sum()).backward()
    (want_y.sum() + want_h.sum()).backward()
    for k in ("original0", "original1"):
        assert_close(k, getattr(m.parametrizations.weight_hh_l0, k).grad,
                     getattr(ref.parametrizations.weight_hh_l0, k).grad)


def test_errors_name_the_argument():
    m = hnn.LSTM(I, H)
    with pytest.raises(TypeError, match="input: .*float32, got torch.float64"):
        m(torch.randn(4, 2, I, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"input: expected input_size 13 .* got shape "
                                         r"\(2, 4, 14\) \(batch first\)"):
        hnn.LSTM(I, H, batch_first=True)(torch.randn(2, 4, I + 1))
    with pytest.raises(ValueError, match=r"at least one time step, got shape \(0, 2, 13\)"):
        m(torch.randn(0, 2, I))
    packed = torch.nn.utils.rnn.pack_padded_sequence(torch.randn(4, 2, I + 1), [4, 2])
    with pytest.raises(ValueError, match=r"PackedSequence data \(rows, input_size 13\), got "
                                         r"shape \(6, 14\)"):
        m(packed)
    with pytest.raises(ValueError, match=r"hx: expected h_0 of shape \(1, 2, 37\)"):
        m(torch.randn(4, 2, I), (torch.zeros(1, 3, H), torch.zeros(1, 3, H)))
    with pytest.raises(TypeError, match="hx: expected None or a tuple of 2"):
        m(torch.randn(4, 2, I), torch.zeros(1, 2, H))
    with pytest.raises(ValueError, match=r"proj_size: expected an int in \[0, hidden_size=37\)"):
        hnn.LSTM(I, H, proj_size=H)
    with pytest.raises(ValueError, match="proj_size: cell 'gru' reads h in its step"):
        hnn.Recurrent("gru", I, H, proj_size=5)
    with pytest.raises(ValueError, match="dropout"):
        hnn.LSTM(I, H, dropout=2)
    with pytest.raises(TypeError, match="parameter weight_ih_l0: .*float64"):
        hnn.LSTM(I, H).double()(torch.randn(4, 2, I))
    cell, x = hnn.LSTMCell(I, H), torch.randn(2, I)
    with pytest.raises(ValueError, match=r"hx: expected c of shape \(2, 37\), got \(37,\)"):
        cell(x, (torch.zeros(2, H), torch.zeros(H)))
    with pytest.raises(ValueError, match="hx: h is torch.float64 on cpu; expected float32"):
        cell(x, (torch.zeros(2, H, dtype=torch.float64), torch.zeros(2, H)))


@pytest.mark.parametrize("bidirectional", [False, True])
def test_double_backward_is_refused_by_name(bidirectional):
    """A gradient of a gradient (a penalty on dL/dx, say) raises torch's
    once-differentiable error at the second backward, not a vague one."""
    m = hnn.LSTM(I, H, bidirectional=bidirectional)
    x = torch.randn(4, 2, I, requires_grad=True)
    (dx,) = torch.autograd.grad(m(x)[0].square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        dx.sum().backward()


def _functional_loss(module):
    """loss(params, x): a sum over module's outputs and finals, by
    torch.func.functional_call (x a tensor or a PackedSequence)."""
    def loss(params, x):
        return weighted_loss(*torch.func.functional_call(module, params, (x,)))
    return loss


@pytest.mark.parametrize("cell, kw, packed", [("lstm", dict(num_layers=2, bidirectional=True),
                                               False),
                                              ("gru", dict(num_layers=2), True),
                                              ("layernorm_lstm", {}, False)])
def test_torch_func_grad_matches_torch_nn(cell, kw, packed):
    """torch.func.grad through halstm.torch layers (reverse mode) gives the
    gradients torch.nn's autograd gives its own layers (layer-norm LSTM:
    halstm's eager autograd)."""
    torch.manual_seed(0)
    m = hnn.Recurrent(cell, I, H, **kw) if cell == "layernorm_lstm" else PEERS[cell][0](I, H, **kw)
    ref = copy.deepcopy(m) if cell == "layernorm_lstm" else PEERS[cell][1](I, H, **kw)
    ref.load_state_dict(m.state_dict())
    x = torch.randn(7, 5, I)
    if packed:
        x = torch.nn.utils.rnn.pack_padded_sequence(x, torch.tensor([7, 2, 5, 1, 7]),
                                                    enforce_sorted=False)
    params = {k: v.detach() for k, v in m.named_parameters()}
    got = torch.func.grad(_functional_loss(m))(params, x)
    want = torch.autograd.grad(_functional_loss(ref)(dict(ref.named_parameters()), x),
                               list(ref.parameters()))
    assert sorted(got) == sorted(k for k, _ in ref.named_parameters())
    for (k, _), w in zip(ref.named_parameters(), want):
        assert_close(f"d {k}", got[k], w)


def test_torch_func_vmap_and_per_sample_gradients(monkeypatch):
    """vmap over inputs (the slices' rows as one batch: a kernel call a
    layer) and over stacked weights (an ensemble), and vmap(grad)
    (per-sample gradients), each as the same calls one by one."""
    torch.manual_seed(0)
    m = hnn.LSTM(I, H, num_layers=2)
    params = {k: v.detach() for k, v in m.named_parameters()}
    xs = torch.randn(3, 6, 2, I)
    calls = []
    forward = halstm.runtime.Library.forward
    monkeypatch.setattr(halstm.runtime.Library, "forward",
                        lambda *a, **k: calls.append(1) or forward(*a, **k))
    with torch.no_grad():
        ys = torch.func.vmap(lambda x: m(x)[0])(xs)
        assert len(calls) == 2
        for i in range(3):
            assert_close(f"y {i}", ys[i], m(xs[i])[0], rtol=1e-6)
    loss = _functional_loss(m)
    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, xs)
    for i in range(3):
        one = torch.func.grad(loss)(params, xs[i])
        for k in params:
            assert_close(f"d {k} of sample {i}", per_sample[k][i], one[k], rtol=1e-6)
    models = [hnn.LSTM(I, H) for _ in range(3)]
    stacked, _ = torch.func.stack_module_state(models)
    with torch.no_grad():
        ys = torch.func.vmap(lambda p: torch.func.functional_call(models[0], p, (xs[0],))[0])(
            stacked)
        for i, model in enumerate(models):
            assert_close(f"ensemble y {i}", ys[i], model(xs[0])[0], rtol=1e-6)


def test_torch_func_refuses_forward_mode_and_second_order():
    m = hnn.GRU(I, H)
    x = torch.randn(4, 2, I)
    with pytest.raises(NotImplementedError, match="jvp"):
        torch.func.jvp(lambda a: m(a)[0], (x,), (torch.ones_like(x),))
    with pytest.raises(RuntimeError, match="first-order transforms only"):
        torch.func.grad(lambda a: torch.func.grad(lambda b: m(b)[0].square().sum())(a).sum())(x)


@pytest.mark.parametrize("cell, kw", [("lstm", dict(num_layers=2, bidirectional=True,
                                                     proj_size=5)), ("gru", {})])
def test_an_empty_batch_gives_empty_outputs(cell, kw):
    """A batch of no rows, as torch.nn takes it: outputs and final states of
    torch.nn's shapes, hx checked, backward gives zero gradients."""
    mine, theirs, _ = PEERS[cell]
    m, ref = mine(I, H, batch_first=True, **kw), theirs(I, H, batch_first=True, **kw)
    x = torch.randn(0, 4, I)
    (y, finals), (y_ref, finals_ref) = m(x), ref(x)
    finals, finals_ref = ((f,) if isinstance(f, torch.Tensor) else f
                          for f in (finals, finals_ref))
    assert y.shape == y_ref.shape
    assert [f.shape for f in finals] == [f.shape for f in finals_ref]
    y.sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in m.parameters())
    with pytest.raises(ValueError, match="hx: expected h_0 of shape"):
        m(x, torch.zeros(1, 1, H) if cell == "gru" else (torch.zeros(1, 0, H),) * 2)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_without_biases_matches_torch(cell):
    """bias=False (the layers' matrix biases are zeros the module makes),
    two layers, bidirectional: outputs and every gradient as torch.nn's."""
    mine, theirs, _ = PEERS[cell]
    torch.manual_seed(0)
    ref = theirs(I, H, num_layers=2, bidirectional=True, bias=False)
    m = mine(I, H, num_layers=2, bidirectional=True, bias=False)
    m.load_state_dict(ref.state_dict())
    assert not any("bias" in k for k in m.state_dict())
    x = torch.randn(4, 3, I)
    for k, (a, b) in enumerate(zip(_squares_and_grads(m, x), _squares_and_grads(ref, x))):
        assert_close(f"result {k}", a, b)


@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn_tanh"])
def test_cells_match_torch(cell):
    mine, theirs = {"lstm": (hnn.LSTMCell, torch.nn.LSTMCell),
                    "gru": (hnn.GRUCell, torch.nn.GRUCell),
                    "rnn_tanh": (hnn.RNNCell, torch.nn.RNNCell)}[cell]
    ref, m = theirs(I, H), mine(I, H)
    m.load_state_dict(ref.state_dict())
    assert list(m.state_dict()) == list(ref.state_dict())
    x = torch.randn(3, I)
    h = torch.randn(3, H)
    hx = (h, torch.randn(3, H)) if cell == "lstm" else h
    results = []
    for module in (m, ref):
        xi = x.clone().requires_grad_()
        out = module(xi, hx)
        out = out if isinstance(out, tuple) else (out,)
        sum((o * o).sum() for o in out).backward()
        results.append([o.detach() for o in out] + [xi.grad] + [p.grad for p in module.parameters()])
        # a decoding loop: unbatched input, default state (zeros)
        u = module(x[0])
        u = u if isinstance(u, tuple) else (u,)
        assert u[0].shape == (H,)
        results[-1] += [a.detach() for a in u]
        # under no_grad, from states that are not contiguous (columns of a
        # transposed array), twice: the second call reuses the packed weights
        with torch.no_grad():
            t = [a.t().contiguous().t() for a in (hx if cell == "lstm" else (hx,))]
            assert not t[0].is_contiguous()
            for _ in range(2):
                n = module(x, tuple(t) if cell == "lstm" else t[0])
                results[-1] += list(n) if isinstance(n, tuple) else [n]
    for k, (a, b) in enumerate(zip(*results)):
        assert_close(f"result {k}", a, b)


def test_autocast_bf16_runs_the_bf16_kernels_where_the_cpu_has_them():
    """Inside torch.autocast(dtype=torch.bfloat16) a float32 module computes
    as precision="bf16" where the CPU has it (else float32, without a
    warning), forward and backward, bitwise; float16 autocast computes in
    float32; a bfloat16 input is taken; outputs and gradients are float32;
    torch.compile(fullgraph=True) under autocast as eagerly."""
    m, ref = _pair("lstm", 2, False, False)
    m16 = hnn.LSTM(I, H, num_layers=2, precision="bf16")
    m16.load_state_dict(ref.state_dict())
    x = torch.randn(5, 2, I, generator=torch.Generator().manual_seed(4))
    runs = {}
    for name, module, dtype in (("bf16", m16, None), ("fp32", m, None),
                                ("autocast bf16", m, torch.bfloat16),
                                ("autocast fp16", m, torch.float16)):
        module.zero_grad(set_to_none=True)
        with warnings.catch_warnings(record=True) as caught, \
                torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=bool(dtype)):
            warnings.simplefilter("always")
            runs[name] = _squares_and_grads(module, x)
            y, _ = module(x.to(dtype) if dtype else x)
        # (precision="bf16" asked for on a host without it warns that it
        # runs in float32: test_bf16_on_cpu_tensors_runs_where_the_cpu_has_it)
        expected = "neither AMX nor AVX512-BF16" if name == "bf16" and not host_has_bf16() else None
        assert not [w for w in caught if "precision" in str(w.message)
                    and not (expected and expected in str(w.message))], name
        assert {a.dtype for a in runs[name]} == {torch.float32} and y.dtype == torch.float32
    for name, want in (("autocast bf16", "bf16" if host_has_bf16() else "fp32"),
                       ("autocast fp16", "fp32")):
        for k, (a, b) in enumerate(zip(runs[name], runs[want])):
            assert torch.equal(a, b), (name, want, k)
    assert not torch.equal(runs["bf16"][0], runs["fp32"][0]) or not host_has_bf16()
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(compiled(x)[0], runs["autocast bf16"][0])


def test_bf16_on_cpu_tensors_runs_where_the_cpu_has_it():
    """precision="bf16" on CPU tensors: bf16 products where the host has
    AMX or AVX512-BF16 (results within bf16's accuracy of torch.nn's, and
    not float32's), else float32 with a warning; a cell that reduces over
    its units computes in float32 and warns."""
    m, ref = _pair("lstm", 2, False, False)
    m16 = hnn.LSTM(I, H, num_layers=2, precision="bf16")
    m16.load_state_dict(ref.state_dict())
    x = torch.randn(6, 19, I, generator=torch.Generator().manual_seed(3))
    for k, (a, b) in enumerate(zip(_squares_and_grads(m, x), _squares_and_grads(m16, x))):
        err = float((a - b).abs().max() / b.abs().max())
        assert (1e-4 < err < 3e-2) if host_has_bf16() else err < 1e-6, (k, err)
    # (sizes of this test's own: a library is loaded, and warns, once a process)
    if host_has_bf16():
        with pytest.warns(UserWarning, match="reduces over its units"):
            hnn.Recurrent("layernorm_lstm", I, H + 3, precision="bf16")(x)
    else:
        with pytest.warns(UserWarning, match="neither AMX nor AVX512-BF16"):
            hnn.LSTM(I, H + 3, precision="bf16")(x)


@pytest.mark.parametrize("cell, layers, bidir, form, output", [
    ("lstm", 1, False, "padded", "y"), ("lstm", 2, True, "packed", "c_n"),
    ("gru", 2, False, "padded", "h_n"), ("lstm", 1, False, "packed", "h_n")])
def test_gradients_of_one_output_alone(cell, layers, bidir, form, output):
    """A loss of y alone, or of one final state alone (changed in place
    first, as torch.nn's may be): every gradient as torch.nn's."""
    m, ref = _pair(cell, layers, bidir, False)
    x = torch.randn(7, 5, I, generator=torch.Generator().manual_seed(2))
    results = []
    for module in (m, ref):
        xi = x.clone().requires_grad_()
        inp = xi if form == "padded" else torch.nn.utils.rnn.pack_padded_sequence(
            xi, LENGTHS[5], enforce_sorted=False)
        y, hn = module(inp)
        y = y.data if form == "packed" else y
        if output == "y":
            loss = (y * y).sum()
        else:
            final = _finals(hn)[0 if output == "h_n" else 1]
            final.mul_(2)
            loss = (final * final).sum()
        loss.backward()
        results.append([y.detach(), xi.grad] + [p.grad for p in module.parameters()])
    for k, (a, b) in enumerate(zip(*results)):
        assert_close(f"result {k}", a, b)


def test_bidirectional_directions_run_at_once(monkeypatch, own_threads):
    """A CPU layer's two directions in one Function: where its steps want
    half the cores or fewer (H=37, B=5; four threads asked for), calls
    after the first run them at once on two library instances (lanes 0
    and 1), forward and backward, with results bitwise those of the first
    call (directions in turn) and as torch.nn's (packed, 2 layers)."""
    monkeypatch.setenv("HALSTM_TORCH_THREADS", "own")   # (on torch's team: in turn)
    monkeypatch.setattr(hnn.kernels, "_threads", None)
    monkeypatch.setenv("HL_NUM_THREADS", "4")
    m, ref = _pair("lstm", 2, True, False, seed=3)
    x = torch.randn(7, 5, I, generator=torch.Generator().manual_seed(4))
    runs = []
    for module in (m, m, ref):
        xi = x.clone().requires_grad_()
        out, finals, loss = _run(module, xi, None, "packed", torch.tensor(LENGTHS[5]))
        loss.backward()
        runs.append([out.detach(), *[f.detach() for f in finals], xi.grad]
                    + [p.grad.clone() for p in module.parameters()])
        module.zero_grad()
    lanes = {spec.rsplit("|", 1)[1] for spec, _, target in hnn.kernels._libs
             if spec.startswith(f"lstm|{2 * H}|") and target == "host"}
    assert lanes == {"0", "1"}, lanes
    for k, (a, b, want) in enumerate(zip(*runs)):
        assert torch.equal(a, b), k
        assert_close(f"result {k}", a, want)


def test_weights_changed_in_place_are_packed_again():
    """The kernels reuse packed weights while their tensors are unchanged
    (halstm.torch's pack keys): changes in place (an optimizer's step,
    load_state_dict, copy_ under no_grad) are seen by the next forward and
    backward, as torch.nn's are."""
    torch.manual_seed(5)
    ref, m = torch.nn.LSTMCell(I, H), hnn.LSTMCell(I, H)
    m.load_state_dict(ref.state_dict())
    x, hx = torch.randn(3, I), (torch.randn(3, H), torch.randn(3, H))
    opts = [torch.optim.SGD(module.parameters(), lr=0.5) for module in (m, ref)]

    def step(module, opt):
        opt.zero_grad()
        h, c = module(x, hx)
        ((h * h).sum() + c.sum()).backward()
        grads = [p.grad.clone() for p in module.parameters()]
        opt.step()
        return [h.detach(), c.detach()] + grads

    for r in range(3):
        for k, (a, b) in enumerate(zip(step(m, opts[0]), step(ref, opts[1]))):
            assert_close(f"round {r} result {k}", a, b)
    other = torch.nn.LSTMCell(I, H)
    m.load_state_dict(other.state_dict())
    with torch.no_grad():
        m.weight_hh.mul_(1.5)
        other.weight_hh.mul_(1.5)
    assert_close("after load_state_dict and mul_", m(x, hx)[0].detach(), other(x, hx)[0].detach())


@pytest.mark.parametrize("cell", ["slstm", "layernorm_lstm"])
def test_a_recurrent_cell_stepped_matches_the_layer(cell):
    """RecurrentCell (any cell, vector parameters included) stepped over a
    sequence from Python: the layer's outputs, final states and every
    gradient (autograd through the steps), given initial states; its
    parameters start as the layer's do."""
    step = hnn.RecurrentCell(cell, I, H)
    layer = hnn.Recurrent(cell, I, H)
    layer.load_state_dict({f"{k}_l0": v for k, v in step.state_dict().items()})
    fresh = hnn.RecurrentCell(cell, I, H)
    fresh.reset_parameters()
    for k, v in layer.state_dict().items():     # vectors: their declared values
        if not k.startswith(("weight", "bias_ih", "bias_hh")):
            assert torch.equal(getattr(fresh, k[:-3]), v), k
    x = torch.randn(5, 3, I)
    hx = tuple((torch.randn(3, H).abs() + 0.5 if s == "n" else torch.randn(3, H))
               for s in layer._states)
    y, finals = layer(x, tuple(a.unsqueeze(0) for a in hx))
    (y.sum() + sum(f.sum() for f in finals)).backward()
    s, ys = hx, []
    for t in range(5):
        s = step(x[t], s)
        ys.append(s[0])
    (torch.stack(ys).sum() + sum(a.sum() for a in s)).backward()
    assert_close("output", torch.stack(ys).detach(), y.detach())
    for name, got, want in zip(layer._states, s, finals):
        assert_close(f"{name}_n", got.detach(), want[0].detach())
    for n, p in step.named_parameters():
        assert_close(f"d {n}", p.grad, getattr(layer, f"{n}_l0").grad)


def test_a_vector_named_with_l_starts_at_its_declared_value():
    """A vector parameter whose name holds "_l" (w_lo_l0) starts at its
    declared init, in Recurrent (both directions, two layers) and in
    RecurrentCell, not uniform as a matrix."""
    from halstm.cells import define, tanh, vector
    d = define("w_lo_cell", "a", "h", lambda x, r, s, p: {"h": tanh(x.a + r.a) * p.w_lo},
               vectors=[vector("w_lo", init=1.0)])
    m = hnn.Recurrent(d, I, H, num_layers=2, bidirectional=True)
    for name in ("w_lo_l0", "w_lo_l1", "w_lo_l1_reverse"):
        assert torch.equal(getattr(m, name), torch.ones(H)), name
    c = hnn.RecurrentCell(d, I, H)
    c.reset_parameters()
    assert torch.equal(c.w_lo, torch.ones(H))
