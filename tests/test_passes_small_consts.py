# Tests of tn/passes.py cse's merging of small constants by value (issue 16): a traced model makes its scalars
# anew in every layer (BERT's attention-mask fill values), which kept each layer's mask computation apart.
import pytest
import torch

import tn  # noqa: F401
from tn.ir import IR, Eqn, Var
from tn.ops import OPS
from tn.passes import cse


def _where_ir(fills):
    """``where(c, f0, f1)`` once per pair of constant fills, each pair its own Vars; every result an output."""
    c = Var((4,), torch.bool)
    consts, eqns, outs = [], [], []
    for a, b in fills:
        va, vb = Var((), a.dtype), Var((), b.dtype)
        consts += [(va, a), (vb, b)]
        o = Var((4,), a.dtype)
        eqns.append(Eqn(OPS["where"], [c, va, vb], [o], {}))
        outs.append(o)
    return IR([c], eqns, outs, consts)


def test_equal_small_constants_merge_and_their_readers_too():
    """Two layers' (0, -inf) fills: one pair of constants and one where remain; -0.0 is not 0.0, a bf16 zero
    not an fp32 zero, a NaN constant merges with its own bit pattern only."""
    bf = torch.bfloat16
    ir = _where_ir([(torch.tensor(0.0, dtype=bf), torch.tensor(float("-inf"), dtype=bf)),
                    (torch.tensor(0.0, dtype=bf), torch.tensor(float("-inf"), dtype=bf))])
    out = cse(ir)
    assert len(out.eqns) == 1 and len(out.consts) == 2 and out.outputs[0] is out.outputs[1]
    kept = cse(_where_ir([(torch.tensor(0.0), torch.tensor(1.0)), (torch.tensor(-0.0), torch.tensor(1.0)),
                          (torch.tensor(0.0, dtype=bf), torch.tensor(1.0, dtype=bf))]))
    assert len(kept.eqns) == 3
    nan = cse(_where_ir([(torch.tensor(float("nan")), torch.tensor(1.0)),
                         (torch.tensor(float("nan")), torch.tensor(1.0))]))
    assert len(nan.eqns) == 1


def test_large_or_parameter_constants_are_not_compared_by_value():
    """Constants over SMALL_CONST elements and Parameters merge only when they are the same object."""
    big = [torch.zeros(64), torch.zeros(64)]
    c = Var((64,), torch.bool)
    va, vb = Var((64,), torch.float32), Var((64,), torch.float32)
    o1, o2 = Var((64,), torch.float32), Var((64,), torch.float32)
    ir = IR([c], [Eqn(OPS["where"], [c, va, va], [o1], {}), Eqn(OPS["where"], [c, vb, vb], [o2], {})], [o1, o2],
            [(va, big[0]), (vb, big[1])])
    assert len(cse(ir).eqns) == 2
    p = [torch.nn.Parameter(torch.zeros(())), torch.nn.Parameter(torch.zeros(()))]
    pr = _where_ir([(p[0].detach().requires_grad_(True), torch.tensor(1.0)), (p[1], torch.tensor(1.0))])
    assert len(cse(pr).eqns) == 2


def test_bert_masks_once_across_layers():
    """A 2-layer BertModel with a padding mask traced under bf16 autocast: one mask where (was one per layer)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=2,
                                  intermediate_size=256, vocab_size=256, max_position_embeddings=64)
    model = transformers.BertModel(cfg).eval()
    ids = torch.randint(0, 256, (2, 32))
    mask = torch.ones(2, 32, dtype=torch.long)
    mask[1, 20:] = 0

    def fwd(i, a):
        """The last hidden state."""
        return model(input_ids=i, attention_mask=a).last_hidden_state

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ir = tn.make_ir(fwd)(ids, mask)
    masks = [e for e in ir.eqns if e.op.name == "where" and e.outputs[0].dtype == torch.bfloat16]
    assert len(masks) == 1


def test_a_size_one_constant_with_a_zero_stride_has_a_key():
    # torch.tensor(2.0).expand(1) is "contiguous" with stride (0,): view(uint8) refuses it (quantile's and
    # index_fill's scalar constants made tn.jit fail with "must be 1 to view Float as Byte")
    from tn.passes import _small_const_key

    t = torch.tensor(2.0).expand(1)
    assert t.stride() == (0,)
    assert _small_const_key(t) == _small_const_key(torch.tensor([2.0]))
    q = torch.tensor([0.25, 0.5])
    x = torch.randn(7)
    torch.testing.assert_close(tn.jit(lambda x: torch.quantile(x, q))(x), torch.quantile(x, q))
