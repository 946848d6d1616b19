# Lowerings of convolution (direct method on TensorE, taps accumulated in PSUM) and 2-d average pooling (VectorE).
"""Convolution and pooling on the NeuronCore.

``convolution`` (1-d and 2-d, stride, padding, dilation, groups, bias), the
*direct* method: input channels go on the partitions, and every kernel tap
``(i, j)`` is one matmul whose moving operand is a strided window of the
input band in SBUF (``x[c, oh*s + i*d, ow*s + j*d]`` for a block of output
pixels) and whose stationary operand is the tap's weights ``W[:, :, i,
j]^T`` (``[C, O]``, made once with TensorE transposes). All taps and
channel chunks accumulate into one PSUM bank (``<= 512`` output pixels x
``<= 128`` output channels), which is evacuated with the bias added on
ScalarE and written with ``ctx.store`` (fused epilogues apply). Padding is
a zeroed band (GpSimd memset) whose interior is filled from HBM; a band
holds the input rows one block of output rows needs, for several images at
once when the images are small. When the channels are few (``C <= 32``,
e.g. the first RGB layer) groups of ``128 // C`` taps are stacked on the
partitions instead (im2col by SBUF->SBUF DMA of whole shifted planes), so one matmul
per block does the whole contraction.

``avg_pool2d`` / ``avg_pool2d_backward`` (batched or unbatched): ``(n, c)`` rows on the partitions,
the image on the free axis (the forward works in bands of output rows when a
whole plane does not fit in SBUF); the window sum is one ``tensor_reduce``
over a 4-d overlapping access pattern, divisors (padding, ``ceil_mode``,
``count_include_pad``, ``divisor_override``) are computed on chip by pooling
an indicator tile; the backward scatters ``grad / divisor`` with one
strided VectorE add per tap.

``convolution_backward``: the input gradient is a convolution (same engine)
of the gradient, zero-inserted by the stride, with the flipped weights read
in their natural layout (no transposes); the weight gradient contracts
output pixels on the partitions (TensorE transposes of the gradient and of
every tap's input window, one PSUM bank per group of taps accumulated over
all pixels); the bias gradient is a VectorE reduction.

A transposed convolution is lowered as that input gradient (plus bias), and
its backward as the forward convolution (input gradient) and the forward
weight gradient with the output gradient and input swapped. 3-d
convolutions, plain and transposed (and their gradients), reach this lowering
as 2-d ones: the tracer decomposes them (:mod:`tn.ops`) into one 2-d
convolution over depth-stacked channels (transposed: one transposed 2-d
convolution whose output channels hold the depth taps, summed along depth);
a 3-d convolution equation built by hand raises
:class:`~tn.lower.base.CannotLower` (it runs on the host, visibly).
"""
from __future__ import annotations

from ..neuron import HbmTensor, Tile, isa
from .base import CannotLower, Copier, Ring, TileScope, lowering
from .matmul import MATMUL_DTYPES, _sbuf_free

__all__ = ["lower_convolution", "lower_avg_pool2d", "lower_avg_pool2d_backward"]

_P = 128
_NB = 512


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _isz(dtype: str) -> int:
    return isa.DTYPE_SIZES[isa.dtype_code(dtype)]


def _window(t: Tile, offset_elems: int, dims) -> Tile:
    """A view of tile ``t`` starting ``offset_elems`` into its free axis with the given (num, stride) dims."""
    return Tile(t.mem, t.pstart, t.pcount, t.offset + offset_elems * t.itemsize, t.dtype, dims, t.name)


def _view(t):
    """An HbmTensor as its row-major view (views pass through)."""
    return t.view() if isinstance(t, HbmTensor) else t


def _pair(v, n=2):
    v = tuple(v) if isinstance(v, (tuple, list)) else (v,)
    return v * n if len(v) == 1 else v


# ---------------------------------------------------------------------------------------------- convolution


class _Conv:
    """Plan and emission of one 2-d convolution (see the module docstring)."""

    def __init__(self, ctx, x, w, b, out, stride, padding, dilation, groups, xdil=(1, 1), bwd_data=False):
        self.ctx = ctx
        self.prog = ctx.prog
        self.x, self.w, self.b, self.out = x, w, b, out
        # x is the physical input; the logical input has (xdil - 1) zeros between its elements
        self.N, self.C, self.Hx, self.Wx = x.shape
        self.xh, self.xw = xdil
        self.H, self.W = (self.Hx - 1) * self.xh + 1, (self.Wx - 1) * self.xw + 1
        self.bwd_data = bwd_data
        if bwd_data:
            # w is a forward weight [O', C'/G, kh, kw]; this conv maps O' channels to C' with the taps flipped
            o_f, cg_f, self.kh, self.kw = w.shape
            self.O, self.Cg = cg_f * groups, o_f // groups
        else:
            self.O, self.Cg, self.kh, self.kw = w.shape
        _, _, self.Ho, self.Wo = out.shape
        (self.sh, self.sw), (self.ph, self.pw), (self.dh, self.dw) = stride, padding, dilation
        self.G = groups
        self.Og = self.O // groups
        self.T = self.kh * self.kw
        self.dt = x.dtype
        self.isz = _isz(self.dt)
        self.OT = _cdiv(self.Og, _P)
        # output pixel blocks: (images, rows, cols) with images*rows*cols <= 512
        if self.Ho * self.Wo <= _NB:
            self.nb, self.rows, self.cols = min(self.N, _NB // (self.Ho * self.Wo)), self.Ho, self.Wo
        elif self.Wo <= _NB:
            self.nb, self.rows, self.cols = 1, _NB // self.Wo, self.Wo
        else:
            self.nb, self.rows, self.cols = 1, 1, _NB
        self.bh = (self.rows - 1) * self.sh + (self.kh - 1) * self.dh + 1
        self.bw = (self.cols - 1) * self.sw + (self.kw - 1) * self.dw + 1
        # (groups of) taps stacked on the partitions when few channels would leave TensorE's rows idle and the
        # im2col DMAs cost less than the matmuls they save
        self.tg = min(self.T, _P // self.Cg) if self.Cg <= _P else 1
        self.TG = _cdiv(self.T, self.tg)
        self.stacked = self.T > 1 and self.tg >= 4 and not bwd_data and self._stacking_pays()
        if not self.stacked:
            self.tg, self.TG = 1, self.T
        self.CC = 1 if self.stacked else _cdiv(self.Cg, _P)
        band = self.CC * self.nb * self.bh * self.bw * self.isz
        col = self.TG * self.nb * self.bh * self.bw * self.isz if self.stacked else 0
        wnat = max(self.Cg, self.Og) * self.T * self.isz
        stage = self.nb * self.bh * self.Wx * self.isz
        rest = 2 * band + 2 * col + 2 * stage + wnat + 2 * _NB * _isz(out.dtype) + 4 * self.G * self.OT
        # weights of one group: [K rows, CC (or tap groups), taps (or 1), output channels]; when they do not
        # fit next to the bands they are streamed in chunks of output channels (bands are re-read per chunk)
        self.wslots = self.TG if self.stacked else self.CC
        self.wtaps = 1 if self.stacked else self.T
        per_o = self.wslots * self.wtaps * self.isz
        free = _sbuf_free(self.prog, ctx) - rest
        if per_o * self.Og <= free:
            self.ocw = self.Og
        else:
            self.ocw = (free // (2 * per_o)) // _P * _P
        self.wbufs = 1 if (self.ocw == self.Og and self.G == 1) else 2
        if self.ocw < min(_P, self.Og):
            raise CannotLower(f"convolution working set does not fit in SBUF (input band {band} bytes per "
                              f"partition, weights {per_o * min(_P, self.Og)} per 128 output channels, "
                              f"{free + rest} bytes free)")

    def _stacking_pays(self) -> bool:
        """Modelled time of one pixel block: matmuls per tap vs. stacked matmuls overlapped with im2col DMAs."""
        arch = self.prog.arch
        npix = self.nb * self.rows * self.cols
        mm_ns = (max(64, npix) * (4 if self.dt == "float32" else 1) + arch.access_cycles) / arch.clock_hz["pe"] * 1e9
        L = (self.rows - 1) * self.sh * self.bw + (self.cols - 1) * self.sw + 1
        dma_bytes = self.T * self.Cg * self.nb * (L * self.isz + arch.dma_chunk_overhead_bytes)
        dma_ns = dma_bytes / arch.hbm_bytes_per_s * 1e9 + arch.dma_fixed_ns * self.T / arch.dma_queues
        return max(self.TG * mm_ns, dma_ns) < 0.8 * self.T * mm_ns

    def emit(self) -> None:
        """Load weights (and bias), then emit every block of output pixels; frees every tile it allocated."""
        prog = self.prog
        with TileScope(prog) as scope:
            sb, ps = scope.sbuf, scope.psum
            self.copy = Copier(prog)
            kpart = self.Cg * self.tg if self.stacked else _P
            w_ring = Ring(sb((kpart, self.wslots, self.wtaps, self.ocw), self.dt, f"cv_wT{i}")
                          for i in range(self.wbufs))
            self.wn = sb((_P, max(self.Cg, self.Og) * self.T), self.dt, "cv_wnat")
            self.tp_ring = Ring(ps((_P, max(1, min(8, 2048 // (_P * self.isz))), _P), self.dt, f"cv_tp{i}")
                                for i in range(2))
            self.bias = None
            if self.b is not None:
                self.bias = sb((_P, self.G * self.OT), "float32", "cv_bias")
                self._load_bias()
            self.band_ring = Ring(sb((_P, self.CC, self.nb, self.bh, self.bw), self.dt, f"cv_band{i}")
                                  for i in range(2))
            self.stage_ring = Ring(sb((_P, self.nb * self.bh * self.Wx), self.dt, f"cv_stage{i}")
                                   for i in range(2))
            if self.stacked:
                self.col_ring = Ring(sb((self.Cg * self.tg, self.TG, self.nb, self.bh * self.bw), self.dt,
                                        f"cv_col{i}")
                                     for i in range(2))
            self.out_ring = Ring(sb((_P, _NB), self.out.dtype, f"cv_out{i}") for i in range(2))
            self.acc_ring = Ring(ps((_P, _NB), "float32", f"cv_acc{i}") for i in range(4))
            for g in range(self.G):
                for oc0 in range(0, self.Og, self.ocw):
                    oc1 = min(self.Og, oc0 + self.ocw)
                    wT = w_ring.take()
                    self._load_weights(g, oc0, oc1, wT)
                    for n0 in range(0, self.N, self.nb):
                        for oh0 in range(0, self.Ho, self.rows):
                            for ow0 in range(0, self.Wo, self.cols):
                                self._block(g, n0, oh0, ow0, oc0, oc1, wT)

    # -------------------------------------------------------------- weights and bias
    def _load_weights(self, g, oc0, oc1, wT) -> None:
        """Weights of group ``g``, output channels ``oc0..oc1``, as stationary operands in ``wT``:
        ``wT[c, cc, tap, o - oc0] = w[g*Og + o, cc*128 + c, i, j]`` (stacked: ``wT[tap*Cg + c, q, 0, o - oc0]``
        for tap group ``q``; backward-data: the flipped taps of ``w`` read K-major, no transposes)."""
        prog = self.prog
        Cg, T, Og = self.Cg, self.T, self.Og
        if self.bwd_data:
            # wT[k, cc, t, m] = w[g*Cg + cc*128 + k, m, flipped tap T-1-t]: rows of w are already K-major
            wflat = self.w.reshape(self.G * Cg, Og * T)
            for cc in range(self.CC):
                k0 = g * Cg + cc * _P
                kp = min(_P, Cg - cc * _P)
                prog.dma_copy(self.wn[:kp, :Og * T], wflat[k0:k0 + kp, :])
                wv = self.wn[:kp, :Og * T].reshape(kp, Og, T)
                for t in range(T):
                    self.copy(wT[:kp, cc, t, :oc1 - oc0], wv[:, oc0:oc1, T - 1 - t])
            return
        wflat = self.w.reshape(self.O, Cg * T)
        for o0 in range(oc0, oc1, _P):
            op = min(_P, oc1 - o0)
            d0 = o0 - oc0
            wn = self.wn
            prog.dma_copy(wn[:op, :Cg * T], wflat[g * Og + o0:g * Og + o0 + op, :])
            wv = wn[:op, :Cg * T].reshape(op, Cg, T)
            if self.stacked:
                for q in range(self.TG):
                    t0, t1 = q * self.tg, min(T, (q + 1) * self.tg)
                    kq = (t1 - t0) * Cg
                    tp = self.tp_ring.take()
                    prog.transpose(tp[:kq, 0, :op], wv.permute(0, 2, 1)[:, t0:t1, :])
                    self.copy(wT[:kq, q, 0, d0:d0 + op], tp[:kq, 0, :op])
                continue
            Gt = self.tp_ring.tiles[0].shape[1]
            for cc in range(self.CC):
                c0 = cc * _P
                cp = min(_P, Cg - c0)
                for t0 in range(0, T, Gt):
                    t1 = min(T, t0 + Gt)
                    tp = self.tp_ring.take()
                    for tap in range(t0, t1):
                        prog.transpose(tp[:cp, tap - t0, :op], wv[:, c0:c0 + cp, tap])
                    self.copy(wT[:cp, cc, t0:t1, d0:d0 + op], tp[:cp, :t1 - t0, :op])

    def _load_bias(self) -> None:
        prog = self.prog
        bcol = self.b.reshape(self.O, 1)
        stage = prog.sbuf((_P, 1), self.b.dtype, name="cv_bstage")
        try:
            for g in range(self.G):
                for ot in range(self.OT):
                    o0 = g * self.Og + ot * _P
                    op = min(_P, self.Og - ot * _P)
                    k = g * self.OT + ot
                    if self.b.dtype == "float32":
                        prog.dma_copy(self.bias[:op, k:k + 1], bcol[o0:o0 + op, :])
                    else:
                        prog.dma_copy(stage[:op, :], bcol[o0:o0 + op, :])
                        prog.tensor_copy(self.bias[:op, k:k + 1], stage[:op, :])
        finally:
            prog.free(stage)

    # -------------------------------------------------------------- one block of output pixels
    def _load_band(self, g, n0, nb, oh0, ow0, rows, cols):
        """Band tile with the (zero-padded) input window of this block, channels on partitions."""
        prog = self.prog
        band = self.band_ring.take()
        ih0 = oh0 * self.sh - self.ph
        iw0 = ow0 * self.sw - self.pw
        bh = (rows - 1) * self.sh + (self.kh - 1) * self.dh + 1
        bw = (cols - 1) * self.sw + (self.kw - 1) * self.dw + 1
        xh, xw = self.xh, self.xw
        # physical input rows/cols whose logical position falls inside the band
        r0 = _cdiv(max(0, ih0), xh)
        r1 = (min(self.H, ih0 + bh) - 1) // xh + 1
        c0 = _cdiv(max(0, iw0), xw)
        c1 = (min(self.W, iw0 + bw) - 1) // xw + 1
        nr, nc = r1 - r0, c1 - c0
        padded = (xh > 1 or xw > 1 or r0 * xh > ih0 or (r1 - 1) * xh < ih0 + bh - 1 or c0 * xw > iw0
                  or (c1 - 1) * xw < iw0 + bw - 1)
        full_rows = xw == 1 and xh == 1 and c0 == iw0 and nc == bw and nc == self.Wx
        for cc in range(self.CC):
            ch0 = g * self.Cg + cc * _P
            cp = min(_P, self.Cg - cc * _P)
            dst = band[:cp, cc, :nb, :bh, :bw]
            if padded:
                prog.memset(dst, 0.0)
            if nr <= 0 or nc <= 0:
                continue
            br0, bc0 = r0 * xh - ih0, c0 * xw - iw0
            inner = band[:cp, cc, :nb, br0:br0 + (nr - 1) * xh + 1:xh, bc0:bc0 + (nc - 1) * xw + 1:xw]
            if full_rows:
                src = self.x[n0:n0 + nb, ch0:ch0 + cp, r0:r1, :].permute(1, 0, 2, 3)
                prog.dma_copy(inner, src)
            else:
                # whole input rows in one contiguous run per (channel, image), then a strided engine copy
                st = self.stage_ring.take()
                stv = st[:cp, :nb * nr * self.Wx].reshape(cp, nb, nr, self.Wx)
                prog.dma_copy(stv, self.x[n0:n0 + nb, ch0:ch0 + cp, r0:r1, :].permute(1, 0, 2, 3))
                prog.tensor_copy(inner, stv[:, :, :, c0:c1], engine="gpsimd" if cc % 2 == 0 else "vector")
        return band

    def _tap_view(self, band, cc, cp, nb, rows, cols, i, j):
        """Moving operand of tap (i, j): ``band[c, n, r*sh + i*dh, q*sw + j*dw]`` for the block's pixels."""
        v = band[:cp, cc, :nb]
        bh, bw = self.bh, self.bw
        off = (i * self.dh) * bw + j * self.dw
        dims = [(nb, bh * bw), (rows, self.sh * bw), (cols, self.sw)]
        return _window(v, off, dims)

    def _block(self, g, n0, oh0, ow0, oc0, oc1, wT) -> None:
        prog = self.prog
        nb = min(self.nb, self.N - n0)
        rows = min(self.rows, self.Ho - oh0)
        cols = min(self.cols, self.Wo - ow0)
        npix = nb * rows * cols
        band = self._load_band(g, n0, nb, oh0, ow0, rows, cols)
        if self.stacked:
            # col[tap*Cg + c, n, :] = the band plane of (c, n) shifted by the tap's offset: one contiguous run per
            # (channel, image); the matmul's moving view then picks rows sh*bw apart and columns sw apart
            col = self.col_ring.take()
            Cg, bh, bw = self.Cg, self.bh, self.bw
            L = (rows - 1) * self.sh * bw + (cols - 1) * self.sw + 1
            plane = band[:Cg, 0, :nb]
            for i in range(self.kh):
                for j in range(self.kw):
                    tap = i * self.kw + j
                    q, tl = divmod(tap, self.tg)
                    off = i * self.dh * bw + j * self.dw
                    prog.dma_copy(col[tl * Cg:(tl + 1) * Cg, q, :nb, :L],
                                  _window(plane, off, [(nb, bh * bw), (L, 1)]))
            movs = []
            for q in range(self.TG):
                kq = (min(self.T, (q + 1) * self.tg) - q * self.tg) * Cg
                movs.append((kq, _window(col[:kq, q, :nb], 0, [(nb, bh * bw), (rows, self.sh * bw), (cols, self.sw)])))
        for o0 in range(oc0, oc1, _P):
            ot = o0 // _P
            op = min(_P, oc1 - o0)
            d0 = o0 - oc0
            acc = self.acc_ring.take()
            if self.stacked:
                for q, (kq, mov) in enumerate(movs):
                    prog.matmul(acc[:op, :npix], wT[:kq, q, 0, d0:d0 + op], mov,
                                accumulate=q > 0, stop=q == self.TG - 1)
            else:
                steps = [(cc, i, j) for cc in range(self.CC) for i in range(self.kh) for j in range(self.kw)]
                for s, (cc, i, j) in enumerate(steps):
                    cp = min(_P, self.Cg - cc * _P)
                    prog.matmul(acc[:op, :npix], wT[:cp, cc, i * self.kw + j, d0:d0 + op],
                                self._tap_view(band, cc, cp, nb, rows, cols, i, j),
                                accumulate=s > 0, stop=s == len(steps) - 1)
            ot_t = self.out_ring.take()
            if self.bias is not None:
                k = g * self.OT + ot
                prog.activation(ot_t[:op, :npix], acc[:op, :npix], "identity", bias=self.bias[:op, k:k + 1])
            else:
                self.copy(ot_t[:op, :npix], acc[:op, :npix])
            ch0 = g * self.Og + o0
            blk = ot_t[:op, :npix].reshape(op, nb, rows, cols)
            for jn in range(nb):
                self.ctx.store(self.out[n0 + jn, ch0:ch0 + op, oh0:oh0 + rows, ow0:ow0 + cols], blk[:, jn])


@lowering("convolution")
def lower_convolution(ctx, eqn, ins, outs) -> None:
    """1-d/2-d convolution, plain or transposed, with stride, padding, dilation, groups, output padding and bias
    (direct method on TensorE)."""
    a = eqn.attrs
    xv, wv = eqn.inputs[0], eqn.inputs[1]
    nd = len(xv.shape) - 2
    if nd not in (1, 2):
        raise CannotLower(f"only 1-d and 2-d convolutions are lowered (input {tuple(xv.shape)})")
    dt = ctx.neuron_dtype(xv.dtype)
    if dt not in MATMUL_DTYPES or wv.dtype != xv.dtype:
        raise CannotLower(f"convolution on TensorE needs fp32/bf16/fp16 input and weight of one dtype "
                          f"(got {xv.dtype}, {wv.dtype})")
    has_bias = len(ins) > 2 and ins[2] is not None and not isinstance(ins[2], (int, float))
    outv = eqn.outputs[0]
    x, w, out = ins[0], ins[1], outs[0]
    stride, padding, dilation = _pair(a["stride"], nd), _pair(a["padding"], nd), _pair(a["dilation"], nd)
    if nd == 1:
        n, c, L = xv.shape
        o, cg, k = wv.shape
        x = x.reshape(n, c, 1, L)
        w = w.reshape(o, cg, 1, k)
        out = out.reshape(outv.shape[0], outv.shape[1], 1, outv.shape[2])
        stride, padding, dilation = (1,) + stride, (0,) + padding, (1,) + dilation
    else:
        x, w, out = _view(x), _view(w), _view(out)
    b = _view(ins[2]) if has_bias else None
    if a.get("transposed"):
        # a transposed convolution is the input gradient of the forward convolution with the same weight:
        # the input zero-inserted by the stride, padded by d*(k-1)-p, convolved with the flipped taps
        kh, kw = w.shape[2], w.shape[3]
        pad_t = tuple((k - 1) * d - p for k, d, p in zip((kh, kw), dilation, padding))
        _Conv(ctx, x, w, b, out, (1, 1), pad_t, dilation, int(a["groups"]), xdil=stride, bwd_data=True).emit()
        return
    _Conv(ctx, x, w, b, out, stride, padding, dilation, int(a["groups"])).emit()


def _grad_bias(ctx, grad, gb) -> None:
    """``gb[o] = sum over (n, h, w) of grad[n, o, h, w]`` (o on partitions, one reduce per chunk of images)."""
    prog = ctx.prog
    N, O, Ho, Wo = grad.shape
    npx = Ho * Wo
    nb = max(1, min(N, 8192 // npx)) if npx <= 8192 else 0
    if nb == 0:
        raise CannotLower(f"bias gradient over {Ho}x{Wo} images is not lowered (more than 8192 pixels per image)")
    g3 = grad.reshape(N, O, npx)
    gcol = gb.reshape(O, 1)
    tiles = []
    try:
        ld = Ring(prog.sbuf((_P, nb, npx), grad.dtype, name=f"cvb_g{i}") for i in range(2))
        part = prog.sbuf((_P, 1), "float32", name="cvb_part")
        tot = prog.sbuf((_P, 1), "float32", name="cvb_tot")
        res = prog.sbuf((_P, 1), gb.dtype, name="cvb_res")
        tiles.extend([*ld.tiles, part, tot, res])
        for o0 in range(0, O, _P):
            op = min(_P, O - o0)
            for n0 in range(0, N, nb):
                k = min(nb, N - n0)
                t = ld.take()
                prog.dma_copy(t[:op, :k, :], g3[n0:n0 + k, o0:o0 + op, :].permute(1, 0, 2))
                dst = tot if n0 == 0 else part
                prog.tensor_reduce(dst[:op], t[:op, :k, :], "add", axis=(1, 2))
                if n0 > 0:
                    prog.tensor_tensor(tot[:op], tot[:op], part[:op], "add")
            prog.tensor_copy(res[:op], tot[:op])
            ctx.store(gcol[o0:o0 + op, :], res[:op])
    finally:
        for t in reversed(tiles):
            prog.free(t)


def _grad_weight(ctx, grad, x, w, gw, stride, padding, dilation, groups) -> None:
    """``gw[o, c, i, j] = sum over pixels of grad[n, o, p] * x[n, c, window(p, i, j)]`` on TensorE.

    Pixels go on the partitions (K): each chunk of <= 128 output pixels of one
    image is transposed on TensorE (grad ``[O, pix] -> [pix, O]`` and every
    tap's input window ``[C, pix] -> [pix, C]``); one matmul per output bank
    accumulates ``[O, taps x C]`` in PSUM over all chunks.
    """
    prog = ctx.prog
    N, O, Ho, Wo = grad.shape
    fw = _Conv(ctx, x, w, None, grad, stride, padding, dilation, groups)
    G, Cg, Og, T = groups, fw.Cg, fw.Og, fw.T
    isz = fw.isz
    # pixel chunks: rows x cols of one image, <= 128 pixels
    if Wo <= _P:
        rr, pc = max(1, _P // Wo), Wo
    else:
        rr, pc = 1, _P
    # re-plan the forward geometry for pixel chunks of one image
    fw.nb, fw.rows, fw.cols = 1, rr, pc
    fw.bh = (rr - 1) * fw.sh + (fw.kh - 1) * fw.dh + 1
    fw.bw = (pc - 1) * fw.sw + (fw.kw - 1) * fw.dw + 1
    fw.CC = _cdiv(Cg, _P)
    # PSUM banks of the result [O, taps, C]: groups of whole taps, or 512-channel slices of one tap
    if Cg <= _NB:
        tpb = _NB // Cg
        banks = [(t0, min(T, t0 + tpb), 0, Cg) for t0 in range(0, T, tpb)]
    else:
        banks = [(t, t + 1, c0, min(Cg, c0 + _NB)) for t in range(T) for c0 in range(0, Cg, _NB)]
    OT = _cdiv(Og, _P)
    pairs = [(ot, bk) for ot in range(OT) for bk in range(len(banks))]
    per_pass = 6
    need = (2 * fw.CC * fw.bh * fw.bw + 2 * OT * Wo * rr + 2 * fw.bh * fw.Wx + T * Cg + Og + Cg * T) * isz + \
        Cg * T * _isz(gw.dtype)
    if need > _sbuf_free(prog, ctx):
        raise CannotLower(f"weight-gradient working set ({need} bytes per partition) does not fit in SBUF")
    gw3 = gw.reshape(G * Og, Cg, T)
    with TileScope(prog) as scope:
        sb = scope.sbuf
        fw.copy = copy = Copier(prog)
        fw.band_ring = Ring(sb((_P, fw.CC, 1, fw.bh, fw.bw), fw.dt, f"cvw_band{i}") for i in range(2))
        fw.stage_ring = Ring(sb((_P, fw.bh * fw.Wx), fw.dt, f"cvw_stage{i}") for i in range(2))
        g_ring = Ring(sb((_P, OT, rr * Wo), fw.dt, f"cvw_g{i}") for i in range(2))
        gT = sb((_P, Og), fw.dt, "cvw_gT")
        xT = sb((_P, T, Cg), fw.dt, "cvw_xT")
        ot_t = sb((_P, Cg, T), gw.dtype, "cvw_out")
        G_tr = max(1, min(8, prog.arch.psum_bank_bytes // (_P * isz)))
        tp_ring = Ring(scope.psum((_P, G_tr, _P), fw.dt, f"cvw_tp{i}") for i in range(2))
        accs = [scope.psum((_P, _NB), "float32", f"cvw_acc{i}") for i in range(per_pass)]

        def transposes(items, npx):
            """items: (src view [kp, npx], kp, dst view [npx, kp]); grouped per PSUM bank."""
            for g0 in range(0, len(items), G_tr):
                tp = tp_ring.take()
                grp = items[g0:g0 + G_tr]
                for q, (src, kp, _) in enumerate(grp):
                    prog.transpose(tp[:npx, q, :kp], src)
                for q, (_, kp, dst) in enumerate(grp):
                    copy(dst, tp[:npx, q, :kp])

        for g in range(G):
            for p0 in range(0, len(pairs), per_pass):
                sel = pairs[p0:p0 + per_pass]
                chunks = [(n, oh0, ow0) for n in range(N) for oh0 in range(0, Ho, rr) for ow0 in range(0, Wo, pc)]
                for ci, (n, oh0, ow0) in enumerate(chunks):
                    rows = min(rr, Ho - oh0)
                    cols = min(pc, Wo - ow0)
                    npx = rows * cols
                    # grad chunk [Og, pix] -> gT [pix, Og]
                    gt = g_ring.take()
                    items = []
                    for ot in range(OT):
                        o0 = ot * _P
                        op = min(_P, Og - o0)
                        gv = gt[:op, ot, :npx].reshape(op, rows, cols)
                        prog.dma_copy(gv, grad[n, g * Og + o0:g * Og + o0 + op, oh0:oh0 + rows, ow0:ow0 + cols])
                        items.append((gt[:op, ot, :npx], op, gT[:npx, o0:o0 + op]))
                    transposes(items, npx)
                    # input windows per tap [C, pix] -> xT [pix, tap, C]
                    band = fw._load_band(g, n, 1, oh0, ow0, rows, cols)
                    items = []
                    for cc in range(fw.CC):
                        c0 = cc * _P
                        cp = min(_P, Cg - c0)
                        for i in range(fw.kh):
                            for j in range(fw.kw):
                                v = fw._tap_view(band, cc, cp, 1, rows, cols, i, j)
                                items.append((v, cp, xT[:npx, i * fw.kw + j, c0:c0 + cp]))
                    transposes(items, npx)
                    for q, (ot, bk) in enumerate(sel):
                        o0 = ot * _P
                        op = min(_P, Og - o0)
                        t0, t1, c0, c1 = banks[bk]
                        prog.matmul(accs[q][:op, :(t1 - t0) * (c1 - c0)], gT[:npx, o0:o0 + op],
                                    xT[:npx, t0:t1, c0:c1], accumulate=ci > 0, stop=ci == len(chunks) - 1)
                for q, (ot, bk) in enumerate(sel):
                    o0 = ot * _P
                    op = min(_P, Og - o0)
                    t0, t1, c0, c1 = banks[bk]
                    acc = accs[q][:op, :(t1 - t0) * (c1 - c0)].reshape(op, t1 - t0, c1 - c0)
                    dst = ot_t[:op, c0:c1, t0:t1]
                    copy(dst.permute(0, 2, 1), acc)
                    ctx.store(gw3[g * Og + o0:g * Og + o0 + op, c0:c1, t0:t1], dst)


@lowering("convolution_backward")
def lower_convolution_backward(ctx, eqn, ins, outs) -> None:
    """Gradients of a 1-d/2-d convolution: input (a convolution of the zero-inserted gradient with the flipped
    weights), weight (pixels contracted on TensorE) and bias (a reduction), as ``output_mask`` asks."""
    a = eqn.attrs
    gv, xv, wv = eqn.inputs[:3]
    nd = len(xv.shape) - 2
    if nd not in (1, 2):
        raise CannotLower(f"only 1-d and 2-d convolution gradients are lowered (input {tuple(xv.shape)})")
    dt = ctx.neuron_dtype(xv.dtype)
    if dt not in MATMUL_DTYPES or wv.dtype != xv.dtype or gv.dtype != xv.dtype:
        raise CannotLower(f"convolution_backward on TensorE needs fp32/bf16/fp16 tensors of one dtype "
                          f"(got {gv.dtype}, {xv.dtype}, {wv.dtype})")
    stride, padding, dilation = _pair(a["stride"], nd), _pair(a["padding"], nd), _pair(a["dilation"], nd)
    groups = int(a["groups"])
    grad, x, w = _view(ins[0]), _view(ins[1]), _view(ins[2])
    if nd == 1:
        grad = grad.reshape(gv.shape[0], gv.shape[1], 1, gv.shape[2])
        x = x.reshape(xv.shape[0], xv.shape[1], 1, xv.shape[2])
        w = w.reshape(wv.shape[0], wv.shape[1], 1, wv.shape[2])
        stride, padding, dilation = (1,) + stride, (0,) + padding, (1,) + dilation
    mask = tuple(a["output_mask"])
    it = iter(outs)
    gx = next(it) if mask[0] else None
    gw = next(it) if mask[1] else None
    gb = next(it) if len(mask) > 2 and mask[2] else None
    kh, kw = w.shape[2], w.shape[3]
    if a.get("transposed"):
        # y = conv_transpose(x, w) is the adjoint of z -> conv(z, w): its input gradient is that forward
        # convolution of the output gradient, its weight gradient the forward weight gradient with the roles of
        # the output gradient and the input swapped
        if gx is not None:
            _Conv(ctx, grad, w, None, gx.reshape(*x.shape), stride, padding, dilation, groups).emit()
        if gw is not None:
            _grad_weight(ctx, x, grad, w, gw.reshape(*w.shape), stride, padding, dilation, groups)
        if gb is not None:
            _grad_bias(ctx, grad, gb)
        return
    if gx is not None:
        gxv = gx.reshape(*x.shape)
        pad_t = tuple((k - 1) * d - p for k, d, p in zip((kh, kw), dilation, padding))
        _Conv(ctx, grad, w, None, gxv, (1, 1), pad_t, dilation, groups, xdil=stride, bwd_data=True).emit()
    if gw is not None:
        _grad_weight(ctx, grad, x, w, gw.reshape(*w.shape), stride, padding, dilation, groups)
    if gb is not None:
        _grad_bias(ctx, grad, gb)


# ---------------------------------------------------------------------------------------------- average pooling


class _Pool:
    """Geometry and shared tiles of one avg_pool2d (forward or backward); ``(n, c)`` rows on the partitions."""

    def __init__(self, ctx, xshape, oshape, attrs, check=True):
        self.ctx = ctx
        self.prog = ctx.prog
        self.N, self.C, self.H, self.W = xshape
        self.Ho, self.Wo = oshape[2], oshape[3]
        self.kh, self.kw = _pair(attrs["kernel_size"])
        st = attrs.get("stride") or (self.kh, self.kw)
        self.sh, self.sw = _pair(st)
        self.ph, self.pw = _pair(attrs.get("padding") or 0)
        self.cip = bool(attrs.get("count_include_pad", True))
        self.div = attrs.get("divisor_override")
        self.R = self.N * self.C
        # padded plane, extended to the last (ceil_mode) window
        self.Hq = max(self.H + 2 * self.ph, (self.Ho - 1) * self.sh + self.kh)
        self.Wq = max(self.W + 2 * self.pw, (self.Wo - 1) * self.sw + self.kw)
        self.padded = self.Hq != self.H or self.Wq != self.W
        ext = (self.Ho - 1) * self.sh + self.kh > self.H + 2 * self.ph or \
            (self.Wo - 1) * self.sw + self.kw > self.W + 2 * self.pw
        self.const_div = None
        if self.div:
            self.const_div = float(self.div)
        elif self.cip and not ext:
            self.const_div = float(self.kh * self.kw)
        need = 4 * (2 * self.Hq * self.Wq + 3 * self.Ho * self.Wo) + 4 * self.H * self.W
        if check and need > _sbuf_free(self.prog, ctx):
            raise CannotLower(f"avg_pool2d of {self.H}x{self.W} planes needs {need} bytes per partition of SBUF; "
                              f"too large for one plane per partition")

    def windows(self, plane: Tile, i: int = None, j: int = None) -> Tile:
        """All windows ``[Ho, Wo, kh, kw]`` of a ``[P, Hq, Wq]`` plane, or the tap ``(i, j)`` view ``[Ho, Wo]``."""
        if i is None:
            return _window(plane, 0, [(self.Ho, self.sh * self.Wq), (self.Wo, self.sw), (self.kh, self.Wq),
                                      (self.kw, 1)])
        return _window(plane, i * self.Wq + j, [(self.Ho, self.sh * self.Wq), (self.Wo, self.sw)])

    def counts(self, tiles) -> Tile:
        """``[128, Ho, Wo]`` fp32 divisors (None when the divisor is a constant)."""
        if self.const_div is not None:
            return None
        prog = self.prog
        ind = prog.sbuf((_P, self.Hq, self.Wq), "float32", name="pool_ind")
        cnt = prog.sbuf((_P, self.Ho, self.Wo), "float32", name="pool_cnt")
        tiles.append(cnt)
        try:
            prog.memset(ind, 0.0)
            if self.cip:
                prog.memset(ind[:, :self.H + 2 * self.ph, :self.W + 2 * self.pw], 1.0)
            else:
                prog.memset(ind[:, self.ph:self.ph + self.H, self.pw:self.pw + self.W], 1.0)
            prog.tensor_reduce(cnt, self.windows(ind), "add", axis=(3, 4))
        finally:
            prog.free(ind)
        return cnt

    def divide(self, out, src, cnt, pc) -> None:
        """``out = src / divisor``."""
        if cnt is None:
            self.prog.tensor_scalar(out, src, "divide", self.const_div)
        else:
            self.prog.tensor_tensor(out, src, cnt[:pc], "divide")


def _pool_shapes(what: str, xv, ov):
    """Input and output shapes as 4-d ``[N, C, H, W]`` (an unbatched ``[C, H, W]`` is one image)."""
    if len(xv.shape) not in (3, 4):
        raise CannotLower(f"{what} lowers [N, C, H, W] or [C, H, W] inputs, not {tuple(xv.shape)}")
    return (1,) * (4 - len(xv.shape)) + tuple(xv.shape), (1,) * (4 - len(ov.shape)) + tuple(ov.shape)


def _pool_dtype(ctx, v) -> str:
    dt = ctx.neuron_dtype(v.dtype)
    if dt not in ("float32", "bfloat16", "float16"):
        raise CannotLower(f"avg_pool2d of {v.dtype} is not lowered (floating point only)")
    return dt


@lowering("avg_pool2d")
def lower_avg_pool2d(ctx, eqn, ins, outs) -> None:
    """2-d average pooling: one overlapping-window tensor_reduce per 128 planes and band of output rows (bands
    keep large planes within SBUF), divisors computed on chip."""
    xv = eqn.inputs[0]
    xshape, oshape = _pool_shapes("avg_pool2d", xv, eqn.outputs[0])
    _pool_dtype(ctx, xv)
    prog = ctx.prog
    pl = _Pool(ctx, xshape, oshape, eqn.attrs, check=False)
    H, W, Ho, Wo, Wq = pl.H, pl.W, pl.Ho, pl.Wo, pl.Wq
    sh, kh, ph, pw = pl.sh, pl.kh, pl.ph, pl.pw
    isx, iso = _isz(ins[0].dtype), _isz(outs[0].dtype)
    const = pl.const_div is not None

    def need(rb):
        bh = (rb - 1) * sh + kh
        return (2 * bh * Wq * isx + 2 * bh * W * isx + rb * Wo * 4 + 2 * rb * Wo * iso
                + (0 if const else rb * Wo * 4 + bh * Wq * 4))

    free = _sbuf_free(prog, ctx)
    rb = Ho
    while rb > 1 and need(rb) > free:
        rb = _cdiv(rb, 2)
    if need(rb) > free:
        raise CannotLower(f"avg_pool2d of {H}x{W} planes: one output row needs {need(1)} bytes per partition of "
                          f"SBUF ({free} free)")
    bhmax = (rb - 1) * sh + kh
    single = rb >= Ho
    x3 = ins[0].reshape(pl.R, H, W)
    out3 = outs[0].reshape(pl.R, Ho, Wo)

    def band_counts(cnt, ih0, bh, rows, ind):
        """Divisors of the output rows of one band: pooled indicator of the counted region."""
        prog.memset(ind[:, :bh, :], 0.0)
        if pl.cip:
            r0, r1, c0, c1 = max(-ph, ih0) - ih0, min(H + ph, ih0 + bh) - ih0, 0, W + 2 * pw
        else:
            r0, r1, c0, c1 = max(0, ih0) - ih0, min(H, ih0 + bh) - ih0, pw, pw + W
        if r1 > r0:
            prog.memset(ind[:, r0:r1, c0:c1], 1.0)
        win = _window(ind, 0, [(rows, sh * Wq), (Wo, pl.sw), (kh, Wq), (pl.kw, 1)])
        prog.tensor_reduce(cnt[:, :rows * Wo].reshape(_P, rows, Wo), win, "add", axis=(3, 4))

    with TileScope(prog) as scope:
        sb = scope.sbuf
        xp_ring = Ring(sb((_P, bhmax, Wq), ins[0].dtype, f"pool_x{i}") for i in range(2))
        st_ring = Ring(sb((_P, bhmax * W), ins[0].dtype, f"pool_st{i}") for i in range(2))
        s_t = sb((_P, rb * Wo), "float32", "pool_sum")
        o_ring = Ring(sb((_P, rb * Wo), outs[0].dtype, f"pool_o{i}") for i in range(2))
        cnt = ind = None
        if not const:
            cnt = sb((_P, rb * Wo), "float32", "pool_cnt")
            ind = sb((_P, bhmax, Wq), "float32", "pool_ind")
            if single:
                band_counts(cnt, -ph, bhmax, Ho, ind)
        for r0 in range(0, pl.R, _P):
            pc = min(_P, pl.R - r0)
            for oh0 in range(0, Ho, rb):
                rows = min(rb, Ho - oh0)
                ih0 = oh0 * sh - ph
                bh = (rows - 1) * sh + kh
                v0, v1 = max(0, ih0), min(H, ih0 + bh)
                xp = xp_ring.take()
                padded = v0 > ih0 or v1 < ih0 + bh or Wq != W
                if padded:
                    prog.memset(xp[:pc, :bh, :], 0.0)
                if v1 > v0:
                    if padded:
                        st = st_ring.take()
                        prog.dma_copy(st[:pc, :(v1 - v0) * W].reshape(pc, v1 - v0, W), x3[r0:r0 + pc, v0:v1, :])
                        prog.tensor_copy(xp[:pc, v0 - ih0:v1 - ih0, pw:pw + W],
                                         st[:pc, :(v1 - v0) * W].reshape(pc, v1 - v0, W), engine="gpsimd")
                    else:
                        prog.dma_copy(xp[:pc, :bh, :], x3[r0:r0 + pc, v0:v1, :])
                win = _window(xp[:pc], 0, [(rows, sh * Wq), (Wo, pl.sw), (kh, Wq), (pl.kw, 1)])
                sv = s_t[:pc, :rows * Wo].reshape(pc, rows, Wo)
                prog.tensor_reduce(sv, win, "add", axis=(3, 4))
                ot = o_ring.take()
                ov = ot[:pc, :rows * Wo].reshape(pc, rows, Wo)
                if const:
                    prog.tensor_scalar(ov, sv, "divide", pl.const_div)
                else:
                    if not single:
                        band_counts(cnt, ih0, bh, rows, ind)
                    prog.tensor_tensor(ov, sv, cnt[:pc, :rows * Wo].reshape(pc, rows, Wo), "divide")
                ctx.store(out3[r0:r0 + pc, oh0:oh0 + rows, :], ov)


@lowering("avg_pool2d_backward")
def lower_avg_pool2d_backward(ctx, eqn, ins, outs) -> None:
    """Gradient of avg_pool2d: ``grad / divisor`` added into every tap's strided window (VectorE)."""
    gv, xv = eqn.inputs[0], eqn.inputs[1]
    xshape, gshape = _pool_shapes("avg_pool2d_backward", xv, gv)
    _pool_dtype(ctx, gv)
    prog = ctx.prog
    pl = _Pool(ctx, xshape, gshape, eqn.attrs)
    H, W, Ho, Wo, Hq, Wq = pl.H, pl.W, pl.Ho, pl.Wo, pl.Hq, pl.Wq
    g = ins[0].reshape(pl.R, Ho * Wo)
    out = outs[0].reshape(pl.R, H * W)
    tiles = []
    try:
        cnt = pl.counts(tiles)
        g_ring = Ring(prog.sbuf((_P, Ho * Wo), ins[0].dtype, name=f"poolb_g{i}") for i in range(2))
        acc_ring = Ring(prog.sbuf((_P, Hq, Wq), "float32", name=f"poolb_acc{i}") for i in range(2))
        gs = prog.sbuf((_P, Ho, Wo), "float32", name="poolb_gs")
        o_ring = Ring(prog.sbuf((_P, H * W), outs[0].dtype, name=f"poolb_o{i}") for i in range(2))
        tiles.extend([*g_ring.tiles, *acc_ring.tiles, gs, *o_ring.tiles])
        for r0 in range(0, pl.R, _P):
            pc = min(_P, pl.R - r0)
            gt = g_ring.take()
            prog.dma_copy(gt[:pc], g[r0:r0 + pc])
            pl.divide(gs[:pc], gt[:pc].reshape(pc, Ho, Wo), cnt, pc)
            acc = acc_ring.take()
            prog.memset(acc[:pc], 0.0, engine="vector")
            for i in range(pl.kh):
                for j in range(pl.kw):
                    v = pl.windows(acc[:pc], i, j)
                    prog.tensor_tensor(v, v, gs[:pc], "add")
            ot = o_ring.take()
            prog.tensor_copy(ot[:pc].reshape(pc, H, W), acc[:pc, pl.ph:pl.ph + H, pl.pw:pl.pw + W],
                             engine="scalar")
            ctx.store(out[r0:r0 + pc], ot[:pc])
    finally:
        for t in reversed(tiles):
            prog.free(t)
