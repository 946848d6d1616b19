/* C math kernels of the software NeuronCore: dtype conversion, elementwise ALU, activations, reductions, copies, gathers.
 *
 * Every kernel works per partition: it gathers the operand's free elements (an access pattern of up
 * to 4 dims, any dtype) into contiguous fp32 scratch, computes there with simple vectorisable loops,
 * and scatters the result converted to the output dtype. Access patterns are validated by the
 * caller (engine.pyx) against their memories; these kernels trust them. Portable C11 (no
 * CPU-specific code); -O3 lets GCC vectorise the inner loops. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "kernels.h"

int tn_abi_version(void) { return 2; }

/* Hot loops get AVX-512 and AVX2 clones next to the portable SSE2 default, chosen by the dynamic loader at load time
   (GCC target_clones on x86-64 Linux); elsewhere only the portable code is built. The build passes
   -ffp-contract=off, so no clone fuses a multiply and an add into an FMA: every clone rounds exactly like the
   default and results do not depend on the CPU. The AVX-512 clone targets x86-64-v4 (AVX-512 F+BW+DQ+VL: bf16
   conversions need 16-bit lanes of the full width) where GCC knows it (12+).
   The build setting TN_NATIVE_ISA (setup.py passes -DTN_NATIVE_ISA=n, _native/build_cffi.py) narrows the clones so
   a wide machine can build and test the narrower code: 2 auto (all three), 1 avx2 (AVX2 + default), 0 portable
   (no clones; TN_NO_CLONES means the same). tn_native_clones() records what this build compiled. */
#ifndef TN_NATIVE_ISA
#define TN_NATIVE_ISA 2
#endif
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) && !defined(TN_NO_CLONES) \
    && TN_NATIVE_ISA > 0
#if TN_NATIVE_ISA == 1
#define TN_HOT __attribute__((target_clones("avx2", "default")))
#define TN_CLONES "avx2 default"
#elif __GNUC__ >= 12
#define TN_HOT __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#define TN_CLONES "x86-64-v4 avx2 default"
#else
#define TN_HOT __attribute__((target_clones("avx512f", "avx2", "default")))
#define TN_CLONES "avx512f avx2 default"
#endif
#else
#define TN_HOT
#define TN_CLONES ""
#endif

const char *tn_native_isa(void)
{
    return TN_NATIVE_ISA >= 2 ? "auto" : TN_NATIVE_ISA == 1 ? "avx2" : "portable";
}

const char *tn_native_clones(void) { return TN_CLONES; }

/* The clone of the TN_HOT kernels the loader picks on this CPU ("default" is the portable code; "" without clones):
   the first of TN_CLONES the CPU supports, the order GCC's resolver tries them in. */
const char *tn_native_clone(void)
{
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) && !defined(TN_NO_CLONES) \
    && TN_NATIVE_ISA > 0
    __builtin_cpu_init();
#if TN_NATIVE_ISA >= 2
#if __GNUC__ >= 12
    if (__builtin_cpu_supports("x86-64-v4")) return "x86-64-v4";
#else
    if (__builtin_cpu_supports("avx512f")) return "avx512f";
#endif
#endif
    if (__builtin_cpu_supports("avx2")) return "avx2";
    return "default";
#else
    return "";
#endif
}

/* ------------------------------------------------------------------ conversions */

static inline float bits_f32(uint32_t x) { float f; memcpy(&f, &x, 4); return f; }
static inline uint32_t f32_bits(float f) { uint32_t x; memcpy(&x, &f, 4); return x; }

static inline uint16_t f32_to_bf16(float f)
{
    uint32_t x = f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u); /* quiet NaN */
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

static inline float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

static inline uint16_t f32_to_f16(float f)
{
    uint32_t x = f32_bits(f);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to infinity */
    if (ax < 0x38800000u) {                                  /* half subnormal (or zero) */
        float a = bits_f32(ax) * 16777216.0f;                /* exact: scale by 2^24 */
        return (uint16_t)(sign | (uint32_t)lrintf(a));        /* RNE; 0x400 is the smallest normal */
    }
    uint32_t h = ((((ax >> 23) - 112u)) << 10) | ((ax & 0x7fffffu) >> 13);
    uint32_t rem = ax & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}

static inline float f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {
        float f = (float)m * 5.9604644775390625e-8f; /* m * 2^-24 */
        return bits_f32(f32_bits(f) | sign);
    }
    if (e == 31) return bits_f32(sign | 0x7f800000u | (m << 13));
    return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

void tn_cvt_f32_to_bf16(const float *src, uint16_t *dst, int64_t n) { for (int64_t i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]); }
void tn_cvt_bf16_to_f32(const uint16_t *src, float *dst, int64_t n) { for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]); }
void tn_cvt_f32_to_f16(const float *src, uint16_t *dst, int64_t n) { for (int64_t i = 0; i < n; i++) dst[i] = f32_to_f16(src[i]); }
void tn_cvt_f16_to_f32(const uint16_t *src, float *dst, int64_t n) { for (int64_t i = 0; i < n; i++) dst[i] = f16_to_f32(src[i]); }

static inline int32_t sat_i32(float v)
{
    if (v != v) return 0;
    if (v >= 2147483647.0f) return INT32_MAX;
    if (v <= -2147483648.0f) return INT32_MIN;
    return (int32_t)v;
}

static inline int64_t sat_i64(float v)
{
    if (v != v) return 0;
    if (v >= 9.2233720368547758e18f) return INT64_MAX;
    if (v <= -9.2233720368547758e18f) return INT64_MIN;
    return (int64_t)v;
}

/* ------------------------------------------------------------------ row load/store */

/* dst[i] = (float) src[i*stride] for a row of n elements of `dtype`. Unit-stride and broadcast (stride 0) rows
   have their own loops: the strided ones do not vectorise. */
TN_HOT static void load_row(float *dst, const char *src, int dtype, int64_t stride, int64_t n)
{
    if (stride == 0 && n > 1) {
        float v;
        load_row(&v, src, dtype, 1, 1);
        for (int64_t i = 0; i < n; i++) dst[i] = v;
        return;
    }
    switch (dtype) {
    case TN_F32:
        if (stride == 1) { memcpy(dst, src, (size_t)n * 4); return; }
        for (int64_t i = 0; i < n; i++) dst[i] = ((const float *)src)[i * stride];
        return;
    case TN_BF16:
        if (stride == 1) {
            const uint16_t *h = (const uint16_t *)src;
            for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(h[i]);
            return;
        }
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(((const uint16_t *)src)[i * stride]);
        return;
    case TN_F16:
        for (int64_t i = 0; i < n; i++) dst[i] = f16_to_f32(((const uint16_t *)src)[i * stride]);
        return;
    case TN_I32:
        for (int64_t i = 0; i < n; i++) dst[i] = (float)((const int32_t *)src)[i * stride];
        return;
    case TN_I64:
        for (int64_t i = 0; i < n; i++) dst[i] = (float)((const int64_t *)src)[i * stride];
        return;
    case TN_U8:
    case TN_BOOL:
        if (stride == 1) {
            const uint8_t *b = (const uint8_t *)src;
            for (int64_t i = 0; i < n; i++) dst[i] = (float)b[i];
            return;
        }
        for (int64_t i = 0; i < n; i++) dst[i] = (float)((const uint8_t *)src)[i * stride];
        return;
    default:
        memset(dst, 0, (size_t)n * 4);
    }
}

/* dst[i*stride] = convert(src[i]) for a row of n elements of `dtype`. */
TN_HOT static void store_row(char *dst, int dtype, int64_t stride, const float *src, int64_t n)
{
    switch (dtype) {
    case TN_F32:
        if (stride == 1) { memcpy(dst, src, (size_t)n * 4); return; }
        for (int64_t i = 0; i < n; i++) ((float *)dst)[i * stride] = src[i];
        return;
    case TN_BF16:
        if (stride == 1) {
            uint16_t *h = (uint16_t *)dst;
            for (int64_t i = 0; i < n; i++) h[i] = f32_to_bf16(src[i]);
            return;
        }
        for (int64_t i = 0; i < n; i++) ((uint16_t *)dst)[i * stride] = f32_to_bf16(src[i]);
        return;
    case TN_F16:
        for (int64_t i = 0; i < n; i++) ((uint16_t *)dst)[i * stride] = f32_to_f16(src[i]);
        return;
    case TN_I32:
        for (int64_t i = 0; i < n; i++) ((int32_t *)dst)[i * stride] = sat_i32(src[i]);
        return;
    case TN_I64:
        for (int64_t i = 0; i < n; i++) ((int64_t *)dst)[i * stride] = sat_i64(src[i]);
        return;
    case TN_U8:
        for (int64_t i = 0; i < n; i++) {
            float v = src[i];
            ((uint8_t *)dst)[i * stride] = (uint8_t)(v != v ? 0 : v <= 0.0f ? 0 : v >= 255.0f ? 255 : (int)v);
        }
        return;
    case TN_BOOL:
        for (int64_t i = 0; i < n; i++) ((uint8_t *)dst)[i * stride] = (uint8_t)(src[i] != 0.0f);
        return;
    default:
        return;
    }
}

static inline int64_t ap_free(const tn_ap *a) { return a->num[0] * a->num[1] * a->num[2] * a->num[3]; }

static inline char *ap_part(const tn_ap *a, int64_t p) { return a->base + p * a->pstride; }

/* `a` with the same elements in the same row-major order but fewer, longer rows: size-1 dims dropped and a dim
   merged into the next inner one where the two walk memory as one (stride[d] == num[d+1] * stride[d+1]); the
   remaining dims are right-aligned (leading dims of size 1). The per-row loops below then make one call per run
   instead of one per element (e.g. a [512, 1] view: 1 row of 512, not 512 rows of 1). */
static inline tn_ap ap_squeeze(const tn_ap *a)
{
    tn_ap s = *a;
    int64_t num[4], st[4];
    int k = 4;
    for (int d = 3; d >= 0; d--) {
        if (a->num[d] == 1) continue;
        if (k < 4 && a->stride[d] == num[k] * st[k]) { num[k] *= a->num[d]; continue; }
        k--;
        num[k] = a->num[d];
        st[k] = a->stride[d];
    }
    for (int d = 0; d < 4; d++) {
        s.num[d] = d < k ? 1 : num[d];
        s.stride[d] = d < k ? 0 : st[d];
    }
    return s;
}

/* Hint the cache to fetch the first bytes (up to 4 KiB) of a row that a copy reads (rw 0) or writes (rw 1) soon:
   partition rows lie far apart, so a copy of many short rows waits for each row's first lines in turn; fetching
   a later row while the current one is copied overlaps those waits. A hint only: it never faults and never
   changes a result. */
#define TN_PREFETCH_AHEAD 2
static inline void prefetch_row(const char *p, int64_t nbytes, int rw)
{
#if defined(__GNUC__) || defined(__clang__)
    if (nbytes > 4096) nbytes = 4096;
    if (rw)
        for (int64_t b = 0; b < nbytes; b += 64) __builtin_prefetch(p + b, 1, 3);
    else
        for (int64_t b = 0; b < nbytes; b += 64) __builtin_prefetch(p + b, 0, 3);
#else
    (void)p; (void)nbytes; (void)rw;
#endif
}

/* Load every free element of partition p of `a` (row-major over its dims) into dst. */
static void load_ap(float *dst, const tn_ap *ap, int64_t p)
{
    tn_ap sq = ap_squeeze(ap);
    const tn_ap *a = &sq;
    const char *base = ap_part(a, p);
    int64_t n3 = a->num[3];
    for (int64_t i0 = 0; i0 < a->num[0]; i0++)
        for (int64_t i1 = 0; i1 < a->num[1]; i1++)
            for (int64_t i2 = 0; i2 < a->num[2]; i2++) {
                int64_t off = (i0 * a->stride[0] + i1 * a->stride[1] + i2 * a->stride[2]) * a->esize;
                load_row(dst, base + off, a->dtype, a->stride[3], n3);
                dst += n3;
            }
}

/* Store src into every free element of partition p of `a` (row-major over its dims). */
static void store_ap(const tn_ap *ap, int64_t p, const float *src)
{
    tn_ap sq = ap_squeeze(ap);
    const tn_ap *a = &sq;
    char *base = ap_part(a, p);
    int64_t n3 = a->num[3];
    for (int64_t i0 = 0; i0 < a->num[0]; i0++)
        for (int64_t i1 = 0; i1 < a->num[1]; i1++)
            for (int64_t i2 = 0; i2 < a->num[2]; i2++) {
                int64_t off = (i0 * a->stride[0] + i1 * a->stride[1] + i2 * a->stride[2]) * a->esize;
                store_row(base + off, a->dtype, a->stride[3], src, n3);
                src += n3;
            }
}

/* First element of partition p as float (per-partition scalars). */
static inline float load_scalar(const tn_ap *a, int64_t p)
{
    float v;
    load_row(&v, ap_part(a, p), a->dtype, 1, 1);
    return v;
}

/* All free elements of a partition contiguous (one run of ap_free elements from base). */
static int ap_free_contiguous(const tn_ap *a)
{
    int64_t expect = 1;
    for (int d = 3; d >= 0; d--) {
        if (a->num[d] != 1 && a->stride[d] != expect) return 0;
        expect *= a->num[d];
    }
    return 1;
}

/* Rows p0 .. p0+np-1 of `a` (n free elements each) into dst, row after row (np*n floats). Rows of free-contiguous
   fp32/bf16 operands load in one call (the per-row calls of load_ap cost ~20 ns, a quarter of a 128-element row). */
TN_HOT static void load_rows(float *dst, const tn_ap *a, int64_t p0, int64_t np, int64_t n, int contig)
{
    if (contig && a->dtype == TN_F32) {
        for (int64_t i = 0; i < np; i++) {
            if (i + TN_PREFETCH_AHEAD < np) prefetch_row(ap_part(a, p0 + i + TN_PREFETCH_AHEAD), n * 4, 0);
            memcpy(dst + i * n, ap_part(a, p0 + i), (size_t)n * 4);
        }
        return;
    }
    if (contig && a->dtype == TN_BF16) {
        for (int64_t i = 0; i < np; i++) {
            if (i + TN_PREFETCH_AHEAD < np) prefetch_row(ap_part(a, p0 + i + TN_PREFETCH_AHEAD), n * 2, 0);
            const uint16_t *h = (const uint16_t *)ap_part(a, p0 + i);
            float *d = dst + i * n;
            for (int64_t j = 0; j < n; j++) d[j] = bf16_to_f32(h[j]);
        }
        return;
    }
    for (int64_t i = 0; i < np; i++) load_ap(dst + i * n, a, p0 + i);
}

/* The inverse of load_rows: np rows of n floats from src into rows p0.. of `a`, converted to its dtype. */
TN_HOT static void store_rows(const tn_ap *a, int64_t p0, int64_t np, int64_t n, const float *src, int contig)
{
    if (contig && a->dtype == TN_F32) {
        for (int64_t i = 0; i < np; i++) {
            if (i + TN_PREFETCH_AHEAD < np) prefetch_row(ap_part(a, p0 + i + TN_PREFETCH_AHEAD), n * 4, 1);
            memcpy(ap_part(a, p0 + i), src + i * n, (size_t)n * 4);
        }
        return;
    }
    if (contig && a->dtype == TN_BF16) {
        for (int64_t i = 0; i < np; i++) {
            if (i + TN_PREFETCH_AHEAD < np) prefetch_row(ap_part(a, p0 + i + TN_PREFETCH_AHEAD), n * 2, 1);
            uint16_t *h = (uint16_t *)ap_part(a, p0 + i);
            const float *x = src + i * n;
            for (int64_t j = 0; j < n; j++) h[j] = f32_to_bf16(x[j]);
        }
        return;
    }
    for (int64_t i = 0; i < np; i++) store_ap(a, p0 + i, src + i * n);
}

/* Byte range [lo, hi) of one partition's row of `a`, relative to its base. */
static void ap_row_span(const tn_ap *a, int64_t *lo, int64_t *hi)
{
    int64_t l = 0, h = 0;
    for (int d = 0; d < 4; d++) {
        int64_t e = (a->num[d] - 1) * a->stride[d];
        if (e < 0) l += e; else h += e;
    }
    *lo = l * a->esize;
    *hi = (h + 1) * a->esize;
}

/* 1 if no row of `out` overlaps a row of `in` belonging to another partition, so loading several partitions'
   rows before storing any gives the results of the partition-by-partition order (an instruction may read and
   write overlapping tiles whose partition ranges are shifted against each other). */
static int rows_independent(const tn_ap *out, const tn_ap *in, int64_t nparts)
{
    if (!in || nparts < 2 || out->pstride != in->pstride || out->pstride <= 0) return 1;  /* other memory */
    int64_t olo, ohi, ilo, ihi, pitch = out->pstride, diff = out->base - in->base;
    ap_row_span(out, &olo, &ohi);
    ap_row_span(in, &ilo, &ihi);
    /* out row p and in row q overlap iff [diff + (p-q)*pitch + olo, ... + ohi) meets [ilo, ihi) */
    int64_t k0 = -(diff / pitch);
    for (int64_t k = k0 - 2; k <= k0 + 2; k++) {
        if (k == 0 || k >= nparts || k <= -nparts) continue;
        int64_t d = diff + k * pitch;
        if (d + olo < ihi && ilo < d + ohi) return 0;
    }
    return 1;
}

/* fp32 operands that kernels may read and write in place, row by row: `x`'s row p and `out`'s row p (n
   contiguous fp32 each) are the same memory or disjoint, and no other rows overlap. */
static int f32_rows_in_place_ok(const tn_ap *out, const tn_ap *x, int64_t n, int64_t nparts)
{
    if (out->pstride != x->pstride) return 1;                 /* SBUF vs PSUM: different memories */
    int64_t d = out->base - x->base;
    return rows_independent(out, x, nparts) && (d == 0 || d >= n * 4 || d <= -n * 4);
}

/* Partitions per block of the elementwise kernels: whole rows, about TN_BLOCK elements (stays in L1/L2). */
#define TN_BLOCK 1024
static inline int64_t block_rows(int64_t n)
{
    return n >= TN_BLOCK ? 1 : TN_BLOCK / (n > 0 ? n : 1);
}

/* ------------------------------------------------------------------ scratch */

/* Per-thread scratch buffers (fp32), grown on demand and kept for the thread's life. */
#define TN_NSCRATCH 5
static _Thread_local float *scratch_buf[TN_NSCRATCH];
static _Thread_local int64_t scratch_cap[TN_NSCRATCH];

static float *scratch(int i, int64_t n)
{
    if (n < 1) n = 1;
    if (scratch_cap[i] < n) {
        int64_t cap = n < 4096 ? 4096 : n;
        float *b = (float *)realloc(scratch_buf[i], (size_t)cap * sizeof(float));
        if (!b) return NULL;
        scratch_buf[i] = b;
        scratch_cap[i] = cap;
    }
    return scratch_buf[i];
}

/* ------------------------------------------------------------------ ALU */

enum {
    ALU_BYPASS = 0, ALU_ADD, ALU_SUB, ALU_MUL, ALU_DIV, ALU_MAX, ALU_MIN, ALU_POW, ALU_EQ, ALU_NE,
    ALU_GE, ALU_GT, ALU_LE, ALU_LT, ALU_AND, ALU_OR, ALU_XOR, ALU_ABSMAX, ALU_MOD,
    /* integer ALU ops: on int32 words, not through fp32 */
    ALU_BAND, ALU_BOR, ALU_BXOR, ALU_SHL, ALU_SHR
};

static inline int alu_is_int(int op) { return op >= ALU_BAND && op <= ALU_SHR; }

/* ------------------------------------------------------------------ integer ALU
   Operands are int32, uint8 or bool (the engine validates this), loaded as int32 values; results are stored
   by two's-complement truncation (uint8: the low 8 bits; bool: != 0). Shift amounts outside 0..31 give 0 for
   a left shift and the sign fill (x >> 31) for the arithmetic right shift, as torch's int32 shifts do. */

static void load_row_i32(int32_t *dst, const char *src, int dtype, int64_t stride, int64_t n)
{
    switch (dtype) {
    case TN_I32:
        for (int64_t i = 0; i < n; i++) dst[i] = ((const int32_t *)src)[i * stride];
        return;
    case TN_U8:
    case TN_BOOL:
        for (int64_t i = 0; i < n; i++) dst[i] = (int32_t)((const uint8_t *)src)[i * stride];
        return;
    default:
        memset(dst, 0, (size_t)n * 4);
    }
}

static void store_row_i32(char *dst, int dtype, int64_t stride, const int32_t *src, int64_t n)
{
    switch (dtype) {
    case TN_I32:
        for (int64_t i = 0; i < n; i++) ((int32_t *)dst)[i * stride] = src[i];
        return;
    case TN_U8:
        for (int64_t i = 0; i < n; i++) ((uint8_t *)dst)[i * stride] = (uint8_t)((uint32_t)src[i] & 0xffu);
        return;
    case TN_BOOL:
        for (int64_t i = 0; i < n; i++) ((uint8_t *)dst)[i * stride] = (uint8_t)(src[i] != 0);
        return;
    default:
        return;
    }
}

static void load_ap_i32(int32_t *dst, const tn_ap *ap, int64_t p)
{
    tn_ap sq = ap_squeeze(ap);
    const tn_ap *a = &sq;
    const char *base = a->base + p * a->pstride;
    int64_t n3 = a->num[3];
    for (int64_t i0 = 0; i0 < a->num[0]; i0++)
        for (int64_t i1 = 0; i1 < a->num[1]; i1++)
            for (int64_t i2 = 0; i2 < a->num[2]; i2++) {
                int64_t off = (i0 * a->stride[0] + i1 * a->stride[1] + i2 * a->stride[2]) * a->esize;
                load_row_i32(dst, base + off, a->dtype, a->stride[3], n3);
                dst += n3;
            }
}

static void store_ap_i32(const tn_ap *ap, int64_t p, const int32_t *src)
{
    tn_ap sq = ap_squeeze(ap);
    const tn_ap *a = &sq;
    char *base = a->base + p * a->pstride;
    int64_t n3 = a->num[3];
    for (int64_t i0 = 0; i0 < a->num[0]; i0++)
        for (int64_t i1 = 0; i1 < a->num[1]; i1++)
            for (int64_t i2 = 0; i2 < a->num[2]; i2++) {
                int64_t off = (i0 * a->stride[0] + i1 * a->stride[1] + i2 * a->stride[2]) * a->esize;
                store_row_i32(base + off, a->dtype, a->stride[3], src, n3);
                src += n3;
            }
}

/* An immediate as an int32 value (the engine validates that it is integral and in range). */
static inline int32_t imm_i32(double v)
{
    return v != v ? 0 : v >= 2147483647.0 ? INT32_MAX : v <= -2147483648.0 ? INT32_MIN : (int32_t)v;
}

/* o[i] = x[i] op y[i] on int32 values; o may alias x or y. */
TN_HOT static int alu_i32(int op, int32_t *o, const int32_t *x, const int32_t *y, int64_t n)
{
    int64_t i;
    switch (op) {
    case ALU_BYPASS: if (o != x) memmove(o, x, (size_t)n * 4); break;
    case ALU_BAND: for (i = 0; i < n; i++) o[i] = x[i] & y[i]; break;
    case ALU_BOR: for (i = 0; i < n; i++) o[i] = x[i] | y[i]; break;
    case ALU_BXOR: for (i = 0; i < n; i++) o[i] = x[i] ^ y[i]; break;
    case ALU_SHL:
        for (i = 0; i < n; i++) {
            uint32_t s = (uint32_t)y[i];
            o[i] = s < 32u ? (int32_t)((uint32_t)x[i] << s) : 0;
        }
        break;
    case ALU_SHR:
        for (i = 0; i < n; i++) {
            uint32_t s = (uint32_t)y[i];
            int32_t v = x[i];   /* arithmetic shift: the sign fills, without relying on >> of negatives */
            uint32_t sh = s < 32u ? s : 31u;
            uint32_t u = (uint32_t)v >> sh;
            uint32_t fill = v < 0 ? ~(0xffffffffu >> sh) : 0u;
            o[i] = (int32_t)(u | fill);
        }
        break;
    default: return TN_EARGS;
    }
    return TN_OK;
}

static int tensor_tensor_i32(int op, const tn_ap *out, const tn_ap *a, const tn_ap *b, int64_t nparts)
{
    int64_t n = ap_free(out);
    int32_t *x = (int32_t *)scratch(0, n), *y = (int32_t *)scratch(1, n);
    if (!x || !y) return TN_ENOMEM;
    for (int64_t p = 0; p < nparts; p++) {   /* partition by partition: every input row read before writing */
        load_ap_i32(x, a, p);
        load_ap_i32(y, b, p);
        int rc = alu_i32(op, x, x, y, n);
        if (rc) return rc;
        store_ap_i32(out, p, x);
    }
    return TN_OK;
}


static inline float pymodf(float x, float y)
{
    float r = fmodf(x, y);
    if (r != 0.0f && ((r < 0.0f) != (y < 0.0f))) r += y;
    return r;
}

/* o[i] = x[i] op y[i]; o may alias x or y. */
TN_HOT static int alu(int op, float *o, const float *x, const float *y, int64_t n)
{
    int64_t i;
    switch (op) {
    case ALU_BYPASS: if (o != x) memmove(o, x, (size_t)n * 4); break;
    case ALU_ADD: for (i = 0; i < n; i++) o[i] = x[i] + y[i]; break;
    case ALU_SUB: for (i = 0; i < n; i++) o[i] = x[i] - y[i]; break;
    case ALU_MUL: for (i = 0; i < n; i++) o[i] = x[i] * y[i]; break;
    case ALU_DIV: for (i = 0; i < n; i++) o[i] = x[i] / y[i]; break;
    case ALU_MAX: for (i = 0; i < n; i++) o[i] = x[i] > y[i] ? x[i] : y[i]; break;
    case ALU_MIN: for (i = 0; i < n; i++) o[i] = x[i] < y[i] ? x[i] : y[i]; break;
    case ALU_POW: for (i = 0; i < n; i++) o[i] = powf(x[i], y[i]); break;
    case ALU_EQ: for (i = 0; i < n; i++) o[i] = x[i] == y[i] ? 1.0f : 0.0f; break;
    case ALU_NE: for (i = 0; i < n; i++) o[i] = x[i] != y[i] ? 1.0f : 0.0f; break;
    case ALU_GE: for (i = 0; i < n; i++) o[i] = x[i] >= y[i] ? 1.0f : 0.0f; break;
    case ALU_GT: for (i = 0; i < n; i++) o[i] = x[i] > y[i] ? 1.0f : 0.0f; break;
    case ALU_LE: for (i = 0; i < n; i++) o[i] = x[i] <= y[i] ? 1.0f : 0.0f; break;
    case ALU_LT: for (i = 0; i < n; i++) o[i] = x[i] < y[i] ? 1.0f : 0.0f; break;
    case ALU_AND: for (i = 0; i < n; i++) o[i] = (x[i] != 0.0f && y[i] != 0.0f) ? 1.0f : 0.0f; break;
    case ALU_OR: for (i = 0; i < n; i++) o[i] = (x[i] != 0.0f || y[i] != 0.0f) ? 1.0f : 0.0f; break;
    case ALU_XOR: for (i = 0; i < n; i++) o[i] = ((x[i] != 0.0f) != (y[i] != 0.0f)) ? 1.0f : 0.0f; break;
    case ALU_ABSMAX:
        for (i = 0; i < n; i++) { float a = fabsf(x[i]), b = fabsf(y[i]); o[i] = a > b ? a : b; }
        break;
    case ALU_MOD: for (i = 0; i < n; i++) o[i] = pymodf(x[i], y[i]); break;
    default: return TN_EARGS;
    }
    return TN_OK;
}

/* o[i] = rev ? s op x[i] : x[i] op s */
static int alu_scalar(int op, float *o, const float *x, float s, int rev, float *tmp, int64_t n)
{
    for (int64_t i = 0; i < n; i++) tmp[i] = s;
    return rev ? alu(op, o, tmp, x, n) : alu(op, o, x, tmp, n);
}

int tn_tensor_tensor(int op, const tn_ap *out, const tn_ap *a, const tn_ap *b, int64_t nparts)
{
    if (alu_is_int(op)) return tensor_tensor_i32(op, out, a, b, nparts);
    int64_t n = ap_free(out), rows = block_rows(n);
    if (rows > nparts) rows = nparts > 0 ? nparts : 1;
    if (!rows_independent(out, a, nparts) || !rows_independent(out, b, nparts)) rows = 1;
    float *x = scratch(0, rows * n), *y = scratch(1, rows * n);
    if (!x || !y) return TN_ENOMEM;
    int ca = ap_free_contiguous(a), cb = ap_free_contiguous(b), co = ap_free_contiguous(out);
    if (ca && cb && co && a->dtype == TN_F32 && b->dtype == TN_F32 && out->dtype == TN_F32
        && f32_rows_in_place_ok(out, a, n, nparts) && f32_rows_in_place_ok(out, b, n, nparts)) {
        /* fp32 rows straight from and to the memories (fp32 rows lose to blocks through scratch on the host) */
        for (int64_t p = 0; p < nparts; p++) {
            if (p + TN_PREFETCH_AHEAD < nparts) {
                prefetch_row(ap_part(a, p + TN_PREFETCH_AHEAD), n * 4, 0);
                prefetch_row(ap_part(b, p + TN_PREFETCH_AHEAD), n * 4, 0);
                prefetch_row(ap_part(out, p + TN_PREFETCH_AHEAD), n * 4, 1);
            }
            int rc = alu(op, (float *)ap_part(out, p), (const float *)ap_part(a, p), (const float *)ap_part(b, p), n);
            if (rc) return rc;
        }
        return TN_OK;
    }
    for (int64_t p0 = 0; p0 < nparts; p0 += rows) {
        int64_t np = nparts - p0 < rows ? nparts - p0 : rows;
        load_rows(x, a, p0, np, n, ca);
        load_rows(y, b, p0, np, n, cb);
        int rc = alu(op, x, x, y, np * n);
        if (rc) return rc;
        store_rows(out, p0, np, n, x, co);
    }
    return TN_OK;
}

#define TN_FLAG_REV0 2
#define TN_FLAG_REV1 4

/* (in op0 s0) op1 s1 with integer ALU ops (op1 may be bypass), partition by partition */
static int tensor_scalar_i32(const tn_ap *out, const tn_ap *in, int op0, const tn_ap *s0, double imm0,
                             int op1, const tn_ap *s1, double imm1, int flags, int64_t nparts)
{
    int64_t n = ap_free(out);
    int32_t *x = (int32_t *)scratch(0, n), *t = (int32_t *)scratch(1, n);
    if (!x || !t) return TN_ENOMEM;
    for (int64_t p = 0; p < nparts; p++) {
        int32_t v0 = imm_i32(imm0), v1 = imm_i32(imm1);
        if (s0) load_row_i32(&v0, s0->base + p * s0->pstride, s0->dtype, 1, 1);
        if (s1 && op1 != ALU_BYPASS) load_row_i32(&v1, s1->base + p * s1->pstride, s1->dtype, 1, 1);
        load_ap_i32(x, in, p);
        for (int64_t i = 0; i < n; i++) t[i] = v0;
        int rc = (flags & TN_FLAG_REV0) ? alu_i32(op0, x, t, x, n) : alu_i32(op0, x, x, t, n);
        if (rc) return rc;
        if (op1 != ALU_BYPASS) {
            for (int64_t i = 0; i < n; i++) t[i] = v1;
            rc = (flags & TN_FLAG_REV1) ? alu_i32(op1, x, t, x, n) : alu_i32(op1, x, x, t, n);
            if (rc) return rc;
        }
        store_ap_i32(out, p, x);
    }
    return TN_OK;
}

int tn_tensor_scalar(const tn_ap *out, const tn_ap *in, int op0, const tn_ap *s0, double imm0,
                     int op1, const tn_ap *s1, double imm1, int flags, int64_t nparts)
{
    if (alu_is_int(op0) || alu_is_int(op1)) {
        if ((!alu_is_int(op0) && op0 != ALU_BYPASS) || (!alu_is_int(op1) && op1 != ALU_BYPASS)) return TN_EARGS;
        return tensor_scalar_i32(out, in, op0, s0, imm0, op1, s1, imm1, flags, nparts);
    }
    int64_t n = ap_free(out), rows = block_rows(n);
    if (rows > nparts) rows = nparts > 0 ? nparts : 1;
    if (!rows_independent(out, in, nparts) || !rows_independent(out, s0, nparts) || !rows_independent(out, s1, nparts))
        rows = 1;
    float *x = scratch(0, rows * n), *t = scratch(1, rows * n);
    if (!x || !t) return TN_ENOMEM;
    int ci = ap_free_contiguous(in), co = ap_free_contiguous(out);
    if (ci && co && in->dtype == TN_F32 && out->dtype == TN_F32 && rows_independent(out, in, nparts)) {
        /* fp32 rows computed in the output row (scalars read first, the input row moved there) */
        for (int64_t p = 0; p < nparts; p++) {
            float v0 = s0 ? load_scalar(s0, p) : (float)imm0;
            float v1 = op1 != ALU_BYPASS && s1 ? load_scalar(s1, p) : (float)imm1;
            if (p + TN_PREFETCH_AHEAD < nparts) {
                prefetch_row(ap_part(in, p + TN_PREFETCH_AHEAD), n * 4, 0);
                prefetch_row(ap_part(out, p + TN_PREFETCH_AHEAD), n * 4, 1);
            }
            float *y = (float *)ap_part(out, p);
            const float *xi = (const float *)ap_part(in, p);
            if (y != xi) memmove(y, xi, (size_t)n * 4);
            int rc = alu_scalar(op0, y, y, v0, flags & TN_FLAG_REV0, t, n);
            if (rc) return rc;
            if (op1 != ALU_BYPASS) {
                rc = alu_scalar(op1, y, y, v1, flags & TN_FLAG_REV1, t, n);
                if (rc) return rc;
            }
        }
        return TN_OK;
    }
    for (int64_t p0 = 0; p0 < nparts; p0 += rows) {
        int64_t np = nparts - p0 < rows ? nparts - p0 : rows;
        load_rows(x, in, p0, np, n, ci);
        /* immediates apply to the whole block at once; per-partition scalars row by row */
        for (int64_t i = 0, len = s0 ? n : np * n; i < np; i += s0 ? 1 : np) {
            float v0 = s0 ? load_scalar(s0, p0 + i) : (float)imm0;
            int rc = alu_scalar(op0, x + i * n, x + i * n, v0, flags & TN_FLAG_REV0, t, len);
            if (rc) return rc;
        }
        if (op1 != ALU_BYPASS)
            for (int64_t i = 0, len = s1 ? n : np * n; i < np; i += s1 ? 1 : np) {
                float v1 = s1 ? load_scalar(s1, p0 + i) : (float)imm1;
                int rc = alu_scalar(op1, x + i * n, x + i * n, v1, flags & TN_FLAG_REV1, t, len);
                if (rc) return rc;
            }
        store_rows(out, p0, np, n, x, co);
    }
    return TN_OK;
}

/* ------------------------------------------------------------------ activations */

enum {
    ACT_IDENTITY = 0, ACT_RELU, ACT_GELU_TANH, ACT_GELU, ACT_SIGMOID, ACT_TANH, ACT_EXP, ACT_LOG,
    ACT_SILU, ACT_SOFTPLUS, ACT_SQRT, ACT_RSQRT, ACT_RECIPROCAL, ACT_SQUARE, ACT_ABS, ACT_SIGN,
    ACT_SIN, ACT_COS, ACT_ERF
};

/* Vectorisable float math (no libm calls, no branches: GCC turns the activation loops below into SIMD code, in
   every clone of TN_HOT; -ffp-contract=off keeps the arithmetic identical in all of them). Accuracy over all
   fp32 inputs (measured against double-precision libm): exp <= 1 ulp, log <= 1 ulp, tanh <= 1.5 ulp,
   sigmoid/erf/sin/cos/softplus <= 2.5 ulp, silu/gelu/gelu_tanh a few ulp (more only where the result is tiny
   and its own argument's rounding dominates, e.g. gelu(x) for x < -9). Subnormal results are kept; special
   values follow C99 (exp(-inf) = 0, log(0) = -inf, log(x < 0) = NaN, NaN propagates). Polynomials: Cephes
   (exp, tanh, erf near 0, log, sin, cos); erfc's was fitted for this file (minimax, relative error 6e-9 on
   [1, 10.5] in t = 1/(1 + a/2)). */

/* p * 2^k for integral k in [-151, 128] (p in [0.7, 1.5]): two exact power-of-two scalings, so results near
   overflow and subnormal results round once. */
static inline float tn_scale2k(float p, float k)
{
    int32_t ki = (int32_t)k;
    int32_t k1 = ki >> 1, k2 = ki - k1;
    return p * bits_f32((uint32_t)(k1 + 127) << 23) * bits_f32((uint32_t)(k2 + 127) << 23);
}

/* e^x (Cephes expf polynomial, 1.5*2^23 rounding trick for the range reduction) */
static inline float tn_expf(float x)
{
    float xc = x > 88.8f ? 88.8f : (x < -104.0f ? -104.0f : x);
    float k = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = xc - k * 0.693359375f;
    r = r - k * -2.12194440e-4f;
    float p = 1.9875691500E-4f;
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * r * r + r + 1.0f;
    float y = tn_scale2k(p, k);
    return x != x ? x : y;
}

/* tanh: odd polynomial below 0.625, 1 - 2/(e^{2|x|} + 1) above */
static inline float tn_tanhf(float x)
{
    float ax = fabsf(x);
    float z = x * x;
    float small = ((((-5.70498872745E-3f * z + 2.06390887954E-2f) * z - 5.37397155531E-2f) * z
                    + 1.33314422036E-1f) * z - 3.33332819422E-1f) * z * x + x;
    float big = 1.0f - 2.0f / (tn_expf(2.0f * (ax > 9.5f ? 9.5f : ax)) + 1.0f);
    big = x < 0.0f ? -big : big;
    return ax < 0.625f ? small : big;
}

/* 1 / (1 + e^-x) from e = e^-|x| (never overflows, keeps tiny results for x << 0) */
static inline float tn_sigmoidf(float x)
{
    float e = tn_expf(-fabsf(x));
    return (x < 0.0f ? e : 1.0f) / (1.0f + e);
}

/* erf(x) for |x| < 1: x * P(x^2) */
static inline float tn_erf_small(float x)
{
    float z = x * x;
    float p = 7.853861353153693E-5f;
    p = p * z - 8.010193625184903E-4f;
    p = p * z + 5.188327685732524E-3f;
    p = p * z - 2.685381193529856E-2f;
    p = p * z + 1.128358514861418E-1f;
    p = p * z - 3.761262582423300E-1f;
    p = p * z + 1.128379165726710E+0f;
    return p * x;
}

/* s * erfc(a) for a >= 0.5: exp(-a^2) (a^2 = ah^2 + (a-ah)(a+ah), ah with 12 significant bits so ah^2 is exact;
   exp of the small second part by its Taylor series)
   times a degree-9 polynomial in t = 1/(1 + a/2) (fitted to erfc(a) e^(a^2) on [0.5, 10.5], relative error 2e-9
   before float rounding); 0 (times s) beyond a = 10.5, where erfc underflows */
static inline float tn_erfc_big_scaled(float a, float s)
{
    float ac = a > 10.5f ? 10.5f : a;
    float ah = bits_f32(f32_bits(ac) & 0xfffff000u);
    /* e2 = e^-d for the small remainder 0 <= d = (ac-ah)(ac+ah) < 0.09: Taylor to d^6 (error < 1e-10) */
    float d = (ac - ah) * (ac + ah);
    float e2 = ((((((1.0f / 720.0f) * d - (1.0f / 120.0f)) * d + (1.0f / 24.0f)) * d - (1.0f / 6.0f)) * d + 0.5f) * d
                - 1.0f) * d + 1.0f;
    float e1 = tn_expf(-(ah * ah));
    float t = 1.0f / (1.0f + 0.5f * ac);
    float p = -0.07368303835391998f;
    p = p * t + 0.3481689989566803f;
    p = p * t - 0.6053896546363831f;
    p = p * t + 0.4006786644458771f;
    p = p * t - 0.10452351719141006f;
    p = p * t + 0.23397386074066162f;
    p = p * t + 0.2351951152086258f;
    p = p * t + 0.2835836112499237f;
    p = p * t + 0.2819855213165283f;
    p = p * t + 3.4981831049663015e-06f;
    float r = ((s * p) * e2) * e1;      /* e1 last: only it may be subnormal */
    return a > 10.5f ? 0.0f * s : r;
}

static inline float tn_erff(float x)
{
    float ax = fabsf(x);
    float big = 1.0f - tn_erfc_big_scaled(ax, 1.0f);
    big = x < 0.0f ? -big : big;
    float y = ax < 1.0f ? tn_erf_small(x) : big;
    return x != x ? x : y;
}

/* gelu(x) = x/2 (1 + erf(x/sqrt(2))); erfc for z = x/sqrt(2) <= -0.5 (no cancellation in 1 + erf) and z >= 1 */
static inline float tn_geluf(float x)
{
    float z = x * 0.70710678118654752f;
    float az = fabsf(z);
    float c = tn_erfc_big_scaled(az, 0.5f * x);
    float big = z < 0.0f ? c : (az > 10.5f ? x : x - c);    /* gelu(inf) = inf, gelu(-inf) = NaN (as 0.5*x*(1+erf)) */
    float small = 0.5f * x * (1.0f + tn_erf_small(z));
    float y = (z > -0.5f && z < 1.0f) ? small : big;
    return x != x ? x : y;
}

/* gelu with the tanh approximation: x/2 (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3) */
static inline float tn_gelu_tanhf(float x)
{
    return x * tn_sigmoidf(2.0f * (0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

/* log(x): x = m 2^e, m in [sqrt(1/2), sqrt(2)); subnormal x scaled by 2^24 first */
static inline float tn_logf(float x)
{
    int den = x < 1.17549435e-38f;
    float xs = den ? x * 16777216.0f : x;
    uint32_t b = f32_bits(xs);
    float e = (float)((int32_t)(b >> 23) - 127) - (den ? 24.0f : 0.0f);
    float m = bits_f32((b & 0x007fffffu) | 0x3f800000u);
    int big = m > 1.41421356f;
    m = big ? m * 0.5f : m;
    e = big ? e + 1.0f : e;
    float f = m - 1.0f;
    float z = f * f;
    float y = 7.0376836292E-2f;
    y = y * f - 1.1514610310E-1f;
    y = y * f + 1.1676998740E-1f;
    y = y * f - 1.2420140846E-1f;
    y = y * f + 1.4249322787E-1f;
    y = y * f - 1.6668057665E-1f;
    y = y * f + 2.0000714765E-1f;
    y = y * f - 2.4999993993E-1f;
    y = y * f + 3.3333331174E-1f;
    y = y * f * z;
    y = y + e * -2.12194440e-4f;
    y = y - 0.5f * z;
    float r = f + y;
    r = r + e * 0.693359375f;
    r = x == 0.0f ? -INFINITY : r;
    r = x < 0.0f ? NAN : r;
    r = x == INFINITY ? x : r;
    return x != x ? x : r;
}

/* softplus(v) = max(v, 0) + log1p(e^-|v|); log1p(y) = log(1 + y) * y / ((1 + y) - 1) */
static inline float tn_softplusf(float v)
{
    float y = tn_expf(-fabsf(v));
    float u = 1.0f + y, d = u - 1.0f;
    float l = d == 0.0f ? y : tn_logf(u) * (y / d);
    float r = (v > 0.0f ? v : 0.0f) + l;
    return v != v ? v : r;
}

/* sin (want_cos = 0) or cos of x for |x| <= TN_SINCOS_MAX: octant reduction with pi/4 in four parts of <= 10
   significant bits (exact products for octants < 2^14); larger |x|, inf and NaN go to libm (see act_apply). */
#define TN_SINCOS_MAX 8192.0f
static inline float tn_sincosf(float x, int want_cos)
{
    float ax = fabsf(x);
    float j = (float)(int32_t)(ax * 1.27323954473516f);
    j = j + (float)((int32_t)j & 1);
    int32_t q = (int32_t)j & 7;
    float r = (((ax - j * 0x1.92p-1f) - j * 0x1.fb8p-13f) - j * -0x1.5ep-24f) - j * 0x1.0b4612p-35f;
    float z = r * r;
    float c = ((2.443315711809948E-005f * z - 1.388731625493765E-003f) * z + 4.166664568298827E-002f) * z * z;
    c = c - 0.5f * z + 1.0f;
    float s = ((-1.9515295891E-4f * z + 8.3321608736E-3f) * z - 1.6666654611E-1f) * z * r + r;
    int32_t qq = want_cos ? q + 2 : q;
    float y = (qq & 2) ? c : s;
    y = (qq & 4) ? -y : y;
    y = (!want_cos && x < 0.0f) ? -y : y;
    return y;
}

TN_HOT static int act_apply(int func, float *x, int64_t n)
{
    int64_t i;
    int big = 0;
    switch (func) {
    case ACT_IDENTITY: break;
    case ACT_RELU: for (i = 0; i < n; i++) x[i] = x[i] > 0.0f ? x[i] : 0.0f; break;
    case ACT_GELU_TANH: for (i = 0; i < n; i++) x[i] = tn_gelu_tanhf(x[i]); break;
    case ACT_GELU: for (i = 0; i < n; i++) x[i] = tn_geluf(x[i]); break;
    case ACT_SIGMOID: for (i = 0; i < n; i++) x[i] = tn_sigmoidf(x[i]); break;
    case ACT_TANH: for (i = 0; i < n; i++) x[i] = tn_tanhf(x[i]); break;
    case ACT_EXP: for (i = 0; i < n; i++) x[i] = tn_expf(x[i]); break;
    case ACT_LOG: for (i = 0; i < n; i++) x[i] = tn_logf(x[i]); break;
    case ACT_SILU: for (i = 0; i < n; i++) x[i] = x[i] * tn_sigmoidf(x[i]); break;
    case ACT_SOFTPLUS: for (i = 0; i < n; i++) x[i] = tn_softplusf(x[i]); break;
    case ACT_SQRT: for (i = 0; i < n; i++) x[i] = sqrtf(x[i]); break;
    case ACT_RSQRT: for (i = 0; i < n; i++) x[i] = 1.0f / sqrtf(x[i]); break;
    case ACT_RECIPROCAL: for (i = 0; i < n; i++) x[i] = 1.0f / x[i]; break;
    case ACT_SQUARE: for (i = 0; i < n; i++) x[i] = x[i] * x[i]; break;
    case ACT_ABS: for (i = 0; i < n; i++) x[i] = fabsf(x[i]); break;
    case ACT_SIGN:
        for (i = 0; i < n; i++) x[i] = x[i] > 0.0f ? 1.0f : (x[i] < 0.0f ? -1.0f : x[i]);
        break;
    case ACT_SIN:
    case ACT_COS:
        /* |x| > TN_SINCOS_MAX, inf and NaN (rare) go to libm, the rest through the vector loops */
        for (i = 0; i < n; i++) big |= !(fabsf(x[i]) <= TN_SINCOS_MAX);
        if (big)
            for (i = 0; i < n; i++) {
                float v = x[i];
                int c = func == ACT_COS;
                x[i] = fabsf(v) <= TN_SINCOS_MAX ? tn_sincosf(v, c) : (c ? cosf(v) : sinf(v));
            }
        else if (func == ACT_SIN)
            for (i = 0; i < n; i++) x[i] = tn_sincosf(x[i], 0);
        else
            for (i = 0; i < n; i++) x[i] = tn_sincosf(x[i], 1);
        break;
    case ACT_ERF: for (i = 0; i < n; i++) x[i] = tn_erff(x[i]); break;
    default: return TN_EARGS;
    }
    return TN_OK;
}

/* ------------------------------------------------------------------ reductions */

enum { RED_NONE = 0, RED_ADD, RED_MAX, RED_MIN, RED_MUL, RED_AND, RED_OR };

static int reduce_init(int op, float *init)
{
    switch (op) {
    case RED_ADD: case RED_OR: *init = 0.0f; return TN_OK;
    case RED_MUL: case RED_AND: *init = 1.0f; return TN_OK;
    case RED_MAX: *init = -INFINITY; return TN_OK;
    case RED_MIN: *init = INFINITY; return TN_OK;
    default: return TN_EARGS;
    }
}

/* Fold x[0..n) into acc with op (NaN propagates through max/min as in torch). Sums, maxima and minima keep 16
   partial results (element i goes to lane i % 16; the lanes are combined in a fixed tree): the loops vectorise,
   and the order, hence the rounding, is the same in every clone. */
#define TN_RED_LANES 16
typedef float tn_v16f __attribute__((vector_size(64)));
typedef int32_t tn_v16i __attribute__((vector_size(64)));
TN_HOT static float reduce_row(int op, float acc, const float *x, int64_t n)
{
    int64_t i;
    float l[TN_RED_LANES];
    int j, w;
    switch (op) {
    case RED_ADD:
        for (j = 0; j < TN_RED_LANES; j++) l[j] = 0.0f;
        for (i = 0; i + TN_RED_LANES <= n; i += TN_RED_LANES)
            for (j = 0; j < TN_RED_LANES; j++) l[j] += x[i + j];
        for (j = 0; i + j < n; j++) l[j] += x[i + j];
        for (w = TN_RED_LANES / 2; w >= 1; w /= 2)
            for (j = 0; j < w; j++) l[j] += l[j + w];
        return acc + l[0];
    case RED_MAX:
    case RED_MIN: {
        /* lv: lane maxima (minima), qv: a NaN seen by the lane (0 if none), folded in at the end; GCC vector
           extensions (split into SSE/AVX2 halves where AVX-512 is missing): the branchy scalar form does not
           vectorise */
        tn_v16f lv, qv = {0}, v;
        for (j = 0; j < TN_RED_LANES; j++) lv[j] = acc;
        int mx = op == RED_MAX;
        for (i = 0; i + TN_RED_LANES <= n; i += TN_RED_LANES) {
            memcpy(&v, x + i, sizeof v);
            tn_v16i take = mx ? (v > lv) : (v < lv), isnan_ = v != v;
            lv = (tn_v16f)(((tn_v16i)v & take) | ((tn_v16i)lv & ~take));
            qv = (tn_v16f)(((tn_v16i)v & isnan_) | ((tn_v16i)qv & ~isnan_));
        }
        for (j = 0; i + j < n; j++) {
            float e = x[i + j];
            lv[j] = (mx ? e > lv[j] : e < lv[j]) ? e : lv[j];
            qv[j] = e != e ? e : qv[j];
        }
        for (j = 0; j < TN_RED_LANES; j++) {
            float e = lv[j];
            acc = (mx ? e > acc : e < acc) || e != e ? e : acc;
            acc = qv[j] != qv[j] ? qv[j] : acc;
        }
        return acc;
    }
    case RED_MUL: for (i = 0; i < n; i++) acc *= x[i]; return acc;
    case RED_AND: for (i = 0; i < n; i++) acc = (acc != 0.0f && x[i] != 0.0f) ? 1.0f : 0.0f; return acc;
    case RED_OR: for (i = 0; i < n; i++) acc = (acc != 0.0f || x[i] != 0.0f) ? 1.0f : 0.0f; return acc;
    default: return acc;
    }
}

/* reduce_row(op, acc, &x, 1), spelled out (a reduction over an axis of size 1 calls it once per element): the
   same operations in the same order, so the same bits (the lanes other than 0 hold 0 for sums and acc for
   maxima/minima, which leave the result as it is for a non-NaN acc, the identity reductions pass). */
static inline float reduce_one(int op, float acc, float x)
{
    float l, q;
    switch (op) {
    case RED_ADD:
        l = 0.0f + x;
        l += 0.0f; l += 0.0f; l += 0.0f; l += 0.0f;   /* the lane tree: l[0] += l[8], l[4], l[2], l[1] (all 0) */
        return acc + l;
    case RED_MAX:
    case RED_MIN:
        if (acc != acc) return reduce_row(op, acc, &x, 1);
        l = (op == RED_MAX ? x > acc : x < acc) ? x : acc;
        q = x != x ? x : 0.0f;
        acc = (op == RED_MAX ? l > acc : l < acc) || l != l ? l : acc;
        return q != q ? q : acc;
    case RED_MUL: return acc * x;
    case RED_AND: return (acc != 0.0f && x != 0.0f) ? 1.0f : 0.0f;
    case RED_OR: return (acc != 0.0f || x != 0.0f) ? 1.0f : 0.0f;
    default: return acc;
    }
}

TN_HOT static void scale_bias_row(float *x, int64_t n, float s, float b, int has_bias)
{
    /* no bias (no bias operand, immediate 0): the product alone, so x * 0 keeps its sign of zero
       (-2 * 0.0 is -0.0, as torch gives; adding +0.0 would make it +0.0). Every other value is unchanged. */
    if (!has_bias) {
        for (int64_t i = 0; i < n; i++) x[i] = x[i] * s;
        return;
    }
    for (int64_t i = 0; i < n; i++) x[i] = x[i] * s + b;
}

int tn_activation(int func, const tn_ap *out, const tn_ap *in, const tn_ap *bias, double bias_imm,
                  const tn_ap *scale, double scale_imm, int reduce_op, const tn_ap *reduce_out, int64_t nparts)
{
    int64_t n = ap_free(out), rows = block_rows(n);
    if (rows > nparts) rows = nparts > 0 ? nparts : 1;
    if (!rows_independent(out, in, nparts) || !rows_independent(out, bias, nparts)
        || !rows_independent(out, scale, nparts) || (reduce_out && (!rows_independent(reduce_out, in, nparts)
        || !rows_independent(out, reduce_out, nparts) || !rows_independent(reduce_out, out, nparts)
        || !rows_independent(reduce_out, bias, nparts) || !rows_independent(reduce_out, scale, nparts))))
        rows = 1;
    float *x = scratch(0, rows * n);
    float init = 0.0f;
    if (!x) return TN_ENOMEM;
    if (reduce_out && reduce_init(reduce_op, &init)) return TN_EARGS;
    int ci = ap_free_contiguous(in), co = ap_free_contiguous(out);
    if (ci && co && in->dtype == TN_F32 && out->dtype == TN_F32) {
        /* fp32 rows in place in the output row (one copy, none when in == out): partition by partition */
        for (int64_t p = 0; p < nparts; p++) {
            float s = scale ? load_scalar(scale, p) : (float)scale_imm;
            float b = (bias ? load_scalar(bias, p) : 0.0f) + (float)bias_imm;
            if (p + TN_PREFETCH_AHEAD < nparts) {
                prefetch_row(ap_part(in, p + TN_PREFETCH_AHEAD), n * 4, 0);
                prefetch_row(ap_part(out, p + TN_PREFETCH_AHEAD), n * 4, 1);
            }
            float *y = (float *)ap_part(out, p);
            const float *xi = (const float *)ap_part(in, p);
            if (y != xi) memmove(y, xi, (size_t)n * 4);
            if (s != 1.0f || b != 0.0f)
                scale_bias_row(y, n, s, b, bias != NULL || bias_imm != 0.0);
            int rc = act_apply(func, y, n);
            if (rc) return rc;
            if (reduce_out) {
                float r = reduce_row(reduce_op, init, y, n);
                store_row(ap_part(reduce_out, p), reduce_out->dtype, 1, &r, 1);
            }
        }
        return TN_OK;
    }
    for (int64_t p0 = 0; p0 < nparts; p0 += rows) {
        int64_t np = nparts - p0 < rows ? nparts - p0 : rows;
        load_rows(x, in, p0, np, n, ci);
        for (int64_t i = 0; i < np; i++) {
            float s = scale ? load_scalar(scale, p0 + i) : (float)scale_imm;
            float b = (bias ? load_scalar(bias, p0 + i) : 0.0f) + (float)bias_imm;
            if (s != 1.0f || b != 0.0f)
                scale_bias_row(x + i * n, n, s, b, bias != NULL || bias_imm != 0.0);
        }
        int rc = act_apply(func, x, np * n);
        if (rc) return rc;
        store_rows(out, p0, np, n, x, co);
        if (reduce_out)
            for (int64_t i = 0; i < np; i++) {
                float r = reduce_row(reduce_op, init, x + i * n, n);
                store_row(ap_part(reduce_out, p0 + i), reduce_out->dtype, 1, &r, 1);
            }
    }
    return TN_OK;
}

/* o[j] = reduce_one(op, acc, x[j]) for j < k, one loop per op (the loops vectorise; a switch per element does
   not): the same operations in the same order as reduce_one, so the same bits. */
TN_HOT static void reduce_ones(int op, float acc, float *restrict o, const float *restrict x, int64_t k)
{
    int64_t j;
    if (acc != acc) {   /* a NaN start (reduce_init never gives one) keeps reduce_one's own path */
        for (j = 0; j < k; j++) o[j] = reduce_one(op, acc, x[j]);
        return;
    }
    switch (op) {
    case RED_ADD:
        for (j = 0; j < k; j++) {
            float l = 0.0f + x[j];
            l += 0.0f; l += 0.0f; l += 0.0f; l += 0.0f;
            o[j] = acc + l;
        }
        return;
    case RED_MAX:
        for (j = 0; j < k; j++) {
            float e = x[j], l = e > acc ? e : acc, q = e != e ? e : 0.0f, a = (l > acc) | (l != l) ? l : acc;
            o[j] = q != q ? q : a;
        }
        return;
    case RED_MIN:
        for (j = 0; j < k; j++) {
            float e = x[j], l = e < acc ? e : acc, q = e != e ? e : 0.0f, a = (l < acc) | (l != l) ? l : acc;
            o[j] = q != q ? q : a;
        }
        return;
    case RED_MUL: for (j = 0; j < k; j++) o[j] = acc * x[j]; return;
    case RED_AND: for (j = 0; j < k; j++) o[j] = (acc != 0.0f && x[j] != 0.0f) ? 1.0f : 0.0f; return;
    case RED_OR: for (j = 0; j < k; j++) o[j] = (acc != 0.0f || x[j] != 0.0f) ? 1.0f : 0.0f; return;
    default: for (j = 0; j < k; j++) o[j] = acc; return;
    }
}

int tn_tensor_reduce(int op, const tn_ap *out, const tn_ap *in, int nred, int64_t nparts)
{
    if (nred < 1 || nred > 4) return TN_EARGS;
    float init;
    if (reduce_init(op, &init)) return TN_EARGS;
    int64_t n = ap_free(in), r = 1;
    for (int d = 4 - nred; d < 4; d++) r *= in->num[d];
    int64_t k = r > 0 ? n / r : 0;
    float *x = scratch(0, n), *o = scratch(1, k);
    if (!x || !o) return TN_ENOMEM;
    /* fp32 rows of one run are read where they are (the kernel only reads `in`; o is scratch) */
    int direct = in->dtype == TN_F32 && ap_free_contiguous(in);
    for (int64_t p = 0; p < nparts; p++) {
        const float *xs = x;
        if (direct) {
            if (p + TN_PREFETCH_AHEAD < nparts) prefetch_row(ap_part(in, p + TN_PREFETCH_AHEAD), n * 4, 0);
            xs = (const float *)ap_part(in, p);
        }
        else load_ap(x, in, p);
        if (r == 1)
            reduce_ones(op, init, o, xs, k);
        else
            for (int64_t j = 0; j < k; j++) o[j] = reduce_row(op, init, xs + j * r, r);
        store_ap(out, p, o);
    }
    return TN_OK;
}

/* ------------------------------------------------------------------ copies */

static void copy_row_bytes(char *d, int64_t ds, const char *s, int64_t ss, int64_t n, int esize)
{
    if (ds == 1 && ss == 1) { memmove(d, s, (size_t)(n * esize)); return; }
    switch (esize) {
    case 1: for (int64_t i = 0; i < n; i++) d[i * ds] = s[i * ss]; break;
    case 2: for (int64_t i = 0; i < n; i++) ((uint16_t *)d)[i * ds] = ((const uint16_t *)s)[i * ss]; break;
    case 4: for (int64_t i = 0; i < n; i++) ((uint32_t *)d)[i * ds] = ((const uint32_t *)s)[i * ss]; break;
    case 8: for (int64_t i = 0; i < n; i++) ((uint64_t *)d)[i * ds] = ((const uint64_t *)s)[i * ss]; break;
    default: for (int64_t i = 0; i < n; i++) memmove(d + i * ds * esize, s + i * ss * esize, (size_t)esize);
    }
}

/* Byte range [*lo, *hi) that the n > 0 elements of pattern `a` at base b (one partition; NULL: offsets) can touch. */
static void ap_span(const tn_ap *a, const char *b, uintptr_t *lo, uintptr_t *hi)
{
    int64_t l = 0, h = 0;
    for (int d = 0; d < 4; d++) {
        int64_t e = (a->num[d] - 1) * a->stride[d];
        if (e < 0) l += e; else h += e;
    }
    *lo = (uintptr_t)b + (uintptr_t)(l * a->esize);
    *hi = (uintptr_t)b + (uintptr_t)((h + 1) * a->esize);
}

/* Copies the n elements of s (at sb) to d (at db) in the row-major element order of both patterns (already
   squeezed), one copy_row_bytes call per run: a run is as many elements as are left in the innermost dim of
   both patterns, so after ap_squeeze merged the dims that walk memory as one, a run is often a whole row or the
   whole part. The memory of d and s must not overlap (then the writes land in the same order as one element at a
   time, and a dst dim of stride 0 keeps the last element written, as before). */
static void copy_runs(char *db, const tn_ap *d, const char *sb, const tn_ap *s, int64_t n, int es)
{
    int64_t di[4] = {0, 0, 0, 0}, si[4] = {0, 0, 0, 0};
    int64_t dn3 = d->num[3], sn3 = s->num[3], ds3 = d->stride[3], ss3 = s->stride[3];
    int64_t od = 0, os = 0; /* element offsets of dims 0..2 of the current index tuples */
    for (int64_t e = 0; e < n;) {
        int64_t k = dn3 - di[3];
        if (sn3 - si[3] < k) k = sn3 - si[3];
        copy_row_bytes(db + (od + di[3] * ds3) * es, ds3, sb + (os + si[3] * ss3) * es, ss3, k, es);
        e += k;
        di[3] += k;
        if (di[3] == dn3) {
            di[3] = 0;
            for (int x = 2; x >= 0; x--) { if (++di[x] < d->num[x]) break; di[x] = 0; }
            od = di[0] * d->stride[0] + di[1] * d->stride[1] + di[2] * d->stride[2];
        }
        si[3] += k;
        if (si[3] == sn3) {
            si[3] = 0;
            for (int x = 2; x >= 0; x--) { if (++si[x] < s->num[x]) break; si[x] = 0; }
            os = si[0] * s->stride[0] + si[1] * s->stride[1] + si[2] * s->stride[2];
        }
    }
}

/* The copy of copy_runs for two (squeezed) patterns of the same dims: one copy_row_bytes per innermost row. */
static void copy_rows_same(char *db, const tn_ap *d, const char *sb, const tn_ap *s, int es)
{
    for (int64_t i0 = 0; i0 < d->num[0]; i0++)
        for (int64_t i1 = 0; i1 < d->num[1]; i1++)
            for (int64_t i2 = 0; i2 < d->num[2]; i2++) {
                int64_t od = (i0 * d->stride[0] + i1 * d->stride[1] + i2 * d->stride[2]) * es;
                int64_t os = (i0 * s->stride[0] + i1 * s->stride[1] + i2 * s->stride[2]) * es;
                copy_row_bytes(db + od, d->stride[3], sb + os, s->stride[3], d->num[3], es);
            }
}

/* Byte copy between two access patterns of the same total size and element size; the two patterns are walked in
   their own row-major orders. When the two patterns' memory ranges are disjoint, the copy goes run by run
   (copy_runs); when they overlap, element by element in that order as the model defines it (an element written
   early may be read later). */
/* The checks of a byte copy between two patterns: same element size, same dims or at least the same element
   count. Sets *same (same dims) and *nfree (elements per partition); TN_EARGS when they cannot be copied. */
static int copy_check(const tn_ap *dst, const tn_ap *src, int *same, int64_t *nfree)
{
    if (src->esize != dst->esize) return TN_EARGS;
    *same = 1;
    for (int d = 0; d < 4; d++) *same &= dst->num[d] == src->num[d];
    *nfree = ap_free(dst);
    return (!*same && ap_free(src) != *nfree) ? TN_EARGS : TN_OK;
}

static int copy_ap_part(const tn_ap *dst, int64_t pd, const tn_ap *src, int64_t ps)
{
    int es = dst->esize, same;
    int64_t nfree;
    if (copy_check(dst, src, &same, &nfree)) return TN_EARGS;
    char *db = ap_part(dst, pd);
    const char *sb = ap_part(src, ps);
    if (nfree <= 0) return TN_OK;
    uintptr_t dlo, dhi, slo, shi;
    ap_span(dst, db, &dlo, &dhi);
    ap_span(src, sb, &slo, &shi);
    if (dhi <= slo || shi <= dlo) {
        tn_ap dq = ap_squeeze(dst), sq = ap_squeeze(src);
        copy_runs(db, &dq, sb, &sq, nfree, es);
        return TN_OK;
    }
    if (same) {
        copy_rows_same(db, dst, sb, src, es);
        return TN_OK;
    }
    /* different shapes, same element count: walk both index tuples */
    int64_t n = nfree;
    int64_t di[4] = {0, 0, 0, 0}, si[4] = {0, 0, 0, 0};
    for (int64_t e = 0; e < n; e++) {
        int64_t od = 0, os = 0;
        for (int d = 0; d < 4; d++) { od += di[d] * dst->stride[d]; os += si[d] * src->stride[d]; }
        memmove(db + od * es, sb + os * es, (size_t)es);
        for (int d = 3; d >= 0; d--) { if (++di[d] < dst->num[d]) break; di[d] = 0; }
        for (int d = 3; d >= 0; d--) { if (++si[d] < src->num[d]) break; si[d] = 0; }
    }
    return TN_OK;
}

/* A contiguous access pattern over buf with the dims of `like` (so copies between the two run row by row). */
static tn_ap contig_like(char *buf, const tn_ap *like, int dtype, int esize)
{
    tn_ap a;
    int64_t s = 1;
    a.base = buf;
    for (int d = 3; d >= 0; d--) { a.num[d] = like->num[d]; a.stride[d] = s; s *= like->num[d]; }
    a.pstride = s * esize;
    a.dtype = dtype;
    a.esize = esize;
    return a;
}

/* copy_ap_part for partitions 0..nparts-1 of both, its checks, squeezes and spans done once (a DMA of many
   partitions of short rows spent most of its time there). */
int tn_copy_bytes(const tn_ap *dst, const tn_ap *src, int64_t nparts)
{
    if (nparts <= 0) return TN_OK;
    int es = dst->esize, same;
    int64_t nfree;
    if (copy_check(dst, src, &same, &nfree)) return TN_EARGS;
    if (nfree <= 0) return TN_OK;
    uintptr_t dlo, dhi, slo, shi;
    ap_span(dst, NULL, &dlo, &dhi);   /* byte offsets from a partition's start */
    ap_span(src, NULL, &slo, &shi);
    tn_ap dq = ap_squeeze(dst), sq = ap_squeeze(src);
    /* both patterns one contiguous row per partition (the common DMA): one memcpy per partition */
    int one_run = dq.num[3] == nfree && sq.num[3] == nfree && dq.stride[3] == 1 && sq.stride[3] == 1;
    int same_sq = 1;
    for (int d = 0; d < 4; d++) same_sq &= dq.num[d] == sq.num[d];
    for (int64_t p = 0; p < nparts; p++) {
        char *db = ap_part(dst, p);
        const char *sb = ap_part(src, p);
        uintptr_t d0 = (uintptr_t)db + dlo, d1 = (uintptr_t)db + dhi, s0 = (uintptr_t)sb + slo, s1 = (uintptr_t)sb + shi;
        if (same && !one_run) {
            copy_rows_same(db, dst, sb, src, es);   /* in order, so overlapping rows copy as before */
        } else if (d1 <= s0 || s1 <= d0) {
            if (one_run && p + TN_PREFETCH_AHEAD < nparts) {
                prefetch_row(ap_part(src, p + TN_PREFETCH_AHEAD), nfree * es, 0);
                prefetch_row(ap_part(dst, p + TN_PREFETCH_AHEAD), nfree * es, 1);
            }
            if (one_run) memcpy(db, sb, (size_t)(nfree * es));
            else if (same_sq) copy_rows_same(db, &dq, sb, &sq, es);
            else copy_runs(db, &dq, sb, &sq, nfree, es);
        } else {
            int rc = copy_ap_part(dst, p, src, p);
            if (rc) return rc;
        }
    }
    return TN_OK;
}

int tn_tensor_copy(const tn_ap *out, const tn_ap *in, int64_t nparts)
{
    if (out->dtype == in->dtype) return tn_copy_bytes(out, in, nparts);
    int64_t n = ap_free(out), rows = block_rows(n);
    if (rows > nparts) rows = nparts > 0 ? nparts : 1;
    if (!rows_independent(out, in, nparts)) rows = 1;
    float *x = scratch(0, rows * n);
    if (!x) return TN_ENOMEM;
    int ci = ap_free_contiguous(in), co = ap_free_contiguous(out);
    for (int64_t p0 = 0; p0 < nparts; p0 += rows) {
        int64_t np = nparts - p0 < rows ? nparts - p0 : rows;
        load_rows(x, in, p0, np, n, ci);
        store_rows(out, p0, np, n, x, co);
    }
    return TN_OK;
}

static inline int64_t load_index(const tn_ap *idx, int64_t p)
{
    const char *s = ap_part(idx, p);
    switch (idx->dtype) {
    case TN_I32: return *(const int32_t *)s;
    case TN_I64: return *(const int64_t *)s;
    case TN_U8: case TN_BOOL: return *(const uint8_t *)s;
    default: return -1;
    }
}

int tn_gather_rows(const tn_ap *dst, const tn_ap *table, int64_t table_rows, const tn_ap *idx,
                   int64_t nparts, int64_t *bad_index)
{
    for (int64_t p = 0; p < nparts; p++) {
        int64_t r = load_index(idx, p);
        if (r < 0 || r >= table_rows) {
            if (bad_index) { bad_index[0] = p; bad_index[1] = r; }
            return TN_EINDEX;
        }
    }
    for (int64_t p = 0; p < nparts; p++) {
        int rc = copy_ap_part(dst, p, table, load_index(idx, p));
        if (rc) return rc;
    }
    return TN_OK;
}

int tn_scatter_rows(const tn_ap *table, int64_t table_rows, const tn_ap *src, const tn_ap *idx,
                    int64_t nparts, int accumulate, int64_t *bad_index)
{
    for (int64_t p = 0; p < nparts; p++) {
        int64_t r = load_index(idx, p);
        if (r < 0 || r >= table_rows) {
            if (bad_index) { bad_index[0] = p; bad_index[1] = r; }
            return TN_EINDEX;
        }
    }
    if (!accumulate) {
        for (int64_t p = 0; p < nparts; p++) {
            int rc = copy_ap_part(table, load_index(idx, p), src, p);
            if (rc) return rc;
        }
        return TN_OK;
    }
    int64_t n = ap_free(src);
    float *x = scratch(0, n), *y = scratch(1, n);
    if (!x || !y) return TN_ENOMEM;
    for (int64_t p = 0; p < nparts; p++) {
        int64_t r = load_index(idx, p);
        load_ap(x, table, r);
        load_ap(y, src, p);
        for (int64_t i = 0; i < n; i++) x[i] += y[i];
        store_ap(table, r, x);
    }
    return TN_OK;
}

/* ------------------------------------------------------------------ VectorE / GpSimd misc */

/* x[i] = c[i] != 0 ? x[i] : y[i] (branch-free: a data-dependent branch mispredicts on real masks) */
TN_HOT static void select_row(float *restrict x, const float *restrict c, const float *restrict y, int64_t n)
{
    for (int64_t i = 0; i < n; i++) x[i] = c[i] != 0.0f ? x[i] : y[i];
}

int tn_select(const tn_ap *out, const tn_ap *pred, const tn_ap *a, const tn_ap *b, int64_t nparts)
{
    int64_t n = ap_free(out);
    float *c = scratch(0, n), *x = scratch(1, n), *y = scratch(2, n);
    if (!c || !x || !y) return TN_ENOMEM;
    for (int64_t p = 0; p < nparts; p++) {
        load_ap(c, pred, p);
        load_ap(x, a, p);
        load_ap(y, b, p);
        select_row(x, c, y, n);
        store_ap(out, p, x);
    }
    return TN_OK;
}

/* Write v (computed in double) to element e of an int or float operand row. */
static void fill_affine(double *vals, const tn_ap *out, const double *coef, int64_t p)
{
    int64_t k = 0;
    for (int64_t i0 = 0; i0 < out->num[0]; i0++)
        for (int64_t i1 = 0; i1 < out->num[1]; i1++)
            for (int64_t i2 = 0; i2 < out->num[2]; i2++) {
                double b = coef[0] + coef[1] * (double)p + coef[2] * (double)i0 + coef[3] * (double)i1 + coef[4] * (double)i2;
                for (int64_t i3 = 0; i3 < out->num[3]; i3++) vals[k++] = b + coef[5] * (double)i3;
            }
}

int tn_iota(const tn_ap *out, const double *coef, int64_t nparts)
{
    int64_t n = ap_free(out);
    double *v = (double *)scratch(3, 2 * n);
    float *x = scratch(0, n);
    if (!v || !x) return TN_ENOMEM;
    for (int64_t p = 0; p < nparts; p++) {
        fill_affine(v, out, coef, p);
        if (out->dtype == TN_I32 || out->dtype == TN_I64) { /* exact integers, row-major over the pattern */
            int64_t k = 0;
            char *base = ap_part(out, p);
            for (int64_t i0 = 0; i0 < out->num[0]; i0++)
                for (int64_t i1 = 0; i1 < out->num[1]; i1++)
                    for (int64_t i2 = 0; i2 < out->num[2]; i2++)
                        for (int64_t i3 = 0; i3 < out->num[3]; i3++, k++) {
                            int64_t off = i0 * out->stride[0] + i1 * out->stride[1] + i2 * out->stride[2] + i3 * out->stride[3];
                            double d = v[k];
                            if (d != d) d = 0.0;
                            if (out->dtype == TN_I32) {
                                int32_t w = d >= 2147483647.0 ? INT32_MAX : d <= -2147483648.0 ? INT32_MIN : (int32_t)d;
                                ((int32_t *)base)[off] = w;
                            } else {
                                ((int64_t *)base)[off] = d >= 9.2e18 ? INT64_MAX : d <= -9.2e18 ? INT64_MIN : (int64_t)d;
                            }
                        }
        } else {
            for (int64_t i = 0; i < n; i++) x[i] = (float)v[i];
            store_ap(out, p, x);
        }
    }
    return TN_OK;
}

enum { CMP_GE = 0, CMP_GT, CMP_LE, CMP_LT, CMP_EQ, CMP_NE };

/* Number of i in [0, n) with e(i) = b + c*i (in double, as fill_affine computes it) below 0 (strict) or at most 0
   (!strict), for c >= 0, where e is nondecreasing in i (rounding is monotone), so those i form a prefix. */
static int64_t affine_count_below(double b, double c, int64_t n, int strict)
{
    int64_t lo = 0, hi = n;   /* invariant: e(i) satisfies the predicate for i < lo and not for i >= hi */
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        double e = b + c * (double)mid;
        if (strict ? e < 0 : e <= 0) lo = mid + 1; else hi = mid;
    }
    return lo;
}

static void fill_range(float *r, int64_t lo, int64_t hi, float f)
{
    for (int64_t i = lo; i < hi; i++) r[i] = f;
}

/* r[i] = (b + c*i) <cmp> 0 ? r[i] : f over a row of n. The expression is monotone in i, so the kept elements form
   one interval (two for not_equal) found by binary search with the exact expression; non-finite b or c (NaN
   comparisons) go element by element. */
static void affine_select_row(int cmp, float *r, int64_t n, double b, double c, float f)
{
    if (!isfinite(b) || !isfinite(c)) {
        for (int64_t i = 0; i < n; i++) {
            double e = b + c * (double)i;
            int keep = cmp == CMP_GE ? e >= 0 : cmp == CMP_GT ? e > 0 : cmp == CMP_LE ? e <= 0
                     : cmp == CMP_LT ? e < 0 : cmp == CMP_EQ ? e == 0 : e != 0;
            if (!keep) r[i] = f;
        }
        return;
    }
    /* for c < 0 work on the mirrored row j = n-1-i: e = (b + c*(n-1)) ... is not bit-identical, so count on
       -e instead: b + c*i < 0  <=>  -(b + c*i) > 0, and -(b + c*i) = (-b) + (-c)*i exactly */
    int neg = c < 0;
    double bb = neg ? -b : b, cc = neg ? -c : c;
    /* with e' = bb + cc*i nondecreasing: lt = #{e' < 0}, le = #{e' <= 0} (prefixes) */
    int64_t lt = affine_count_below(bb, cc, n, 1), le = affine_count_below(bb, cc, n, 0);
    /* sets of e (not e'): e >= 0 is e' >= 0 (suffix [lt, n)) or, mirrored, e' <= 0 (prefix [0, le)) */
    int64_t klo, khi;
    switch (cmp) {
    case CMP_GE: klo = neg ? 0 : lt; khi = neg ? le : n; break;
    case CMP_GT: klo = neg ? 0 : le; khi = neg ? lt : n; break;
    case CMP_LE: klo = neg ? lt : 0; khi = neg ? n : le; break;
    case CMP_LT: klo = neg ? le : 0; khi = neg ? n : lt; break;
    case CMP_EQ: klo = lt; khi = le; break;
    default:   /* not_equal: everything but [lt, le) */
        fill_range(r, lt, le, f);
        return;
    }
    fill_range(r, 0, klo, f);
    fill_range(r, khi > klo ? khi : klo, n, f);
}

int tn_affine_select(int cmp, const tn_ap *out, const tn_ap *in, const double *coef, double fill, int64_t nparts)
{
    if (cmp < CMP_GE || cmp > CMP_NE) return TN_EARGS;
    int64_t n = ap_free(out), n3 = out->num[3];
    float *x = scratch(0, n);
    if (!x) return TN_ENOMEM;
    float f = (float)fill;
    for (int64_t p = 0; p < nparts; p++) {
        load_ap(x, in, p);
        float *r = x;
        for (int64_t i0 = 0; i0 < out->num[0]; i0++)
            for (int64_t i1 = 0; i1 < out->num[1]; i1++)
                for (int64_t i2 = 0; i2 < out->num[2]; i2++, r += n3) {
                    double b = coef[0] + coef[1] * (double)p + coef[2] * (double)i0 + coef[3] * (double)i1
                             + coef[4] * (double)i2;
                    affine_select_row(cmp, r, n3, b, coef[5], f);
                }
        store_ap(out, p, x);
    }
    return TN_OK;
}

int tn_memset(const tn_ap *out, double value, int64_t nparts)
{
    int64_t n = ap_free(out);
    float *x = scratch(0, n);
    if (!x) return TN_ENOMEM;
    if (out->dtype == TN_I32 || out->dtype == TN_I64) {
        double coef[6] = {value, 0, 0, 0, 0, 0};
        return tn_iota(out, coef, nparts);
    }
    for (int64_t i = 0; i < n; i++) x[i] = (float)value;
    for (int64_t p = 0; p < nparts; p++) store_ap(out, p, x);
    return TN_OK;
}

/* bn_stats: out = [count, mean, var (population)] per partition. */
int tn_bn_stats(const tn_ap *out, const tn_ap *in, int64_t nparts)
{
    int64_t n = ap_free(in);
    float *x = scratch(0, n);
    if (!x) return TN_ENOMEM;
    for (int64_t p = 0; p < nparts; p++) {
        load_ap(x, in, p);
        double s = 0, ss = 0;
        for (int64_t i = 0; i < n; i++) s += x[i];
        double mean = n ? s / (double)n : 0.0;
        for (int64_t i = 0; i < n; i++) { double d = x[i] - mean; ss += d * d; }
        float r[3] = {(float)n, (float)mean, (float)(n ? ss / (double)n : 0.0)};
        store_ap(out, p, r);
    }
    return TN_OK;
}

/* bn_aggr: combine G [count, mean, var] triples into [mean, var] (Chan et al.). */
int tn_bn_aggr(const tn_ap *out, const tn_ap *in, int64_t nparts)
{
    int64_t n = ap_free(in);
    float *x = scratch(0, n);
    if (!x || n % 3) return x ? TN_EARGS : TN_ENOMEM;
    for (int64_t p = 0; p < nparts; p++) {
        load_ap(x, in, p);
        double cnt = 0, mean = 0, m2 = 0;
        for (int64_t g = 0; g + 3 <= n; g += 3) {
            double c = x[g], m = x[g + 1], v = x[g + 2];
            if (c <= 0) continue;
            double tot = cnt + c, delta = m - mean;
            mean += delta * c / tot;
            m2 += v * c + delta * delta * cnt * c / tot;
            cnt = tot;
        }
        float r[2] = {(float)mean, (float)(cnt > 0 ? m2 / cnt : 0.0)};
        store_ap(out, p, r);
    }
    return TN_OK;
}

/* acc[i] = acc[i] <op> x[i], exactly as reduce_row(op, acc[i], x + i, 1) (NaN propagates through max/min) */
TN_HOT static void reduce_elementwise(int op, float *restrict acc, const float *restrict x, int64_t n)
{
    int64_t i;
    switch (op) {
    case RED_ADD: for (i = 0; i < n; i++) acc[i] = acc[i] + x[i]; break;
    case RED_MAX: for (i = 0; i < n; i++) acc[i] = ((x[i] > acc[i]) | (x[i] != x[i])) ? x[i] : acc[i]; break;
    case RED_MIN: for (i = 0; i < n; i++) acc[i] = ((x[i] < acc[i]) | (x[i] != x[i])) ? x[i] : acc[i]; break;
    case RED_MUL: for (i = 0; i < n; i++) acc[i] = acc[i] * x[i]; break;
    case RED_AND: for (i = 0; i < n; i++) acc[i] = (acc[i] != 0.0f && x[i] != 0.0f) ? 1.0f : 0.0f; break;
    case RED_OR: for (i = 0; i < n; i++) acc[i] = (acc[i] != 0.0f || x[i] != 0.0f) ? 1.0f : 0.0f; break;
    default: break;
    }
}

int tn_partition_reduce(int op, const tn_ap *out, const tn_ap *in, int64_t nparts_out, int64_t nparts_in)
{
    float init;
    if (reduce_init(op, &init)) return TN_EARGS;
    int64_t n = ap_free(in);
    float *acc = scratch(0, n), *x = scratch(1, n);
    if (!acc || !x) return TN_ENOMEM;
    for (int64_t i = 0; i < n; i++) acc[i] = init;
    for (int64_t q = 0; q < nparts_in; q++) {
        load_ap(x, in, q);
        reduce_elementwise(op, acc, x, n);
    }
    for (int64_t p = 0; p < nparts_out; p++) store_ap(out, p, acc);
    return TN_OK;
}

/* 1 if no row of `out` (partitions 0..nout-1) shares a byte with a row q of `in` for any q in [qmin, qmax]:
   writing out's rows in any order then leaves every such input row as it was. Patterns with different partition
   strides lie in different memories (SBUF, PSUM), as rows_independent assumes. */
static int rows_disjoint(const tn_ap *out, int64_t nout, const tn_ap *in, int64_t qmin, int64_t qmax)
{
    if (out->pstride != in->pstride || out->pstride <= 0) return 1;
    int64_t olo, ohi, ilo, ihi, pitch = out->pstride, diff = out->base - in->base;
    ap_row_span(out, &olo, &ohi);
    ap_row_span(in, &ilo, &ihi);
    /* out row p and in row q overlap iff [diff + (p-q)*pitch + olo, ... + ohi) meets [ilo, ihi) */
    for (int64_t k = -qmax; k <= nout - 1 - qmin; k++) {
        int64_t d = diff + k * pitch;
        if (d + olo < ihi && ilo < d + ohi) return 0;
    }
    return 1;
}

int tn_partition_shuffle(const tn_ap *out, const tn_ap *in, const int64_t *perm, int64_t nparts_out)
{
    int64_t n = ap_free(in);
    if (nparts_out <= 0) return TN_OK;
    int64_t qmin = perm[0], qmax = perm[0];
    for (int64_t p = 1; p < nparts_out; p++) {
        qmin = perm[p] < qmin ? perm[p] : qmin;
        qmax = perm[p] > qmax ? perm[p] : qmax;
    }
    if (out->dtype == in->dtype && rows_disjoint(out, nparts_out, in, qmin, qmax)) {
        /* no output row overlaps a source row: copy each row straight to its place (the staged copy below moves
           every byte twice); the same bytes land in the same order as through the staging pattern */
        int es = in->esize;
        int one_run = ap_free_contiguous(in) && ap_free_contiguous(out);
        for (int64_t p = 0; p < nparts_out; p++) {
            if (one_run) {
                if (p + TN_PREFETCH_AHEAD < nparts_out) {
                    prefetch_row(ap_part(in, perm[p + TN_PREFETCH_AHEAD]), n * es, 0);
                    prefetch_row(ap_part(out, p + TN_PREFETCH_AHEAD), n * es, 1);
                }
                memcpy(ap_part(out, p), ap_part(in, perm[p]), (size_t)(n * es));
            } else {
                int rc = copy_ap_part(out, p, in, perm[p]);
                if (rc) return rc;
            }
        }
        return TN_OK;
    }
    /* out may overlap in: stage every selected source partition in scratch first */
    if (out->dtype == in->dtype) { /* exact byte copy through a contiguous staging pattern */
        int es = in->esize;
        char *st = (char *)scratch(0, (n * nparts_out * es + 3) / 4 + 1);
        if (!st) return TN_ENOMEM;
        tn_ap stage_in = contig_like(st, in, in->dtype, es), stage_out = contig_like(st, out, in->dtype, es);
        for (int64_t p = 0; p < nparts_out; p++) copy_ap_part(&stage_in, p, in, perm[p]);
        for (int64_t p = 0; p < nparts_out; p++) copy_ap_part(out, p, &stage_out, p);
        return TN_OK;
    }
    float *all = scratch(0, n * nparts_out);
    if (!all) return TN_ENOMEM;
    for (int64_t p = 0; p < nparts_out; p++) load_ap(all + p * n, in, perm[p]);
    for (int64_t p = 0; p < nparts_out; p++) store_ap(out, p, all + p * n);
    return TN_OK;
}

/* out[q][p] = in[p][q] (q < F, p < P) for T-typed elements, rows ips / ops bytes apart, in 8 x 8 blocks (each
   input row read and each output row written 8 contiguous elements at a time; plain element stores: staging a
   block in a local array and copying its rows out stalls on store forwarding). */
#define TN_TRANSPOSE_BODY(T, CONV)                                                                        \
    {                                                                                                    \
        for (int64_t p0 = 0; p0 < P; p0 += 8)                                                            \
            for (int64_t q0 = 0; q0 < F; q0 += 8) {                                                      \
                int64_t pe = P - p0 < 8 ? P - p0 : 8, qe = F - q0 < 8 ? F - q0 : 8;                     \
                for (int64_t j = 0; j < qe; j++) {                                                       \
                    T *o = (T *)(ob + (q0 + j) * ops) + p0;                                              \
                    const char *ic = ib + p0 * ips + (q0 + j) * (int64_t)sizeof(T##_in);                  \
                    for (int64_t i = 0; i < pe; i++) o[i] = CONV(*(const T##_in *)(ic + i * ips));        \
                }                                                                                        \
            }                                                                                            \
    }
typedef uint32_t u32x_in;
typedef uint32_t u32x;
typedef uint16_t u16x_in;
typedef uint16_t u16x;
typedef uint16_t f32w_in;   /* bf16 bits in, fp32 out */
typedef float f32w;
#define TN_SAME(v) (v)

static void transpose_u32_scalar(char *ob, int64_t ops, const char *ib, int64_t ips, int64_t P, int64_t F)
TN_TRANSPOSE_BODY(u32x, TN_SAME)

/* 8 x 8 blocks of 32-bit words transposed in registers (GCC vector shuffles: the unpack / shuffle / 128-bit
   permute sequence of the classic AVX transpose, lowered to what each clone has); partial blocks by the scalar
   body. */
typedef uint32_t tn_v8u __attribute__((vector_size(32)));
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define TN_SHUF8(a, b, i0, i1, i2, i3, i4, i5, i6, i7) __builtin_shufflevector(a, b, i0, i1, i2, i3, i4, i5, i6, i7)
#else
#define TN_SHUF8(a, b, i0, i1, i2, i3, i4, i5, i6, i7) __builtin_shuffle(a, b, (tn_v8u){i0, i1, i2, i3, i4, i5, i6, i7})
#endif
TN_HOT static void transpose_u32(char *ob, int64_t ops, const char *ib, int64_t ips, int64_t P, int64_t F)
{
    int64_t P8 = P & ~(int64_t)7, F8 = F & ~(int64_t)7;
    for (int64_t p0 = 0; p0 < P8; p0 += 8)
        for (int64_t q0 = 0; q0 < F8; q0 += 8) {
            tn_v8u r[8], t[8], u[8];
            for (int i = 0; i < 8; i++) memcpy(&r[i], ib + (p0 + i) * ips + q0 * 4, 32);
            for (int i = 0; i < 8; i += 2) {
                t[i] = TN_SHUF8(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
                t[i + 1] = TN_SHUF8(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
            }
            for (int i = 0; i < 8; i += 4) {
                u[i] = TN_SHUF8(t[i], t[i + 2], 0, 1, 8, 9, 4, 5, 12, 13);
                u[i + 1] = TN_SHUF8(t[i], t[i + 2], 2, 3, 10, 11, 6, 7, 14, 15);
                u[i + 2] = TN_SHUF8(t[i + 1], t[i + 3], 0, 1, 8, 9, 4, 5, 12, 13);
                u[i + 3] = TN_SHUF8(t[i + 1], t[i + 3], 2, 3, 10, 11, 6, 7, 14, 15);
            }
            for (int i = 0; i < 4; i++) {
                tn_v8u lo = TN_SHUF8(u[i], u[i + 4], 0, 1, 2, 3, 8, 9, 10, 11);
                tn_v8u hi = TN_SHUF8(u[i], u[i + 4], 4, 5, 6, 7, 12, 13, 14, 15);
                memcpy(ob + (q0 + i) * ops + p0 * 4, &lo, 32);
                memcpy(ob + (q0 + i + 4) * ops + p0 * 4, &hi, 32);
            }
        }
    if (F8 < F) transpose_u32_scalar(ob + F8 * ops, ops, ib + F8 * 4, ips, P, F - F8);
    if (P8 < P) transpose_u32_scalar(ob + P8 * 4, ops, ib + P8 * ips, ips, P - P8, F8);
}
static void transpose_u16(char *ob, int64_t ops, const char *ib, int64_t ips, int64_t P, int64_t F)
TN_TRANSPOSE_BODY(u16x, TN_SAME)
static void transpose_bf16_f32(char *ob, int64_t ops, const char *ib, int64_t ips, int64_t P, int64_t F)
TN_TRANSPOSE_BODY(f32w, bf16_to_f32)

int tn_transpose(const tn_ap *out, const tn_ap *in, int64_t nparts_in)
{
    int64_t f = ap_free(in);
    if (ap_free_contiguous(in) && ap_free_contiguous(out)) {
        /* The usual case, plain tiles: bit-exact copies, transposed into contiguous scratch and then copied out row
           by row (partition rows lie a multiple of 4 KiB apart, in one L1 set: writing across 128 of them directly
           would miss on every store). Measured again with the runtime's padded rows (issue 13): writing the 8 x 8
           blocks straight into padded PSUM rows is 3x faster when they are cached (bench/engine_kernels.py) but 2x
           slower in a GPT-2 step, where the output rows are cold and every block half-writes 8 of their lines. */
        int oes = out->esize;
        char *t = (char *)scratch(0, (f * nparts_in * oes + 3) / 4);
        if (!t) return TN_ENOMEM;
        int64_t trow = nparts_in * oes;
        if (in->dtype == out->dtype && in->esize == 4)
            transpose_u32(t, trow, in->base, in->pstride, nparts_in, f);
        else if (in->dtype == out->dtype && in->esize == 2)
            transpose_u16(t, trow, in->base, in->pstride, nparts_in, f);
        else if (in->dtype == TN_BF16 && out->dtype == TN_F32)
            transpose_bf16_f32(t, trow, in->base, in->pstride, nparts_in, f);
        else
            t = NULL;
        if (t) {
            for (int64_t q = 0; q < f; q++) {
                if (q + TN_PREFETCH_AHEAD < f) prefetch_row(out->base + (q + TN_PREFETCH_AHEAD) * out->pstride, trow, 1);
                memcpy(out->base + q * out->pstride, t + q * trow, (size_t)trow);
            }
            return TN_OK;
        }
    }
    float *all = scratch(0, f * nparts_in), *row = scratch(1, nparts_in);
    if (!all || !row) return TN_ENOMEM;
    for (int64_t p = 0; p < nparts_in; p++) load_ap(all + p * f, in, p);
    for (int64_t q = 0; q < f; q++) {
        for (int64_t p = 0; p < nparts_in; p++) row[p] = all[p * f + q];
        store_ap(out, q, row);
    }
    return TN_OK;
}

/* ------------------------------------------------------------------ TensorE */

static int ap_rows_contiguous(const tn_ap *a)
{
    int64_t expect = 1;
    for (int d = 3; d >= 0; d--) {
        if (a->num[d] != 1 && a->stride[d] != expect) return 0;
        expect *= a->num[d];
    }
    return a->pstride % a->esize == 0;
}

int tn_matmul_ap(const tn_ap *psum, const tn_ap *stat, const tn_ap *mov, int64_t K, int accumulate)
{
    int64_t M = ap_free(stat), N = ap_free(mov);
    if (psum->dtype != TN_F32 || !ap_rows_contiguous(psum) || ap_free(psum) != N) return TN_EARGS;
    if (stat->dtype != mov->dtype) return TN_EARGS;
    float *ps = (float *)psum->base;
    int64_t pss = psum->pstride / 4;
    if (stat->dtype == TN_BF16 && ap_rows_contiguous(stat) && ap_rows_contiguous(mov))
        return tn_matmul_bf16((const uint16_t *)stat->base, stat->pstride / 2, (const uint16_t *)mov->base,
                              mov->pstride / 2, ps, pss, (int)K, (int)M, (int)N, accumulate);
    if (stat->dtype == TN_F32 && ap_rows_contiguous(stat) && ap_rows_contiguous(mov))
        return tn_matmul_f32((const float *)stat->base, stat->pstride / 4, (const float *)mov->base,
                             mov->pstride / 4, ps, pss, (int)K, (int)M, (int)N, accumulate);
    if (stat->dtype == TN_BF16) { /* gather bf16 bits into contiguous scratch, stay exact */
        uint16_t *s = (uint16_t *)scratch(0, (K * M + 1) / 2 + 1), *m = (uint16_t *)scratch(1, (K * N + 1) / 2 + 1);
        if (!s || !m) return TN_ENOMEM;
        tn_ap ds = contig_like((char *)s, stat, TN_BF16, 2);
        tn_ap dm = contig_like((char *)m, mov, TN_BF16, 2);
        int rc = tn_copy_bytes(&ds, stat, K);
        if (!rc) rc = tn_copy_bytes(&dm, mov, K);
        if (rc) return rc;
        return tn_matmul_bf16(s, M, m, N, ps, pss, (int)K, (int)M, (int)N, accumulate);
    }
    /* fp32 strided, or fp16: convert to contiguous fp32 */
    float *s = scratch(0, K * M), *m = scratch(1, K * N);
    if (!s || !m) return TN_ENOMEM;
    for (int64_t k = 0; k < K; k++) { load_ap(s + k * M, stat, k); load_ap(m + k * N, mov, k); }
    return tn_matmul_f32(s, M, m, N, ps, pss, (int)K, (int)M, (int)N, accumulate);
}
