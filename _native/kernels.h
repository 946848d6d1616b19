/* C math kernels of the software NeuronCore: shared declarations for the cffi module and the Cython engine. */
#ifndef TN_KERNELS_H
#define TN_KERNELS_H
#include <stdint.h>
#include <stddef.h>

/* Version of the kernel ABI; bumped whenever a signature below changes. */
int tn_abi_version(void);

/* What this build compiled (kernels.c): the build setting TN_NATIVE_ISA ("auto", "avx2" or "portable"), the
   target_clones of the hot elementwise kernels ("x86-64-v4 avx2 default", "avx2 default" or "" for none) and the
   clone the loader picks on this CPU ("" without clones). */
const char *tn_native_isa(void);
const char *tn_native_clones(void);
const char *tn_native_clone(void);

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

/* --- NeuronCore engine kernels (VectorE / ScalarE / GpSimd / DMA math; kernels.c) --- */
/* An operand's access pattern: element (p, i0, i1, i2, i3) lives at
   base + p*pstride + (i0*stride[0] + i1*stride[1] + i2*stride[2] + i3*stride[3]) * esize.
   The caller (the Cython engine) checks every access pattern against its memory before calling. */
typedef struct tn_ap {
    char *base;
    int64_t pstride;
    int64_t num[4];
    int64_t stride[4];
    int32_t dtype;
    int32_t esize;
} tn_ap;

/* dtype codes (tn.neuron.isa.DTYPE_CODES) */
enum { TN_F32 = 0, TN_BF16 = 1, TN_F16 = 2, TN_I32 = 3, TN_I64 = 4, TN_U8 = 5, TN_BOOL = 6 };
/* error codes returned by the kernels (0 = ok) */
enum { TN_OK = 0, TN_EARGS = -1, TN_EINDEX = -2, TN_ENOMEM = -3 };

/* Conversions (bf16 round-to-nearest-even; fp16 IEEE binary16, round-to-nearest-even). */
void tn_cvt_f32_to_bf16(const float *src, uint16_t *dst, int64_t n);
void tn_cvt_bf16_to_f32(const uint16_t *src, float *dst, int64_t n);
void tn_cvt_f32_to_f16(const float *src, uint16_t *dst, int64_t n);
void tn_cvt_f16_to_f32(const uint16_t *src, float *dst, int64_t n);

/* All kernels below run over nparts partitions; operands share the free shape of `out` unless stated. */
int tn_copy_bytes(const tn_ap *dst, const tn_ap *src, int64_t nparts);
int tn_tensor_copy(const tn_ap *out, const tn_ap *in, int64_t nparts);
int tn_gather_rows(const tn_ap *dst, const tn_ap *table, int64_t table_rows, const tn_ap *idx,
                   int64_t nparts, int64_t *bad_index);
/* table[idx[p], :] = src[p, :] (or += with accumulate, in fp32, in partition order) */
int tn_scatter_rows(const tn_ap *table, int64_t table_rows, const tn_ap *src, const tn_ap *idx,
                    int64_t nparts, int accumulate, int64_t *bad_index);
int tn_tensor_tensor(int op, const tn_ap *out, const tn_ap *a, const tn_ap *b, int64_t nparts);
int tn_tensor_scalar(const tn_ap *out, const tn_ap *in, int op0, const tn_ap *s0, double imm0,
                     int op1, const tn_ap *s1, double imm1, int flags, int64_t nparts);
int tn_activation(int func, const tn_ap *out, const tn_ap *in, const tn_ap *bias, double bias_imm,
                  const tn_ap *scale, double scale_imm, int reduce_op, const tn_ap *reduce_out, int64_t nparts);
/* reduce the innermost nred dims of in (4-D); out holds the kept dims right-aligned */
int tn_tensor_reduce(int op, const tn_ap *out, const tn_ap *in, int nred, int64_t nparts);
int tn_select(const tn_ap *out, const tn_ap *pred, const tn_ap *a, const tn_ap *b, int64_t nparts);
/* coef = {base, channel_multiplier, m0, m1, m2, m3} */
int tn_iota(const tn_ap *out, const double *coef, int64_t nparts);
int tn_affine_select(int cmp, const tn_ap *out, const tn_ap *in, const double *coef, double fill, int64_t nparts);
int tn_memset(const tn_ap *out, double value, int64_t nparts);
int tn_bn_stats(const tn_ap *out, const tn_ap *in, int64_t nparts);
int tn_bn_aggr(const tn_ap *out, const tn_ap *in, int64_t nparts);
int tn_partition_reduce(int op, const tn_ap *out, const tn_ap *in, int64_t nparts_out, int64_t nparts_in);
int tn_partition_shuffle(const tn_ap *out, const tn_ap *in, const int64_t *perm, int64_t nparts_out);
/* out[f, p] = in[p, f]: out has (free size of in) partitions and nparts_in free elements */
int tn_transpose(const tn_ap *out, const tn_ap *in, int64_t nparts_in);
/* psum (fp32, contiguous free) (+)= stat[K, M]^T @ mov[K, N]; gathers/converts strided or fp16 operands */
int tn_matmul_ap(const tn_ap *psum, const tn_ap *stat, const tn_ap *mov, int64_t K, int accumulate);
/* --- end engine kernels --- */

/* --- device allocator --- */
/* Caching allocator of the neuron devices' memory (device_alloc.c): one arena per device index
   (0 .. TN_DEV_MAX_DEVICES-1), 64-byte aligned blocks in size classes (4 per power of two), freed blocks kept for
   reuse by their own device; thread-safe. tn_dev_alloc_on returns NULL when out of memory, over the device's
   limit or for a device index out of range; tn_dev_alloc is device 0. tn_dev_free returns 0, TN_EINDEX for a
   double free or TN_EARGS for a pointer it never gave (a block goes back to the arena it came from).
   tn_dev_stats fills 8 values of one device: allocated, peak, reserved, requested, allocs, frees, cache hits,
   limit (bytes). Functions taking a device return TN_EINDEX for an index out of range; empty_cache and set_limit
   take -1 for every device. tn_dev_block_device is the device of a live block (TN_EARGS otherwise). */
#define TN_DEV_MAX_DEVICES 128
void *tn_dev_alloc_on(int64_t dev, int64_t nbytes);
void *tn_dev_alloc(int64_t nbytes);
int tn_dev_free(void *ptr);
int64_t tn_dev_block_bytes(void *ptr);
int64_t tn_dev_block_device(int64_t addr);
int tn_dev_stats(int64_t dev, int64_t *out);
int tn_dev_reset_peak(int64_t dev);
int tn_dev_empty_cache(int64_t dev);
int tn_dev_set_limit(int64_t dev, int64_t nbytes);
/* tn_dev_alloc / tn_dev_free with addresses as integers (0 = out of memory), cheaper to call from Python. */
int64_t tn_dev_alloc_addr(int64_t dev, int64_t nbytes);
int tn_dev_free_addr(int64_t addr);
int tn_dev_max_devices(void);
void tn_dev_reinit_after_fork(void);   /* a forked child that keeps using the device: a fresh allocator lock */   /* TN_DEV_MAX_DEVICES, checked against tn.neuron.machine.MAX_DEVICES */
/* Fast path of small eager ops: out[i] = a[i] (op) b[i] over n contiguous elements at addresses a, b, out;
   op 0 add, 1 sub, 2 mul; dtype TN_F32, or TN_BF16 computed in fp32 and rounded to nearest even (as the
   engines do). Returns 0, or TN_EARGS (touching nothing) for a null address or bad op/dtype/n. */
int tn_dev_binary(int op, int dtype, int64_t a, int64_t b, int64_t out, int64_t n);
/* --- end device allocator --- */

#endif
