# Tests of the compiler's weight stream (tn/lower/layout.py, WeightStream): which DMA queue a weight load goes to.
import pytest

pytest.importorskip("tn.lower.layout")
from tn.lower import layout  # noqa: E402
from tn.neuron import Program  # noqa: E402
from tn.neuron.runtime import simulate_timing  # noqa: E402


def _stream(prog):
    w = prog.hbm("w", (1, 128, 1, 512), "bfloat16")
    lay = layout.BLayout(512, 128, "bfloat16", 512)
    ws = layout.WeightStream(prog, [(w, lay, 0)], budget=64 * 1024)
    ws.bind(w, w)
    return ws, w


def test_weight_load_avoids_queues_behind_a_dma_that_waits_for_compute():
    """Every DMA queue but the last ends with a load that waits for a store that waits for a long ScalarE chain
    (so the queue waits for compute one DMA removed); the weight load goes to the last queue and starts at
    once instead of after the chain (queues run in order)."""
    prog = Program("ws", arch="trn1")
    nq = prog.arch.dma_queues
    src = prog.sbuf((128, 2048), "float32")
    prog.memset(src, 1.0, engine="vector")
    for _ in range(8):                                  # a long compute chain
        prog.activation(src, src, "exp")
    scratch = prog.hbm("scratch", (nq - 1, 128, 16), "float32")
    back = [prog.sbuf((128, 16), "float32") for _ in range(nq - 1)]
    for q in range(nq - 1):
        prog.dma_copy(scratch[q], src[:, :16], queue=q)             # waits for the chain
        prog.dma_copy(back[q], scratch[q], queue=q)                 # waits for that store only
    free = prog.sbuf((128, 16), "float32")
    prog.dma_copy(free, prog.hbm("other", (128, 16), "float32"), queue=nq - 1)
    ws, w = _stream(prog)
    assert ws._queue() == nq - 1
    view = ws.get(w, 0)
    prog.memset(view[:, 0, :1], 0.0)                    # a reader, so the load is not dead code
    r = simulate_timing(prog.build(check=False))
    load = len(prog._recs) - 2
    chain_end = max(r.times[i][1] for i in range(1, 10))
    assert r.times[load][0] < chain_end
