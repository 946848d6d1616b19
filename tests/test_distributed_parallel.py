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


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_fsdp2_two_ranks_matches_single_device(model):
    results = _train(model=model, parallel="fsdp2")
    _check_matches_single_device(results)
    stats = results[0]["stats"]
    assert stats["all_gather_into_tensor"]["calls"] >= 20 * 2 and stats["reduce_scatter_tensor"]["calls"] >= 20


@pytest.mark.slow
def test_tensor_parallel_two_ranks_matches_single_device():
    results = _train(model="llama", parallel="tp")
    _check_matches_single_device(results)
    assert results[0]["stats"]["all_reduce"]["calls"] >= 20 * 2 * 2   # row-wise outputs: 2 per layer per pass
