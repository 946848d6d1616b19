# Tests of tn.adaptive's eager regions on the NeuronCore model for a model that lives on the CPU (issue 13).
import copy

import pytest
import torch
import torch.nn as nn

import tn

# eager for good on the neuron backend: no signature is ever compiled (min_calls is never reached)
EAGER = dict(min_calls=10 ** 9, backend="neuron")
# compiles soon: eager and compiled calls mix
MIXED = dict(costs={"eager": 0.01, "compiled": 0.001, "compile": 0.02}, compile_time_prior=0.02, backend="neuron")


class Block(nn.Module):
    """A residual MLP block with a LayerNorm."""

    def __init__(self, d=16):
        super().__init__()
        self.n = nn.LayerNorm(d)
        self.a = nn.Linear(d, 32)
        self.b = nn.Linear(32, d)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(self.n(x))))


def _pair(seed=0, **policy):
    torch.manual_seed(seed)
    m = nn.Sequential(Block(), Block())
    ref = copy.deepcopy(m)
    return m, ref, tn.adaptive(m, **policy)


def _close(a, b, tol=1e-5):
    assert a.device.type == "cpu" and a.shape == b.shape, (a.device, a.shape, b.shape)
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("windows", [True, False])
def test_forward_runs_on_the_device_and_equals_cpu(windows):
    m, ref, a = _pair(eager_windows=windows, **EAGER)
    x = torch.randn(4, 16)
    with torch.no_grad(), tn.profile() as prof:
        y = a(x)
    _close(y, ref(x))
    # the eager regions' programs are in the profile: modelled, deterministic
    assert len(prof.runs) > 0 and prof.total_us > 0
    rows = {r["region"]: r for r in a.report(print_table=False)}
    assert rows["<root>"]["mode"] == "eager" and rows["<root>"]["compiles"] == 0
    assert rows["<root>"]["eager_on"] == ("neuron (windows)" if windows else "neuron (op by op)")
    assert rows["<root>"]["eager_device_us"] > 0
    assert a.regions["<root>"].eager_device_programs == len(prof.runs)
    # every parameter went up once; a second call reuses the mirrors
    mirrors = a._tn_ctl.placement.mirrors
    up = mirrors.uploads
    assert up >= len(list(m.parameters())) + 1  # parameters and the input
    with torch.no_grad():
        _close(a(x), ref(x))
    assert mirrors.uploads == up and mirrors.reuses > 0


def test_host_escape_hatch_runs_nothing_on_the_device():
    m, ref, a = _pair(eager_on="host", min_calls=10 ** 9, backend="neuron")
    x = torch.randn(4, 16)
    with torch.no_grad(), tn.profile() as prof:
        y = a(x)
    _close(y, ref(x))
    assert len(prof.runs) == 0
    assert {r["eager_on"] for r in a.report(print_table=False)} == {"host"}
    # the reference backend runs compiled regions on the host: eager follows it there by default
    _, _, a = _pair(min_calls=10 ** 9, backend="reference")
    assert a.report(print_table=False)[0]["eager_on"] == "host"
    with pytest.raises(tn.TnError):
        tn.adaptive(nn.Linear(2, 2), eager_on="gpu")


def test_parameter_changes_refresh_the_mirrors():
    m, ref, a = _pair(**EAGER)
    x = torch.randn(3, 16)
    with torch.no_grad():
        a(x)
        for mod in (m, ref):
            mod[0].a.weight.mul_(2.0)            # in place: _version changes
            mod[1].b.bias = nn.Parameter(torch.ones(16))  # a new parameter object
        _close(a(x), ref(x))
        sd = {k: torch.randn_like(v) for k, v in ref.state_dict().items()}
        m.load_state_dict(sd)
        ref.load_state_dict(sd)
        _close(a(x), ref(x))


@pytest.mark.parametrize("policy", [EAGER, MIXED], ids=["eager", "mixed"])
def test_training_steps_equal_cpu(policy):
    m, ref, a = _pair(seed=1, **policy)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(5):
        x = torch.randn(8, 16)
        xr = x.clone().requires_grad_(True)
        x.requires_grad_(True)
        loss = a(x).square().mean()
        loss_ref = ref(xr).square().mean()
        loss.backward()
        loss_ref.backward()
        assert loss.device.type == "cpu"
        torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
        _close(x.grad, xr.grad, 1e-4)
        for p, pr in zip(m.parameters(), ref.parameters()):
            assert p.grad is not None and p.grad.device.type == "cpu"
            _close(p.grad, pr.grad, 1e-4)
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
    for p, pr in zip(m.parameters(), ref.parameters()):
        _close(p.detach(), pr.detach(), 1e-4)
    if policy is EAGER:
        assert a.regions["<root>"].eager_device_us > 0


def test_batchnorm_running_stats_written_back():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4)).train()
    ref = copy.deepcopy(m)
    a = tn.adaptive(m, regions=[""], **EAGER)
    for _ in range(3):
        x = torch.randn(6, 8)
        (a(x) ** 2).sum().backward()
        (ref(x) ** 2).sum().backward()
    bn, bnr = m[1], ref[1]
    _close(bn.running_mean, bnr.running_mean)
    _close(bn.running_var, bnr.running_var)
    assert int(bn.num_batches_tracked) == int(bnr.num_batches_tracked) == 3
    _close(m[0].weight.grad, ref[0].weight.grad, 1e-4)
    m.eval()
    ref.eval()
    with torch.no_grad():
        x = torch.randn(5, 8)
        _close(a(x), ref(x))


class _InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x, acc):
        acc.add_(x * self.w)       # an in-place write to an argument
        return x, acc * 2          # the first result is the caller's own tensor


def test_in_place_argument_write_and_identity():
    torch.manual_seed(0)
    mod = _InPlace()
    a = tn.adaptive(mod, regions=[""], **EAGER)
    x, acc = torch.randn(3, 4), torch.zeros(3, 4)
    acc_ref = x * mod.w.detach()
    with torch.no_grad():
        x_out, y = a(x, acc)
    assert x_out is x
    _close(acc, acc_ref)
    _close(y, 2 * acc_ref)


class _HostOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(torch.from_numpy(x.numpy() * 2.0))  # numpy() of a device tensor raises


def test_region_that_fails_on_the_device_falls_back_to_the_host():
    torch.manual_seed(0)
    mod = _HostOnly()
    ref = copy.deepcopy(mod)
    a = tn.adaptive(mod, regions=[""], **EAGER)
    x = torch.randn(2, 4)
    with torch.no_grad():
        _close(a(x), ref(x))
        _close(a(x), ref(x))
    row = a.report(print_table=False)[0]
    assert row["eager_on"].startswith("host (fell back: ")
    assert "on the host for good" in row["reason"] or a.regions["<root>"].eager_host
    with pytest.raises(RuntimeError):  # the user's own error is still the user's
        a(torch.randn(2, 5))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hf_generate_equals_cpu(tiny_hf, kind):
    m = tiny_hf(kind)
    ids = torch.randint(2, 64, (2, 5))
    ref = m.generate(ids, max_new_tokens=8, do_sample=False)
    a = tn.adaptive(m, **EAGER)
    with tn.profile() as prof:
        out = a.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(out, ref)
    assert len(prof.runs) > 0 and prof.total_us > 0
    rows = {r["region"]: r for r in a.report(print_table=False)}
    assert rows["<root>"]["eager_on"] == "neuron (windows)" and rows["<root>"]["eager_device_us"] > 0
    assert all(r["compiles"] == 0 for r in rows.values())
    if kind != "gpt2":
        return
    # again with compiles: compiled and device-eager calls mix, the tokens stay
    m2 = tiny_hf("gpt2")
    a2 = tn.adaptive(m2, **MIXED)
    for _ in range(2):
        assert torch.equal(a2.generate(ids, max_new_tokens=8, do_sample=False), ref)
    assert sum(r["compiles"] for r in a2.report(print_table=False)) >= 1


def test_dropout_draws_as_cpu_and_backward_runs_on_the_device():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.Linear(16, 4)).train()
    ref = copy.deepcopy(m)
    a = tn.adaptive(m, regions=[""], **EAGER)
    x = torch.randn(5, 8)
    torch.manual_seed(3)
    y = a(x)
    torch.manual_seed(3)
    yr = ref(x)
    _close(y.detach(), yr.detach())
    with tn.profile() as prof:  # the eager region's backward runs on the device too
        y.square().sum().backward()
    yr.square().sum().backward()
    assert len(prof.runs) > 0 and prof.total_us > 0
    for p, pr in zip(m.parameters(), ref.parameters()):
        _close(p.grad, pr.grad, 1e-4)


def test_hf_gpt2_training_steps_equal_cpu(tiny_hf):
    m = tiny_hf("gpt2").train()
    for mod in m.modules():
        if isinstance(mod, nn.Dropout):
            mod.p = 0.0
    ref = copy.deepcopy(m)
    a = tn.adaptive(m, **EAGER)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    torch.manual_seed(0)
    for _ in range(3):
        ids = torch.randint(2, 64, (2, 8))
        loss = a(ids, labels=ids).loss
        loss_ref = ref(ids, labels=ids).loss
        loss.backward()
        loss_ref.backward()
        torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-5)
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
    for p, pr in zip(m.parameters(), ref.parameters()):
        _close(p.detach(), pr.detach(), 1e-4)
    assert a.regions["<root>"].eager_device_us > 0


def test_backward_runs_in_windows_and_restores_the_mode():
    from tn.device import windows

    counts = {}
    for flag in (True, False):
        m, ref, a = _pair(seed=2, eager_windows=flag, **EAGER)
        for _ in range(2):  # the second step hits the window cache
            x = torch.randn(4, 16)
            loss = a(x).square().sum()
            with tn.profile() as prof:
                loss.backward()
            assert windows.mode() == "op"  # the backward pass's windows end with it
            ref(x).square().sum().backward()
        for p, pr in zip(m.parameters(), ref.parameters()):
            _close(p.grad, pr.grad, 1e-4)
        counts[flag] = len(prof.runs)
        assert prof.total_us > 0
    assert counts[True] < counts[False], counts


def test_block_regions_without_the_root():
    # each block is moved to the device on its own: one block's result (downloaded) is the next one's input,
    # which the mirrors hand back without a copy; gradients cross both boundaries
    m, ref, a = _pair(seed=3, regions=["0", "1"], **EAGER)
    mirrors = a._tn_ctl.placement.mirrors
    x = torch.randn(4, 16)
    with torch.no_grad():
        _close(a(x), ref(x))
    assert mirrors.reuses >= 1
    x = torch.randn(4, 16, requires_grad=True)
    xr = x.detach().clone().requires_grad_(True)
    a(x).square().sum().backward()
    ref(xr).square().sum().backward()
    _close(x.grad, xr.grad, 1e-4)
    for p, pr in zip(m.parameters(), ref.parameters()):
        _close(p.grad, pr.grad, 1e-4)
    assert all(a.regions[n].eager_device_us > 0 for n in ("0", "1"))


def test_cpu_autocast_keeps_its_meaning():
    m, ref, a = _pair(seed=4, **EAGER)
    x = torch.randn(4, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y, yr = a(x), ref(x)
    with torch.no_grad():
        y32 = ref(x)
    assert y.dtype == yr.dtype
    _close(y.float(), yr.float(), 1e-2)
    assert (yr.float() - y32).abs().max() > 0  # autocast changed the CPU result: the test can tell


def test_log_says_where_eager_calls_run(monkeypatch, caplog):
    monkeypatch.setenv("TN_LOG", "adaptive")
    _, _, a = _pair(**EAGER)
    with caplog.at_level("WARNING", logger="tn"), torch.no_grad():
        a(torch.randn(2, 16))
    assert "eager calls run on the neuron device (windows)" in caplog.text


class _Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls = self.calls + 1  # reassigned, not updated in place
        return self.lin(x) * self.calls


def test_reassigned_buffer_comes_back():
    torch.manual_seed(0)
    mod = _Counter()
    ref = copy.deepcopy(mod)
    a = tn.adaptive(mod, regions=[""], **EAGER)
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):
            _close(a(x), ref(x))
    assert mod.calls.device.type == "cpu" and float(mod.calls) == 3.0
