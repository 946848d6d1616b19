# A reshape of a value already in a program's HBM is an alias of that buffer (no HBM -> HBM copy), unless the
# reshaped value leaves the program (an output keeps its own buffer); results equal torch's.
import torch

import tn
import tn.lower  # noqa: F401  (registers the lowerings)


def _compile(fn, *args):
    ir = tn.make_ir(fn)(*args)
    return ir, tn.lower.compile_ir(ir)


def _hbm_shapes(exe):
    """Shapes of every HBM tensor declared by the executable's programs."""
    return [tuple(t.shape) for st in exe._steps if getattr(st, "enc", None) is not None for t in st.enc.hbm]


def _run(exe, args):
    out = exe(list(args))
    return out if isinstance(out, (list, tuple)) else [out]


def test_matmul_reshape_matmul_reads_the_producer_buffer():
    torch.manual_seed(0)
    x, w1, w2 = torch.randn(128, 64), torch.randn(64, 96), torch.randn(48, 32)

    def f(x, w1, w2):
        h = x @ w1                      # [128, 96]
        r = h.reshape(256, 48)          # contiguous: a view of h's buffer
        return torch.relu(r @ w2)

    ir, exe = _compile(f, x, w1, w2)
    assert (256, 48) not in _hbm_shapes(exe)
    (y,) = _run(exe, (x, w1, w2))
    torch.testing.assert_close(y, f(x, w1, w2), rtol=1e-4, atol=1e-4)


def test_bert_style_head_split_has_no_reshape_copy():
    torch.manual_seed(0)
    s, d, nh = 128, 256, 4
    hd = d // nh
    x = torch.randn(s, d)
    wq, wk, wv, wo = (torch.randn(d, d) * 0.05 for _ in range(4))

    def f(x, wq, wk, wv, wo):
        def heads(t):
            return t.reshape(1, s, nh, hd).permute(0, 2, 1, 3)
        q, k, v = heads(x @ wq), heads(x @ wk), heads(x @ wv)
        p = torch.softmax(q @ k.transpose(-1, -2) / hd ** 0.5, dim=-1)
        a = (p @ v).permute(0, 2, 1, 3).contiguous()
        g = torch.nn.functional.gelu(a.reshape(s, d) @ wo)     # [s, d]
        return g.reshape(1, s, d).reshape(s, d) @ wo

    ir, exe = _compile(f, x, wq, wk, wv, wo)
    shapes = _hbm_shapes(exe)
    assert (1, s, nh, hd) not in shapes and (1, s, d) not in shapes
    (y,) = _run(exe, (x, wq, wk, wv, wo))
    torch.testing.assert_close(y, f(x, wq, wk, wv, wo), rtol=1e-3, atol=1e-3)


def test_reshaped_output_keeps_its_own_buffer():
    torch.manual_seed(0)
    x, w = torch.randn(64, 32), torch.randn(32, 16)

    def f(x, w):
        h = x @ w
        return h, h.reshape(8, 128)     # both leave the program: two buffers

    ir, exe = _compile(f, x, w)
    assert (8, 128) in _hbm_shapes(exe)
    h, r = _run(exe, (x, w))
    torch.testing.assert_close(h, x @ w, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(r, (x @ w).reshape(8, 128), rtol=1e-4, atol=1e-4)
    assert h.data_ptr() != r.data_ptr()
    r.add_(1.0)
    torch.testing.assert_close(h, x @ w, rtol=1e-4, atol=1e-4)


def test_reshaped_value_written_in_place_after_matches_torch():
    torch.manual_seed(0)
    x, w1, w2 = torch.randn(64, 32), torch.randn(32, 16), torch.randn(16, 8)

    def f(x, w1, w2):
        h = x @ w1
        r = h.reshape(128, 8)
        r.mul_(2.0)                     # writes h too (a view)
        return h @ w2, r.sum(0)

    _, exe = _compile(f, x, w1, w2)
    got = _run(exe, (x, w1, w2))
    want = f(x.clone(), w1, w2)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_jit_head_split_matches_torch():
    torch.manual_seed(0)
    x, w1, w2 = torch.randn(128, 64), torch.randn(64, 64), torch.randn(16, 16)

    @tn.jit
    def f(x, w1, w2):
        return (x @ w1).reshape(1, 128, 4, 16) @ w2

    torch.testing.assert_close(f(x, w1, w2), (x @ w1).reshape(1, 128, 4, 16) @ w2, rtol=1e-4, atol=1e-4)
