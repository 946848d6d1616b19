# tn's exception conventions: every tn error is a tn.TnError and also the builtin/torch type PyTorch code catches.
import ast
import importlib
import pathlib
import pkgutil

import pytest
import torch

import tn
import tn.errors as errors
import tn.lower  # noqa: F401  (registers the neuron backend; imports the compiler's error sites)

ROOT = pathlib.Path(tn.__file__).resolve().parent.parent

# the documented table of tn/errors.py: tn type -> the type users' code catches
EXPECTED_BASES = {
    errors.TracingError: RuntimeError,
    errors.UnsupportedOpError: RuntimeError,
    errors.CompileError: RuntimeError,
    errors.ExecutionError: RuntimeError,
    errors.NeuronError: RuntimeError,
    errors.DeviceError: RuntimeError,
    errors.OutOfMemoryError: torch.OutOfMemoryError,
    errors.OnChipMemoryError: torch.OutOfMemoryError,
    errors.ArgumentTypeError: TypeError,
    errors.ArgumentValueError: ValueError,
    errors.MissingDependencyError: ImportError,
}
CATCHABLE = (RuntimeError, TypeError, ValueError, ImportError)


def _import_all_tn_modules():
    for pkg in (tn, tn.lower, tn.neuron, tn.device, tn.adaptive, tn.assess):
        for info in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + "."):
            importlib.import_module(info.name)


def _all_subclasses(cls):
    out = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


@pytest.mark.parametrize("cls", sorted(EXPECTED_BASES, key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_each_error_type_is_a_tn_error_and_its_builtin_base(cls):
    assert issubclass(cls, tn.TnError)
    assert issubclass(cls, EXPECTED_BASES[cls])
    assert getattr(tn, cls.__name__) is cls          # exported at the top level
    assert cls.__name__ in errors.__all__


def test_every_tn_error_class_in_the_package_derives_from_a_catchable_builtin():
    _import_all_tn_modules()
    plain = [f"{c.__module__}.{c.__qualname__}" for c in _all_subclasses(tn.TnError) if not issubclass(c, CATCHABLE)]
    assert plain == [], f"tn error classes that only derive from TnError: {plain}"


def test_no_source_raises_the_bare_base_class():
    """``raise TnError(...)`` says nothing about the kind of failure: tn code raises one of the typed errors."""
    found = []
    for path in [*(ROOT / "tn").rglob("*.py"), *(ROOT / "adaptive").rglob("*.py")]:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                f = node.exc.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if name == "TnError":
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == [], f"raise TnError(...) at {found}"


def _sbuf_full():
    tn.neuron.Program("too_big").sbuf((128, 1 << 20), "float32")


def test_on_chip_memory_errors_are_out_of_memory_and_neuron_errors():
    for caught in (torch.OutOfMemoryError, RuntimeError, tn.NeuronError, tn.OutOfMemoryError, tn.TnError):
        with pytest.raises(caught, match="SBUF is full"):
            _sbuf_full()


def test_device_out_of_memory_is_a_torch_out_of_memory_error():
    from tn.device import allocator

    torch.neuron.empty_cache()
    try:
        allocator.set_memory_limit(torch.neuron.memory_reserved() + 4096)
        with pytest.raises(torch.OutOfMemoryError, match="cannot allocate") as info:
            torch.empty(1 << 20, device="neuron")
        assert isinstance(info.value, tn.TnError) and isinstance(info.value, allocator.DeviceMemoryError)
    finally:
        allocator.set_memory_limit(0)


def test_tracing_and_unsupported_op_errors_are_runtime_errors():
    def branchy(x):
        return x + 1 if x.sum() > 0 else x - 1

    with pytest.raises(RuntimeError) as info:
        tn.jit(branchy, backend="reference")(torch.randn(3))
    assert isinstance(info.value, tn.TracingError)
    with pytest.raises(RuntimeError) as info:
        tn.make_ir(lambda x: torch.geqrf(x)[0])(torch.randn(2, 7, dtype=torch.float64))  # float64: no meta kernel, no native form
    assert isinstance(info.value, tn.UnsupportedOpError)


def test_mixed_devices_are_a_runtime_error():
    if torch.neuron.device_count() < 2:
        pytest.skip("the modelled machine has one device")
    a = torch.ones(3, device="neuron:0")
    b = torch.ones(3, device="neuron:1")
    with pytest.raises(RuntimeError, match="same device") as info:
        a + b
    assert isinstance(info.value, tn.DeviceError)
    with pytest.raises(RuntimeError) as info:
        torch.ones(1, device=f"neuron:{torch.neuron.device_count()}")
    assert isinstance(info.value, tn.DeviceError)


def test_bad_arguments_are_type_and_value_errors():
    with pytest.raises(TypeError):
        tn.jit(42)
    with pytest.raises(TypeError):
        tn.jit(lambda x: x, static_argnums="0")
    with pytest.raises(ValueError):
        tn.jit(lambda x: x, cache_size=0)
    with pytest.raises(ValueError, match="unknown backend"):
        tn.jit(lambda x: x, backend="no such backend")(torch.ones(1))
    with pytest.raises(TypeError):
        tn.adaptive(42)
    with pytest.raises(TypeError, match="unknown policy keyword"):
        tn.adaptive(torch.nn.Linear(2, 2), no_such_keyword=1)
    with pytest.raises(ValueError):
        torch.neuron.set_eager_mode("no such mode")
    with pytest.raises(ValueError):
        tn.profile().table(by="nothing")


def test_no_source_raises_a_bare_builtin_error():
    """tn's errors keep ``tn.TnError`` as their common base: tn code raises ``ArgumentTypeError`` /
    ``ArgumentValueError`` / a ``RuntimeError``-derived tn error, never a bare ``TypeError``, ``ValueError``,
    ``RuntimeError`` or ``NotImplementedError`` that ``except tn.TnError`` would miss (tn.lower.testing's
    ``AssertionError`` is a test helper's assertion, and a re-raise of a caught object is not a construction)."""
    bare = {"TypeError", "ValueError", "RuntimeError", "NotImplementedError", "KeyError", "IndexError"}
    found = []
    for path in [*(ROOT / "tn").rglob("*.py"), *(ROOT / "adaptive").rglob("*.py")]:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and isinstance(node.exc.func, ast.Name):
                if node.exc.func.id in bare:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.exc.func.id}")
    assert found == [], f"bare builtin errors raised at {found}"
