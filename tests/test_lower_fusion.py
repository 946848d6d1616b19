# Fusion planner (tn.lower.fusion) and tile engine (tn.lower.tile): groups with tile aliases (widening casts, size-1 reshapes)
# tile like any elementwise group, and long elementwise chains compile in one build.
import re

import pytest
import torch

import tn
import tn.lower  # noqa: F401  (registers the lowerings and the neuron backend)
import tn.lower.compiler
import tn.passes
import tn.reference


def _ir(fn, *args):
    """The optimised IR of ``fn(*args)``."""
    return tn.passes.optimize(tn.make_ir(fn)(*args))


@pytest.fixture
def builds(monkeypatch):
    """Counts ``NeuronExecutable._build`` calls (each failed fused group makes the compiler rebuild)."""
    count = {"n": 0}
    orig = tn.lower.compiler.NeuronExecutable._build

    def counted(self, host):
        """The original build, counted."""
        count["n"] += 1
        return orig(self, host)

    monkeypatch.setattr(tn.lower.compiler.NeuronExecutable, "_build", counted)
    return count


def _max_partitions(exe):
    """Most partitions any SBUF operand of the executable's programs spans."""
    best = 0
    for st in exe._steps:
        enc = getattr(st, "enc", None)
        if enc is None:
            continue
        for a, b in re.findall(r"p(\d+)\.\.(\d+)", enc.listing()):
            best = max(best, int(b) - int(a) + 1)
    return best


def _cast_chain(x):
    """bf16 in, fp32 math (a widening cast inside the group), bf16 out."""
    y = x.float()
    return (torch.exp(y * 0.5) + y).to(torch.bfloat16)


@pytest.mark.parametrize("shape", [(4096,), (128, 512), (3, 100, 70)])
def test_group_with_widening_cast_is_fused_and_tiled_over_partitions(shape, builds):
    # a widening cast is a tile alias inside a group; the group stays a plain map group (tiled over the
    # partitions, any size) instead of one whole row on one partition (which failed beyond 8192 elements)
    x = torch.randn(shape).bfloat16()
    ir = _ir(_cast_chain, x)
    assert any(e.op.name == "convert" for e in ir.eqns)
    exe = tn.lower.compile_ir(ir, strict=True)
    assert builds["n"] == 1
    assert exe.stats["fused_eqns"] == len(ir.eqns)
    assert exe.stats["programs"] == 1
    assert _max_partitions(exe) >= 32
    got = exe([x])[0]
    want = tn.reference.run_ir(ir, [x])[0]
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


def test_long_bf16_special_function_chain_one_build(builds):
    # torch.special.zeta on bf16 decomposes into ~350 elementwise equations: one fused group, one build
    # (it used to be rebuilt once per equation, every attempt failing the same way)
    x = (torch.rand(64, 256) * 4 + 1.5).bfloat16()
    q = (torch.rand(64, 256) * 3 + 0.5).bfloat16()
    ir = _ir(torch.special.zeta, x, q)
    assert len(ir.eqns) > 200
    exe = tn.lower.compile_ir(ir, strict=True)
    assert builds["n"] == 1
    assert exe.stats["fused_eqns"] == len(ir.eqns)
    got = exe([x, q])[0].float()
    want = torch.special.zeta(x.float(), q.float())
    torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-2)


def _chain_softmax(x):
    """A long elementwise chain into a softmax over long rows."""
    for _ in range(40):
        x = torch.sin(x) * 1.01 + 0.1
    return torch.softmax(x, -1)


@pytest.mark.parametrize("shape", [(8, 4096), (2, 20000), (4, 70000)])
def test_row_group_too_long_for_sbuf_is_split_at_plan_time(shape, builds):
    # with the whole chain, the softmax rows do not fit the row group's SBUF budget: the planner splits the
    # chain off (a map group) instead of proposing a group that fails (one rebuild per leading equation);
    # rows longer than any budget (70000) leave the reductions on their own
    x = torch.randn(shape)
    ir = _ir(_chain_softmax, x)
    exe = tn.lower.compile_ir(ir, strict=True)
    assert builds["n"] == 1
    assert exe.stats["fused_eqns"] >= len(ir.eqns) - 3
    got = exe([x])[0]
    torch.testing.assert_close(got, _chain_softmax(x), rtol=1e-4, atol=1e-6)


def test_row_group_that_fits_is_planned_whole():
    # a softmax after a short chain stays one row group (the split only applies when rows do not fit)
    from tn.lower import fusion

    x = torch.randn(16, 2048)
    ir = _ir(lambda t: torch.softmax(torch.tanh(t) * 2 + t.sigmoid(), -1), x)
    groups = fusion.plan(ir, {})
    assert len(groups) == 1
    (g,) = groups.values()
    assert isinstance(g, fusion.Group) and g.r == 1 and len(g.eqns) == len(ir.eqns)
