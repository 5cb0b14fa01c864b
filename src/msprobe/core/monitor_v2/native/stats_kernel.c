/* One pass over a contiguous CPU buffer: min, max, sum, sum of squares and NaN count.
 *
 * ATen has no kernel that reduces all of these in one read (aminmax, sum and a norm
 * read the data three times, aminmax at half speed). This kernel keeps LANES
 * independent accumulators, which the compiler turns into vector registers, and sums
 * blocks of BLOCK elements in float and the block totals in double. A NaN makes the
 * block's float sums NaN, so only a block whose sums are not finite (NaN, Inf, or fp32
 * overflow) is read again, in double, counting its NaNs: finite data pays nothing for
 * the count. A part whose float squares underflowed (every value below ~1e-19 in
 * magnitude, not all zeros) is read again in double too. Min and max skip NaN (the caller
 * reports NaN for them when the count is not zero). Large buffers are split over
 * `threads` POSIX threads.
 *
 * `msprobe_stats_zeros` also counts the elements equal to zero (-0.0 included, NaN not)
 * in the same read, with integer lane counters. It is a separate set of reducers, so the
 * default statistics pay nothing for the optional count.
 *
 * Built at run time by msprobe's native.py with the system C compiler; on x86-64 the
 * reducers are cloned for AVX-512, AVX2 and baseline CPUs and picked when loaded, so
 * one build runs on every machine that shares the cache. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define LANES 16
#define BLOCK 4096
#define MIN_PER_THREAD ((int64_t)1 << 20)
#define MAX_THREADS 64

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(MSPROBE_NO_CLONES)
#define VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VECTOR_CLONES
#endif

enum { F32 = 0, BF16 = 1, F16 = 2 };

typedef struct {
    const void *data;
    int64_t n;
    int dtype;
    float mn, mx;
    double sum, sq;
    int64_t nans;
    int want_zeros;
    int64_t zeros;
} part_t;

static inline float bf16_value(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* ZEROS is a compile-time 0 or 1: with 0 the zero count is compiled out. */
#define REDUCE(LOAD, ZEROS)                                                        \
    float mn[LANES], mx[LANES];                                                    \
    double sum = 0.0, sq = 0.0;                                                    \
    int64_t nans = 0, zeros = 0, i = 0, n = p->n;                                  \
    for (int j = 0; j < LANES; j++) {                                              \
        mn[j] = INFINITY;                                                          \
        mx[j] = -INFINITY;                                                         \
    }                                                                              \
    while (n - i >= LANES) {                                                       \
        int64_t start = i, stop = n - i > BLOCK ? i + BLOCK : n - (n - i) % LANES; \
        float bs[LANES] = {0}, bq[LANES] = {0};                                    \
        int32_t bz[LANES] = {0}; /* at most BLOCK / LANES per lane and block */    \
        for (; i < stop; i += LANES) {                                             \
            for (int j = 0; j < LANES; j++) {                                      \
                float v = LOAD(i + j);                                             \
                mn[j] = v < mn[j] ? v : mn[j];                                     \
                mx[j] = v > mx[j] ? v : mx[j];                                     \
                bs[j] += v;                                                        \
                bq[j] += v * v;                                                    \
                if (ZEROS) bz[j] += v == 0.0f;                                     \
            }                                                                      \
        }                                                                          \
        double block_sum = 0.0, block_sq = 0.0;                                    \
        for (int j = 0; j < LANES; j++) {                                          \
            block_sum += bs[j];                                                    \
            block_sq += bq[j];                                                     \
            if (ZEROS) zeros += bz[j];                                             \
        }                                                                          \
        if (!isfinite(block_sum) || !isfinite(block_sq)) {                         \
            /* fp32 overflowed, or the block holds Inf or NaN (a NaN makes the      \
               sums NaN, so finite blocks need no count): redo it in double. */    \
            block_sum = block_sq = 0.0;                                            \
            for (int64_t k = start; k < stop; k++) {                               \
                double v = LOAD(k);                                                \
                block_sum += v;                                                    \
                block_sq += v * v;                                                 \
                nans += v != v;                                                    \
            }                                                                      \
        }                                                                          \
        sum += block_sum;                                                          \
        sq += block_sq;                                                            \
    }                                                                              \
    for (; i < n; i++) {                                                           \
        float v = LOAD(i);                                                         \
        mn[0] = v < mn[0] ? v : mn[0];                                             \
        mx[0] = v > mx[0] ? v : mx[0];                                             \
        sum += v;                                                                  \
        sq += (double)v * v;                                                       \
        nans += v != v;                                                            \
        if (ZEROS) zeros += v == 0.0f;                                             \
    }                                                                              \
    p->mn = mn[0];                                                                 \
    p->mx = mx[0];                                                                 \
    for (int j = 1; j < LANES; j++) {                                              \
        p->mn = mn[j] < p->mn ? mn[j] : p->mn;                                     \
        p->mx = mx[j] > p->mx ? mx[j] : p->mx;                                     \
    }                                                                              \
    if (sq < (double)n * 0x1p-100 && (p->mn != 0.0f || p->mx != 0.0f)) {          \
        /* Squares of values below ~1e-19 underflow in float (1e-30 squares to 0):   \
           a part whose sum of squares is this small, and that holds a non-zero, is  \
           read again in double. Above the bound the float error (< 2^-149 a square) \
           is below 1e-9 of the sum; finite data of ordinary size never comes here. */ \
        sum = sq = 0.0;                                                            \
        for (int64_t k = 0; k < n; k++) {                                          \
            double v = LOAD(k);                                                    \
            sum += v;                                                              \
            sq += v * v;                                                           \
        }                                                                          \
    }                                                                              \
    p->sum = sum;                                                                  \
    p->sq = sq;                                                                    \
    p->nans = nans;                                                                \
    p->zeros = zeros;

#define LOAD_F32(k) x[k]
#define LOAD_BF16(k) bf16_value(x[k])
#define LOAD_F16(k) ((float)x[k])

VECTOR_CLONES static void reduce_f32(part_t *p) {
    const float *x = (const float *)p->data;
    REDUCE(LOAD_F32, 0)
}

VECTOR_CLONES static void reduce_f32_zeros(part_t *p) {
    const float *x = (const float *)p->data;
    REDUCE(LOAD_F32, 1)
}

VECTOR_CLONES static void reduce_bf16(part_t *p) {
    const uint16_t *x = (const uint16_t *)p->data;
    REDUCE(LOAD_BF16, 0)
}

VECTOR_CLONES static void reduce_bf16_zeros(part_t *p) {
    const uint16_t *x = (const uint16_t *)p->data;
    REDUCE(LOAD_BF16, 1)
}

#ifdef __FLT16_MAX__
VECTOR_CLONES static void reduce_f16(part_t *p) {
    const _Float16 *x = (const _Float16 *)p->data;
    REDUCE(LOAD_F16, 0)
}

VECTOR_CLONES static void reduce_f16_zeros(part_t *p) {
    const _Float16 *x = (const _Float16 *)p->data;
    REDUCE(LOAD_F16, 1)
}
#endif

/* Bit i set: dtype i is supported by this build. */
int msprobe_stats_dtypes(void) {
#ifdef __FLT16_MAX__
    return (1 << F32) | (1 << BF16) | (1 << F16);
#else
    return (1 << F32) | (1 << BF16);
#endif
}

static void *run_part(void *arg) {
    part_t *p = (part_t *)arg;
    switch (p->dtype) {
    case BF16: p->want_zeros ? reduce_bf16_zeros(p) : reduce_bf16(p); break;
#ifdef __FLT16_MAX__
    case F16: p->want_zeros ? reduce_f16_zeros(p) : reduce_f16(p); break;
#endif
    default: p->want_zeros ? reduce_f32_zeros(p) : reduce_f32(p); break;
    }
    return NULL;
}

static int64_t stats(const void *data, int64_t n, int dtype, int threads, double *out, int64_t *zeros_out) {
    part_t parts[MAX_THREADS];
    pthread_t tids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    size_t item = dtype == F32 ? 4 : 2;
    if (threads > n / MIN_PER_THREAD) threads = (int)(n / MIN_PER_THREAD);
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads < 1) threads = 1;
    int64_t chunk = (n / threads) & ~(int64_t)(LANES - 1);
    for (int t = 0; t < threads; t++) {
        int64_t begin = chunk * t;
        parts[t].data = (const char *)data + begin * item;
        parts[t].n = t == threads - 1 ? n - begin : chunk;
        parts[t].dtype = dtype;
        parts[t].want_zeros = zeros_out != NULL;
        parts[t].zeros = 0;
    }
    /* A thread that cannot be started is run here instead. */
    for (int t = 1; t < threads; t++)
        started[t] = pthread_create(&tids[t], NULL, run_part, &parts[t]) == 0;
    run_part(&parts[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(tids[t], NULL);
        else
            run_part(&parts[t]);
    }
    double mn = parts[0].mn, mx = parts[0].mx, sum = 0.0, sq = 0.0;
    int64_t nans = 0, zeros = 0;
    for (int t = 0; t < threads; t++) {
        mn = parts[t].mn < mn ? parts[t].mn : mn;
        mx = parts[t].mx > mx ? parts[t].mx : mx;
        sum += parts[t].sum;
        sq += parts[t].sq;
        nans += parts[t].nans;
        zeros += parts[t].zeros;
    }
    if (zeros_out != NULL)
        *zeros_out = zeros;
    out[0] = mn;
    out[1] = mx;
    out[2] = sum;
    out[3] = sq;
    return nans;
}

/* out = {min, max, sum, sum of squares}; returns the NaN count. */
int64_t msprobe_stats(const void *data, int64_t n, int dtype, int threads, double *out) {
    return stats(data, n, dtype, threads, out, NULL);
}

/* The same, and *zeros = the number of elements equal to zero, in the same read. */
int64_t msprobe_stats_zeros(const void *data, int64_t n, int dtype, int threads, double *out, int64_t *zeros) {
    return stats(data, n, dtype, threads, out, zeros);
}

/* Many buffers in one call (one call from Python instead of one per tensor, whose
   fixed cost is most of the cost of a small tensor): buffer i gives out[4 i .. 4 i + 3],
   nans[i] and, unless zeros is NULL, zeros[i], exactly as msprobe_stats(_zeros) of it
   alone with the same thread count. */
void msprobe_stats_many(const void *const *data, const int64_t *counts, const int *dtypes, int64_t buffers,
                        int threads, double *out, int64_t *nans, int64_t *zeros) {
    for (int64_t i = 0; i < buffers; i++)
        nans[i] = stats(data[i], counts[i], dtypes[i], threads, out + 4 * i, zeros != NULL ? zeros + i : NULL);
}
