/* TensorE matmul tile kernel of the software NeuronCore: psum[M,N] (+)= stat[K,M]^T @ mov[K,N], fp32 and bf16 inputs, fp32 accumulation. */
/*
 * How it is fast:
 *  - operands are first packed into aligned, contiguous per-thread scratch (SBUF rows sit a partition pitch
 *    apart, 224 KiB, so reading them in place costs a TLB miss per row);
 *  - a register-blocked micro-kernel keeps an MR x NR block of the result in vector registers over all of K;
 *  - the micro-kernel is chosen at run time: AVX-512F (8x32), AVX2+FMA (6x16), or a portable C fallback
 *    that is always compiled; bf16 tiles use AMX (TDPBF16PS, bf16 products exact, fp32 accumulation)
 *    when the CPU has it and the OS grants the tile state, else they are widened to fp32 while packing.
 * Scratch is per thread (a pthread key: allocated on a thread's first call, freed when it exits), so
 * callers may run tiles from several threads at once. AMX flushes bf16 denormal products to zero
 * (DAZ/FTZ, as TDPBF16PS always does); the other paths keep them.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include "kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define TN_MM_X86 1
#include <immintrin.h>
#include <cpuid.h>
#include <unistd.h>
#include <sys/syscall.h>
#endif

/* TensorE limits: contraction (partitions) <= 128, stationary columns <= 128, moving columns <= 512 (one PSUM bank). */
#define TN_MM_MAX_K 128
#define TN_MM_MAX_M 128
#define TN_MM_MAX_N 512

/* Largest register block over all variants; packed panels are padded to these with zeros. */
#define TN_MM_MR_MAX 8
#define TN_MM_NR_MAX 32
/* Floats between the starts of two packed panels: K x width plus 64 bytes, so that panels do not start a
   multiple of 4 KiB apart (the packers write one row into every panel in turn: without the pad all those
   stores fall into one L1 set and evict each other). */
#define TN_MM_PANEL_PAD 16
/* bf16 elements between two VNNI rows (k pairs) of the AMX moving operand: 2*Np plus 64 bytes, for the same
   reason (a tile load reads 16 rows; unpadded they would be 2 KiB apart and share two L1 sets). */
#define TN_AMX_VROW(Np) ((int64_t)(Np) * 2 + 32)
#define TN_MM_PANEL(K, width) ((int64_t)(K) * (width) + TN_MM_PANEL_PAD)
/* Bounds for every variant (panels are at least 4 floats wide, so there are at most 160 of them). */
#define TN_MM_APACK_FLOATS (TN_MM_MAX_K * (TN_MM_MAX_M + TN_MM_MR_MAX) + 160 * TN_MM_PANEL_PAD)
#define TN_MM_BPACK_FLOATS (TN_MM_MAX_K * (TN_MM_MAX_N + TN_MM_NR_MAX) + 160 * TN_MM_PANEL_PAD)

/* Dims inside the TensorE limits and strides at least one row wide (rows never overlap). */
static int tn_mm_args_ok(int K, int M, int N, int64_t ss, int64_t ms, int64_t ps)
{
    return K >= 1 && K <= TN_MM_MAX_K && M >= 1 && M <= TN_MM_MAX_M && N >= 1 && N <= TN_MM_MAX_N
        && ss >= M && ms >= N && ps >= N;
}

static inline float tn_bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* ---------------------------------------------------------------- per-thread scratch */

typedef struct {
    float *a;        /* packed stationary: MR-wide panels, each K x MR */
    float *b;        /* packed moving: NR-wide panels, each K x NR */
    uint16_t *abf;   /* AMX: stationary transposed, M_pad x K_pad bf16 */
    uint16_t *bbf;   /* AMX: moving in VNNI pairs, K_pad/2 x N_pad x 2 bf16 */
} tn_mm_scratch;

static pthread_key_t tn_mm_key;
static pthread_once_t tn_mm_key_once = PTHREAD_ONCE_INIT;
static int tn_mm_key_ok;

/* Frees one thread's scratch (the pthread key destructor: runs when the thread exits). */
static void tn_mm_free_scratch(void *p)
{
    tn_mm_scratch *s = p;
    if (!s) return;
    free(s->a); free(s->b); free(s->abf); free(s->bbf);
    free(s);
}

static void tn_mm_make_key(void)
{
    tn_mm_key_ok = pthread_key_create(&tn_mm_key, tn_mm_free_scratch) == 0;
}

/* The calling thread's scratch buffers (allocated on first use, freed at thread exit), or NULL if memory
   is short (the caller then takes the unpacked path). */
static tn_mm_scratch *tn_mm_get_scratch(void)
{
    pthread_once(&tn_mm_key_once, tn_mm_make_key);
    if (!tn_mm_key_ok) return NULL;
    tn_mm_scratch *s = pthread_getspecific(tn_mm_key);
    if (s) return s;
    s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->a = aligned_alloc(64, sizeof(float) * TN_MM_APACK_FLOATS);
    s->b = aligned_alloc(64, sizeof(float) * TN_MM_BPACK_FLOATS);
    s->abf = aligned_alloc(64, sizeof(uint16_t) * 128 * 128);
    s->bbf = aligned_alloc(64, sizeof(uint16_t) * 64 * TN_AMX_VROW(512));
    if (!s->a || !s->b || !s->abf || !s->bbf || pthread_setspecific(tn_mm_key, s) != 0) {
        tn_mm_free_scratch(s);
        return NULL;
    }
    return s;
}

/* ---------------------------------------------------------------- packing (fp32 path) */

/* Packs stat (K x M, fp32 or bf16) into MR-wide panels: ap[p*K*MR + k*MR + i] = stat[k][p*MR + i], zero padded. */
static void tn_mm_pack_a(float *ap, const void *stat, int is_bf16, int64_t ss, int K, int M, int MR)
{
    int panels = (M + MR - 1) / MR;
    for (int p = 0; p < panels; p++) {
        int m0 = p * MR, mr = M - m0 < MR ? M - m0 : MR;
        float *dst = ap + (int64_t)p * TN_MM_PANEL(K, MR);
        for (int k = 0; k < K; k++, dst += MR) {
            if (is_bf16) {
                const uint16_t *src = (const uint16_t *)stat + (int64_t)k * ss + m0;
                for (int i = 0; i < mr; i++) dst[i] = tn_bf16_to_f32(src[i]);
            } else {
                memcpy(dst, (const float *)stat + (int64_t)k * ss + m0, sizeof(float) * (size_t)mr);
            }
            for (int i = mr; i < MR; i++) dst[i] = 0.0f;
        }
    }
}

/* Packs mov (K x N) into NR-wide panels: bp[q*K*NR + k*NR + j] = mov[k][q*NR + j], zero padded. */
static void tn_mm_pack_b(float *bp, const void *mov, int is_bf16, int64_t ms, int K, int N, int NR)
{
    int panels = (N + NR - 1) / NR;
    for (int k = 0; k < K; k++) {
        if (is_bf16) {
            const uint16_t *src = (const uint16_t *)mov + (int64_t)k * ms;
            for (int q = 0; q < panels; q++) {
                float *dst = bp + (int64_t)q * TN_MM_PANEL(K, NR) + (int64_t)k * NR;
                int n0 = q * NR, nr = N - n0 < NR ? N - n0 : NR;
                for (int j = 0; j < nr; j++) dst[j] = tn_bf16_to_f32(src[n0 + j]);
                for (int j = nr; j < NR; j++) dst[j] = 0.0f;
            }
        } else {
            const float *src = (const float *)mov + (int64_t)k * ms;
            for (int q = 0; q < panels; q++) {
                float *dst = bp + (int64_t)q * TN_MM_PANEL(K, NR) + (int64_t)k * NR;
                int n0 = q * NR, nr = N - n0 < NR ? N - n0 : NR;
                memcpy(dst, src + n0, sizeof(float) * (size_t)nr);
                for (int j = nr; j < NR; j++) dst[j] = 0.0f;
            }
        }
    }
}

/* ---------------------------------------------------------------- micro-kernels */

/* A micro-kernel: c[i*ldc + j] (+)= sum_k a[k*MR + i] * b[k*NR + j] for the full MR x NR block. */
typedef void (*tn_mm_ukernel)(int K, const float *a, const float *b, float *c, int64_t ldc, int accumulate);

#define TN_GEN_MR 4
#define TN_GEN_NR 16
typedef float tn_v4f __attribute__((vector_size(16), aligned(4)));
/* Portable fallback: 4 x 16 block in 16 four-wide GCC/Clang vectors (SSE2 on x86-64, NEON on arm64). */
static void tn_mm_ukernel_generic(int K, const float *a, const float *b, float *c, int64_t ldc, int accumulate)
{
    tn_v4f acc[TN_GEN_MR][4];
    for (int i = 0; i < TN_GEN_MR; i++)
        for (int j = 0; j < 4; j++) {
            if (accumulate) memcpy(&acc[i][j], c + i * ldc + 4 * j, sizeof(tn_v4f));
            else acc[i][j] = (tn_v4f){0.0f, 0.0f, 0.0f, 0.0f};
        }
    for (int k = 0; k < K; k++) {
        tn_v4f bk[4];
        memcpy(bk, b + (int64_t)k * TN_GEN_NR, sizeof bk);
        for (int i = 0; i < TN_GEN_MR; i++) {
            float ai = a[(int64_t)k * TN_GEN_MR + i];
            for (int j = 0; j < 4; j++) acc[i][j] += ai * bk[j];
        }
    }
    for (int i = 0; i < TN_GEN_MR; i++)
        for (int j = 0; j < 4; j++) memcpy(c + i * ldc + 4 * j, &acc[i][j], sizeof(tn_v4f));
}

#ifdef TN_MM_X86
#define TN_AVX2_MR 6
#define TN_AVX2_NR 16
/* AVX2 + FMA: 6 x 16 block in 12 ymm accumulators (named variables: GCC keeps them in registers). */
__attribute__((target("avx2,fma")))
static void tn_mm_ukernel_avx2(int K, const float *a, const float *b, float *c, int64_t ldc, int accumulate)
{
    __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
#define TN_AVX2_LOADC(i) \
    c##i##0 = accumulate ? _mm256_loadu_ps(c + i * ldc) : _mm256_setzero_ps(); \
    c##i##1 = accumulate ? _mm256_loadu_ps(c + i * ldc + 8) : _mm256_setzero_ps();
    TN_AVX2_LOADC(0) TN_AVX2_LOADC(1) TN_AVX2_LOADC(2) TN_AVX2_LOADC(3) TN_AVX2_LOADC(4) TN_AVX2_LOADC(5)
#undef TN_AVX2_LOADC
    for (int k = 0; k < K; k++) {
        const __m256 b0 = _mm256_load_ps(b + (int64_t)k * TN_AVX2_NR);
        const __m256 b1 = _mm256_load_ps(b + (int64_t)k * TN_AVX2_NR + 8);
        const float *ak = a + (int64_t)k * TN_AVX2_MR;
        __m256 ai;
#define TN_AVX2_STEP(i) \
        ai = _mm256_broadcast_ss(ak + i); \
        c##i##0 = _mm256_fmadd_ps(ai, b0, c##i##0); \
        c##i##1 = _mm256_fmadd_ps(ai, b1, c##i##1);
        TN_AVX2_STEP(0) TN_AVX2_STEP(1) TN_AVX2_STEP(2) TN_AVX2_STEP(3) TN_AVX2_STEP(4) TN_AVX2_STEP(5)
#undef TN_AVX2_STEP
    }
#define TN_AVX2_STOREC(i) \
    _mm256_storeu_ps(c + i * ldc, c##i##0); \
    _mm256_storeu_ps(c + i * ldc + 8, c##i##1);
    TN_AVX2_STOREC(0) TN_AVX2_STOREC(1) TN_AVX2_STOREC(2) TN_AVX2_STOREC(3) TN_AVX2_STOREC(4) TN_AVX2_STOREC(5)
#undef TN_AVX2_STOREC
}

#define TN_AVX512_MR 8
#define TN_AVX512_NR 32
/* AVX-512F: 8 x 32 block in 16 zmm accumulators (M = 128 and N = 512 split without remainder). */
__attribute__((target("avx512f")))
static void tn_mm_ukernel_avx512(int K, const float *a, const float *b, float *c, int64_t ldc, int accumulate)
{
    __m512 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51, c60, c61, c70, c71;
#define TN_512_LOADC(i) \
    c##i##0 = accumulate ? _mm512_loadu_ps(c + i * ldc) : _mm512_setzero_ps(); \
    c##i##1 = accumulate ? _mm512_loadu_ps(c + i * ldc + 16) : _mm512_setzero_ps();
    TN_512_LOADC(0) TN_512_LOADC(1) TN_512_LOADC(2) TN_512_LOADC(3)
    TN_512_LOADC(4) TN_512_LOADC(5) TN_512_LOADC(6) TN_512_LOADC(7)
#undef TN_512_LOADC
    for (int k = 0; k < K; k++) {
        const __m512 b0 = _mm512_load_ps(b + (int64_t)k * TN_AVX512_NR);
        const __m512 b1 = _mm512_load_ps(b + (int64_t)k * TN_AVX512_NR + 16);
        const float *ak = a + (int64_t)k * TN_AVX512_MR;
        __m512 ai;
#define TN_512_STEP(i) \
        ai = _mm512_set1_ps(ak[i]); \
        c##i##0 = _mm512_fmadd_ps(ai, b0, c##i##0); \
        c##i##1 = _mm512_fmadd_ps(ai, b1, c##i##1);
        TN_512_STEP(0) TN_512_STEP(1) TN_512_STEP(2) TN_512_STEP(3)
        TN_512_STEP(4) TN_512_STEP(5) TN_512_STEP(6) TN_512_STEP(7)
#undef TN_512_STEP
    }
#define TN_512_STOREC(i) \
    _mm512_storeu_ps(c + i * ldc, c##i##0); \
    _mm512_storeu_ps(c + i * ldc + 16, c##i##1);
    TN_512_STOREC(0) TN_512_STOREC(1) TN_512_STOREC(2) TN_512_STOREC(3)
    TN_512_STOREC(4) TN_512_STOREC(5) TN_512_STOREC(6) TN_512_STOREC(7)
#undef TN_512_STOREC
}

/* AVX-512 packing of stat into 8-wide panels (see tn_mm_pack_a); bf16 widened on the way. */
__attribute__((target("avx512f,avx512bw,avx512vl")))
static void tn_mm_pack_a_avx512(float *ap, const void *stat, int is_bf16, int64_t ss, int K, int M, int MR)
{
    int panels = (M + 7) / 8;
    (void)MR;
    for (int k = 0; k < K; k++) {
        for (int p = 0; p < panels; p++) {
            int m0 = p * 8, cnt = M - m0 < 8 ? M - m0 : 8;
            __mmask8 mk = (__mmask8)((1u << cnt) - 1u);
            __m256 v;
            if (is_bf16) {
                __m128i h = _mm_maskz_loadu_epi16(mk, (const uint16_t *)stat + (int64_t)k * ss + m0);
                v = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
            } else {
                v = _mm256_maskz_loadu_ps(mk, (const float *)stat + (int64_t)k * ss + m0);
            }
            _mm256_store_ps(ap + (int64_t)p * TN_MM_PANEL(K, 8) + (int64_t)k * 8, v);
        }
    }
}

/* AVX-512 packing of mov into 32-wide panels (see tn_mm_pack_b); bf16 widened on the way. */
__attribute__((target("avx512f,avx512bw,avx512vl")))
static void tn_mm_pack_b_avx512(float *bp, const void *mov, int is_bf16, int64_t ms, int K, int N, int NR)
{
    int panels = (N + 31) / 32;
    (void)NR;
    for (int k = 0; k < K; k++) {
        for (int q = 0; q < panels; q++) {
            int n0 = q * 32, cnt = N - n0 < 32 ? N - n0 : 32;
            __mmask16 m0 = cnt >= 16 ? 0xffff : (__mmask16)((1u << cnt) - 1u);
            __mmask16 m1 = cnt >= 32 ? 0xffff : cnt <= 16 ? 0 : (__mmask16)((1u << (cnt - 16)) - 1u);
            __m512 v0, v1;
            if (is_bf16) {
                const uint16_t *src = (const uint16_t *)mov + (int64_t)k * ms + n0;
                __m256i h0 = _mm256_maskz_loadu_epi16(m0, src), h1 = _mm256_maskz_loadu_epi16(m1, src + 16);
                v0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h0), 16));
                v1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h1), 16));
            } else {
                const float *src = (const float *)mov + (int64_t)k * ms + n0;
                v0 = _mm512_maskz_loadu_ps(m0, src);
                v1 = _mm512_maskz_loadu_ps(m1, src + 16);
            }
            float *dst = bp + (int64_t)q * TN_MM_PANEL(K, 32) + (int64_t)k * 32;
            _mm512_store_ps(dst, v0);
            _mm512_store_ps(dst + 16, v1);
        }
    }
}
#endif

/* ---------------------------------------------------------------- run-time choice */

/* A packer: stat into MR-wide panels (pack_a) or mov into NR-wide panels (pack_b), fp32 or bf16 source. */
typedef void (*tn_mm_packer)(float *dst, const void *src, int is_bf16, int64_t stride, int K, int width, int block);

typedef struct {
    tn_mm_ukernel kern;
    int mr, nr;
    tn_mm_packer pack_a, pack_b;
    int amx;  /* 1: bf16 tiles may use AMX */
} tn_mm_isa;

static tn_mm_isa tn_mm_chosen;
static int tn_mm_chosen_ready;

#ifdef TN_MM_X86
/* AMX-BF16 present, its state enabled by the OS, and this process granted the tile data (Linux arch_prctl). */
static int tn_mm_amx_usable(void)
{
    unsigned int a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    if (!((d >> 22) & 1) || !((d >> 24) & 1)) return 0;       /* AMX-BF16, AMX-TILE */
    if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1)) return 0;  /* OSXSAVE */
    unsigned int lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if (((lo >> 17) & 3) != 3) return 0;                        /* XTILECFG, XTILEDATA */
#if defined(__linux__) && defined(SYS_arch_prctl)
    unsigned long mask = 0;
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0) return 0;
    if (syscall(SYS_arch_prctl, 0x1022 /* ARCH_GET_XCOMP_PERM */, &mask) != 0) return 0;
    return (mask >> 18) & 1;
#else
    return 0;
#endif
}
#endif

/* The code path for a name ("auto", "generic", "avx2", "avx512", "amx"); returns 0, or -1 if this CPU lacks it. */
static int tn_mm_isa_pick(const char *name, tn_mm_isa *out)
{
    tn_mm_isa isa = {tn_mm_ukernel_generic, TN_GEN_MR, TN_GEN_NR, tn_mm_pack_a, tn_mm_pack_b, 0};
    int is_auto = !strcmp(name, "auto");
    if (!is_auto && strcmp(name, "generic") && strcmp(name, "avx2") && strcmp(name, "avx512") && strcmp(name, "amx"))
        return -1;
#ifdef TN_MM_X86
    __builtin_cpu_init();
    int has512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                 && __builtin_cpu_supports("avx512vl");
    int has2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if ((is_auto || !strcmp(name, "avx512") || !strcmp(name, "amx")) && has512)
        isa = (tn_mm_isa){tn_mm_ukernel_avx512, TN_AVX512_MR, TN_AVX512_NR, tn_mm_pack_a_avx512, tn_mm_pack_b_avx512, 0};
    else if ((is_auto || !strcmp(name, "avx2")) && has2)
        isa = (tn_mm_isa){tn_mm_ukernel_avx2, TN_AVX2_MR, TN_AVX2_NR, tn_mm_pack_a, tn_mm_pack_b, 0};
    else if (!is_auto && strcmp(name, "generic"))
        return -1;
    if ((is_auto || !strcmp(name, "amx")) && has512) {
        static int amx_state = -1;  /* the OS permission is asked once per process */
        if (amx_state < 0) amx_state = tn_mm_amx_usable();
        isa.amx = amx_state;
    }
    if (!strcmp(name, "amx") && !isa.amx) return -1;
#else
    if (!is_auto && strcmp(name, "generic")) return -1;
#endif
    *out = isa;
    return 0;
}

/* The code path in force: chosen on first use ("auto": the fastest this CPU and OS allow). */
static const tn_mm_isa *tn_mm_isa_get(void)
{
    if (!__atomic_load_n(&tn_mm_chosen_ready, __ATOMIC_ACQUIRE)) {
        tn_mm_isa isa;
        tn_mm_isa_pick("auto", &isa);
        tn_mm_chosen = isa;
        __atomic_store_n(&tn_mm_chosen_ready, 1, __ATOMIC_RELEASE);
    }
    return &tn_mm_chosen;
}

int tn_matmul_set_isa(const char *name)
{
    tn_mm_isa isa;
    if (!name || tn_mm_isa_pick(name, &isa) != 0) return -1;
    tn_mm_chosen = isa;
    __atomic_store_n(&tn_mm_chosen_ready, 1, __ATOMIC_RELEASE);
    return 0;
}

/* ---------------------------------------------------------------- AMX bf16 path */

#ifdef TN_MM_X86
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) tn_amx_cfg;

/* In-register transpose of a 16 x 16 matrix of 32-bit words (r[i] is row i on entry, column i on exit). */
__attribute__((target("avx512f")))
static inline void tn_tr16x16_epi32(__m512i r[16])
{
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    /* u[4i + c], 128-bit lane L: column 4L + c of rows 4i..4i+3 */
    __m512i u[16];
    for (int i = 0; i < 4; i++) {
        u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        __m512i x0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
        __m512i y0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44), y1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
        r[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);
        r[4 + c] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
        r[8 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
    }
}

/* Packs for AMX: at[m*Kp + k] = stat[k][m] (bf16, Mp x Kp), bv[(k/2)*TN_AMX_VROW(Np) + n*2 + k%2] = mov[k][n];
   zero padded. */
__attribute__((target("avx512f,avx512bw")))
static void tn_amx_pack(uint16_t *at, uint16_t *bv, const uint16_t *stat, int64_t ss, const uint16_t *mov,
                        int64_t ms, int K, int M, int N, int Kp, int Mp, int Np)
{
    /* moving: interleave rows 2j and 2j+1 */
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int j = 0; j < Kp / 2; j++) {
        int k0 = 2 * j, k1 = 2 * j + 1;
        const uint16_t *r0 = k0 < K ? mov + (int64_t)k0 * ms : NULL;
        const uint16_t *r1 = k1 < K ? mov + (int64_t)k1 * ms : NULL;
        uint16_t *dst = bv + (int64_t)j * TN_AMX_VROW(Np);
        for (int n = 0; n < Np; n += 32) {
            int cnt = N - n;
            cnt = cnt < 0 ? 0 : cnt > 32 ? 32 : cnt;
            __mmask32 mk = cnt == 32 ? 0xffffffffu : ((1u << cnt) - 1u);
            __m512i x0 = r0 ? _mm512_maskz_loadu_epi16(mk, r0 + n) : _mm512_setzero_si512();
            __m512i x1 = r1 ? _mm512_maskz_loadu_epi16(mk, r1 + n) : _mm512_setzero_si512();
            _mm512_store_si512((void *)(dst + 2 * n), _mm512_permutex2var_epi16(x0, lo, x1));
            _mm512_store_si512((void *)(dst + 2 * n + 32), _mm512_permutex2var_epi16(x0, hi, x1));
        }
    }
    /* stationary: pair rows (2j, 2j+1) into 32-bit words, then transpose 16 x 16 word blocks; 32 columns (one
       64-byte line of a row) per load, so every line of the operand is read once (the rows of a tile lie a
       partition pitch apart, in one cache set: a line read twice is usually gone the second time) */
    for (int m0 = 0; m0 < Mp; m0 += 32) {
        int cnt = M - m0;
        cnt = cnt < 0 ? 0 : cnt > 32 ? 32 : cnt;
        __mmask32 mk = cnt == 32 ? 0xffffffffu : (__mmask32)((1u << cnt) - 1u);
        for (int jb = 0; jb < Kp / 2; jb += 16) {
            __m512i r[16], h[16];
            for (int jj = 0; jj < 16; jj++) {
                int k0 = 2 * (jb + jj), k1 = k0 + 1;
                __m512i x0 = k0 < K ? _mm512_maskz_loadu_epi16(mk, stat + (int64_t)k0 * ss + m0) : _mm512_setzero_si512();
                __m512i x1 = k1 < K ? _mm512_maskz_loadu_epi16(mk, stat + (int64_t)k1 * ss + m0) : _mm512_setzero_si512();
                r[jj] = _mm512_permutex2var_epi16(x0, lo, x1);   /* columns m0 .. m0+15 */
                h[jj] = _mm512_permutex2var_epi16(x0, hi, x1);   /* columns m0+16 .. m0+31 */
            }
            tn_tr16x16_epi32(r);
            for (int c = 0; c < 16; c++)
                _mm512_store_si512((void *)(at + (int64_t)(m0 + c) * Kp + 2 * jb), r[c]);
            tn_tr16x16_epi32(h);
            for (int c = 0; c < 16; c++)
                _mm512_store_si512((void *)(at + (int64_t)(m0 + 16 + c) * Kp + 2 * jb), h[c]);
        }
    }
}

/* psum block (32 x 32 at m0, n0) via AMX: 2 x 2 result tiles, over K in chunks of 32. */
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw")))
static int tn_matmul_bf16_amx(const uint16_t *stat, int64_t ss, const uint16_t *mov, int64_t ms,
                              float *psum, int64_t ps, int K, int M, int N, int accumulate, tn_mm_scratch *s)
{
    int Kp = (K + 31) & ~31, Mp = (M + 31) & ~31, Np = (N + 31) & ~31;
    tn_amx_pack(s->abf, s->bbf, stat, ss, mov, ms, K, M, N, Kp, Mp, Np);
    tn_amx_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    _tile_loadconfig(&cfg);
    float tmp[32 * 32] __attribute__((aligned(64)));
    const int64_t bstride = TN_AMX_VROW(Np) * 2;   /* bytes between VNNI rows */
    const int64_t astride = (int64_t)Kp * 2;   /* bytes between rows of the transposed stationary */
    for (int m0 = 0; m0 < Mp; m0 += 32) {
        for (int n0 = 0; n0 < Np; n0 += 32) {
            int full = m0 + 32 <= M && n0 + 32 <= N;
            int direct = full && !accumulate;
            float *c = direct ? psum + (int64_t)m0 * ps + n0 : tmp;
            int64_t cst = direct ? ps * 4 : 32 * 4;
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int k0 = 0; k0 < Kp; k0 += 32) {
                const uint16_t *a0 = s->abf + (int64_t)m0 * Kp + k0;
                const uint16_t *b0 = s->bbf + (int64_t)(k0 / 2) * TN_AMX_VROW(Np) + 2 * n0;
                _tile_loadd(4, a0, astride);
                _tile_loadd(5, a0 + 16 * Kp, astride);
                _tile_loadd(6, b0, bstride);
                _tile_loadd(7, b0 + 32, bstride);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
            _tile_stored(0, c, cst);
            _tile_stored(1, c + 16, cst);
            _tile_stored(2, (char *)c + 16 * cst, cst);
            _tile_stored(3, (char *)c + 16 * cst + 64, cst);
            if (full && accumulate) {
                for (int i = 0; i < 32; i++) {
                    float *out = psum + (int64_t)(m0 + i) * ps + n0;
                    _mm512_storeu_ps(out, _mm512_add_ps(_mm512_loadu_ps(out), _mm512_load_ps(tmp + i * 32)));
                    _mm512_storeu_ps(out + 16, _mm512_add_ps(_mm512_loadu_ps(out + 16), _mm512_load_ps(tmp + i * 32 + 16)));
                }
            } else if (!full) {
                int mr = M - m0 < 32 ? M - m0 : 32, nr = N - n0 < 32 ? N - n0 : 32;
                for (int i = 0; i < mr; i++) {
                    float *out = psum + (int64_t)(m0 + i) * ps + n0;
                    for (int j = 0; j < nr; j++) out[j] = accumulate ? out[j] + tmp[i * 32 + j] : tmp[i * 32 + j];
                }
            }
        }
    }
    _tile_release();
    return 0;
}
#endif

/* ---------------------------------------------------------------- drivers */

/* Simple unpacked loops: used only when scratch memory cannot be had. */
static void tn_mm_simple(const void *stat, int64_t ss, const void *mov, int64_t ms, int is_bf16,
                         float *psum, int64_t ps, int K, int M, int N, int accumulate)
{
    for (int m = 0; m < M; m++) {
        float *out = psum + (int64_t)m * ps;
        if (!accumulate) memset(out, 0, sizeof(float) * (size_t)N);
        for (int k = 0; k < K; k++) {
            float a = is_bf16 ? tn_bf16_to_f32(((const uint16_t *)stat)[(int64_t)k * ss + m])
                              : ((const float *)stat)[(int64_t)k * ss + m];
            if (is_bf16) {
                const uint16_t *b = (const uint16_t *)mov + (int64_t)k * ms;
                for (int n = 0; n < N; n++) out[n] += a * tn_bf16_to_f32(b[n]);
            } else {
                const float *b = (const float *)mov + (int64_t)k * ms;
                for (int n = 0; n < N; n++) out[n] += a * b[n];
            }
        }
    }
}

/* Packs both operands and runs the chosen micro-kernel over all MR x NR blocks. */
static void tn_mm_packed(const void *stat, int64_t ss, const void *mov, int64_t ms, int is_bf16,
                         float *psum, int64_t ps, int K, int M, int N, int accumulate,
                         const tn_mm_isa *isa, tn_mm_scratch *s)
{
    const int MR = isa->mr, NR = isa->nr;
    isa->pack_a(s->a, stat, is_bf16, ss, K, M, MR);
    isa->pack_b(s->b, mov, is_bf16, ms, K, N, NR);
    float tmp[TN_MM_MR_MAX * TN_MM_NR_MAX] __attribute__((aligned(64)));
    int npan = (N + NR - 1) / NR, mpan = (M + MR - 1) / MR;
    for (int q = 0; q < npan; q++) {
        int n0 = q * NR, nr = N - n0 < NR ? N - n0 : NR;
        const float *bq = s->b + (int64_t)q * TN_MM_PANEL(K, NR);
        for (int p = 0; p < mpan; p++) {
            int m0 = p * MR, mr = M - m0 < MR ? M - m0 : MR;
            const float *ap = s->a + (int64_t)p * TN_MM_PANEL(K, MR);
            if (mr == MR && nr == NR) {
                isa->kern(K, ap, bq, psum + (int64_t)m0 * ps + n0, ps, accumulate);
            } else {
                isa->kern(K, ap, bq, tmp, NR, 0);
                for (int i = 0; i < mr; i++) {
                    float *out = psum + (int64_t)(m0 + i) * ps + n0;
                    const float *t = tmp + i * NR;
                    if (accumulate) for (int j = 0; j < nr; j++) out[j] += t[j];
                    else memcpy(out, t, sizeof(float) * (size_t)nr);
                }
            }
        }
    }
}

int tn_matmul_f32(const float *stat, int64_t stat_stride, const float *mov, int64_t mov_stride,
                  float *psum, int64_t psum_stride, int K, int M, int N, int accumulate)
{
    if (!tn_mm_args_ok(K, M, N, stat_stride, mov_stride, psum_stride) || !stat || !mov || !psum) return -1;
    tn_mm_scratch *s = tn_mm_get_scratch();
    if (!s) tn_mm_simple(stat, stat_stride, mov, mov_stride, 0, psum, psum_stride, K, M, N, accumulate);
    else tn_mm_packed(stat, stat_stride, mov, mov_stride, 0, psum, psum_stride, K, M, N, accumulate,
                      tn_mm_isa_get(), s);
    return 0;
}

int tn_matmul_bf16(const uint16_t *stat, int64_t stat_stride, const uint16_t *mov, int64_t mov_stride,
                   float *psum, int64_t psum_stride, int K, int M, int N, int accumulate)
{
    if (!tn_mm_args_ok(K, M, N, stat_stride, mov_stride, psum_stride) || !stat || !mov || !psum) return -1;
    tn_mm_scratch *s = tn_mm_get_scratch();
    if (!s) {
        tn_mm_simple(stat, stat_stride, mov, mov_stride, 1, psum, psum_stride, K, M, N, accumulate);
        return 0;
    }
    const tn_mm_isa *isa = tn_mm_isa_get();
#ifdef TN_MM_X86
    if (isa->amx)
        return tn_matmul_bf16_amx(stat, stat_stride, mov, mov_stride, psum, psum_stride, K, M, N, accumulate, s);
#endif
    tn_mm_packed(stat, stat_stride, mov, mov_stride, 1, psum, psum_stride, K, M, N, accumulate, isa, s);
    return 0;
}

/* Name of the code path in force, as tn_matmul_set_isa takes it: "amx", "avx512", "avx2" or "generic". */
const char *tn_matmul_isa(void)
{
    const tn_mm_isa *isa = tn_mm_isa_get();
    if (isa->amx) return "amx";
#ifdef TN_MM_X86
    if (isa->kern == tn_mm_ukernel_avx512) return "avx512";
    if (isa->kern == tn_mm_ukernel_avx2) return "avx2";
#endif
    return "generic";
}
