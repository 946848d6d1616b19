# Shared pytest setup: IR verification after every pass, and the list of jit backends the model tests run on.
import os

import pytest
import torch

os.environ.setdefault("TN_VERIFY", "1")

import tn.passes  # noqa: E402  (after TN_VERIFY is set)
from tn import config  # noqa: E402

tn.passes.VERIFY = True
torch.set_num_threads(1)

#: jit backends every backend-parametrized test runs on. The NeuronCore
#: compiler adds "neuron" here (one line) once it is ready for the suite.
#: TN_TEST_BACKENDS=reference,neuron overrides the list for one run.
BACKENDS = ["reference", "neuron"]
if config.get("test_backends"):
    BACKENDS = [b.strip() for b in config.get("test_backends").split(",") if b.strip()]


#: Test modules of the neuron device whose tests run twice, in both eager modes of the device: "op" (every op
#: its own program) and "adaptive" (ops gathered into windows, tn.device.windows). Tests marked op_mode_only
#: run in op mode only; adaptive runs of tests marked adaptive_slow are marked slow.
EAGER_MODE_MODULES = ("test_device", "test_device_usage", "test_training_device", "test_device_autocast",
                      "test_device_memory", "test_device_deterministic")


def pytest_generate_tests(metafunc):
    if "device_eager_mode" not in metafunc.fixturenames:
        return
    if metafunc.module.__name__.rpartition(".")[2] not in EAGER_MODE_MODULES or \
            metafunc.definition.get_closest_marker("op_mode_only"):
        return
    slow = metafunc.definition.get_closest_marker("adaptive_slow") is not None
    metafunc.parametrize("device_eager_mode", ["op", pytest.param("adaptive", marks=[pytest.mark.slow] if slow
                                                                  else [])], indirect=True)


@pytest.fixture(autouse=True)
def device_eager_mode(request):
    """The neuron device's eager mode for this test ("op" or "adaptive", see EAGER_MODE_MODULES); tests outside
    those modules keep the mode in force (TN_EAGER_MODE). Queued work is flushed and counted before the test
    ends, so an adaptive run checks the windows it made."""
    mode = getattr(request, "param", None)
    if mode is None:
        yield None
        return
    from tn.device import windows

    with windows.eager_mode(mode):
        yield mode
        windows.flush("end of test")


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Name of a tn.jit backend; tests using it run once per entry of BACKENDS."""
    name = request.param
    from tn.jit import backend_compile_fn

    backend_compile_fn(name)          # registered (the compiler's on first use), or a clear error: never a skip
    return name


def _tiny_hf_model(kind: str):
    """A tiny HF model with seeded random weights, in eval mode: ``gpt2``, ``gpt2-eager-attention``, ``llama``,
    ``t5`` or ``mistral`` (2 layers, hidden 32, vocabulary 64). Skips the test without transformers."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    T = transformers
    if kind in ("gpt2", "gpt2-eager-attention"):
        attn = {"attn_implementation": "eager"} if kind == "gpt2-eager-attention" else {}
        return T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=64,
                                              bos_token_id=0, eos_token_id=1, pad_token_id=1, **attn)).eval()
    if kind == "llama":
        return T.LlamaForCausalLM(T.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=1)).eval()
    if kind == "t5":
        return T.T5ForConditionalGeneration(T.T5Config(
            vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0,
            pad_token_id=0, eos_token_id=1)).eval()
    if kind == "mistral":
        return T.MistralForCausalLM(T.MistralConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, sliding_window=8)).eval()
    raise ValueError(f"unknown tiny HF model {kind!r}")


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches and counters (graph breaks) reset before and after the test (the compile-door tests)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture
def adaptive():
    """The neuron device in adaptive eager mode (tn.device.windows) with fresh counters; flushes at the end."""
    from tn.device import windows  # lazy: only the window tests ask for this fixture

    windows.reset_stats()
    with windows.eager_mode("adaptive"):
        yield windows
        windows.flush("end of test")


@pytest.fixture
def tiny_hf():
    """Builder of tiny seeded HF models (see :func:`_tiny_hf_model`): ``tiny_hf("gpt2")``."""
    return _tiny_hf_model


def _module_matches_on_device(make, x, out_tol=None):
    """``make()`` on CPU and a copy on the neuron device (same state): the forward and the gradients of
    ``y.square().sum()`` (input, weight, bias) agree; ``out_tol``: rtol/atol of the forward (default: torch's)."""
    m, md = make(), make()
    md.load_state_dict(m.state_dict())
    md.to("neuron")
    x = x.requires_grad_()
    xd = x.detach().to("neuron").requires_grad_()
    y, yd = m(x), md(xd)
    y.square().sum().backward()
    yd.square().sum().backward()
    torch.testing.assert_close(yd.cpu(), y, **({} if out_tol is None else {"rtol": out_tol, "atol": out_tol}))
    for a, r in ((xd.grad, x.grad), (md.weight.grad, m.weight.grad), (md.bias.grad, m.bias.grad)):
        torch.testing.assert_close(a.cpu(), r, rtol=1e-4, atol=1e-4)


@pytest.fixture
def module_matches_on_device():
    """:func:`_module_matches_on_device`: a module and its neuron-device copy agree in forward and backward."""
    return _module_matches_on_device


_SOLO_GROUPS: dict = {}


def solo_process_group(name: str = "tn_solo") -> str:
    """Register (once per process) a one-rank gloo process group named ``name`` and return the name.

    Functional collectives (``torch.ops._c10d_functional``) take a group name, so in-process tests of compiled
    collectives need no default process group (``torch.distributed.init_process_group`` would stay in force for
    every later test of the worker)."""
    if name not in _SOLO_GROUPS:
        import torch.distributed as dist
        from torch._C._distributed_c10d import _register_process_group

        store = dist.HashStore()
        pg = dist.ProcessGroup(store, 0, 1)
        gloo = dist.ProcessGroupGloo(store, 0, 1)
        pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
        pg._set_group_name(name)
        _register_process_group(name, pg)
        _SOLO_GROUPS[name] = pg
    return name


@pytest.fixture
def solo_group():
    """The name of a one-rank gloo process group (:func:`solo_process_group`)."""
    return solo_process_group()
