# Tests of weight layouts (tn/lower/layout.py): the layout program, the cache and its invalidation, the policy choosing the laid-out variant.
import pytest
import torch

pytest.importorskip("tn.lower.layout")
import tn  # noqa: E402
import tn.lower  # noqa: E402,F401
from tn.lower import layout  # noqa: E402
from tn.lower.compiler import compile_ir  # noqa: E402
from tn.neuron import runtime  # noqa: E402

TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


def _expected_layout(w, lay):
    """T[g, p, kc, j] = W[g*ngw + j, kc*128 + p], zero padded."""
    N, K = w.shape
    out = torch.zeros(lay.shape, dtype=w.dtype)
    for g in range(lay.NG):
        for kc in range(lay.KC):
            blk = w[g * lay.ngw:(g + 1) * lay.ngw, kc * 128:(kc + 1) * 128]     # [j, p]
            out[g, :blk.shape[1], kc, :blk.shape[0]] = blk.t()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n,k", [(1, 1), (5, 7), (128, 128), (129, 300), (700, 130), (2048, 512), (512, 2048)])
def test_layout_program_matches_definition(n, k, dtype):
    w = torch.randn(n, k).to(dtype)
    lay = layout.b_layout(n, k, tn.lower.base.NEURON_DTYPES[dtype])
    assert lay.ngw % 128 == 0 or lay.ngw == n
    out = torch.zeros(lay.shape, dtype=dtype)
    res = runtime.run(layout.layout_program(lay), {"w": w, "wt": out})
    assert torch.equal(out, _expected_layout(w, lay))
    assert res.hbm_read_bytes == w.numel() * w.element_size()


def test_layout_groups_are_long_runs():
    # >= 8 KiB contiguous per partition when the weight allows, whole banks when they fit 16 KiB
    for n, k in [(2048, 512), (2048, 2048), (512, 2048), (2304, 768), (768, 3072)]:
        lay = layout.b_layout(n, k, "bfloat16")
        assert lay.KC * lay.ngw * 2 >= 8192 or lay.ngw >= n


def _linear_exe(n_in=300, n_out=200, dtype=torch.float32):
    lin = torch.nn.Linear(n_in, n_out).to(dtype)
    x = torch.randn(64, n_in).to(dtype)
    ir = tn.make_ir(lambda m, x: m(x))(lin, x)
    return lin, x, compile_ir(tn.passes.optimize(ir), strict=True)


def _flat(lin, x):
    return [lin.weight, lin.bias, x]


def test_parameters_use_the_cached_layout_once():
    layout.clear()
    lin, x, exe = _linear_exe()
    assert exe.stats.get("layout_weights") == 1
    with torch.no_grad():
        want = lin(x)
    with tn.profile() as p1:
        (y1,) = exe(_flat(lin, x))
    with tn.profile() as p2:
        (y2,) = exe(_flat(lin, x))
    torch.testing.assert_close(y1, want, **TOL[torch.float32])
    torch.testing.assert_close(y2, want, **TOL[torch.float32])
    names1 = [r.name for r in p1.runs]
    names2 = [r.name for r in p2.runs]
    assert sum(n.startswith("tn_layout") for n in names1) == 1      # laid out on the first call (a Parameter)
    assert not any(n.startswith("tn_layout") for n in names2)       # then reused
    assert layout.cache_info()["tensors"] >= 1


def test_in_place_update_invalidates_the_layout():
    layout.clear()
    lin, x, exe = _linear_exe()
    exe(_flat(lin, x))
    with torch.no_grad():
        lin.weight.mul_(-2.0)           # bumps the version counter
        want = lin(x)
    (y,) = exe(_flat(lin, x))
    torch.testing.assert_close(y, want, **TOL[torch.float32])


def test_write_through_data_is_caught_by_the_fingerprint():
    layout.clear()
    lin, x, exe = _linear_exe()
    exe(_flat(lin, x))
    exe(_flat(lin, x))
    lin.weight.data.normal_()           # .data writes bypass the version counter
    with torch.no_grad():
        want = lin(x)
    (y,) = exe(_flat(lin, x))
    torch.testing.assert_close(y, want, **TOL[torch.float32])


def test_changing_weights_keep_the_plain_program():
    """Training: weights that change between calls are transposed on chip (no layout program per call)."""
    layout.clear()
    lin, x, exe = _linear_exe()
    exe(_flat(lin, x))                  # a Parameter: laid out optimistically
    for step in range(3):
        with torch.no_grad():
            lin.weight.add_(0.01)
            want = lin(x)
        with tn.profile() as p:
            (y,) = exe(_flat(lin, x))
        torch.testing.assert_close(y, want, **TOL[torch.float32])
        assert not any(r.name.startswith("tn_layout") for r in p.runs), step
    # unchanged again: the laid-out variant comes back (one layout program, then reuse)
    exe(_flat(lin, x))
    with tn.profile() as p:
        exe(_flat(lin, x))
    assert not any(r.name.startswith("tn_layout") for r in p.runs)


def test_plain_tensors_are_laid_out_only_when_they_come_back_unchanged():
    layout.clear()
    lin, x, exe = _linear_exe()
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    with tn.profile() as p1:
        exe([w, b, x])
    assert not any(r.name.startswith("tn_layout") for r in p1.runs)   # first sighting of a plain tensor
    with tn.profile() as p2:
        (y,) = exe([w, b, x])
    assert sum(r.name.startswith("tn_layout") for r in p2.runs) == 1
    torch.testing.assert_close(y, x @ w.t() + b, **TOL[torch.float32])
    # the laid-out program does not transpose the weight on TensorE
    te = [sum(r.counts.get("TensorE", 0) for r in p.runs if not r.name.startswith("tn_layout")) for p in (p1, p2)]
    assert te[1] < te[0]


def test_layout_cache_entries_die_with_the_weight():
    import gc

    layout.clear()
    w = torch.nn.Parameter(torch.randn(200, 300))
    x = torch.randn(64, 300)
    exe = compile_ir(tn.passes.optimize(tn.make_ir(lambda x, w: x @ w.t())(x, w)), strict=True)
    exe([x, w])
    assert layout.cache_info()["tensors"] == 1
    del w, exe          # (the last profile's RunResults hold their bound arrays)
    gc.collect()
    assert layout.cache_info()["tensors"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_jit_linear_odd_shapes_both_variants(dtype):
    """Through tn.jit: odd sizes, first call and steady calls agree with torch."""
    layout.clear()
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(131, 257), torch.nn.ReLU(), torch.nn.Linear(257, 67)).to(dtype)
    x = torch.randn(3, 37, 131).to(dtype)
    f = tn.jit(m, backend="neuron")
    with torch.no_grad():
        want = m(x)
        for _ in range(3):
            torch.testing.assert_close(f(x), want, **TOL[dtype])


def test_fingerprint_of_a_tensor_past_float32_integer_range_stays_in_bounds():
    # 2**25 + 1 elements: a float32 linspace(0, n - 1) rounded the last index to n (IndexError on GPT-2's wte)
    from tn.lower.layout import fingerprint

    t = torch.arange(2 ** 25 + 1, dtype=torch.int32).view(torch.float32)
    fp = fingerprint(t).view(torch.int32)
    assert fp[0].item() == 0 and fp[-1].item() == 2 ** 25


@pytest.mark.parametrize("n,k", [(300, 130), (128, 2048)])
def test_layout_program_casts_an_fp32_weight_to_bf16(n, k):
    """The cast layout holds exactly what a program would transpose after its ``convert``: W rounded to bf16."""
    w = torch.randn(n, k)
    lay = layout.b_layout(n, k, "bfloat16")
    got, _ = layout.make(w, lay)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, _expected_layout(w.to(torch.bfloat16), lay))


def test_autocast_weights_are_laid_out_already_cast():
    """Under autocast a Linear's fp32 weight reaches the matmul as ``permute(convert(W))``: the laid-out variant
    reads a bf16 layout made once (no per-call cast written to HBM and read back), gives the plain program's
    results bit for bit, and lays the weight out again after it changes in place."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
    x = torch.randn(64, 256)
    layout.clear()
    j = tn.jit(m)

    def call():
        with torch.autocast("cpu", dtype=torch.bfloat16), tn.profile() as prof:
            y = j(x)
            want = m(x)        # (inside one autocast region per call: autocast caches its casts of weights)
        return y, want, prof

    with torch.no_grad():
        y0, want, p0 = call()
        names = [r.name for r in p0.runs]
        assert sum(n.endswith("_float32_to_bfloat16") for n in names) == 2, names
        y1, _, p1 = call()
        assert [r.name for r in p1.runs] == [names[-1]]           # layouts reused
        torch.testing.assert_close(y1, want, **TOL[torch.bfloat16])
        assert torch.equal(y0, y1)
        weights_bf16 = 2 * 256 * 512 * 2
        inputs = x.numel() * 4 + (512 + 256) * 4                  # x and the biases, fp32
        assert p1.runs[-1].hbm_read_bytes <= weights_bf16 + inputs + 64 * 1024
        m[0].weight.add_(0.01)
        y2, want2, p2 = call()
        assert not any(r.name.startswith("tn_layout") for r in p2.runs)   # changed: the plain program
        torch.testing.assert_close(y2, want2, **TOL[torch.bfloat16])
        assert not torch.equal(y2, y1)
        y3, want3, p3 = call()                                    # unchanged since: laid out again
        assert sum(r.name.startswith("tn_layout") for r in p3.runs) == 1
        assert torch.equal(y3, y2)


def test_weight_stream_leaves_the_matmuls_room_to_read_it():
    """A BERT-base layer under bf16 autocast (12 KiB weight groups): the stream keeps at most 2 * (ahead + 1)
    slots, not as many as its 128 KiB budget holds, so every matmul reads its weight groups from the stream
    (with ten slots the matmuls had 24 KiB of SBUF left, split K into panels and loaded the weights themselves)
    and the result matches torch."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.bert.modeling_bert import BertLayer

    streams = []
    close = layout.WeightStream.close

    def record(self):
        streams.append((self.nslots, self.next, len(self.seq)))
        close(self)

    torch.manual_seed(0)
    block = BertLayer(transformers.BertConfig(attn_implementation="sdpa")).eval()
    x = torch.randn(1, 128, 768)
    f = tn.jit(block, backend="neuron")
    layout.WeightStream.close = record
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            want = block(x)[0]
            f(x)
            got = f(x)[0]
    finally:
        layout.WeightStream.close = close
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)
    assert streams and all(nslots <= 4 and handed == n for nslots, handed, n in streams)
