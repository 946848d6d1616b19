# PyTorch's own parallelism on neuron ranks: FSDP2, tensor parallel, 2-D meshes, DCP on tiny HF GPT-2 / Llama.
"""FSDP2 (``fully_shard``), tensor parallel (``parallelize_module``) and DTensor on the ``neuron`` backend.

Every run starts real ranks (spawned processes on loopback, the rank jobs of
``tests/dist_parallel.py``) and compares with one device: rank 0 trains an
unsharded copy of the same tiny HF model on the whole batch. These are
multi-process training runs, so they are ``slow``.
"""
from __future__ import annotations

import functools

import pytest
import torch

import dist_parallel as P
import dist_workers as W

pytest.importorskip("transformers")


def _train(world=2, **kw):
    reports, _ = W.run_ranks(functools.partial(P.job_train, **kw), world, timeout=900)
    return W.ok(reports)


def _check_matches_single_device(results, rtol=1e-4, atol=1e-5, params=True):
    R = results[0]
    assert len(R["losses"]) == len(R["ref_losses"]) == 20
    torch.testing.assert_close(torch.tensor(R["losses"]), torch.tensor(R["ref_losses"]), rtol=rtol, atol=atol)
    torch.testing.assert_close(torch.tensor(R["norms"]), torch.tensor(R["ref_norms"]), rtol=10 * rtol, atol=atol)
    assert min(R["ref_norms"]) > 0.5       # max_norm 0.5: clipping took part in every step
    if params:
        assert R["params"].keys() == R["ref_params"].keys()
        for k, ref in R["ref_params"].items():
            torch.testing.assert_close(R["params"][k], ref, rtol=10 * rtol, atol=10 * atol, msg=k)
    for other in results[1:]:
        assert other["losses"] == R["losses"]   # every rank saw the same global mean
    assert R["fallback_ops"] == {}              # every op FSDP2/DTensor called ran on the device model
    assert all(ns > 0 for ns in R["step_collective_ns"])


@pytest.fixture(scope="module")
def fsdp2_gpt2():
    return _train(model="gpt2", parallel="fsdp2")


def _check_fsdp2(results):
    _check_matches_single_device(results)
    stats = results[0]["stats"]
    # per step: each of the 2 blocks gathered in forward and again in backward, the root once; 3 reduce-scatters
    assert stats["all_gather_into_tensor"]["calls"] == 20 * 5 and stats["reduce_scatter_tensor"]["calls"] == 20 * 3


@pytest.mark.slow
def test_fsdp2_two_ranks_gpt2_matches_single_device(fsdp2_gpt2):
    _check_fsdp2(fsdp2_gpt2)


@pytest.mark.slow
def test_fsdp2_two_ranks_llama_matches_single_device():
    _check_fsdp2(_train(model="llama", parallel="fsdp2"))


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_tensor_parallel_two_ranks_matches_single_device(model):
    results = _train(model=model, parallel="tp")
    _check_matches_single_device(results)
    assert results[0]["stats"]["all_reduce"]["calls"] >= 20 * 2 * 2   # row-wise outputs: 2 per layer per pass


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_ddp_two_ranks_matches_single_device(model):
    """DistributedDataParallel of a tiny HF model, 20 AdamW steps with gradient clipping: the same losses, norms
    and weights as one device training on the whole batch."""
    results = _train(model=model, parallel="ddp")
    _check_matches_single_device(results)
    assert results[0]["stats"]["all_reduce"]["calls"] >= 20      # gradient buckets, every step


@pytest.mark.slow
def test_ddp_four_ranks_gpt2_matches_single_device():
    results = _train(world=4, model="gpt2", parallel="ddp")
    _check_matches_single_device(results)
    assert all(len(r["losses"]) == 20 for r in results) and len(results) == 4


@pytest.mark.slow
def test_fsdp2_mixed_precision_bf16_params_fp32_reduce_matches_single_device_recipe(fsdp2_gpt2):
    results = _train(model="gpt2", parallel="fsdp2", mixed_precision=True)
    # bf16 rounding of the gradients makes AdamW's steps of near-zero gradients differ in sign: losses and norms
    # agree, single weights may not
    _check_matches_single_device(results, rtol=1e-3, atol=1e-5, params=False)
    mp, fp32 = results[0]["stats"], fsdp2_gpt2[0]["stats"]
    # bf16 parameters are gathered (half the bytes of fp32), fp32 gradients reduced (the same bytes)
    assert mp["all_gather_into_tensor"]["bytes"] * 2 == fp32["all_gather_into_tensor"]["bytes"]
    assert mp["reduce_scatter_tensor"]["bytes"] == fp32["reduce_scatter_tensor"]["bytes"]


@pytest.mark.slow
def test_two_dimensional_mesh_fsdp2_by_tensor_parallel_four_ranks_matches_single_device():
    results = _train(world=4, model="llama", parallel="fsdp2+tp")
    _check_matches_single_device(results)
    stats = results[0]["stats"]
    assert stats["all_gather_into_tensor"]["calls"] > 0 and stats["all_reduce"]["calls"] > 0


@pytest.mark.slow
def test_distributed_checkpoint_resume_gives_the_same_losses(tmp_path):
    path = str(tmp_path / "ckpt")
    full = _train(model="gpt2", parallel="fsdp2", save_at=10, checkpoint=path, reference=False)
    resumed = _train(model="gpt2", parallel="fsdp2", checkpoint=path, resume=True, reference=False)
    assert resumed[0]["first_step"] == 10 and len(resumed[0]["losses"]) == 10
    for a, b in zip(full, resumed):
        torch.testing.assert_close(torch.tensor(b["losses"]), torch.tensor(a["losses"][10:]), rtol=1e-6, atol=0)
    for k, v in full[0]["params"].items():
        torch.testing.assert_close(resumed[0]["params"][k], v, rtol=1e-6, atol=0, msg=k)


@pytest.mark.slow
def test_tensor_parallel_llama_generate_gives_the_same_tokens_as_one_device():
    reports, _ = W.run_ranks(P.job_tp_generate, 2, timeout=900)
    for R in W.ok(reports):
        assert R["tokens"].shape == (2, 5 + 8)
        assert torch.equal(R["tokens"], R["ref_tokens"])
        assert R["stats"]["all_reduce"]["calls"] == 8 * 2 * 2     # per new token: 2 layers x (o_proj, down_proj)
