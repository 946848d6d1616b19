/* TensorE matmul tile kernel of the software NeuronCore: psum[M,N] (+)= stat[K,M]^T @ mov[K,N], fp32 and bf16 inputs, fp32 accumulation. */
#include <string.h>
#include "kernels.h"

/* TensorE limits: contraction (partitions) <= 128, stationary columns <= 128, moving columns <= 512 (one PSUM bank). */
#define TN_MM_MAX_K 128
#define TN_MM_MAX_M 128
#define TN_MM_MAX_N 512

/* Dims inside the TensorE limits and strides at least one row wide (rows never overlap). */
static int tn_mm_args_ok(int K, int M, int N, int64_t ss, int64_t ms, int64_t ps)
{
    return K >= 1 && K <= TN_MM_MAX_K && M >= 1 && M <= TN_MM_MAX_M && N >= 1 && N <= TN_MM_MAX_N
        && ss >= M && ms >= N && ps >= N;
}

/* Simple reference version: row m of psum accumulates k-rank-1 updates. */
int tn_matmul_f32(const float *stat, int64_t stat_stride, const float *mov, int64_t mov_stride,
                  float *psum, int64_t psum_stride, int K, int M, int N, int accumulate)
{
    if (!tn_mm_args_ok(K, M, N, stat_stride, mov_stride, psum_stride) || !stat || !mov || !psum) return -1;
    for (int m = 0; m < M; m++) {
        float *out = psum + (int64_t)m * psum_stride;
        if (!accumulate) memset(out, 0, sizeof(float) * (size_t)N);
        for (int k = 0; k < K; k++) {
            float a = stat[(int64_t)k * stat_stride + m];
            const float *b = mov + (int64_t)k * mov_stride;
            for (int n = 0; n < N; n++) out[n] += a * b[n];
        }
    }
    return 0;
}

static inline float tn_bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

int tn_matmul_bf16(const uint16_t *stat, int64_t stat_stride, const uint16_t *mov, int64_t mov_stride,
                   float *psum, int64_t psum_stride, int K, int M, int N, int accumulate)
{
    if (!tn_mm_args_ok(K, M, N, stat_stride, mov_stride, psum_stride) || !stat || !mov || !psum) return -1;
    for (int m = 0; m < M; m++) {
        float *out = psum + (int64_t)m * psum_stride;
        if (!accumulate) memset(out, 0, sizeof(float) * (size_t)N);
        for (int k = 0; k < K; k++) {
            float a = tn_bf16_to_f32(stat[(int64_t)k * stat_stride + m]);
            const uint16_t *b = mov + (int64_t)k * mov_stride;
            for (int n = 0; n < N; n++) out[n] += a * tn_bf16_to_f32(b[n]);
        }
    }
    return 0;
}
