# Hugging Face Transformers (GPT-2, Llama with GQA + rotary, BERT) from tiny configs, unchanged, on tn:
# tn.jit (neuron and reference backends), torch.compile(backend="neuron"), the neuron device; generate() tokens.
import copy
import logging

import pytest
import torch

import tn
from tn import dynamo_backend

transformers = pytest.importorskip("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)

VOCAB = 128
TOL = dict(rtol=1e-4, atol=1e-4)  # fp32 logits of random-weight models are O(1)


def _gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
                                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _llama():
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                   max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def _bert():
    cfg = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64,
                                  pad_token_id=0)
    return transformers.BertForMaskedLM(cfg)


BUILDERS = {"gpt2": _gpt2, "llama": _llama, "bert": _bert}
CAUSAL = ("gpt2", "llama")



def build(name, seed=0):
    """A tiny random-weight model in eval mode (no dropout), deterministic per seed."""
    torch.manual_seed(seed)
    model = BUILDERS[name]()
    assert sum(p.numel() for p in model.parameters()) < 200_000
    return model.eval()


def inputs(batch=2, seq=8, seed=1, pad=False):
    """Token ids (never the pad id 0) and an attention mask (left padding of the first row when ``pad``)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    if pad:
        mask[0, :3] = 0
        ids[0, :3] = 0
    return ids, mask




def no_dropout(model):
    """``model`` in train mode with every dropout probability 0 (deterministic training steps)."""
    model.train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


def train_losses(model, ids, step_model=None, steps=3):
    """Losses of ``steps`` AdamW steps of a causal LM on ``ids`` (labels = ids), through ``step_model``."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    f = model if step_model is None else step_model
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = f(ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def jit_host_ops(jitted):
    """``{op: count}`` of host fallbacks over every program a tn.jit function has compiled (neuron backend)."""
    return dynamo_backend.host_ops_of(jitted)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# --------------------------------------------------------------------------- tn.jit


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_jit_neuron_matches_eager_and_lowers_natively(name):
    model = build(name)
    ids, mask = inputs()
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
    f = tn.jit(model, backend="neuron")
    with tn.profile() as prof:
        got = f(ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want, **TOL)
    assert prof.total_us > 0
    assert jit_host_ops(f) == {}, f"{name}: every op of the forward should lower to the NeuronCore"


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_jit_reference_with_padding_matches_eager(name):
    model = build(name)
    ids, mask = inputs(pad=True)
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
    got = tn.jit(model, backend="reference")(ids, attention_mask=mask).logits
    # padded query rows of a causal model attend to nothing real; compare the real positions
    torch.testing.assert_close(got[:, 3:], want[:, 3:], **TOL)


@pytest.mark.parametrize("kwargs", [{}, {"use_cache": False}, {"attention_mask": "ones"}],
                         ids=["no_mask", "no_cache", "mask"])
def test_gpt2_model_without_attention_mask_traces(kwargs):
    # transformers' masking_utils asks is_tracing(mask) before reading mask values; tn's tracer
    # must look like tracing to it (it raised tn.TracingError at masking_utils.py before).
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64)
    model = transformers.GPT2Model(cfg).eval()
    ids, mask = inputs()
    kw = {k: (mask if v == "ones" else v) for k, v in kwargs.items()}
    with torch.no_grad():
        want = model(ids, **kw).last_hidden_state
    got = tn.jit(model, backend="neuron")(ids, **kw).last_hidden_state
    torch.testing.assert_close(got, want, **TOL)
    assert not torch.compiler.is_compiling()


# --------------------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_torch_compile_matches_eager(name):
    model = build(name)
    ids, mask = inputs()
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        before = dynamo_backend.graphs_compiled()
        got = torch.compile(model, backend="neuron")(ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want, **TOL)
    assert dynamo_backend.graphs_compiled() > before


@pytest.mark.parametrize("name", [pytest.param("gpt2"), pytest.param("llama", marks=pytest.mark.slow)])
def test_torch_compile_generate_same_tokens(name):
    model = build(name)
    ids, mask = inputs(batch=1, seq=6)
    want = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4)
    model.forward = torch.compile(model.forward, backend="neuron", dynamic=False)
    got = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4)
    assert torch.equal(got, want)


# --------------------------------------------------------------------------- the neuron device


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_device_matches_eager(name):
    model = build(name)
    ids, mask = inputs()
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        dev = copy.deepcopy(model).to("neuron")
        got = dev(ids.to("neuron"), attention_mask=mask.to("neuron")).logits
    assert got.device.type == "neuron"
    torch.testing.assert_close(got.cpu(), want, **TOL)


@pytest.mark.parametrize("name", CAUSAL)
def test_device_generate_same_tokens(name):
    model = build(name)
    ids, mask = inputs(batch=1, seq=6)
    want = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=5)
    dev = copy.deepcopy(model).to("neuron")
    got = dev.generate(ids.to("neuron"), attention_mask=mask.to("neuron"), do_sample=False, max_new_tokens=5)
    assert got.device.type == "neuron"
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("name", ["gpt2"])
def test_torch_compile_on_device_inputs(name):
    model = build(name)
    ids, mask = inputs()
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        dev = copy.deepcopy(model).to("neuron")
        got = torch.compile(dev, backend="neuron")(ids.to("neuron"), attention_mask=mask.to("neuron")).logits
    assert got.device.type == "neuron"
    torch.testing.assert_close(got.cpu(), want, **TOL)


# --------------------------------------------------------------------------- training


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_jit_gradients_match_eager(name):
    # torch.autograd.grad inside tn.jit: attention's backward traces through SDPA's math composite.
    model = build(name)
    ids, _ = inputs()
    params = [p for p in model.parameters()]

    def loss_and_grads(m, ids):
        loss = m(ids, labels=ids).loss
        return loss, torch.autograd.grad(loss, [p for p in m.parameters()])

    f = tn.jit(loss_and_grads, backend="neuron")
    loss, grads = f(model, ids)
    want_loss = model(ids, labels=ids).loss
    want = torch.autograd.grad(want_loss, params)
    torch.testing.assert_close(loss, want_loss.detach(), **TOL)
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", [pytest.param("gpt2"), pytest.param("llama", marks=pytest.mark.slow)])
def test_torch_compile_training_matches_eager(name):
    ids, _ = inputs()
    want = train_losses(no_dropout(build(name)), ids)
    model = no_dropout(build(name))
    got = train_losses(model, ids, torch.compile(model, backend="neuron"))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-5)
    assert dynamo_backend.host_ops() == {}, "forward and backward graphs should lower to the NeuronCore"


@pytest.mark.parametrize("name", [pytest.param("gpt2"), pytest.param("llama", marks=pytest.mark.slow)])
def test_torch_compile_training_on_device_matches_cpu(name):
    ids, _ = inputs()
    want = train_losses(no_dropout(build(name)), ids)
    model = no_dropout(build(name)).to("neuron")
    got = train_losses(model, ids.to("neuron"), torch.compile(model, backend="neuron"))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-5)
    assert all(p.device.type == "neuron" for p in model.parameters())


def test_transformers_is_the_version_the_test_extra_pins():
    # the HF tests exercise one release: a new one could silently change which paths they take
    import pathlib
    import tomllib

    pyproject = tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())
    pins = [r for r in pyproject["project"]["optional-dependencies"]["test"] if r.startswith("transformers")]
    assert pins == [f"transformers=={transformers.__version__}"]
