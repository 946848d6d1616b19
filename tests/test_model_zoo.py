# More Hugging Face families (beyond test_hf_models.py's GPT-2/Llama/BERT) from tiny random configs, unchanged:
# tn.jit(model) on the neuron backend and torch.compile(backend="neuron") against CPU eager (eval, fp32), with
# no host fallbacks; gradients of a few through both doors. Most cases are slow; a few fast ones stay unmarked.
import logging

import pytest
import torch

import tn
from tn import dynamo_backend

transformers = pytest.importorskip("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)
T = transformers

V = 128
TOL = dict(rtol=1e-4, atol=1e-4)
GRAD_TOL = dict(rtol=1e-4, atol=1e-5)


def _ids(batch=2, seq=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, V, (batch, seq), generator=g)


def _mask(batch=2, seq=8):
    return torch.ones(batch, seq, dtype=torch.long)


def _pixels(batch=2, size=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, size, size, generator=g)


def _text(**extra):
    return dict(input_ids=_ids(), attention_mask=_mask(), **extra)


# name -> (model factory, input factory); every config is tiny (< 200k parameters)
ZOO = {
    "t5": (lambda: T.T5ForConditionalGeneration(T.T5Config(
        vocab_size=V, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)),
        lambda: _text(decoder_input_ids=_ids(seq=5, seed=2))),
    "bart": (lambda: T.BartForConditionalGeneration(T.BartConfig(
        vocab_size=V, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)),
        lambda: _text(decoder_input_ids=_ids(seq=5, seed=2))),
    # sliding window (4 < seq 8) and grouped-query attention
    "mistral": (lambda: T.MistralForCausalLM(T.MistralConfig(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, sliding_window=4, pad_token_id=0)), _text),
    "qwen2": (lambda: T.Qwen2ForCausalLM(T.Qwen2Config(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)), _text),
    # partial rotary (a quarter of each head)
    "gpt_neox": (lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, rotary_pct=0.25, pad_token_id=0)), _text),
    "opt": (lambda: T.OPTForCausalLM(T.OPTConfig(
        vocab_size=V, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, word_embed_proj_dim=64, pad_token_id=1)), _text),
    # multi-query attention, parallel attention/MLP
    "falcon": (lambda: T.FalconForCausalLM(T.FalconConfig(
        vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, new_decoder_architecture=False,
        multi_query=True, parallel_attn=True, alibi=False, bias=False, pad_token_id=0)), _text),
    "phi": (lambda: T.PhiForCausalLM(T.PhiConfig(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, partial_rotary_factor=0.5, pad_token_id=0)), _text),
    "gemma": (lambda: T.GemmaForCausalLM(T.GemmaConfig(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=64, pad_token_id=0)), _text),
    "distilbert": (lambda: T.DistilBertForMaskedLM(T.DistilBertConfig(
        vocab_size=V, dim=64, n_layers=2, n_heads=4, hidden_dim=128, max_position_embeddings=64,
        pad_token_id=0)), _text),
    "roberta": (lambda: T.RobertaForSequenceClassification(T.RobertaConfig(
        vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=64, pad_token_id=1)), _text),
    "clip_text": (lambda: T.CLIPTextModel(T.CLIPTextConfig(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)), _text),
    "clip_vision": (lambda: T.CLIPVisionModel(T.CLIPVisionConfig(
        image_size=32, patch_size=8, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4)), lambda: dict(pixel_values=_pixels())),
    "vit": (lambda: T.ViTForImageClassification(T.ViTConfig(
        image_size=32, patch_size=8, num_channels=3, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, num_labels=10)), lambda: dict(pixel_values=_pixels())),
    # conv1d stem, then (permuted conv output + positions) through layer norm
    "whisper_encoder": (lambda: T.WhisperModel(T.WhisperConfig(
        vocab_size=V, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16,
        max_source_positions=16, max_target_positions=32, pad_token_id=0, decoder_start_token_id=1)).get_encoder(),
        lambda: dict(input_features=torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1)))),
    "resnet": (lambda: T.ResNetForImageClassification(T.ResNetConfig(
        num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic",
        num_labels=10)), lambda: dict(pixel_values=_pixels())),
    # channels-last layer norm (permute, LayerNorm, permute back)
    "convnext": (lambda: T.ConvNextForImageClassification(T.ConvNextConfig(
        num_channels=3, hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, num_labels=10,
        out_features=None, out_indices=None)), lambda: dict(pixel_values=_pixels())),
}

#: fast representative cases (run in the default suite); every other case is marked slow
FAST_JIT = {"mistral", "convnext"}
FAST_COMPILE = {"distilbert"}


def build(name, seed=0):
    """A tiny random-weight model of family ``name`` in eval mode, and its example inputs."""
    make_model, make_inputs = ZOO[name]
    torch.manual_seed(seed)
    model = make_model()
    assert sum(p.numel() for p in model.parameters()) < 200_000
    return model.eval(), make_inputs()


def first_output(out):
    """The main tensor of a model output (logits, else the last hidden state)."""
    for k in ("logits", "last_hidden_state"):
        v = getattr(out, k, None)
        if v is not None:
            return v
    return out[0]


def _cases(fast):
    return [pytest.param(n, marks=() if n in fast else pytest.mark.slow) for n in sorted(ZOO)]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# --------------------------------------------------------------------------- inference


@pytest.mark.parametrize("name", _cases(FAST_JIT))
def test_jit_neuron_matches_cpu(name):
    model, kw = build(name)
    with torch.no_grad():
        want = first_output(model(**kw))
    f = tn.jit(model, backend="neuron")
    with tn.profile() as prof:
        got = first_output(f(**kw))
    torch.testing.assert_close(got, want, **TOL)
    assert prof.total_us > 0
    assert dynamo_backend.host_ops_of(f) == {}, f"{name}: every op should lower to the NeuronCore"


@pytest.mark.parametrize("name", _cases(FAST_COMPILE))
def test_torch_compile_matches_cpu(name):
    model, kw = build(name)
    with torch.no_grad():
        want = first_output(model(**kw))
        before = dynamo_backend.graphs_compiled()
        got = first_output(torch.compile(model, backend="neuron")(**kw))
    torch.testing.assert_close(got, want, **TOL)
    assert dynamo_backend.graphs_compiled() > before
    assert dynamo_backend.host_ops() == {}, f"{name}: every op should lower to the NeuronCore"


# --------------------------------------------------------------------------- training (gradients)


def _labelled(name, kw):
    """``kw`` with labels for the model's own loss (encoder-decoders derive decoder inputs from labels)."""
    kw = dict(kw)
    if "pixel_values" in kw:
        kw["labels"] = torch.tensor([1, 3])
    elif "decoder_input_ids" in kw:
        kw["labels"] = kw.pop("decoder_input_ids")
    else:
        kw["labels"] = kw["input_ids"]
    return kw


def _train_model(name):
    model, kw = build(name)
    model.train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model, _labelled(name, kw)


TRAIN = [pytest.param("t5", marks=pytest.mark.slow), pytest.param("mistral", marks=pytest.mark.slow),
         pytest.param("vit", marks=pytest.mark.slow), pytest.param("resnet", marks=pytest.mark.slow),
         pytest.param("convnext", marks=pytest.mark.slow)]


@pytest.mark.parametrize("name", TRAIN)
def test_jit_gradients_match_cpu(name):
    model, kw = _train_model(name)
    params = list(model.parameters())
    want_loss = model(**kw).loss
    want = torch.autograd.grad(want_loss, params)

    def loss_and_grads(m, kw):
        loss = m(**kw).loss
        return loss, torch.autograd.grad(loss, list(m.parameters()))

    f = tn.jit(loss_and_grads, backend="neuron")
    loss, grads = f(model, kw)
    torch.testing.assert_close(loss, want_loss.detach(), **GRAD_TOL)
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w, **GRAD_TOL)
    assert dynamo_backend.host_ops_of(f) == {}


@pytest.mark.parametrize("name", TRAIN)
def test_torch_compile_gradients_match_cpu(name):
    # ResNet's BatchNorm updates running stats in place (graph input mutation); ConvNeXt's backward graph
    # receives channels-last (permuted) saved activations and views them as that layout allows.
    model, kw = _train_model(name)
    params = list(model.parameters())
    want_loss = model(**kw).loss
    want = torch.autograd.grad(want_loss, params)
    model2, _ = _train_model(name)  # same seed: same weights and buffers
    loss = torch.compile(model2, backend="neuron")(**kw).loss
    grads = torch.autograd.grad(loss, list(model2.parameters()))
    torch.testing.assert_close(loss.detach(), want_loss.detach(), **GRAD_TOL)
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w, **GRAD_TOL)
    for (k, a), (_, b) in zip(model2.named_buffers(), model.named_buffers()):
        torch.testing.assert_close(a, b, **TOL, msg=f"buffer {k}")
    assert dynamo_backend.host_ops() == {}


@pytest.mark.slow
def test_compiled_adamw_steps_match_cpu():
    # a few optimizer steps of a compiled model (forward and backward graphs on the NeuronCore), losses as on CPU
    def losses(compiled):
        model, kw = _train_model("mistral")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        f = torch.compile(model, backend="neuron") if compiled else model
        out = []
        for _ in range(2):
            opt.zero_grad()
            loss = f(**kw).loss
            loss.backward()
            opt.step()
            out.append(loss.item())
        return out

    torch.testing.assert_close(torch.tensor(losses(True)), torch.tensor(losses(False)), **GRAD_TOL)


# --------------------------------------------------------------------------- layout regressions (fast)


class _ChannelsLastNorm(torch.nn.Module):
    """ConvNeXt/Whisper's pattern: a permuted activation through LayerNorm, then ``view`` (needs a contiguous result)."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.proj = torch.nn.Linear(8, 4)

    def forward(self, x):  # x: [B, C=8, H, W]
        y = self.norm(x.permute(0, 2, 3, 1))  # LayerNorm returns a contiguous tensor whatever its input's layout
        return self.proj(y.view(-1, 8)).sum(-1)


def test_jit_layer_norm_of_permuted_input_is_contiguous():
    # tn traces native_layer_norm through a decomposition, which kept the permuted input's strides;
    # the .view after it raised "view size is not compatible with input tensor's size and stride".
    torch.manual_seed(0)
    m = _ChannelsLastNorm().eval()
    x = torch.randn(2, 8, 3, 5)
    with torch.no_grad():
        want = m(x)
    torch.testing.assert_close(tn.jit(m, backend="neuron")(x), want, **TOL)


def test_torch_compile_graph_views_a_channels_last_input():
    # AOTAutograd graphs are traced for their inputs' strides (ConvNeXt's backward graph gets channels-last saved
    # activations); tn traced every input as contiguous, so permute(x) was not contiguous and the graph's
    # .view raised "view size is not compatible with input tensor's size and stride".
    def f(x):
        return (x.permute(0, 2, 3, 1) * 2).view(-1, x.shape[1]).sum(0)

    x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    torch.testing.assert_close(torch.compile(f, backend="neuron")(x), f(x), **TOL)
