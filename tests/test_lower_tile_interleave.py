# Tests of tn/lower/tile.py's tile interleaving (issue 16): consecutive tiles of a fused group are emitted equation
# by equation in pairs, so ScalarE works on one tile while VectorE works on the other (engines run in order).
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("tn.lower.tile")
import tn  # noqa: E402
import tn.lower  # noqa: E402,F401
import tn.lower.compiler as compiler  # noqa: E402
import tn.lower.tile as tile  # noqa: E402

H = 768


def _norm(x, res, gamma, beta):
    """The residual add and LayerNorm of a BERT layer."""
    return F.layer_norm(x + res, (H,), gamma, beta, 1e-12)


def _args(rows):
    g = torch.Generator().manual_seed(7)
    return [torch.randn(rows, H, generator=g), torch.randn(rows, H, generator=g), torch.randn(H, generator=g),
            torch.randn(H, generator=g)]


def _run(monkeypatch, rows, width):
    monkeypatch.setattr(tile, "INTERLEAVE", width)
    # every tile on the same engines, so the per-tile sequences compare (GpSimd's share: test_lower_tile_pool.py)
    monkeypatch.setattr(tile, "BALANCE_POOL", False)
    exe = compiler.compile_ir(tn.make_ir(_norm)(*_args(rows)), strict=True, arch="trn1")
    out, = exe(_args(rows))
    monkeypatch.undo()
    run = exe.last_profile.runs[-1]
    compute = [(q, o) for q, _, _, o in run.instructions() if q in ("ScalarE", "VectorE")]
    return exe, out, run, compute


def test_layernorm_tiles_are_interleaved_in_pairs(monkeypatch):
    """1024 rows of 768: one row group of 8 tiles of 128 rows. Interleaved, the compute instructions are the
    serial per-tile sequence with each equation's instruction emitted for two tiles in turn; the results are
    bit-identical and equal to torch, and the modelled time is lower (ScalarE and VectorE overlap)."""
    new, got, run_new, seq_new = _run(monkeypatch, 1024, 2)
    old, want, run_old, seq_old = _run(monkeypatch, 1024, 1)
    assert [u.kind for u in new.schedule.units] == ["row"]
    assert len(seq_new) == len(seq_old) and len(seq_old) % 8 == 0
    per_tile = seq_old[:len(seq_old) // 8]
    assert seq_old == per_tile * 8
    assert seq_new == [ins for ins in per_tile for _ in range(2)] * 4
    assert sorted(i[3] for i in run_new.instructions()) == sorted(i[3] for i in run_old.instructions())
    assert torch.equal(got, want)
    torch.testing.assert_close(got, _norm(*_args(1024)), rtol=1e-4, atol=1e-4)
    assert run_new.total_ns < 0.95 * run_old.total_ns
    assert run_new.hbm_read_bytes == run_old.hbm_read_bytes and run_new.hbm_write_bytes == run_old.hbm_write_bytes


def test_an_odd_tile_count_and_a_single_tile(monkeypatch):
    """320 rows: tiles of 128, 128, 64 (the last one alone); 128 rows: one tile, nothing to interleave (the same
    program either way). Both equal to torch."""
    _, got, run_new, seq_new = _run(monkeypatch, 320, 2)
    _, want, run_old, seq_old = _run(monkeypatch, 320, 1)
    assert sorted(seq_new) == sorted(seq_old) and seq_new != seq_old
    assert torch.equal(got, want)
    torch.testing.assert_close(got, _norm(*_args(320)), rtol=1e-4, atol=1e-4)
    _, got1, _, seq1 = _run(monkeypatch, 128, 2)
    _, want1, _, seq2 = _run(monkeypatch, 128, 1)
    assert seq1 == seq2 and torch.equal(got1, want1)


def test_interleaving_needs_room_for_two_sets_of_intermediates():
    """A group interleaves two tiles only when its ring buffers plus two tiles' intermediates fit the budget."""
    vals = tile._Values(per_elem=2 * 12 + 20 + 12, peak_b=20, temps=3)
    assert tile._interleave(vals, f_max=512, n_eqns=5, n_tiles=8) == 2
    assert tile._interleave(vals, f_max=512, n_eqns=5, n_tiles=1) == 1       # one tile
    assert tile._interleave(vals, f_max=512, n_eqns=1, n_tiles=8) == 1       # one equation: nothing to overlap
    f_max = tile.SBUF_BUDGET // vals.per_elem                                # one set fits, two do not
    assert tile._interleave(vals, f_max=f_max, n_eqns=5, n_tiles=8) == 1
