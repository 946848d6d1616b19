/* Caching allocator of the `neuron` devices' memory (each device's HBM): one arena per device, size classes, free lists, stats. */
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
    int64_t dev;          /* device (arena) index */
    struct blk *next;     /* free-list link */
} blk;

/* One arena per device: its free lists, counters and limit (the device's HBM). */
typedef struct arena {
    blk *free_heads[NCLASS];
    int64_t allocated, peak, reserved, requested, nalloc, nfree, hits, limit;
} arena;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static arena arenas[TN_DEV_MAX_DEVICES];

static int bad_device(int64_t dev) { return dev < 0 || dev >= TN_DEV_MAX_DEVICES; }

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

static void release_cached_locked(arena *a) {
    for (int i = 0; i < NCLASS; i++) {
        blk *b = a->free_heads[i];
        while (b) {
            blk *nx = b->next;
            a->reserved -= b->cap;
            b->magic = 0;
            free(b);
            b = nx;
        }
        a->free_heads[i] = NULL;
    }
}

void *tn_dev_alloc_on(int64_t dev, int64_t nbytes) {
    if (bad_device(dev) || nbytes < 0 || nbytes > ((int64_t)1 << 46)) return NULL;
    int64_t cap, cls;
    size_class(nbytes, &cap, &cls);
    pthread_mutex_lock(&mu);
    arena *a = &arenas[dev];
    blk *b = NULL;
    blk **pp = &a->free_heads[cls];
    while (*pp) {                       /* the last class mixes sizes: take a block big enough */
        if ((*pp)->cap >= cap) {
            b = *pp;
            *pp = b->next;
            break;
        }
        pp = &(*pp)->next;
    }
    if (b) {
        a->hits++;
    } else {
        if (a->limit > 0 && a->reserved + cap > a->limit) release_cached_locked(a);
        if (a->limit > 0 && a->reserved + cap > a->limit) {
            pthread_mutex_unlock(&mu);
            return NULL;
        }
        void *raw = NULL;
        if (posix_memalign(&raw, HDR, (size_t)(HDR + cap)) != 0 || raw == NULL) {
            for (int d = 0; d < TN_DEV_MAX_DEVICES; d++) release_cached_locked(&arenas[d]);
            if (posix_memalign(&raw, HDR, (size_t)(HDR + cap)) != 0 || raw == NULL) {
                pthread_mutex_unlock(&mu);
                return NULL;
            }
        }
        b = (blk *)raw;
        b->cap = cap;
        b->cls = cls;
        b->dev = dev;
        a->reserved += cap;
    }
    b->magic = MAGIC_LIVE;
    b->req = nbytes;
    b->next = NULL;
    a->allocated += b->cap;
    a->requested += nbytes;
    if (a->allocated > a->peak) a->peak = a->allocated;
    a->nalloc++;
    pthread_mutex_unlock(&mu);
    return (char *)b + HDR;
}

void *tn_dev_alloc(int64_t nbytes) { return tn_dev_alloc_on(0, nbytes); }

int tn_dev_free(void *ptr) {
    if (ptr == NULL || ((uintptr_t)ptr & (HDR - 1)) != 0) return TN_EARGS;
    blk *b = (blk *)((char *)ptr - HDR);
    pthread_mutex_lock(&mu);
    if (b->magic != MAGIC_LIVE || bad_device(b->dev)) {
        int rc = b->magic == MAGIC_FREE ? TN_EINDEX : TN_EARGS;
        pthread_mutex_unlock(&mu);
        return rc;
    }
    arena *a = &arenas[b->dev];
    b->magic = MAGIC_FREE;
    a->allocated -= b->cap;
    a->requested -= b->req;
    a->nfree++;
    b->next = a->free_heads[b->cls];
    a->free_heads[b->cls] = b;
    pthread_mutex_unlock(&mu);
    return TN_OK;
}

int64_t tn_dev_block_bytes(void *ptr) {
    if (ptr == NULL || ((uintptr_t)ptr & (HDR - 1)) != 0) return TN_EARGS;
    blk *b = (blk *)((char *)ptr - HDR);
    return b->magic == MAGIC_LIVE ? b->cap : TN_EARGS;
}

int64_t tn_dev_block_device(int64_t addr) {
    void *ptr = (void *)(intptr_t)addr;
    if (ptr == NULL || ((uintptr_t)ptr & (HDR - 1)) != 0) return TN_EARGS;
    blk *b = (blk *)((char *)ptr - HDR);
    return b->magic == MAGIC_LIVE ? b->dev : TN_EARGS;
}

int tn_dev_stats(int64_t dev, int64_t *out) {
    if (bad_device(dev) || out == NULL) return TN_EINDEX;
    pthread_mutex_lock(&mu);
    arena *a = &arenas[dev];
    out[0] = a->allocated;
    out[1] = a->peak;
    out[2] = a->reserved;
    out[3] = a->requested;
    out[4] = a->nalloc;
    out[5] = a->nfree;
    out[6] = a->hits;
    out[7] = a->limit;
    pthread_mutex_unlock(&mu);
    return TN_OK;
}

int tn_dev_reset_peak(int64_t dev) {
    if (bad_device(dev)) return TN_EINDEX;
    pthread_mutex_lock(&mu);
    arenas[dev].peak = arenas[dev].allocated;
    pthread_mutex_unlock(&mu);
    return TN_OK;
}

int tn_dev_empty_cache(int64_t dev) {
    if (dev != -1 && bad_device(dev)) return TN_EINDEX;
    pthread_mutex_lock(&mu);
    for (int64_t d = 0; d < TN_DEV_MAX_DEVICES; d++)
        if (dev == -1 || d == dev) release_cached_locked(&arenas[d]);
    pthread_mutex_unlock(&mu);
    return TN_OK;
}

int tn_dev_set_limit(int64_t dev, int64_t nbytes) {
    if (dev != -1 && bad_device(dev)) return TN_EINDEX;
    pthread_mutex_lock(&mu);
    for (int64_t d = 0; d < TN_DEV_MAX_DEVICES; d++)
        if (dev == -1 || d == dev) arenas[d].limit = nbytes < 0 ? 0 : nbytes;
    pthread_mutex_unlock(&mu);
    return TN_OK;
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

/* The same as tn_dev_alloc_on / tn_dev_free with addresses as integers (cheaper to call from Python). */
int64_t tn_dev_alloc_addr(int64_t dev, int64_t nbytes) { return (int64_t)(intptr_t)tn_dev_alloc_on(dev, nbytes); }

int tn_dev_free_addr(int64_t addr) { return tn_dev_free((void *)(intptr_t)addr); }

int tn_dev_max_devices(void) { return TN_DEV_MAX_DEVICES; }

/* In a forked child: a fresh lock (another thread of the parent may have held it at fork time). */
void tn_dev_reinit_after_fork(void) { pthread_mutex_init(&mu, NULL); }
