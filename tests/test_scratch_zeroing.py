# The runtime zeroes only the bytes of unbound outputs/scratch a program could see unzeroed (issue 13, host wall):
# tn.neuron.zeroing's analysis, and runs on dirty reused blocks that still read and leave what zero-start runs do.
import copy
import gc
import logging

import numpy as np
import pytest
import torch

import tn
from tn.neuron import Program, runtime
from tn.neuron.zeroing import Ranges, block_ranges, zero_ranges


@pytest.fixture(autouse=True)
def exact_ranges(monkeypatch):
    """Zero exactly the analysed ranges, however small the block (by default a block whose ranges cost about as
    much as all of it is zeroed whole, which would hide a wrong analysis in these small programs)."""
    monkeypatch.setattr(runtime, "_RANGE_COST", 0)
    monkeypatch.setattr(runtime, "_MERGE_GAP", 0)


def _ranges(enc):
    return zero_ranges(enc.records, enc.hbm)


def _dirty(res, value=0xA5) -> int:
    """Fill the block of ``res`` with garbage and return its address: once the caller drops ``res``, the program's
    next run reuses that block dirty (check with :func:`_addr`)."""
    carved = res._lazy[3][-1]
    carved.block.fill(value)
    return carved.addr


def _addr(res) -> int:
    """The address of the block of the run ``res``."""
    return res._lazy[3][-1].addr


def test_scratch_read_before_written_reads_zeros_on_a_fresh_and_on_a_dirty_reused_block():
    # s is read (into y) before the program writes it; its second half is written first, then all of it is read
    prog = Program("read_first")
    x = prog.hbm("x", (4, 8), "float32")
    y = prog.hbm("y", (4, 8), "float32", kind="output")
    s = prog.hbm("s", (4, 8), "float32", kind="scratch")
    t = prog.sbuf((4, 8), "float32")
    u = prog.sbuf((4, 8), "float32")
    prog.dma_copy(t, x)
    prog.dma_copy(s[2:], t[2:])      # rows 2..3 written
    prog.dma_copy(u, s)              # then all of s read: rows 0..1 still unwritten
    prog.dma_copy(y, u)
    prog.dma_copy(s, t)              # finally all of s written
    enc = prog.build()
    r = _ranges(enc)
    assert r[2] == Ranges(((0, 64),), ())                 # s: rows 0..1 (2 x 8 x 4 bytes) read first
    assert r[1] == Ranges((), ())                         # y: written everywhere, never read
    call = enc.prepare_call()
    xs = np.arange(32, dtype=np.float32).reshape(4, 8) + 1
    want = xs.copy()
    want[:2] = 0
    addr = None
    for k in range(3):
        res = call([xs])
        assert addr is None or _addr(res) == addr      # the dirty block of the run before
        np.testing.assert_array_equal(res.outputs["y"], want)
        np.testing.assert_array_equal(res.outputs["s"], xs)
        res2 = call([xs])                 # held result: this run gets a block of its own
        assert _addr(res2) != _addr(res)
        np.testing.assert_array_equal(res2.outputs["y"], want)
        del res2
        addr = _dirty(res)
        del res


def test_an_output_written_in_part_keeps_zeros_elsewhere_on_a_dirty_reused_block():
    prog = Program("part")
    x = prog.hbm("x", (8, 6), "float32")
    y = prog.hbm("y", (8, 6), "float32", kind="output")
    t = prog.sbuf((8, 6), "float32")
    prog.dma_copy(t, x)
    prog.dma_copy(y[::2, 1:5], t[:4, 1:5])      # even rows, columns 1..4
    enc = prog.build()
    assert _ranges(enc)[1].read_first == ()
    call = enc.prepare_call()
    xs = np.random.default_rng(0).standard_normal((8, 6)).astype(np.float32)
    want = np.zeros_like(xs)
    want[::2, 1:5] = xs[:4, 1:5]
    res = call([xs])
    np.testing.assert_array_equal(res.outputs["y"], want)
    addr = _dirty(res)
    del res
    res = call([xs])
    assert _addr(res) == addr
    np.testing.assert_array_equal(res.outputs["y"], want)   # zeros where not written, not the 0xA5 garbage


def test_never_written_scratch_reads_zeros_when_looked_at_and_costs_nothing_before_the_run():
    prog = Program("untouched")
    x = prog.hbm("x", (128, 64), "float32")
    y = prog.hbm("y", (128, 64), "float32", kind="output")
    prog.hbm("kept_on_chip", (128, 256), "float32", kind="scratch")   # a compiled value that never left SBUF
    t = prog.sbuf((128, 64), "float32")
    prog.dma_copy(t, x)
    prog.dma_copy(y, t)
    call = prog.build().prepare_call()
    lay = call._layout((1, 2))
    assert lay.zero == ()                      # nothing to zero before a run ...
    assert sum(b - a for a, b in lay.late) == 128 * 256 * 4 and lay.late_at == (2,)   # ... the scratch on demand
    xs = np.ones((128, 64), np.float32)
    res = call([xs])
    addr = _dirty(res)
    del res
    res = call([xs])
    assert _addr(res) == addr
    carved = res._lazy[3][-1]
    assert carved.late and carved.block.view(np.uint8)[carved.shift + lay.offsets[1]] == 0xA5   # still dirty
    out = res.outputs
    assert not out["kept_on_chip"].any() and carved.late == ()
    np.testing.assert_array_equal(out["y"], xs)
    # a plan's first() of a never-written scratch tensor reads 0 too; of a written output, its value
    plan = call.plan([0])
    del carved, out, res
    res = plan([xs], [xs.__array_interface__["data"][0]])
    addr = _dirty(res)
    del res
    res = plan([xs], [xs.__array_interface__["data"][0]])
    assert _addr(res) == addr
    assert plan.first(res, 1) == 1.0
    assert res._lazy[3][-1].late                   # reading an output does not zero the scratch
    assert plan.first(res, 2) == 0.0


def test_strided_transposed_and_reversed_writes_count_exactly():
    prog = Program("patterns")
    x = prog.hbm("x", (8, 8), "float32")
    a = prog.hbm("a", (8, 8), "float32", kind="output")
    b = prog.hbm("b", (8, 8), "float32", kind="output")
    c = prog.hbm("c", (16,), "bfloat16", kind="output")
    t = prog.sbuf((8, 8), "float32")
    prog.dma_copy(t, x)
    prog.dma_copy(a.T, t)                         # transposed: every element written
    prog.dma_copy(b[::-1, ::2], t[:, :4])         # rows reversed, even columns only
    tb = prog.sbuf((1, 16), "bfloat16")
    prog.memset(tb, 1.0)
    prog.dma_copy(c.reshape(1, 16)[:, 3:11], tb[:, 3:11])
    enc = prog.build()
    r = _ranges(enc)
    assert r[1] == Ranges((), ())
    assert r[2].read_first == () and r[2].unwritten == tuple((4 * k + 4, 4 * k + 8) for k in range(0, 64, 2))
    assert r[3] == Ranges((), ((0, 6), (22, 32)))   # bf16 elements 3..10 written


def test_gather_and_scatter_are_conservative():
    # a gather may read any row of its table view; a scatter writes only where its indices point (never counted
    # as writing) and an accumulating one also reads: the embedding gradient relies on its table starting at 0
    prog = Program("indirect")
    idx = prog.hbm("idx", (4, 1), "int32")
    src = prog.hbm("src", (4, 8), "float32")
    tab = prog.hbm("tab", (6, 8), "float32", kind="scratch")
    grad = prog.hbm("grad", (6, 8), "float32", kind="output")
    out = prog.hbm("out", (4, 8), "float32", kind="output")
    it = prog.sbuf((4, 1), "int32")
    st = prog.sbuf((4, 8), "float32")
    gt = prog.sbuf((4, 8), "float32")
    prog.dma_copy(it, idx)
    prog.dma_copy(st, src)
    prog.dma_copy(tab[:3], st[:3])               # rows 0..2 of the table written
    prog.dma_gather(gt, tab, it)                 # any row may be read: rows 3..5 are read first
    prog.dma_copy(out, gt)
    prog.dma_scatter(grad, st, it, accumulate=True)
    enc = prog.build()
    r = _ranges(enc)
    assert r[2] == Ranges(((96, 192),), ((96, 192),))   # rows 3..5: read first and never written
    assert r[3] == Ranges(((0, 192),), ((0, 192),))
    call = enc.prepare_call()
    ids = np.array([[0], [4], [4], [2]], np.int32)
    srcs = np.arange(32, dtype=np.float32).reshape(4, 8) + 1
    tab_ref = np.zeros((6, 8), np.float32)
    tab_ref[:3] = srcs[:3]
    grad_ref = np.zeros((6, 8), np.float32)
    np.add.at(grad_ref, ids[:, 0], srcs)
    addr = None
    for _ in range(2):
        res = call([ids, srcs])
        assert addr is None or _addr(res) == addr
        np.testing.assert_array_equal(res.outputs["out"], tab_ref[ids[:, 0]])
        np.testing.assert_array_equal(res.outputs["grad"], grad_ref)
        addr = _dirty(res)
        del res


def test_a_pattern_outside_its_tensor_marks_the_whole_tensor():
    prog = Program("bad")
    x = prog.hbm("x", (4, 4), "float32")
    s = prog.hbm("s", (4, 4), "float32", kind="scratch")
    t = prog.sbuf((4, 4), "float32")
    prog.dma_copy(t, x)
    prog.dma_copy(s, t)
    enc = prog.build()
    recs = enc.records.copy()
    f = 16 + 6                          # operand 0's element offset: push the write past the tensor's end
    recs[1, f] = 8
    assert zero_ranges(recs, enc.hbm)[1] == Ranges(((0, 64),), ((0, 64),))
    assert _ranges(enc)[1] == Ranges((), ())


def test_a_block_whose_ranges_cost_about_as_much_as_all_of_it_is_zeroed_whole(monkeypatch):
    monkeypatch.setattr(runtime, "_RANGE_COST", 8192)
    monkeypatch.setattr(runtime, "_MERGE_GAP", 4096)
    prog = Program("small")
    x = prog.hbm("x", (4, 8), "float32")
    y = prog.hbm("y", (4, 8), "float32", kind="output")
    prog.hbm("s", (4, 8), "float32", kind="scratch")
    t = prog.sbuf((4, 8), "float32")
    prog.dma_copy(t, x)
    prog.dma_copy(y[:, :4], t[:, :4])
    call = prog.build().prepare_call()
    lay = call._layout((1, 2))
    assert lay.zero is None and lay.late == ()     # one range of a 320-byte block: the whole block, in one call
    res = call([np.ones((4, 8), np.float32)])
    assert not res.outputs["s"].any() and (res.outputs["y"][:, 4:] == 0).all()


def test_a_dropped_result_whose_outputs_were_read_gives_its_block_back():
    # the arrays RunResult.outputs made are freed before the result's block entry, so the block is seen unused
    prog = Program("viewed")
    x = prog.hbm("x", (4, 8), "float32")
    y = prog.hbm("y", (4, 8), "float32", kind="output")
    t = prog.sbuf((4, 8), "float32")
    prog.dma_copy(t, x)
    prog.dma_copy(y, t)
    call = prog.build().prepare_call()
    xs = np.ones((4, 8), np.float32)
    res = call([xs])
    addr = _addr(res)
    np.testing.assert_array_equal(res.outputs["y"], xs)
    del res
    assert len(call._spare) == 1 and call._spare[0][1] == addr
    res = call([xs])
    assert _addr(res) == addr and call._spare == []
    held = res.outputs["y"]
    del res                                  # an array of the result alive: its block stays out of the spare list
    assert call._spare == []
    np.testing.assert_array_equal(held, xs)


def test_block_ranges_place_sort_and_merge():
    ranges = {3: ((0, 8), (100, 120)), 5: ((4, 12), (0, 2)), 7: ()}
    assert block_ranges(ranges, (3, 5, 7), (64, 0, 128)) == ((0, 2), (4, 12), (64, 72), (164, 184))
    assert block_ranges(ranges, (3, 5, 7), (64, 0, 128), merge_gap=4) == ((0, 12), (64, 72), (164, 184))
    assert block_ranges(ranges, (3, 5, 7), (64, 0, 128), merge_gap=64) == ((0, 72), (164, 184))
    assert block_ranges(ranges, (3, 5, 7), (64, 0, 128), merge_gap=100) == ((0, 184),)


@pytest.mark.parametrize("seed", range(6))
def test_random_dma_programs_leave_what_a_zero_start_run_leaves(seed):
    # random strided copies between SBUF and three carved tensors (reads before writes, partial writes, HBM to HBM):
    # a run on a dirty reused block shows the same outputs and scratch as a run with every tensor bound to zeros
    rng = np.random.default_rng(seed)
    prog = Program(f"random{seed}")
    x = prog.hbm("x", (8, 12), "float32")
    carved = [prog.hbm("o0", (8, 12), "float32", kind="output"), prog.hbm("s0", (12, 8), "float32", kind="scratch"),
              prog.hbm("o1", (8, 12), "float32", kind="output")]
    t = prog.sbuf((12, 12), "float32")
    prog.dma_copy(t[:8], x)
    prog.dma_copy(t[8:], x[:4])

    def view(h):
        r, c = h.shape
        r0, c0 = int(rng.integers(0, r)), int(rng.integers(0, c))
        v = h[r0::int(rng.choice([1, 2, -1])), c0::int(rng.choice([1, 3, -2]))]
        return v.T if rng.random() < 0.3 else v

    for _ in range(10):
        kind = rng.random()
        h = carved[int(rng.integers(0, 3))]
        v = view(h)
        a, b = v.shape
        if a > 12 or b > 12:
            continue
        if kind < 0.45:
            prog.dma_copy(v, t[:a, :b])
        elif kind < 0.85:
            prog.dma_copy(t[:a, :b], v)
        else:
            g = carved[int(rng.integers(0, 3))]
            if g is h:
                continue
            w = g.view()[:a, :b] if g.shape[0] >= a and g.shape[1] >= b else None
            if w is not None:
                prog.dma_copy(w, v)
    for o in carved:
        if o.kind == "output":
            prog.dma_copy(t[:1, :4], o[:1, :4])   # one more read of each output
    enc = prog.build()
    r = _ranges(enc)
    assert any(v.read_first for v in r.values())
    call = enc.prepare_call()
    lay = call._layout((1, 2, 3))
    assert sum(b - a for a, b in lay.zero) < 3 * 8 * 12 * 4        # some of the block is left dirty before a run
    xs = rng.standard_normal((8, 12)).astype(np.float32)
    ref = call([xs] + [np.zeros(h.shape, np.float32) for h in carved]).outputs
    addr = None
    for _ in range(3):
        res = call([xs])
        assert addr is None or _addr(res) == addr
        out = res.outputs
        for h in carved:
            np.testing.assert_array_equal(out[h.name], ref[h.name], err_msg=h.name)
        del out
        addr = _dirty(res, int(rng.integers(1, 256)))
        del res


def test_a_compiled_training_step_zeroes_almost_nothing_before_its_runs():
    # the case in small: a GPT-2 training step under tn.jit writes its scratch before reading it, so the
    # block its call carves (scratch and the range flag) needs (almost) no zeroing before the run; and its losses
    # and updated parameters equal, bit for bit, those of the same steps on blocks zeroed whole
    transformers = pytest.importorskip("transformers")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=100, n_positions=32, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg).train()
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))

    def sgd_step(m, x):
        loss = m(input_ids=x, labels=x).loss
        params = list(m.parameters())
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.sub_(0.01 * g)
        return loss.detach()

    step = tn.jit(sgd_step, backend="neuron")
    with tn.profile() as prof:
        step(copy.deepcopy(model), ids)
    calls = {id(r._lazy[0]): r._lazy[0] for r in prof.runs}
    del prof
    carved = zeroed = 0
    for call in calls.values():
        for lay in call._layouts.values():
            carved += lay.size
            zeroed += lay.size if lay.zero is None else sum(b - a for a, b in lay.zero)
    assert carved > 500_000 and zeroed <= 0.02 * carved
    plans = [o for o in gc.get_objects() if type(o) is runtime.BoundPlan and id(o.call) in calls]
    assert plans
    saved = [(p, p._zero, p._late) for p in plans]

    def set_whole(whole):
        for p, zero, late in saved:
            p._zero, p._late = (None, ()) if whole else (zero, late)

    models = {"ranges": copy.deepcopy(model), "whole": copy.deepcopy(model)}
    losses = {"ranges": [], "whole": []}
    try:
        for _ in range(3):
            for key in ("ranges", "whole"):
                for call in calls.values():
                    for block, _ in call._spare:
                        block.fill(0xA5)     # garbage where the ranges run does not zero
                set_whole(key == "whole")
                losses[key].append(float(step(models[key], ids)))
    finally:
        set_whole(False)
    assert losses["ranges"] == losses["whole"]
    for a, b in zip(models["ranges"].parameters(), models["whole"].parameters()):
        assert torch.equal(a, b)
