# Tests of tn.adaptive with mutable state arguments (KV caches) and masked front-padded buckets.
import copy

import pytest
import torch
import torch.nn as nn

import tn
from tn import passes
from tn import bucketing
from tn.adaptive import state
from tn.bucketing import Mixed
from tn.jit import backend_compile_fn, make_ir

FAST = dict(costs={"eager": 0.01, "compiled": 0.001, "compile": 0.02}, compile_time_prior=0.02,
            backend="reference")


class KV:
    """A minimal KV cache: a registered state type whose ``update`` grows its tensors by cat. (A Python
    counter attribute would be a static part of every signature, so each call would be a new one.)"""

    def __init__(self):
        self.k = None
        self.v = None
        self.started = False

    def update(self, k, v):
        self.k = k if self.k is None else torch.cat([self.k, k], 1)
        self.v = v if self.v is None else torch.cat([self.v, v], 1)
        self.started = True
        return self.k, self.v


tn.adaptive.register_state_type(KV)


class Decoder(nn.Module):
    """One attention step over a growing cache (softmax over all cached keys)."""

    def __init__(self, d=16):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x, cache):
        q, k, v = self.qkv(x).chunk(3, -1)
        k, v = cache.update(k, v)
        w = torch.softmax(q @ k.transpose(-1, -2) / 4.0, -1)
        return self.out(w @ v)


def _decoder_pair(seed, cls=None, **policy):
    """A decoder, its plain copy, and the adaptive wrapper of the first (one region: the whole decoder)."""
    torch.manual_seed(seed)
    m = (cls or Decoder)()
    ref = copy.deepcopy(m)
    return m, ref, tn.adaptive(m, regions=[""], **(policy or FAST))


@torch.no_grad()
def _step_both(a, ref, xs):
    """Run the adaptive and the plain decoder over the same tokens (no grad); compare outputs and caches."""
    ca, cr = KV(), KV()
    for x in xs:
        ya, yr = a(x, ca), ref(x, cr)
        torch.testing.assert_close(ya, yr, rtol=1e-5, atol=1e-5)
        assert ca.started and cr.started
        torch.testing.assert_close(ca.k, cr.k)
        torch.testing.assert_close(ca.v, cr.v)
    return ca


def test_state_roundtrip_spec_and_write_back():
    c = KV()
    c.update(torch.ones(1, 2, 4), torch.zeros(1, 2, 4))
    leaves = []
    spec = state.flatten(c, leaves)
    assert len(leaves) == 2
    proxy = state.build(spec, iter([l.clone() for l in leaves]))
    assert type(proxy) is KV and proxy is not c and proxy.started
    pre = [proxy.k, proxy.v]
    proxy.update(torch.full((1, 1, 4), 2.0), torch.full((1, 1, 4), 3.0))
    outs = []
    post = state.flatten(proxy, outs, pre)
    assert not state.unchanged(spec, post) and len(outs) == 2
    state.write_back(c, post, iter(outs), leaves)
    assert c.k.shape == (1, 3, 4) and float(c.v[0, 2, 0]) == 3.0
    # untouched: nothing new, nothing to write
    outs2 = []
    again = state.flatten(c, outs2, [c.k, c.v])
    assert outs2 == [] and state.unchanged(state.flatten(c, []), again)


def test_state_unhashable_attribute_is_a_clear_refusal():
    c = KV()
    c.extra = {"a": [1, 2]}  # containers recurse: fine
    state.flatten(c, [])
    c.bad = bytearray(b"x")  # unhashable, not a tensor
    with pytest.raises(state.StateError, match="neither a tensor nor hashable"):
        state.flatten(c, [])


def test_decoder_with_cache_compiles_and_writes_back():
    m, ref, a = _decoder_pair(0)
    xs = [torch.randn(1, 3, 16)] + [torch.randn(1, 1, 16) for _ in range(12)]
    _step_both(a, ref, xs)
    _step_both(a, ref, xs)  # again: compiled programs (and buckets) reused
    row = a.report(print_table=False)[0]
    assert row["hits"] > 0 and "for good" not in str(row["reason"])


def test_decoder_cache_buckets_with_masks():
    m, ref, a = _decoder_pair(1)
    xs = [torch.randn(2, 4, 16)] + [torch.randn(2, 1, 16) for _ in range(20)]
    _step_both(a, ref, xs)
    r = a.regions["<root>"]
    b = r.group.bucketing
    assert b is not None and any(b.masked), r.reason
    assert r.padded > 0
    assert r.compiles < 12  # one program per bucket, not per cache length


def test_cache_on_neuron_device_keeps_device_and_values():
    torch.manual_seed(2)
    m = Decoder()
    ref = copy.deepcopy(m)
    md = copy.deepcopy(m).to("neuron")
    a = tn.adaptive(md, regions=[""], costs=FAST["costs"], compile_time_prior=0.02)
    ca, cr = KV(), KV()
    xs = [torch.randn(1, 2, 16)] + [torch.randn(1, 1, 16) for _ in range(10)]
    for x in xs:
        with torch.no_grad():
            ya = a(x.to("neuron"), ca)
        yr = ref(x, cr)
        assert ya.device.type == "neuron" and ca.k.device.type == "neuron"
        torch.testing.assert_close(ya.cpu(), yr, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ca.k.cpu(), cr.k)
    assert a.regions["<root>"].hits > 0


class SizeBakingDecoder(Decoder):
    """Scales scores by 1/len (a Python int from the shape): padding would change it."""

    def forward(self, x, cache):
        q, k, v = self.qkv(x).chunk(3, -1)
        k, v = cache.update(k, v)
        w = torch.softmax(q @ k.transpose(-1, -2) / k.shape[1], -1)
        return self.out(w @ v)


def test_masked_bucket_refused_when_the_program_bakes_the_length():
    m, ref, a = _decoder_pair(4, SizeBakingDecoder)
    xs = [torch.randn(1, 3, 16)] + [torch.randn(1, 1, 16) for _ in range(16)]
    _step_both(a, ref, xs)
    r = a.regions["<root>"]
    assert r.group.bucketing is None and "depends on the size" in r.group.bucket_refused, r.group.bucket_refused
    assert r.dead is None


def test_cache_under_autograd_stays_eager_with_reason():
    m, ref, a = _decoder_pair(3)
    ca, cr = KV(), KV()
    for x in [torch.randn(1, 2, 16)] + [torch.randn(1, 1, 16) for _ in range(6)]:
        a(x, ca).sum().backward()
        ref(x, cr).sum().backward()
        for c in (ca, cr):
            c.k, c.v = c.k.detach(), c.v.detach()
    row = a.report(print_table=False)[0]
    assert row["hits"] == 0 and "mutable state" in row["reason"]
    for p, pr in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, pr.grad)


# ---------------------------------------------------------------- the masked rewrite itself

def _attn(pk, pv, q, kn, vn, p):
    k = torch.cat([pk, kn], -2)
    v = torch.cat([pv, vn], -2)
    w = torch.softmax(q @ k.transpose(-1, -2) / 4.0, -1)
    return w @ v, k, v


@pytest.mark.parametrize("backend", ["reference", "neuron"])
@pytest.mark.parametrize("n,bucket", [(5, 8), (1, 4), (8, 8)])
def test_masked_program_equals_unpadded(backend, n, bucket):
    torch.manual_seed(n)
    pk, pv = torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16)
    q, kn, vn = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16)
    ref = _attn(pk, pv, q, kn, vn, None)
    front = bucket - n
    pad = lambda x: torch.cat([x[:, :, :1].expand(1, 2, front, 16) * 1e3, x], 2)  # noqa: E731  (large: must vanish)
    p = torch.tensor(float(front))
    ir = passes.optimize(make_ir(_attn)(pad(pk), pad(pv), q, kn, vn, p))
    assert bucketing.masked_axes(ir, {0: 2, 1: 2}) == [None, 2, 2]
    mir, axes = bucketing.masked_program(ir, {0: 2, 1: 2}, 5)
    passes.verify(mir)
    outs = backend_compile_fn(backend, "test")(mir)([pad(pk), pad(pv), q, kn, vn, p])
    outs = [o if a is None else o.narrow(a, front, o.shape[a] - front) for o, a in zip(outs, axes)]
    for o, r in zip(outs, ref):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fn,why", [
    (lambda k, kn: torch.cat([kn, k], 1).sum(1), "not first"),
    (lambda k, kn: k[:, :2] + 0, "cuts"),
    (lambda k, kn: k.argmax(1), "no identity"),
    (lambda k, kn: k.cumsum(1), "scans"),
    (lambda k, kn: k * torch.arange(k.shape[1], dtype=torch.float32)[None, :, None], "fixed tensor"),
    (lambda k, kn: k.reshape(k.shape[0], -1), "merges"),
])
def test_masked_refuses_what_padding_would_change(fn, why):
    ir = passes.optimize(make_ir(fn)(torch.randn(2, 6, 4), torch.randn(2, 1, 4)))
    with pytest.raises(Mixed, match=why):
        bucketing.masked_axes(ir, {0: 1})


def test_masked_allows_constants_uniform_along_the_dimension():
    fn = lambda k: (k * torch.full((1, k.shape[1], 1), 2.0)).amax(1)  # noqa: E731
    ir = passes.optimize(make_ir(fn)(torch.randn(2, 6, 4)))
    assert bucketing.masked_axes(ir, {0: 1}) == [None]


def test_runtime_refuses_tensor_without_memory():
    class NoMemory(torch.Tensor):
        @staticmethod
        def __new__(cls, shape):
            return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32, device="cpu")

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise RuntimeError("no values")

    f = tn.jit(lambda x: x * 2, backend="neuron")
    with pytest.raises(Exception, match="no memory"):
        f(NoMemory((4, 4)))


@pytest.mark.parametrize("kind", ["gpt2", "llama", "gpt2-eager-attention"])
def test_hf_generate_blocks_bucketed(kind, tiny_hf):
    """HF generate with a DynamicCache through compiled blocks: GPT-2 (sdpa), RoPE + grouped KV heads (Llama),
    and GPT-2's eager attention with its additive mask of length n + 1 (padded at the front by the cache's pad
    count, so the two stay aligned). Tokens equal plain generation; the blocks are bucketed with masks."""
    m = tiny_hf(kind)
    blocks = ["model.layers.0", "model.layers.1"] if kind == "llama" else ["transformer.h.0", "transformer.h.1"]
    ids = torch.randint(2, 64, (1, 5))
    ref = m.generate(ids, max_new_tokens=14, do_sample=False)
    a = tn.adaptive(m, regions=blocks, **FAST)
    for _ in range(2):
        assert torch.equal(a.generate(ids, max_new_tokens=14, do_sample=False), ref)
    for name in blocks:
        r = a.regions[name]
        assert r.group.bucketing is not None and any(r.group.bucketing.masked), (r.reason, r.group.bucket_refused)
        assert r.hits > 0


def test_masked_decode_attention_compiles_its_fused_epilogue(caplog):
    """The score matmul has one row per head: its fused epilogue's hand-off rows start at partitions 1, 2, 3
    (not a compute-engine start); they are computed in scratch and moved by DMA, not refused and rebuilt.
    The softmax weights' consumer (a small masking group) lays its tile out one row per partition to read
    them where the softmax left them."""
    import logging
    from tn.lower.compiler import compile_ir
    torch.manual_seed(5)
    pk, pv = torch.randn(1, 4, 16, 16), torch.randn(1, 4, 16, 16)
    q, kn, vn = torch.randn(1, 4, 1, 16), torch.randn(1, 4, 1, 16), torch.randn(1, 4, 1, 16)
    p = torch.tensor(3.0)
    ir = passes.optimize(make_ir(_attn)(pk, pv, q, kn, vn, p))
    mir, axes = bucketing.masked_program(ir, {0: 2, 1: 2}, 5)
    with caplog.at_level(logging.DEBUG, logger="tn"):
        run = compile_ir(mir)
    retries = [r for r in caplog.records if "fused group" in r.getMessage() or "hand-off" in r.getMessage()]
    assert not retries, caplog.text  # one build: no group refused, every SBUF hand-off read in place
    outs = run([pk, pv, q, kn, vn, p])
    ref = _attn(pk[:, :, 3:], pv[:, :, 3:], q, kn, vn, None)
    torch.testing.assert_close(outs[0], ref[0], rtol=1e-5, atol=1e-5)


def test_masked_buckets_start_at_masked_min_bucket():
    from tn.adaptive.policy import bucket_size, make_policy
    pol = make_policy()
    assert bucket_size(pol, 5, masked=True) == 128 and bucket_size(pol, 128, masked=True) == 128
    assert bucket_size(pol, 129, masked=True) == 256 and bucket_size(pol, 5) == 8
    assert bucket_size(make_policy(masked_min_bucket=16), 5, masked=True) == 16
    with pytest.raises(tn.TnError):
        make_policy(masked_min_bucket=0)


def test_recurrence_is_judged_per_call_structure():
    """Decode steps (one structure, bucketed, recurring) must not make a prompt (another structure, a new
    length each time) look recurrent."""
    m, _, a = _decoder_pair(6)
    r = a.regions["<root>"]
    with torch.no_grad():
        for prompt_len in (3, 5, 7, 9):
            c = KV()
            a(torch.randn(1, prompt_len, 16), c)          # prompt: the cache is empty (k is None)
            for _ in range(8):
                a(torch.randn(1, 1, 16), c)               # decode steps
    assert len(r.class_reps) == 2  # prompts (empty cache) and decode steps
    rates = sorted(r.recurrence(k) for k in r.class_reps)
    assert rates[0] == 0.0 and rates[1] > 0.5


@pytest.mark.parametrize("kind", ["t5", "mistral"])
def test_hf_generate_encoder_decoder_and_sliding_caches(kind, tiny_hf):
    """T5 (an EncoderDecoderCache; blocks returning None in their tuples) and Mistral (a sliding-window
    cache) under default regions: tokens equal plain generation and no region falls back for good."""
    m = tiny_hf(kind)
    ids = torch.randint(3, 64, (1, 6))
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False)
    ref = m.generate(ids, **kw)
    a = tn.adaptive(copy.deepcopy(m), **FAST)
    for _ in range(2):
        assert torch.equal(a.generate(ids, **kw), ref)
    rows = a.report(print_table=False)
    assert not [r["region"] for r in rows if r["mode"] == "eager (for good)"], rows
    assert sum(r["hits"] for r in rows) > 0


def test_tn_jit_refuses_a_cache_with_a_pointer_to_adaptive():
    """tn.jit takes pytrees of tensors; a KV cache (even an empty one, which the call would fill with traced
    tensors) is refused with a message naming tn.adaptive."""
    f = tn.jit(lambda x, cache: cache.update(x, x)[0] * 2)
    for c in (KV(), _filled()):
        with pytest.raises(tn.TnError, match="tn.adaptive"):
            f(torch.randn(1, 2, 4), c)


def _filled():
    c = KV()
    c.update(torch.randn(1, 3, 4), torch.randn(1, 3, 4))
    return c


def test_hf_generate_left_padded_batch(tiny_hf):
    """A left-padded batch: HF generate passes position_ids only to a forward whose signature names them, so
    the adaptive forward must keep the model's signature (the padded rows got wrong positions otherwise)."""
    import inspect
    m = tiny_hf("gpt2")
    ids = torch.randint(3, 64, (3, 7))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[1, :1] = 0
    ids[mask == 0] = 1
    kw = dict(attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    ref = m.generate(ids, **kw)
    a = tn.adaptive(copy.deepcopy(m), **FAST)
    assert "position_ids" in inspect.signature(a.forward).parameters
    for _ in range(2):
        assert torch.equal(a.generate(ids, **kw), ref)
    assert a.regions["transformer.h.0"].hits > 0


def test_a_slice_keeping_the_last_positions_is_front_padding_safe_only_when_asked():
    """tn.bucketing's ``tail_slices`` (the device's windows use it; tn.adaptive does not): ``x[:, -k:]`` of a
    front-padded dimension keeps real positions, and the program at another size is the same one."""
    def f(k, new):
        kc = torch.cat([k, new], 1)
        return kc, kc[:, -1:] * 2, kc[:, :1]

    small = make_ir(f)(torch.randn(2, 3, 4), torch.randn(2, 1, 4))
    big = make_ir(f)(torch.randn(2, 6, 4), torch.randn(2, 1, 4))
    assert "depend on the size" in bucketing.same_program(small, big, [(0, 1)])
    assert bucketing.same_program(small, big, [(0, 1)], tail_slices=True) is None
    with pytest.raises(Mixed, match="along it"):
        bucketing.masked_axes(big, {0: 1})
    with pytest.raises(Mixed, match="along it"):                      # kc[:, :1]: the first, a padded position
        bucketing.masked_axes(big, {0: 1}, tail_slices=True)
    g = lambda k, new: f(k, new)[:2]                                   # noqa: E731
    assert bucketing.masked_axes(make_ir(g)(torch.randn(2, 6, 4), torch.randn(2, 1, 4)), {0: 1},
                                 tail_slices=True) == [1, None]


@pytest.mark.parametrize("backend", ["reference", "neuron"])
def test_finite_padding_leaves_the_values_of_a_kv_cache_unmasked(backend):
    """tn.bucketing's ``finite_padding`` (the device's windows pad with zeros): ``weights @ values`` masks the
    weights only, since the values' padded positions still hold the (finite) padding; same results."""
    torch.manual_seed(3)
    n, bucket = 5, 8
    pk, pv = torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16)
    q, kn, vn = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16)
    ref = _attn(pk, pv, q, kn, vn, None)
    front = bucket - n
    pad = lambda x: torch.cat([torch.zeros(1, 2, front, 16), x], 2)  # noqa: E731
    p = torch.tensor(float(front))
    ir = passes.optimize(make_ir(_attn)(pad(pk), pad(pv), q, kn, vn, p))
    both, _ = bucketing.masked_program(ir, {0: 2, 1: 2}, 5)
    mir, axes = bucketing.masked_program(ir, {0: 2, 1: 2}, 5, finite_padding=True)
    wheres = lambda m: sum(e.op.name == "where" for e in m.eqns)  # noqa: E731
    assert wheres(mir) == wheres(both) - 1
    outs = backend_compile_fn(backend, "test")(mir)([pad(pk), pad(pv), q, kn, vn, p])
    outs = [o if a is None else o.narrow(a, front, o.shape[a] - front) for o, a in zip(outs, axes)]
    for o, r in zip(outs, ref):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)
