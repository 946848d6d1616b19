/* Caching allocator of the `neuron` device's memory (the software NeuronCore's HBM): size classes, free lists, stats. */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

/* Every block starts with a 64-byte header; the caller gets header + 64 (64-byte aligned). */
#define HDR 64
#define MAGIC_LIVE 0x6e65757275736c69ULL  /* "neurusli" */
#define MAGIC_FREE 0x6e657572636163aeULL
#define NCLASS (64 * 4)

typedef struct blk {
    uint64_t magic;
    int64_t cap;          /* usable bytes */
    int64_t cls;          /* size class index */
    int64_t req;          /* bytes asked for by the live allocation */
    struct blk *next;     /* free-list link */
} blk;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static blk *free_heads[NCLASS];
static int64_t st_allocated, st_peak, st_reserved, st_requested, st_nalloc, st_nfree, st_hits, st_limit;

/* Size class of n bytes: 64 B minimum, then 4 classes per power of two (at most 25% rounding waste). */
static void size_class(int64_t n, int64_t *cap, int64_t *cls) {
    if (n <= 64) {
        *cap = 64;
        *cls = 0;
        return;
    }
    int p = 63 - __builtin_clzll((unsigned long long)(n - 1));  /* 2^p < n <= 2^(p+1) */
    int64_t step = (int64_t)1 << (p - 2 > 0 ? p - 2 : 0);
    int64_t c = (n + step - 1) / step * step;
    int64_t sub = (c - ((int64_t)1 << p)) / step - 1;             /* 0..3 */
    if (sub < 0) sub = 0;
    *cap = c;
    *cls = (int64_t)p * 4 + sub;
    if (*cls >= NCLASS) *cls = NCLASS - 1;
}

static void release_cached_locked(void) {
    for (int i = 0; i < NCLASS; i++) {
        blk *b = free_heads[i];
        while (b) {
            blk *nx = b->next;
            st_reserved -= b->cap;
            b->magic = 0;
            free(b);
            b = nx;
        }
        free_heads[i] = NULL;
    }
}

void *tn_dev_alloc(int64_t nbytes) {
    if (nbytes < 0 || nbytes > ((int64_t)1 << 46)) return NULL;
    int64_t cap, cls;
    size_class(nbytes, &cap, &cls);
    pthread_mutex_lock(&mu);
    blk *b = NULL;
    blk **pp = &free_heads[cls];
    while (*pp) {                       /* the last class mixes sizes: take a block big enough */
        if ((*pp)->cap >= cap) {
            b = *pp;
            *pp = b->next;
            break;
        }
        pp = &(*pp)->next;
    }
    if (b) {
        st_hits++;
    } else {
        if (st_limit > 0 && st_reserved + cap > st_limit) release_cached_locked();
        if (st_limit > 0 && st_reserved + cap > st_limit) {
            pthread_mutex_unlock(&mu);
            return NULL;
        }
        void *raw = NULL;
        if (posix_memalign(&raw, HDR, (size_t)(HDR + cap)) != 0 || raw == NULL) {
            release_cached_locked();
            if (posix_memalign(&raw, HDR, (size_t)(HDR + cap)) != 0 || raw == NULL) {
                pthread_mutex_unlock(&mu);
                return NULL;
            }
        }
        b = (blk *)raw;
        b->cap = cap;
        b->cls = cls;
        st_reserved += cap;
    }
    b->magic = MAGIC_LIVE;
    b->req = nbytes;
    b->next = NULL;
    st_allocated += b->cap;
    st_requested += nbytes;
    if (st_allocated > st_peak) st_peak = st_allocated;
    st_nalloc++;
    pthread_mutex_unlock(&mu);
    return (char *)b + HDR;
}

int tn_dev_free(void *ptr) {
    if (ptr == NULL || ((uintptr_t)ptr & (HDR - 1)) != 0) return TN_EARGS;
    blk *b = (blk *)((char *)ptr - HDR);
    pthread_mutex_lock(&mu);
    if (b->magic != MAGIC_LIVE) {
        int rc = b->magic == MAGIC_FREE ? TN_EINDEX : TN_EARGS;
        pthread_mutex_unlock(&mu);
        return rc;
    }
    b->magic = MAGIC_FREE;
    st_allocated -= b->cap;
    st_requested -= b->req;
    st_nfree++;
    b->next = free_heads[b->cls];
    free_heads[b->cls] = b;
    pthread_mutex_unlock(&mu);
    return TN_OK;
}

int64_t tn_dev_block_bytes(void *ptr) {
    if (ptr == NULL || ((uintptr_t)ptr & (HDR - 1)) != 0) return TN_EARGS;
    blk *b = (blk *)((char *)ptr - HDR);
    return b->magic == MAGIC_LIVE ? b->cap : TN_EARGS;
}

void tn_dev_stats(int64_t *out) {
    pthread_mutex_lock(&mu);
    out[0] = st_allocated;
    out[1] = st_peak;
    out[2] = st_reserved;
    out[3] = st_requested;
    out[4] = st_nalloc;
    out[5] = st_nfree;
    out[6] = st_hits;
    out[7] = st_limit;
    pthread_mutex_unlock(&mu);
}

void tn_dev_reset_peak(void) {
    pthread_mutex_lock(&mu);
    st_peak = st_allocated;
    pthread_mutex_unlock(&mu);
}

void tn_dev_empty_cache(void) {
    pthread_mutex_lock(&mu);
    release_cached_locked();
    pthread_mutex_unlock(&mu);
}

void tn_dev_set_limit(int64_t nbytes) {
    pthread_mutex_lock(&mu);
    st_limit = nbytes < 0 ? 0 : nbytes;
    pthread_mutex_unlock(&mu);
}

/* ---- fast path of small eager elementwise ops (tn.device.fastpath) ---- */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return 0x7fc0;  /* NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);                 /* round to nearest even */
}

static inline float apply_op(int op, float x, float y) {
    switch (op) {
    case 0: return x + y;
    case 1: return x - y;
    default: return x * y;
    }
}

int tn_dev_binary(int op, int dtype, int64_t a, int64_t b, int64_t out, int64_t n) {
    if (a == 0 || b == 0 || out == 0 || n < 0 || op < 0 || op > 2) return TN_EARGS;
    if (dtype == TN_F32) {
        const float *x = (const float *)(intptr_t)a, *y = (const float *)(intptr_t)b;
        float *o = (float *)(intptr_t)out;
        for (int64_t i = 0; i < n; i++) o[i] = apply_op(op, x[i], y[i]);
        return TN_OK;
    }
    if (dtype == TN_BF16) {
        const uint16_t *x = (const uint16_t *)(intptr_t)a, *y = (const uint16_t *)(intptr_t)b;
        uint16_t *o = (uint16_t *)(intptr_t)out;
        for (int64_t i = 0; i < n; i++) o[i] = f32_to_bf16(apply_op(op, bf16_to_f32(x[i]), bf16_to_f32(y[i])));
        return TN_OK;
    }
    return TN_EARGS;
}

/* The same as tn_dev_alloc / tn_dev_free with addresses as integers (cheaper to call from Python). */
int64_t tn_dev_alloc_addr(int64_t nbytes) { return (int64_t)(intptr_t)tn_dev_alloc(nbytes); }

int tn_dev_free_addr(int64_t addr) { return tn_dev_free((void *)(intptr_t)addr); }
