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
/* --- end matmul --- */

#endif
