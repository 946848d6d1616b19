# Tests of conformance fixes from issue 17 (bench/coverage.py findings): ops that ran on the host or gave wrong answers.
import pytest
import torch

import tn
import tn.lower  # noqa: F401  (registers the lowerings and the neuron backend)


def _no_new_fallbacks(before):
    after = torch.neuron.fallback_ops()
    new = {k: v for k, v in after.items() if v != before.get(k, 0)}
    assert not new, f"host fallbacks: {new} ({torch.neuron.fallback_reasons()})"


# --------------------------------------------------------------------------- scans on the device


_SCANS = {
    "logcumsumexp": lambda t: torch.logcumsumexp(t, 1),
    "cummax": lambda t: torch.cummax(t, 1),
    "cummin": lambda t: torch.cummin(t, 0),
}


@pytest.mark.parametrize("name", sorted(_SCANS))
def test_scans_run_natively_on_the_device(monkeypatch, name):
    """The device's composite logcumsumexp/cummax/cummin call the kernels aten._logcumsumexp and
    aten._cummax_helper/_cummin_helper (no Meta kernel, no core op): they ran on the host."""
    monkeypatch.setenv("TN_STRICT", "1")
    f = _SCANS[name]
    x = torch.randn(6, 7, generator=torch.Generator().manual_seed(0))
    x[2, 3] = x[2, 1]                      # a tie: the later index wins
    before = dict(torch.neuron.fallback_ops())
    got = f(x.to("neuron"))
    want = f(x)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert g.device.type == "neuron"
        torch.testing.assert_close(g.cpu(), w)
    _no_new_fallbacks(before)


@pytest.mark.parametrize("name", sorted(_SCANS))
def test_scans_gradient_on_the_device(name):
    f = _SCANS[name]
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    xd = x.to("neuron").requires_grad_()
    xc = x.clone().requires_grad_()
    out_d, out_c = f(xd), f(xc)
    (out_d[0] if isinstance(out_d, tuple) else out_d).sum().backward()
    (out_c[0] if isinstance(out_c, tuple) else out_c).sum().backward()
    torch.testing.assert_close(xd.grad.cpu(), xc.grad, rtol=1e-4, atol=1e-5)
