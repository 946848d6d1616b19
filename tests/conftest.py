# Shared pytest setup: IR verification after every pass, and the list of jit backends the model tests run on.
import os

import pytest
import torch

os.environ.setdefault("TN_VERIFY", "1")

import tn.passes  # noqa: E402  (after TN_VERIFY is set)

tn.passes.VERIFY = True
torch.set_num_threads(1)

#: jit backends every backend-parametrized test runs on. The NeuronCore
#: compiler adds "neuron" here (one line) once it registers that backend.
BACKENDS = ["reference"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Name of a tn.jit backend; tests using it run once per entry of BACKENDS."""
    return request.param
