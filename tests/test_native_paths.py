# The native code paths a machine can run (issue 14): TN_NATIVE_ISA / TN_MATMUL_ISA parse, build_info reports them,
# and every matmul path the CPU has gives the engine the results of the automatic path.
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import tn.config as cfg
import tn._native as native
from tn._native import build_cffi

# A program run by the engine: fp32 and bf16 matmuls over edge and full tile shapes, with accumulation groups.
# Prints the build info and the outputs as JSON.
_SCRIPT = textwrap.dedent("""
    import json
    import numpy as np
    import tn._native
    from tn.neuron import Program
    from tn.neuron.runtime import to_bf16

    SHAPES = [(128, 128, 512), (3, 7, 5), (97, 128, 300), (128, 1, 512), (64, 128, 1)]
    rng = np.random.default_rng(7)
    out = {}
    for dtype in ("float32", "bfloat16"):
        for K, M, N in SHAPES:
            p = Program("paths")
            feeds = {}
            ps = p.psum((M, N))
            for i in range(2):  # two matmuls accumulating into one PSUM tile
                a_h, b_h = p.hbm(f"a{i}", (K, M), dtype), p.hbm(f"b{i}", (K, N), dtype)
                a, b = p.sbuf((K, M), dtype), p.sbuf((K, N), dtype)
                p.dma_copy(a, a_h)
                p.dma_copy(b, b_h)
                p.matmul(ps, a, b, accumulate=i > 0)
                for name, shape in ((f"a{i}", (K, M)), (f"b{i}", (K, N))):
                    v = rng.standard_normal(shape).astype(np.float32)
                    feeds[name] = to_bf16(v) if dtype == "bfloat16" else v
            y_h = p.hbm("y", (M, N), "float32", kind="output")
            y = p.sbuf((M, N), "float32")
            p.tensor_copy(y, ps)
            p.dma_copy(y_h, y)
            res = p.run(feeds)
            out[f"{dtype}:{K}x{M}x{N}"] = np.asarray(res.outputs["y"], np.float64).tolist()
    print(json.dumps({"info": tn._native.build_info(), "out": out}))
""")


def _run(matmul_isa):
    """The script's JSON in a fresh process with TN_MATMUL_ISA=matmul_isa (the build's clones unchanged)."""
    env = dict(os.environ, TN_MATMUL_ISA=matmul_isa, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def auto_run():
    return _run("auto")


# ---------------------------------------------------------------- the settings

def test_matmul_isa_setting_parses(monkeypatch):
    monkeypatch.delenv("TN_MATMUL_ISA", raising=False)
    assert cfg.get("matmul_isa") == "auto"
    for name in ("auto", "generic", "avx2", "avx512", "amx"):
        monkeypatch.setenv("TN_MATMUL_ISA", name)
        assert cfg.get("matmul_isa") == name
    monkeypatch.setenv("TN_MATMUL_ISA", "")
    assert cfg.get("matmul_isa") == "auto"
    monkeypatch.setenv("TN_MATMUL_ISA", "sse9")
    with pytest.raises(cfg.ConfigError, match="TN_MATMUL_ISA='sse9'"):
        cfg.get("matmul_isa")
    assert issubclass(cfg.ConfigError, ValueError)


def test_native_isa_setting_matches_the_build_script(monkeypatch):
    """tn.config lists the build setting with the values the build helper (setup.py, build_cffi.py) accepts."""
    assert cfg.SETTINGS["native_isa"].choices == tuple(build_cffi.NATIVE_ISAS)
    monkeypatch.delenv("TN_NATIVE_ISA", raising=False)
    assert cfg.get("native_isa") == build_cffi.native_isa() == "auto"
    assert build_cffi.native_macros() == [("TN_NATIVE_ISA", "2")]
    for name, level in build_cffi.NATIVE_ISAS.items():
        monkeypatch.setenv("TN_NATIVE_ISA", name)
        assert cfg.get("native_isa") == build_cffi.native_isa() == name
        assert build_cffi.native_macros() == [("TN_NATIVE_ISA", str(level))]
    monkeypatch.setenv("TN_NATIVE_ISA", "avx9")
    with pytest.raises(ValueError, match="TN_NATIVE_ISA='avx9'"):
        build_cffi.native_isa()
    with pytest.raises(cfg.ConfigError, match="TN_NATIVE_ISA='avx9'"):
        cfg.get("native_isa")


# ---------------------------------------------------------------- what the build and the process use

def test_build_info_reports_the_build_and_the_path_in_force():
    info = native.build_info()
    assert info["native_isa"] in build_cffi.NATIVE_ISAS
    clones = info["clones"]
    if info["native_isa"] == "portable" or not clones:
        assert clones == () and info["clone"] == ""
    else:
        assert clones[-1] == "default" and info["clone"] in clones
        assert len(clones) == 3 if info["native_isa"] == "auto" else clones == ("avx2", "default")
    # the engine links its own copy of the kernels: same build, same matmul path
    assert native.engine.native_build() == (info["native_isa"], " ".join(clones))
    assert info["engine_matmul_isa"] == info["matmul_isa"] in native.matmul_isas()
    wanted = cfg.get("matmul_isa")
    if wanted != "auto":
        assert info["matmul_isa"] == wanted


def test_set_matmul_isa_switches_both_modules_and_names_what_the_cpu_has():
    before = native.build_info()["matmul_isa"]
    have = native.matmul_isas()
    assert have[0] == "generic" and set(have) <= set(native.MATMUL_ISAS)
    try:
        for name in have:
            assert native.set_matmul_isa(name) == name
            info = native.build_info()
            assert info["matmul_isa"] == info["engine_matmul_isa"] == name
        assert native.set_matmul_isa("auto") == have[-1]
        missing = [n for n in native.MATMUL_ISAS if n not in have]
        for name in missing:
            with pytest.raises(cfg.ConfigError, match=f"no {name} matmul path; it has {', '.join(have)}"):
                native.set_matmul_isa(name)
            assert native.build_info()["matmul_isa"] == have[-1]  # nothing changed
        with pytest.raises(cfg.ConfigError, match="expected one of"):
            native.set_matmul_isa("sse9")
    finally:
        native.set_matmul_isa(before)


def test_an_unavailable_matmul_path_fails_at_load_with_a_clear_error():
    missing = [n for n in native.MATMUL_ISAS if n not in native.matmul_isas()]
    if not missing:
        pytest.skip("this CPU has every matmul path (hardware)")
    env = dict(os.environ, TN_MATMUL_ISA=missing[-1])
    proc = subprocess.run([sys.executable, "-c", "import tn._native"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    assert f"ConfigError: TN_MATMUL_ISA='{missing[-1]}': this CPU/OS has no {missing[-1]} matmul path" in proc.stderr


# ---------------------------------------------------------------- every path the CPU has gives the same results

@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512", "amx"])
def test_engine_matmul_on_each_path_matches_the_auto_path(isa, auto_run):
    if isa not in native.matmul_isas():
        pytest.skip(f"this CPU/OS has no {isa} matmul path (hardware)")
    run = _run(isa)
    assert run["info"]["matmul_isa"] == run["info"]["engine_matmul_isa"] == isa
    assert run["out"].keys() == auto_run["out"].keys()
    for key, want in auto_run["out"].items():
        # the tolerance of tests/test_native_matmul.py (accumulation order differs between paths)
        np.testing.assert_allclose(np.array(run["out"][key]), np.array(want), rtol=1e-5, atol=1e-4, err_msg=key)
