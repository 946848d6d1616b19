# FSDP2 / tensor-parallel / 2-D rank jobs on tiny HF GPT-2 and Llama (tests and bench/distributed.py run them).
"""Rank jobs of PyTorch's own parallelism APIs on the neuron device, for :func:`tn.distributed.spawn.run_ranks`.

Each job is ``job(rank, world, **options) -> dict`` (pass options with
``functools.partial``; the partial of a module-level function pickles), e.g.::

    import functools, dist_parallel as P
    from tn.distributed.spawn import run_ranks, results_of
    results_of(run_ranks(functools.partial(P.job_train, model="gpt2", parallel="fsdp2"), 2)[0])

* :func:`job_train`: a training loop (AdamW, gradient clipping) of a tiny HF
  model (random weights, nothing downloaded) parallelised by
  ``parallel`` = ``"ddp"``, ``"fsdp2"`` (``fully_shard`` per block and the
  root), ``"tp"`` (``parallelize_module`` with Colwise/Rowwise plans over a
  1-D mesh; GPT-2's ``Conv1D`` layers first become ``nn.Linear``, see
  :func:`gpt2_linear_for_tp`) or ``"fsdp2+tp"`` (a 2-D
  ``DeviceMesh('neuron', (dp, tp))``).
  Every rank of a data-parallel dimension takes its slice of one global
  batch; rank 0 also trains an unsharded copy on one device on the whole
  batch, so the result holds both loss curves (``losses``, ``ref_losses``).
  ``mixed_precision=True`` gives FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)`` and the reference follows the same recipe on one
  device (a bf16 copy of the fp32 weights runs forward and backward, its
  gradients step the fp32 weights).
* :func:`job_tp_generate`: greedy ``generate`` of a tensor-parallel Llama
  against the same model on one device.
* What a bench reads from the result: ``step_wall_s`` (host wall time of each
  parallel step), ``step_collective_ns`` (modelled collective time of each
  step, from :func:`torch.neuron.collective_stats`), ``stats`` (per collective
  calls, bytes, modelled ns after the loop) and ``fallback_ops`` (ops that ran
  on the host instead of the device model).

The model builders (:func:`build_model`) use configs small enough for a
2-core host: 2 layers, hidden 32, vocabulary 64, dropout 0.
"""
from __future__ import annotations

import datetime
import time

import torch

VOCAB = 64


# ---------------------------------------------------------------------------------------------- models
def build_model(kind: str):
    """A tiny HF causal LM with seeded random weights, in train mode, on the CPU: ``"gpt2"`` or ``"llama"``
    (2 layers, hidden 32, 4 heads, vocabulary 64, no dropout)."""
    import transformers as T

    T.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = T.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=0,
                           eos_token_id=1, pad_token_id=1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return T.GPT2LMHeadModel(cfg).train()
    if kind == "llama":
        cfg = T.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                            bos_token_id=0, eos_token_id=1, pad_token_id=1)
        return T.LlamaForCausalLM(cfg).train()
    raise ValueError(f"unknown model kind {kind!r} (gpt2, llama)")


def blocks(model):
    """The transformer blocks of a :func:`build_model` model (what FSDP2 shards one by one)."""
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


# ---------------------------------------------------------------------------------------------- parallelism
def llama_tp_plan(model) -> dict:
    """``parallelize_module`` plan of a HF Llama: q/k/v and gate/up projections column-wise, o/down projections
    row-wise (Megatron's split; each rank holds ``heads / tp`` attention heads; the attention reshapes with
    ``-1`` heads, so the local shards need no model change)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i, _ in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[p + name] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[p + name] = RowwiseParallel()
    return plan


def gpt2_tp_plan(model) -> dict:
    """``parallelize_module`` plan of a HF GPT-2 made ready by :func:`gpt2_linear_for_tp`: c_attn and c_fc
    column-wise, the two c_proj row-wise."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i, _ in enumerate(model.transformer.h):
        p = f"transformer.h.{i}."
        plan.update({p + "attn.c_attn": ColwiseParallel(), p + "mlp.c_fc": ColwiseParallel(),
                     p + "attn.c_proj": RowwiseParallel(), p + "mlp.c_proj": RowwiseParallel()})
    return plan


def _bench_distributed():
    """``bench/distributed.py`` as a module: its GPT-2 tensor-parallel conversion is the one these jobs use."""
    import importlib.util
    import pathlib
    import sys

    name = "tn_bench_distributed"
    if name not in sys.modules:
        path = pathlib.Path(__file__).resolve().parents[1] / "bench" / "distributed.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


def gpt2_linear_for_tp(model, tp: int):
    """A HF GPT-2 made shardable by Colwise/Rowwise plans (``bench/distributed.py``'s ``gpt2_linear_for_tp``:
    ``Conv1D`` -> ``nn.Linear``, c_attn's q/k/v rows reordered per rank, ``split_size = hidden / tp``)."""
    return _bench_distributed().gpt2_linear_for_tp(model, tp)


def apply_tp(model, mesh):
    """Tensor-parallel ``model`` over the 1-D ``mesh``: a Llama with :func:`llama_tp_plan`, a GPT-2 converted by
    :func:`gpt2_linear_for_tp` with :func:`gpt2_tp_plan`."""
    from torch.distributed.tensor.parallel import parallelize_module

    if hasattr(model, "transformer"):
        gpt2_linear_for_tp(model, mesh.size())
        return parallelize_module(model, mesh, gpt2_tp_plan(model))
    return parallelize_module(model, mesh, llama_tp_plan(model))


def apply_fsdp2(model, mesh=None, mixed_precision: bool = False):
    """``fully_shard`` each block, then the root (FSDP2's usual wrapping); ``mixed_precision``: bf16 parameters in
    forward/backward, fp32 gradient reduction."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = {"mesh": mesh} if mesh is not None else {}
    if mixed_precision:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blk in blocks(model):
        fully_shard(blk, **kw)
    fully_shard(model, **kw)
    return model


def _init(rank, world, timeout_s=60.0):
    import torch.distributed as dist

    import tn  # noqa: F401  (registers the backend)

    dist.init_process_group("neuron", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    return dist


def _batches(steps: int, batch: int, seq: int):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (batch, seq), generator=g) for _ in range(steps)]


def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a model whose gradients are not all DTensors of one mesh (tensor
    parallel shards some layers only; FSDP2 x TP puts the sharded layers on the 2-D mesh and the rest on the
    data-parallel one; torch's foreach norm refuses either mix): the 2-norm of each group (a DTensor group's
    reduced over its mesh), their total, then every gradient scaled as torch's does."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    groups: dict = {}
    for g in grads:
        groups.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    if len(groups) == 1:
        return torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], max_norm)
    norms = []
    for mesh, group in groups.items():
        norm = torch.nn.utils.get_total_norm(group)
        norms.append(norm.full_tensor() if mesh is not None else norm)
    total = torch.stack(norms).square().sum().sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0).item()
    for g in grads:
        g.mul_(coef)
    return total


def _train_step(model, opt, ids, max_norm):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    norm = clip_grad_norm(list(model.parameters()), max_norm)
    opt.step()
    opt.zero_grad()
    return loss, norm


def _unwrapped(net):
    """The model inside a ``DistributedDataParallel`` wrapper (whose state dict prefixes every key with
    ``module.``); FSDP2 and tensor parallel change the model in place, so it is returned as it is."""
    from torch.nn.parallel import DistributedDataParallel

    return net.module if isinstance(net, DistributedDataParallel) else net


def _full(x):
    """A plain CPU tensor of ``x`` (a DTensor is gathered first)."""
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor):
        x = x.full_tensor()
    return x.detach().to("cpu").float().clone()


def _collective_ns() -> float:
    return sum(v["modelled_ns"] for v in torch.neuron.collective_stats().values())


def parallelize(model, parallel: str, world: int, tp: int = 2, mixed_precision: bool = False):
    """``model`` (on the neuron device) parallelised by ``parallel`` (see the module docstring); returns
    ``(model, dp_rank, dp_size)``: the data-parallel coordinate that picks this rank's slice of the batch."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model), rank, world
    if parallel == "fsdp2":
        return apply_fsdp2(model, init_device_mesh("neuron", (world,)), mixed_precision), rank, world
    if parallel == "tp":
        return apply_tp(model, init_device_mesh("neuron", (world,))), 0, 1
    if parallel == "fsdp2+tp":
        if world % tp:
            raise ValueError(f"world {world} is not a multiple of tp {tp}")
        mesh = init_device_mesh("neuron", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        apply_tp(model, mesh["tp"])
        apply_fsdp2(model, mesh["dp"], mixed_precision)
        return model, mesh["dp"].get_local_rank(), world // tp
    raise ValueError(f"unknown parallel {parallel!r} (ddp, fsdp2, tp, fsdp2+tp)")


def _mixed_precision_reference_step(master, shadow, opt, ids, max_norm):
    """One single-device step of FSDP2's mixed-precision recipe: the bf16 ``shadow`` gets the fp32 ``master``
    weights, runs forward and backward, its gradients become the master's in fp32, then clip and step."""
    with torch.no_grad():
        for s_param, m_param in zip(shadow.parameters(), master.parameters()):
            s_param.copy_(m_param)
    loss = shadow(input_ids=ids, labels=ids).loss
    loss.backward()
    for s_param, m_param in zip(shadow.parameters(), master.parameters()):
        m_param.grad = s_param.grad.float()
        s_param.grad = None
    norm = torch.nn.utils.clip_grad_norm_(master.parameters(), max_norm)
    opt.step()
    opt.zero_grad()
    return loss, norm


def _save_checkpoint(net, opt, path, step):
    """``torch.distributed.checkpoint.save`` of the sharded model and optimizer state (each rank writes its
    shards) and the step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(net, opt)
    dcp.save({"model": model_sd, "optim": optim_sd, "step": torch.tensor(step)}, checkpoint_id=path)


def _load_checkpoint(net, opt, path) -> int:
    """``torch.distributed.checkpoint.load`` into the (already sharded) ``net`` and ``opt``; the saved step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(net, opt)
    state = {"model": model_sd, "optim": optim_sd, "step": torch.tensor(0)}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["step"])


def job_train(rank, world, model="gpt2", parallel="fsdp2", steps=20, per_rank=2, seq=16, lr=3e-3, max_norm=0.5,
              mixed_precision=False, tp=2, reference=True, save_at=None, checkpoint=None, resume=False):
    """Train ``model`` for ``steps`` steps under ``parallel`` (see the module docstring); rank 0 also trains the
    single-device reference when ``reference``. Returns losses (the global batch's mean loss of each step, the
    same on every rank), gradient norms, per-step host wall and modelled collective time, stats.

    Checkpoints (``torch.distributed.checkpoint``, sharded): ``save_at=k, checkpoint=DIR`` saves the state after
    ``k`` steps (and trains on); ``resume=True, checkpoint=DIR`` loads it into a freshly built and parallelised
    model and optimizer and trains the remaining steps (``losses`` then holds those steps only)."""
    dist = _init(rank, world)
    import tn

    base = build_model(model)
    net = build_model(model)
    net.load_state_dict(base.state_dict())
    net.to("neuron")
    net, dp_rank, dp_size = parallelize(net, parallel, world, tp, mixed_precision)
    # tensor parallel leaves embeddings and norms plain tensors (or, under FSDP2, DTensors of the data-parallel
    # mesh) beside the 2-D shards: torch's foreach optimizer kernels refuse that mix, so the per-parameter loop
    opt = torch.optim.AdamW(net.parameters(), lr=lr, foreach=False if "tp" in parallel else None)
    data = _batches(steps, per_rank * dp_size, seq)
    first = _load_checkpoint(net, opt, checkpoint) if resume else 0
    tn.neuron.reset_op_counts()
    torch.neuron.reset_collective_stats()
    losses, norms, walls, coll = [], [], [], []
    for step in range(first, steps):
        ids = data[step]
        t0, c0 = time.perf_counter(), _collective_ns()
        mine = ids[dp_rank * per_rank:(dp_rank + 1) * per_rank].to("neuron")
        loss, norm = _train_step(net, opt, mine, max_norm)
        mean = loss.detach().float()
        if dp_size > 1:
            dist.all_reduce(mean, op=dist.ReduceOp.AVG)   # the mean over equal slices = the global batch's mean
        losses.append(mean.item())
        norms.append(float(_full(norm)))
        walls.append(time.perf_counter() - t0)
        coll.append(_collective_ns() - c0)
        if save_at is not None and step + 1 == save_at:
            _save_checkpoint(net, opt, checkpoint, step + 1)
    out = {"losses": losses, "norms": norms, "step_wall_s": walls, "step_collective_ns": coll, "first_step": first,
           "stats": torch.neuron.collective_stats(), "fallback_ops": dict(tn.neuron.fallback_ops()),
           "params": {k: _full(v) for k, v in _unwrapped(net).state_dict().items()}}   # every rank: gathers are
    # collectives
    if rank:
        out["params"] = None
    if rank == 0 and reference and not resume:
        ref = base.to("neuron")
        ropt = torch.optim.AdamW(ref.parameters(), lr=lr)
        shadow = build_model(model).to("neuron", torch.bfloat16) if mixed_precision else None
        ref_losses, ref_norms = [], []
        for ids in data:
            if shadow is not None:
                loss, norm = _mixed_precision_reference_step(ref, shadow, ropt, ids.to("neuron"), max_norm)
            else:
                loss, norm = _train_step(ref, ropt, ids.to("neuron"), max_norm)
            ref_losses.append(loss.item())
            ref_norms.append(float(norm))
        out["ref_losses"], out["ref_norms"] = ref_losses, ref_norms
        if "tp" in parallel and model == "gpt2":   # the same layout as the sharded model's (after training)
            gpt2_linear_for_tp(ref, world if parallel == "tp" else tp)
        out["ref_params"] = {k: _full(v) for k, v in ref.state_dict().items()}
    dist.destroy_process_group()
    return out


def job_tp_generate(rank, world, new_tokens=8, prompt_len=5):
    """Greedy ``generate`` of a tensor-parallel HF Llama (:func:`llama_tp_plan` over all ranks, KV cache of the
    local heads) and, on every rank, of the unsharded model on one device: both token sequences."""
    _init(rank, world)
    from torch.distributed.device_mesh import init_device_mesh

    base = build_model("llama").eval()
    net = build_model("llama").eval()
    net.load_state_dict(base.state_dict())
    net.to("neuron")
    apply_tp(net, init_device_mesh("neuron", (world,)))
    prompt = torch.randint(2, VOCAB, (2, prompt_len), generator=torch.Generator().manual_seed(3))
    torch.neuron.reset_collective_stats()
    with torch.no_grad():
        tokens = net.generate(prompt.to("neuron"), max_new_tokens=new_tokens, do_sample=False,
                              attention_mask=torch.ones_like(prompt).to("neuron"))
        stats = torch.neuron.collective_stats()
        ref = base.to("neuron").generate(prompt.to("neuron"), max_new_tokens=new_tokens, do_sample=False,
                                         attention_mask=torch.ones_like(prompt).to("neuron"))
    import torch.distributed as dist

    dist.destroy_process_group()
    return {"tokens": tokens.cpu(), "ref_tokens": ref.cpu(), "stats": stats}
