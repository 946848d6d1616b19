/* C math kernels of the software NeuronCore: shared declarations for the cffi module and the Cython engine. */
#ifndef TN_KERNELS_H
#define TN_KERNELS_H
#include <stdint.h>
#include <stddef.h>

/* Version of the kernel ABI; bumped whenever a signature below changes. */
int tn_abi_version(void);

/* --- matmul (TensorE) --- */
/* psum[m*psum_stride + n] = (or += if accumulate) sum_k stat[k*stat_stride + m] * mov[k*mov_stride + n]
   for k < K <= 128, m < M <= 128, n < N <= 512; strides in elements, >= the row width (M, N, N).
   bf16 operands are widened exactly to fp32 (<<16); accumulation in fp32. Returns 0, or -1 (touching
   no memory) for dims out of range, strides narrower than a row or NULL pointers. */
int tn_matmul_f32(const float *stat, int64_t stat_stride, const float *mov, int64_t mov_stride,
                  float *psum, int64_t psum_stride, int K, int M, int N, int accumulate);
int tn_matmul_bf16(const uint16_t *stat, int64_t stat_stride, const uint16_t *mov, int64_t mov_stride,
                   float *psum, int64_t psum_stride, int K, int M, int N, int accumulate);
/* Name of the code path the matmul kernels take: "amx" (AVX-512 fp32, AMX bf16), "avx512", "avx2" or "generic". */
const char *tn_matmul_isa(void);
/* Forces a code path, for tests and benches: "auto", "generic", "avx2", "avx512" or "amx" (avx512 + AMX for bf16).
   Returns 0, or -1 (nothing changed) if the name is unknown or this CPU/OS lacks that path. Not thread-safe. */
int tn_matmul_set_isa(const char *name);
/* --- end matmul --- */

#endif
