# Tests of tn/lower/tile.py's affine folding (issue 17: no silent wrong answer): a chain of `x * c` / `x + c`
# steps is folded into one ScalarE activation func(x * scale + bias) only when that rounds as eager's separate
# steps do, so results are bit-identical to PyTorch on CPU, including values that a floor turns into integers.
import pytest
import torch

import tn
import tn.lower.compiler as compiler
import tn.passes
from tn.lower.tile import _fold_exact, _power_of_two

X = torch.randn(4096, generator=torch.Generator().manual_seed(3))
C = torch.arange(-2048.0, 2048.0)

CHAINS = [
    ("(x+1)*0.7", lambda x: (x + 1) * 0.7, X),
    ("x*0.3*0.7", lambda x: x * 0.3 * 0.7, X),
    ("x+0.1+0.2", lambda x: x + 0.1 + 0.2, X),
    ("x/3", lambda x: x / 3.0, X),
    ("floor((c+1)*0.1)", lambda c: torch.floor((c + 1) * 0.1), C),   # was 34 integers off by one
    ("x*3+1", lambda x: x * 3 + 1, X),
    ("(x+1)*2", lambda x: (x + 1) * 2, X),
    ("x*0.5*0.3-1", lambda x: x * 0.5 * 0.3 - 1, X),
    ("1-x*0.3", lambda x: 1 - x * 0.3, X),
]


@pytest.mark.parametrize("name,fn,x", CHAINS, ids=[c[0] for c in CHAINS])
def test_affine_chains_are_bit_identical_to_eager(name, fn, x):
    """Every element equals eager's (before: up to 2614 of 4096 differed in the last bit, floor 34 by 1)."""
    out = tn.jit(fn)(x)
    assert torch.equal(out, fn(x))


def _compute_instructions(fn, x):
    exe = compiler.compile_ir(tn.passes.optimize(tn.make_ir(fn)(x)), strict=True, arch="trn1")
    exe([x])
    return [o for q, _, _, o in exe.last_profile.runs[-1].instructions() if q in ("ScalarE", "VectorE", "GpSimd")]


def test_exact_folds_stay_one_instruction():
    """A multiply then an add (what the engine's activation computes) stays one instruction per tile; an add
    then a non power-of-two multiply is two, as eager rounds twice."""
    one = _compute_instructions(lambda x: torch.tanh(x * 3 + 1), X)
    two = _compute_instructions(lambda x: torch.tanh((x + 1) * 0.7), X)
    assert len(two) == 2 * len(one) and len(one) > 0


def test_fold_rules():
    """The composition rule: powers of two scale exactly; a second add or a later non power-of-two multiply
    after an add does not fold."""
    assert _power_of_two(0.5) and _power_of_two(-4.0) and not _power_of_two(0.7) and not _power_of_two(0.0)
    assert not _power_of_two(2.0 ** -140)                      # subnormal in fp32
    assert _fold_exact((1.0, 0.0, False), (0.7, 0.0, False)) == (0.7, 0.0, False)
    assert _fold_exact((0.7, 0.0, False), (1.0, 1.0, True)) == (0.7, 1.0, True)
    assert _fold_exact((1.0, 1.0, True), (0.7, 0.0, False)) is None
    assert _fold_exact((1.0, 1.0, True), (2.0, 0.0, False)) == (2.0, 2.0, True)
    assert _fold_exact((0.3, 0.0, False), (0.7, 0.0, False)) is None
    assert _fold_exact((0.5, 0.0, False), (0.7, 0.0, False)) == (0.35, 0.0, False)
    assert _fold_exact((1.0, 0.1, True), (1.0, 0.2, True)) is None
