# The compiler's schedule (tn.lower.schedule): what it prints for small known programs, that planning is
# deterministic, and that a unit failing to emit adds a veto and plans again.
import pytest
import torch
import torch.nn as nn

import tn
import tn.lower  # noqa: F401  (registers the lowerings)
from tn.lower import emit, fusion, schedule
from tn.lower.base import CannotLower
from tn.lower.compiler import NeuronExecutable


def _ir(module, *args):
    """The IR of ``module(*args)`` (as the doors hand it to the compiler)."""
    torch.manual_seed(0)
    return tn.make_ir(module.eval())(*args)


def _streams(exe):
    """Every program's encoded instruction records and HBM tensors, in order (names aside)."""
    out = []
    for st in exe._steps:
        enc = getattr(st, "enc", None)
        if enc is None:
            out.append(type(st).__name__)
            continue
        out.append((enc.records.tobytes(), [(t.shape, t.dtype, t.kind) for t in enc.hbm]))
    return out


def _units(sched):
    return [(u.start, u.stop, u.kind, u.label, u.program, [v.aval for v in u.keeps], [v.aval for v in u.takes])
            for u in sched.units]


def test_linear_gelu_prints_one_matmul_epilogue_unit():
    ir = _ir(nn.Sequential(nn.Linear(64, 128), nn.GELU()), torch.randn(8, 64))
    exe = tn.lower.compile_ir(ir)
    text = str(exe.schedule)
    assert text == (
        "schedule of Sequential: 4 equations in 1 unit, 1 program, 1 build\n"
        "  program 0: Sequential_0_matmul+gelu\n"
        "        1-3  epilogue   matmul+gelu   -> g       B = a^T; skips 0")
    assert repr(exe.schedule) == "<tn.lower.Schedule 1 units, 0 vetoes>"


def test_norm_linear_softmax_prints_units_handoffs_and_prologue():
    # LayerNorm -> Linear -> ReLU -> Softmax: a row group (the norm, its result left in SBUF), the matmul with
    # LayerNorm's gamma/beta as a prologue and ReLU as epilogue (result left in SBUF), a softmax row group
    ir = _ir(nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 64), nn.ReLU(), nn.Softmax(-1)), torch.randn(8, 64))
    exe = tn.lower.compile_ir(ir)
    lines = str(exe.schedule).splitlines()
    assert lines[0] == "schedule of Sequential: 20 equations in 3 units, 1 program, 1 build"
    assert lines[1] == "  program 0: Sequential_0_norm+matmul+relu+softmax"
    assert lines[2].split() == "0-8 row norm -> n loads prologue(n) vectors; keeps n in SBUF".split()
    assert lines[3].split() == ("12-14 epilogue matmul+relu -> t B = c^T; p = prologue(n); takes n from SBUF; "
                                "keeps t in SBUF; skips 9-11; frees n").split()
    assert lines[4].split() == "15-19 row softmax -> y takes t from SBUF; frees t".split()
    assert len(lines) == 5
    # the units cover every equation once (skipped equations are listed on the unit reading around them)
    covered = sorted(j for u in exe.schedule.units for j in list(u.eqns) + u.skipped)
    assert covered == list(range(len(ir.eqns)))


def test_unfused_schedule_is_one_unit_per_equation_with_frees():
    ir = _ir(nn.Sequential(nn.Linear(16, 16), nn.ReLU()), torch.randn(4, 16))
    exe = tn.lower.compile_ir(ir, fuse=False)
    sched = exe.schedule
    assert [(u.kind, u.label) for u in sched.units] == [("op", "permute"), ("op", "matmul"), ("op", "add"),
                                                         ("op", "relu")]
    names = ir.var_names()
    assert [[names[v] for v in u.frees] for u in sched.units] == [[], ["d"], ["e"], ["f"]]
    assert str(sched).splitlines()[1] == "  program 0: Sequential_0_matmul+add+relu"


def test_host_equations_and_their_program_breaks_are_units():
    # a float64 value cannot go to the chip: the equations around it form programs of their own
    def f(x):
        y = torch.exp(x) + 1
        z = y.double().sum().float()
        return torch.relu(z * y)

    ir = tn.make_ir(f)(torch.randn(4, 8))
    exe = tn.lower.compile_ir(ir)
    kinds = [(u.kind, u.program) for u in exe.schedule.units]
    assert ("host", 1) in kinds
    assert exe.stats["programs"] == len({p for k, p in kinds if k not in ("host", "collective", "folded")})
    text = str(exe.schedule)
    assert "  step 1: host" in text and "has no NeuronCore equivalent" in text


def test_plan_is_deterministic_and_matches_the_emitted_schedule():
    ir = _ir(nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 64), nn.ReLU(), nn.Softmax(-1)), torch.randn(8, 64))
    exe = tn.lower.compile_ir(ir)
    first = schedule.plan(exe.ir, schedule.Vetoes())
    second = schedule.plan(exe.ir, schedule.Vetoes())
    assert _units(first) == _units(second)
    assert str(first) == str(second)
    assert _units(first) == _units(exe.schedule)
    # the printed plan is the emitted one but for the program names, which emitting gives
    assert [ln for ln in str(first).splitlines() if "program" not in ln] == \
        [ln for ln in str(exe.schedule).splitlines() if "program" not in ln]


@pytest.fixture
def failing_row_group(monkeypatch):
    """Make the first fused row group's lowering fail once (as a group whose rows do not fit would)."""
    failed = []
    orig = fusion.Group.lower

    def lower(self, ctx, ins, outs):
        """Fail the first row group emitted, then lower as before."""
        if self.r and type(self) is fusion.Group and not failed:
            failed.append(self.eqns[0])
            raise CannotLower("forced failure (test)")
        return orig(self, ctx, ins, outs)

    monkeypatch.setattr(fusion.Group, "lower", lower)
    return failed


def test_a_failed_unit_adds_a_veto_and_plans_again(failing_row_group):
    ir = _ir(nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 64), nn.ReLU(), nn.Softmax(-1)), torch.randn(8, 64))
    exe = tn.lower.compile_ir(ir)
    sched = exe.schedule
    assert len(failing_row_group) == 1
    assert sched.builds == 2
    (veto,) = sched.vetoes.history
    assert (veto.kind, veto.at) == ("nofuse", 0) and "forced failure" in veto.reason
    assert sched.vetoes.nofuse == {0}
    # the re-plan: the norm's first equation is lowered on its own, the rest of the norm is a row group
    assert [(u.start, u.kind) for u in sched.units][:2] == [(0, "op"), (1, "row")]
    text = str(sched)
    assert "2 builds" in text and "  vetoes:\n    nofuse at 0: fused group failed: forced failure (test)" in text
    # the same result as planning with the veto from the start, and the same programs
    replanned = schedule.plan(exe.ir, sched.vetoes)
    assert _units(replanned) == _units(sched)
    again = tn.lower.compile_ir(ir)    # the fixture fails only once: the plan with no veto
    assert again.schedule.builds == 1 and _units(again.schedule) != _units(sched)
    torch.manual_seed(1)
    inputs = [torch.randn(v.shape) for v in exe.ir.inputs]
    torch.testing.assert_close(exe(inputs)[0], again(inputs)[0], rtol=1e-5, atol=1e-6)


def test_veto_replan_emits_the_programs_of_the_vetoed_plan(failing_row_group, monkeypatch):
    ir = _ir(nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 64), nn.ReLU(), nn.Softmax(-1)), torch.randn(8, 64))
    exe = tn.lower.compile_ir(ir)
    vetoes = exe.schedule.vetoes

    # the executable built directly from a plan that starts with the same veto (one build, no failure)
    def build_once(self, _vetoes):
        """Plan with the recorded veto and emit."""
        fresh = schedule.Vetoes(_vetoes.host)
        fresh.nofuse = set(vetoes.nofuse)
        sched = schedule.plan(self.ir, fresh, fuse=self.fuse, laid_out=self._laid_out)
        self._use(emit.emit(sched, name=self.name, arch=self.arch, strict=self.strict, laid_out=self._laid_out))
        self.schedule = sched

    monkeypatch.setattr(NeuronExecutable, "_build", build_once)
    direct = tn.lower.compile_ir(ir)
    assert direct.schedule.builds == 1
    assert _streams(direct) == _streams(exe)


def test_vetoes_record_each_kind():
    v = schedule.Vetoes({3: "a collective"})
    x = tn.ir.Var((2, 2), torch.float32)
    for veto in (schedule.Veto("host", 1, "no"), schedule.Veto("nofuse", 2, "no"),
                 schedule.Veto("no_handoff", 4, "no", x), schedule.Veto("no_prologue", 5, "no", x)):
        v.add(veto)
    assert v.host == {3: "a collective", 1: "no"}
    assert v.nofuse == {2} and v.no_handoff == {x} and v.no_prologue == {x}
    assert [h.kind for h in v.history] == ["host", "nofuse", "no_handoff", "no_prologue"]
    with pytest.raises(AssertionError):
        schedule.Veto("sometimes", 0, "no")
