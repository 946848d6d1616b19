# Shared pytest setup: IR verification after every pass, and the list of jit backends the model tests run on.
import importlib
import os

import pytest
import torch

os.environ.setdefault("TN_VERIFY", "1")

import tn.passes  # noqa: E402  (after TN_VERIFY is set)

tn.passes.VERIFY = True
torch.set_num_threads(1)

#: jit backends every backend-parametrized test runs on. The NeuronCore
#: compiler adds "neuron" here (one line) once it is ready for the suite.
#: TN_TEST_BACKENDS=reference,neuron overrides the list for one run.
BACKENDS = ["reference", "neuron"]
if os.environ.get("TN_TEST_BACKENDS"):
    BACKENDS = [b.strip() for b in os.environ["TN_TEST_BACKENDS"].split(",") if b.strip()]

#: Modules that register a backend when imported.
_BACKEND_MODULES = {"neuron": "tn.lower"}


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Name of a tn.jit backend; tests using it run once per entry of BACKENDS."""
    name = request.param
    from tn.jit import backends

    if name not in backends() and name in _BACKEND_MODULES:
        importlib.import_module(_BACKEND_MODULES[name])
    if name not in backends():
        pytest.skip(f"jit backend {name!r} is not registered")
    return name
