# Tests of fused Linear chains (tn/lower/chain.py): planning, feature-major lowering against torch (odd shapes, fp32/bf16, both weight variants).
import pytest
import torch

pytest.importorskip("tn.lower.chain")
import tn  # noqa: E402
import tn.lower  # noqa: E402,F401
import tn.passes  # noqa: E402
from tn.lower import chain, layout  # noqa: E402
from tn.lower.compiler import compile_ir  # noqa: E402

TOL = {torch.float32: dict(rtol=2e-4, atol=2e-4), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


class MLP(torch.nn.Module):
    def __init__(self, sizes, act="gelu", bias=True, residual=False):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b, bias=bias) for a, b in zip(sizes, sizes[1:]))
        self.act = act
        self.residual = residual

    def forward(self, x):
        h = x
        for i, lin in enumerate(self.layers):
            h = lin(h)
            if i + 1 < len(self.layers):
                h = torch.nn.functional.gelu(h) if self.act == "gelu" else torch.relu(h * 0.5 + 1.0)
        return h + x if self.residual else h


def _compile(m, x):
    ir = tn.passes.optimize(tn.make_ir(lambda m, x: m(x))(m, x))
    return ir, compile_ir(ir, strict=True)


def _flat(m, x):
    return [p for p in m.parameters()] + [x]


def _run(m, x, calls=2):
    """The compiled result of ``calls`` calls (the first plain or laid out, later ones steady), each checked."""
    ir, exe = _compile(m, x)
    with torch.no_grad():
        want = m(x)
    for _ in range(calls):
        (got,) = exe(_flat(m, x))
        torch.testing.assert_close(got, want, **TOL[x.dtype])
    return ir, exe


def test_plan_finds_the_mlp_chain():
    m = MLP([512, 2048, 2048, 512])
    x = torch.randn(64, 512)
    ir = tn.passes.optimize(tn.make_ir(lambda m, x: m(x))(m, x))
    chains = chain.plan(ir, {})
    assert len(chains) == 1
    (c,) = chains.values()
    assert [(L.K, L.N) for L in c.layers] == [(512, 2048), (2048, 2048), (2048, 512)]
    assert len(c.eqns) == len(ir.eqns)


def test_plan_stops_at_escaping_intermediates():
    lin1, lin2 = torch.nn.Linear(64, 96), torch.nn.Linear(96, 32)

    def f(x):
        h = torch.relu(lin1(x))
        return lin2(h), h           # h escapes: the chain must end at the first layer

    x = torch.randn(16, 64)
    ir = tn.passes.optimize(tn.make_ir(f)(x))
    for c in chain.plan(ir, {}).values():
        assert len(c.layers) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("sizes,m", [
    ((512, 2048, 2048, 512), 64),      # the benchmark MLP
    ((131, 257, 67), 37),              # nothing a multiple of 128
    ((300, 129, 200), 1),              # a single token
    ((64, 640, 96), 130),              # two token tiles, last layer token-major
    ((200, 300, 250), 600),            # more than 512 tokens: moving operand in chunks
    ((1000, 130, 1000), 100),          # last layer wide (several weight groups)
])
def test_mlp_matches_torch(sizes, m, dtype):
    torch.manual_seed(0)
    mod = MLP(sizes).to(dtype).eval()
    x = torch.randn(m, sizes[0]).to(dtype)
    layout.clear()
    ir, exe = _run(mod, x)
    assert any(isinstance(g, chain.LinearChain) for g in chain.plan(ir, {}).values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_chain_epilogues_relu_affine_no_bias_and_residual(dtype):
    torch.manual_seed(1)
    mod = MLP([96, 160, 96], act="relu", bias=False, residual=True).to(dtype).eval()
    x = torch.randn(50, 96).to(dtype)
    _run(mod, x)


def test_chain_plain_weights_variant():
    """Weights that change every call: the chain transposes them on chip (the plain variant), still right."""
    torch.manual_seed(2)
    mod = MLP([200, 384, 130]).eval()
    x = torch.randn(40, 200)
    ir, exe = _compile(mod, x)
    for step in range(3):
        with torch.no_grad():
            for p in mod.parameters():
                p.add_(0.01 * step)
            want = mod(x)
        with tn.profile() as prof:
            (got,) = exe(_flat(mod, x))
        torch.testing.assert_close(got, want, **TOL[torch.float32])
        if step:
            assert not any(r.name.startswith("tn_layout") for r in prof.runs)


def test_chain_keeps_intermediates_on_chip():
    torch.manual_seed(3)
    mod = MLP([256, 512, 256]).to(torch.bfloat16).eval()
    x = torch.randn(64, 256).to(torch.bfloat16)
    _, exe = _run(mod, x)
    prof = exe.last_profile
    weights = sum(p.numel() * 2 for p in mod.parameters())
    # read: weights (laid out, same bytes), biases, x; written: the result. Nothing else.
    assert prof.hbm_read_bytes == weights + x.numel() * 2
    assert prof.hbm_write_bytes == 64 * 256 * 2


def test_benchmark_mlp_tensore_utilisation():
    """MLP 512-2048-2048-512, 64 tokens, bf16: TensorE busy time is mostly matmul FLOPs at the bf16 peak."""
    torch.manual_seed(0)
    mod = MLP([512, 2048, 2048, 512]).to(torch.bfloat16).eval()
    x = torch.randn(64, 512).to(torch.bfloat16)
    f = tn.jit(mod, backend="neuron")
    with torch.no_grad():
        f(x)
        with tn.profile() as prof:
            f(x)
    runs = prof.runs
    flops = sum(r.matmul_flops for r in runs)
    busy = sum(r.busy_ns["TensorE"] for r in runs) * 1e-9
    assert flops / (runs[0].arch.peak_flops_bf16 * busy) >= 0.9
