# tn.adaptive carries Mamba's cache (conv/recurrent states a region updates in place with copy_) as state (issue 17).
import pytest
import torch

import tn

transformers = pytest.importorskip("transformers")


def test_linear_attention_layer_is_state_and_its_dict_tensors_are_leaves():
    from transformers.cache_utils import LinearAttentionLayer

    from tn.adaptive import state

    layer = LinearAttentionLayer()
    layer.conv_states[0] = torch.zeros(1, 4, 3)
    assert state.is_state(layer)
    leaves = []
    spec = state.flatten(layer, leaves)
    assert len(leaves) == 1 and leaves[0] is layer.conv_states[0]
    assert spec[0] == "o"


def test_holding_tensors_inside_a_dict_is_not_static():
    from tn.adaptive import state

    class Holder:
        def __init__(self):
            self.states = {0: torch.zeros(2)}

    with pytest.raises(state.StateError, match="holding tensors"):
        state.flatten([Holder()], [])


def test_mamba_decode_regions_compile_and_match_eager():
    """The mixer's causal_conv1d_update writes conv_state.copy_(...) into the cache's tensor: regions holding
    it stayed eager for good ('writes in place into a tensor it did not receive as an argument')."""
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(0)
    cfg = MambaConfig(vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=2, conv_kernel=4, expand=2)
    m = MambaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (1, 5))
    want = m.generate(ids, max_new_tokens=4, do_sample=False)
    am = tn.adaptive(m, costs={"eager": 1.0, "compiled": 0.0, "compile": 0.0}, min_calls=1, min_gain=0.0)
    got = am.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, want)
    rows = tn.adaptive_report(am, print_table=False)
    stuck = [r["region"] for r in rows if "eager for good" in str(r.get("reason", ""))]
    assert not stuck, stuck
    layers = [r for r in rows if r["region"] in ("backbone.layers.0", "backbone.layers.1", "<root>")]
    assert layers and all(r["compiles"] >= 1 and r["hits"] >= 1 for r in layers), layers
