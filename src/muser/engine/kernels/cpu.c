/* The CPU exact lane's kernels: GEMM over quantized or f32 weights, attention over one layer's
 * KV plane, and the element-wise tails of a decode step (book 12, 14, 16; ggml-cpu ops.cpp).
 *
 * Row invariance (DESIGN.md "Exactness contract"): every output element is reduced in ONE fixed
 * order that depends neither on the number of rows in the call, nor on the row's index, nor on
 * the thread count, nor on the instruction set the code was compiled for:
 *
 *   dot(x, w) over n:  32 partial sums, lane l takes elements k = l (mod 32) in increasing k
 *                      (acc_l = acc_l + x_k * w_k, one rounding per op), then a fixed pairwise
 *                      combine 32 -> 16 -> 8 -> 4 -> 2 -> 1 (lane l + lane l + half).
 *
 * The code is written with GCC vector extensions (element-wise semantics), built without FP
 * contraction (-ffp-contract=off) or reassociation, and cloned per ISA (x86-64-v3 / baseline)
 * through target_clones: a clone only changes how many lanes one instruction carries, never
 * which values are added in which order. Threads split output rows, never a reduction.
 * exp and tanh are this file's own (plain f32 ops), not libm's, whose ISA-specific variants
 * could differ in the last bit.
 */

#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MU_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define MU_CLONES
#endif

#if defined(__x86_64__) || defined(__i386__)
#define MU_PAUSE() __builtin_ia32_pause()
#else
#define MU_PAUSE() ((void)0)
#endif

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));
typedef int8_t c8u __attribute__((vector_size(8), aligned(1)));
typedef int32_t i8v __attribute__((vector_size(32)));

static inline v8 ld8(const float *p) { return *(const v8u *)p; }
static inline void st8(float *p, v8 v) { *(v8u *)p = v; }
static inline v8 splat(float f) { return (v8){f, f, f, f, f, f, f, f}; }
static inline v8 q8(const int8_t *q) { return __builtin_convertvector(*(const c8u *)q, v8); }

/* ------------------------------------------------------------------------------------------- */
/* thread pool: N-1 workers that spin briefly, then sleep on a condition variable */

#define MAX_THREADS 64
#define SPIN 20000 /* pauses before a worker sleeps (~0.5 ms) */

typedef void (*task_fn)(void *arg, int ith, int nth);

static int n_threads = 1;
static int n_started = 0;
static pthread_t workers[MAX_THREADS];
static atomic_uint gen;
static atomic_int remaining;
static task_fn cur_fn;
static void *cur_arg;
static int cur_nth;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t run_mu = PTHREAD_MUTEX_INITIALIZER;

static void *worker_main(void *p) {
    int ith = (int)(intptr_t)p;
    unsigned seen = 0;
    for (;;) {
        unsigned g;
        int spins = 0;
        while ((g = atomic_load_explicit(&gen, memory_order_acquire)) == seen) {
            if (++spins < SPIN) {
                MU_PAUSE();
                continue;
            }
            pthread_mutex_lock(&mu);
            while ((g = atomic_load_explicit(&gen, memory_order_acquire)) == seen)
                pthread_cond_wait(&cv, &mu);
            pthread_mutex_unlock(&mu);
            break;
        }
        seen = g;
        if (ith < cur_nth)
            cur_fn(cur_arg, ith, cur_nth);
        atomic_fetch_sub_explicit(&remaining, 1, memory_order_release);
    }
    return NULL;
}

int mu_set_threads(int n) {
    if (n < 1 || n > MAX_THREADS)
        return -1;
    pthread_mutex_lock(&run_mu);
    while (n_started < n - 1) {
        if (pthread_create(&workers[n_started], NULL, worker_main, (void *)(intptr_t)(n_started + 1)) != 0) {
            pthread_mutex_unlock(&run_mu);
            return -2;
        }
        pthread_detach(workers[n_started]);
        n_started++;
    }
    n_threads = n;
    pthread_mutex_unlock(&run_mu);
    return 0;
}

int mu_get_threads(void) { return n_threads; }

static void run_tasks(task_fn fn, void *arg) {
    pthread_mutex_lock(&run_mu);
    int nth = n_threads;
    if (nth == 1 || n_started == 0) {
        fn(arg, 0, 1);
        pthread_mutex_unlock(&run_mu);
        return;
    }
    cur_fn = fn;
    cur_arg = arg;
    cur_nth = nth;
    atomic_store_explicit(&remaining, n_started, memory_order_relaxed);
    pthread_mutex_lock(&mu);
    atomic_fetch_add_explicit(&gen, 1, memory_order_release);
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
    fn(arg, 0, nth);
    for (long spins = 0; atomic_load_explicit(&remaining, memory_order_acquire) > 0; spins++) {
        if (spins < 2000)
            MU_PAUSE();
        else
            sched_yield(); /* a shared machine: the worker may be waiting for this core */
    }
    pthread_mutex_unlock(&run_mu);
}

/* [lo, hi) of n items for thread ith of nth, in multiples of `align` */
static void split_range(int64_t n, int ith, int nth, int64_t align, int64_t *lo, int64_t *hi) {
    int64_t per = (n + nth - 1) / nth;
    per = (per + align - 1) / align * align;
    *lo = per * ith < n ? per * ith : n;
    *hi = *lo + per < n ? *lo + per : n;
}

/* ------------------------------------------------------------------------------------------- */
/* the fixed-order reduction */

static inline float combine32(const float a[32]) {
    float s16[16], s8[8], s4[4], s2[2];
    for (int l = 0; l < 16; l++) s16[l] = a[l] + a[l + 16];
    for (int l = 0; l < 8; l++) s8[l] = s16[l] + s16[l + 8];
    for (int l = 0; l < 4; l++) s4[l] = s8[l] + s8[l + 4];
    for (int l = 0; l < 2; l++) s2[l] = s4[l] + s4[l + 2];
    return s2[0] + s2[1];
}

static inline float finish(v8 a0, v8 a1, v8 a2, v8 a3, const float *x, const float *w, int64_t k0, int64_t n) {
    float a[32];
    st8(a, a0);
    st8(a + 8, a1);
    st8(a + 16, a2);
    st8(a + 24, a3);
    for (int64_t k = k0; k < n; k++) a[k - k0] = a[k - k0] + x[k] * w[k];  /* tail: lanes 0.. */
    return combine32(a);
}

/* the reference order, scalar: what every vector path below must equal bit for bit */
float mu_dot_ref(const float *x, const float *w, int64_t n) {
    float a[32] = {0};
    for (int64_t k = 0; k < n; k++) a[k % 32] = a[k % 32] + x[k] * w[k];
    return combine32(a);
}

static inline float dot_f32(const float *x, const float *w, int64_t n) {
    v8 a0 = splat(0), a1 = a0, a2 = a0, a3 = a0;
    int64_t k = 0;
    for (; k + 32 <= n; k += 32) {
        a0 = a0 + ld8(x + k) * ld8(w + k);
        a1 = a1 + ld8(x + k + 8) * ld8(w + k + 8);
        a2 = a2 + ld8(x + k + 16) * ld8(w + k + 16);
        a3 = a3 + ld8(x + k + 24) * ld8(w + k + 24);
    }
    return finish(a0, a1, a2, a3, x, w, k, n);
}

/* ------------------------------------------------------------------------------------------- */
/* GEMM: y[t, n] = dot(x[t, :], W[n, :]) for t < T, n < n_out
 *   fmt 0: W f32 [n_out, n_in]
 *   fmt 1: Q8_0: qs int8 [n_out, n_in], d f32 [n_out, n_in / 32]; w = (float)q * d, exactly
 *          ggml's dequantize_row_q8_0, formed in registers (the product is then x * w)
 *   fmt 2, 3: NVFP4 as stored, 4.5 bits a weight: q uint8 [n_out, n_in / 2], two E2M1 codes a byte
 *          in ggml's block_nvfp4 order (per 16-value group, byte j holds element j in its low
 *          nibble and element j + 8 in its high one), d uint8 [n_out, n_in / 16] scale bytes,
 *          s f32 [n_out] (scale2; NULL for ggml's type 40: its w is q * d, which * 1 would not
 *          change). A code becomes ggml's kvalues_fp4 (= 2 x E2M1, an integer) and a scale byte
 *          its f32 through a 256-entry table: fmt 2 E4M3FN x 0.5 (the companion form), fmt 3 ggml's UE4M3 half (ggml_ue4m3_to_fp32 / 2).
 *          w = ((float)q * d) * s: q * d is exact, so w is the decoder's (e2m1 * e4m3fn) * scale2
 *          (book 7.2) or kvalues_fp4[q] * ue4m3_half(d) (ggml dequantize_row_nvfp4) bit for bit */

/* kvalues_fp4 (ggml-common.h): E2M1 code -> 2 x its value */
static const int8_t nv_kv[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
/* scale byte -> f32, [0]: E4M3FN x 0.5, [1]: UE4M3 half; engine/nvfp4.py _tables' values (mu_init) */
static float nv_scale[2][256];
void mu_init(void);

static float e4m3_mag(uint32_t b) { /* 7 magnitude bits: subnormal m 2^-9, else (1 + m/8) 2^(e-7) */
    uint32_t e = (b >> 3) & 0xF, m = b & 7;
    union { uint32_t u; float f; } p2 = {(e + 127 - 7) << 23};
    return e == 0 ? (float)m * 0x1p-9f : (1.0f + (float)m / 8.0f) * p2.f;
}

static void nv_tables(void) {
    for (uint32_t b = 0; b < 256; b++) {
        float mag = e4m3_mag(b & 0x7F);
        nv_scale[0][b] = (b & 0x7F) == 0x7F ? NAN : ((b & 0x80) ? -mag : mag) * 0.5f;
        nv_scale[1][b] = (b == 0 || b == 0x7F) ? 0.0f : mag * 0.5f; /* bit 7 ignored (unsigned) */
    }
}

void mu_nvfp4_scales(int form, float *out) {
    memcpy(out, nv_scale[form ? 1 : 0], sizeof(nv_scale[0]));
}

/* one 32-value block's codes (16 bytes: two groups) -> kvalues_fp4 as f32, elements 0..31 */
static inline void nv4_generic(const uint8_t *qb, v8 *c0, v8 *c1, v8 *c2, v8 *c3) {
    int8_t c[32];
    for (int g = 0; g < 2; g++)
        for (int j = 0; j < 8; j++) {
            c[16 * g + j] = nv_kv[qb[8 * g + j] & 0xF];
            c[16 * g + 8 + j] = nv_kv[qb[8 * g + j] >> 4];
        }
    *c0 = q8(c), *c1 = q8(c + 8), *c2 = q8(c + 16), *c3 = q8(c + 24);
}

typedef struct {
    int fmt;
    const void *w;
    const void *d;
    const float *s;
    int64_t n_out, n_in;
    const float *x;
    int64_t ldx, T;
    float *y;
    int64_t ldy;
} gemm_args;

#define TT 8 /* rows of x sharing one pass over a weight row */

/* R rows of x (R <= TT) against the weight row w, each output's four 8-lane accumulators summed
 * over the 32-blocks in the one order dot_f32 uses (so a row's bits do not depend on T): one lane
 * group at a time, so R accumulators, the weight vector and one product are live (16 AVX2
 * registers; the four groups of R rows at once would spill) */
#define ROWS_PASS(R)                                                                              \
    do {                                                                                          \
        const float *x0 = a->x + t * a->ldx;                                                      \
        v8 acc[4][TT];                                                                            \
        const int64_t kb = K / 32 * 32;                                                           \
        for (int j = 0; j < 4; j++) {                                                             \
            v8 g[TT];                                                                             \
            for (int r = 0; r < (R); r++) g[r] = splat(0);                                        \
            for (int64_t k = 8 * j; k < kb; k += 32) {                                            \
                v8 wk = ld8(w + k);                                                               \
                for (int r = 0; r < (R); r++) g[r] = g[r] + ld8(x0 + r * a->ldx + k) * wk;        \
            }                                                                                     \
            for (int r = 0; r < (R); r++) acc[j][r] = g[r];                                       \
        }                                                                                         \
        for (int r = 0; r < (R); r++)                                                             \
            a->y[(t + r) * a->ldy + n] = finish(acc[0][r], acc[1][r], acc[2][r], acc[3][r],       \
                                                x0 + r * a->ldx, w, kb, K);                       \
    } while (0)

/* The GEMM body, instantiated once per ISA (the Q8 loader and the BC broadcast are the only
 * intrinsics, with NV4, the NVFP4 code decoder: int8 -> f32 is exact, a broadcast copies bits and a
 * code's table entry is one integer, so which instruction widens a quant, looks up a code or splats
 * a scale cannot change a value). */
#define GEMM_TASK(NAME, ATTR, Q8, BC, NV4)                                                         \
    ATTR static void NAME(void *p, int ith, int nth) {                                            \
        const gemm_args *a = (const gemm_args *)p;                                                \
        int64_t n0, n1;                                                                           \
        split_range(a->n_out, ith, nth, 8, &n0, &n1);                                             \
        const int64_t K = a->n_in;                                                                \
        float *wrow = NULL;                                                                       \
        if (a->fmt != 0 && a->T > 1) wrow = (float *)malloc(sizeof(float) * (size_t)(K + 32));    \
        for (int64_t n = n0; n < n1; n++) {                                                       \
            const float *w;                                                                       \
            if (a->fmt == 0) {                                                                    \
                w = (const float *)a->w + n * K;                                                  \
            } else if (a->fmt >= 2) {                                                             \
                /* NVFP4: 32-value blocks of two 16-value groups, decoded in registers */         \
                const uint8_t *q = (const uint8_t *)a->w + n * (K / 2);                           \
                const uint8_t *sc = (const uint8_t *)a->d + n * (K / 16);                         \
                const float *tab = nv_scale[a->fmt - 2];                                          \
                const int s1 = a->s == NULL; /* type 40: no scale2 multiply (x 1 is exact) */     \
                v8 sn = splat(s1 ? 1.0f : a->s[n]), c0, c1, c2, c3;                               \
                if (a->T == 1) {                                                                  \
                    const float *x = a->x;                                                        \
                    v8 a0 = splat(0), a1 = a0, a2 = a0, a3 = a0;                                  \
                    for (int64_t b = 0; b < K / 32; b++) {                                        \
                        v8 d0 = BC(tab + sc[2 * b]), d1 = BC(tab + sc[2 * b + 1]);                \
                        const float *xb = x + 32 * b;                                             \
                        NV4(q + 16 * b, &c0, &c1, &c2, &c3);                                      \
                        c0 = c0 * d0, c1 = c1 * d0, c2 = c2 * d1, c3 = c3 * d1;                   \
                        if (!s1) c0 = c0 * sn, c1 = c1 * sn, c2 = c2 * sn, c3 = c3 * sn;          \
                        a0 = a0 + ld8(xb) * c0;                                                   \
                        a1 = a1 + ld8(xb + 8) * c1;                                               \
                        a2 = a2 + ld8(xb + 16) * c2;                                              \
                        a3 = a3 + ld8(xb + 24) * c3;                                              \
                    }                                                                             \
                    a->y[n] = finish(a0, a1, a2, a3, x, x, K, K);                                 \
                    continue;                                                                     \
                }                                                                                 \
                /* several rows: the same values decoded once into a row buffer, then as fmt 0 */ \
                for (int64_t b = 0; b < K / 32; b++) {                                            \
                    v8 d0 = BC(tab + sc[2 * b]), d1 = BC(tab + sc[2 * b + 1]);                    \
                    float *wb = wrow + 32 * b;                                                    \
                    NV4(q + 16 * b, &c0, &c1, &c2, &c3);                                          \
                    c0 = c0 * d0, c1 = c1 * d0, c2 = c2 * d1, c3 = c3 * d1;                       \
                    if (!s1) c0 = c0 * sn, c1 = c1 * sn, c2 = c2 * sn, c3 = c3 * sn;              \
                    st8(wb, c0), st8(wb + 8, c1), st8(wb + 16, c2), st8(wb + 24, c3);             \
                }                                                                                 \
                w = wrow;                                                                         \
            } else if (a->T == 1) {                                                               \
                /* decode in registers: one block of 32 = four 8-lane groups, lanes 0..31 */      \
                const int8_t *q = (const int8_t *)a->w + n * K;                                   \
                const float *d = (const float *)a->d + n * (K / 32);                             \
                const float *x = a->x;                                                            \
                v8 a0 = splat(0), a1 = a0, a2 = a0, a3 = a0;                                      \
                for (int64_t b = 0; b < K / 32; b++) {                                            \
                    v8 db = splat(d[b]);                                                          \
                    const int8_t *qb = q + 32 * b;                                                \
                    const float *xb = x + 32 * b;                                                 \
                    a0 = a0 + ld8(xb) * (Q8(qb) * db);                                            \
                    a1 = a1 + ld8(xb + 8) * (Q8(qb + 8) * db);                                    \
                    a2 = a2 + ld8(xb + 16) * (Q8(qb + 16) * db);                                  \
                    a3 = a3 + ld8(xb + 24) * (Q8(qb + 24) * db);                                  \
                }                                                                                 \
                a->y[n] = finish(a0, a1, a2, a3, x, x, K, K);                                     \
                continue;                                                                         \
            } else {                                                                              \
                /* several rows: the same values decoded once into a row buffer */                \
                const int8_t *q = (const int8_t *)a->w + n * K;                                   \
                const float *d = (const float *)a->d + n * (K / 32);                             \
                for (int64_t b = 0; b < K / 32; b++) {                                            \
                    v8 db = splat(d[b]);                                                          \
                    for (int j = 0; j < 32; j += 8) st8(wrow + 32 * b + j, Q8(q + 32 * b + j) * db); \
                }                                                                                 \
                w = wrow;                                                                         \
            }                                                                                     \
            int64_t t = 0;                                                                        \
            for (; t + TT <= a->T; t += TT) ROWS_PASS(TT);                                        \
            for (; t + TT / 2 <= a->T; t += TT / 2) ROWS_PASS(TT / 2);                            \
            for (; t < a->T; t++) a->y[t * a->ldy + n] = dot_f32(a->x + t * a->ldx, w, K);        \
        }                                                                                         \
        free(wrow);                                                                               \
    }

static inline v8 bc(const float *p) { return splat(*p); }
GEMM_TASK(gemm_task_generic, , q8, bc, nv4_generic)

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define MU_AVX2 __attribute__((target("avx2,f16c")))
MU_AVX2 static inline v8 q8_avx2(const int8_t *q) {
    return (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
}
/* one vbroadcastss per scale: gcc builds two adjacent splat()s through a stack round trip */
MU_AVX2 static inline v8 bc_avx2(const float *p) { return (v8)_mm256_broadcast_ss(p); }
/* kvalues_fp4 as the high bytes of their f16 values (every one has a zero low byte; code 8 is
 * +0, as the integer 0 converts) */
static const uint8_t nv_kv_f16hi[16] = {0x00, 0x3C, 0x40, 0x42, 0x44, 0x46, 0x48, 0x4A,
                                        0x00, 0xBC, 0xC0, 0xC2, 0xC4, 0xC6, 0xC8, 0xCA};
/* 16 code bytes -> 32 kvalues_fp4: the nibbles index a 16-byte table (pshufb), a zero low byte
 * is interleaved in and the f16 values widen exactly to f32 (vcvtph2ps, 8 lanes an op) */
MU_AVX2 static inline void nv4_avx2(const uint8_t *qb, v8 *c0, v8 *c1, v8 *c2, v8 *c3) {
    const __m128i tab = _mm_loadu_si128((const __m128i *)nv_kv_f16hi), m4 = _mm_set1_epi8(0xF);
    const __m128i z = _mm_setzero_si128(), v = _mm_loadu_si128((const __m128i *)qb);
    const __m128i lo = _mm_shuffle_epi8(tab, _mm_and_si128(v, m4));                     /* elements j */
    const __m128i hi = _mm_shuffle_epi8(tab, _mm_and_si128(_mm_srli_epi16(v, 4), m4));  /* j + 8 */
    *c0 = (v8)_mm256_cvtph_ps(_mm_unpacklo_epi8(z, lo));
    *c1 = (v8)_mm256_cvtph_ps(_mm_unpacklo_epi8(z, hi));
    *c2 = (v8)_mm256_cvtph_ps(_mm_unpackhi_epi8(z, lo));
    *c3 = (v8)_mm256_cvtph_ps(_mm_unpackhi_epi8(z, hi));
}
GEMM_TASK(gemm_task_avx2, MU_AVX2, q8_avx2, bc_avx2, nv4_avx2)
#endif

static int baseline_only = 0; /* tests: run the baseline instantiation on any CPU */

void mu_gemm_baseline(int on) { baseline_only = on; }

static task_fn gemm_task(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    static int avx2 = -1;
    if (avx2 < 0) avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") ? 1 : 0;
    if (avx2 && !baseline_only) return gemm_task_avx2;
#endif
    return gemm_task_generic;
}

int mu_gemm(int fmt, const void *w, const void *d, const float *s, int64_t n_out, int64_t n_in, const float *x,
            int64_t ldx, int64_t T, float *y, int64_t ldy) {
    if (fmt < 0 || fmt > 3 || (fmt != 0 && n_in % 32) || n_out < 0 || T < 0)
        return -1;
    mu_init(); /* the NVFP4 scale tables */
    gemm_args a = {fmt, w, d, s, n_out, n_in, x, ldx, T, y, ldy};
    run_tasks(gemm_task(), &a);
    return 0;
}

/* ------------------------------------------------------------------------------------------- */
/* exp and tanh: Cody-Waite reduction and a degree-7 polynomial in plain f32 ops, eight lanes at
 * a time (element-wise: a value's lane cannot change it). exp(x) = 0 below -86 (< 4.5e-38),
 * inf above 88.72, NaN stays NaN. */

typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8 sel(v8i m, v8 a, v8 b) { return (v8)((m & (v8i)a) | (~m & (v8i)b)); }

static inline v8 exp_v8(v8 x) {
    const v8i big = x > splat(88.72283935546875f), small = x < splat(-86.0f), nan = x != x;
    v8 xc = sel(big | nan, splat(0.0f), sel(small, splat(0.0f), x));
    const v8 shifter = splat(12582912.0f); /* 1.5 * 2^23: round to nearest integer */
    v8 n = (xc * splat(1.44269502162933349609375f) + shifter) - shifter;
    v8 r = xc - n * splat(0.693145751953125f); /* ln2 high part: n * hi is exact */
    r = r - n * splat(1.428606765330187045e-06f);
    v8 p = splat(1.0f / 5040.0f);
    p = p * r + splat(1.0f / 720.0f);
    p = p * r + splat(1.0f / 120.0f);
    p = p * r + splat(1.0f / 24.0f);
    p = p * r + splat(1.0f / 6.0f);
    p = p * r + splat(0.5f);
    p = p * r + splat(1.0f);
    p = p * r + splat(1.0f);
    v8i e = __builtin_convertvector(n, v8i);
    v8 s2 = (v8)((e + 126) << 23); /* 2^(n-1): n reaches 128 just below the overflow bound */
    v8 y = (p * s2) * splat(2.0f);
    y = sel(small, splat(0.0f), y);
    y = sel(big, splat(INFINITY), y);
    return sel(nan, x, y);
}

/* v[i] = exp(v[i]) in place; the tail goes through a padded group (the same lanes' code) */
static inline void exp_inplace(float *v, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) st8(v + i, exp_v8(ld8(v + i)));
    if (i < n) {
        float t[8] = {0};
        memcpy(t, v + i, sizeof(float) * (size_t)(n - i));
        st8(t, exp_v8(ld8(t)));
        memcpy(v + i, t, sizeof(float) * (size_t)(n - i));
    }
}

static inline float exp_f32(float x) {
    float t = x;
    exp_inplace(&t, 1);
    return t;
}

/* tanh(x) = sign(x) (1 - 2 / (exp(2|x|) + 1)) */
static inline float tanh_from_exp(float x, float e) {
    float t = 1.0f - 2.0f / (e + 1.0f);
    return x != x ? x : (x < 0 ? -t : t);
}

float mu_exp(float x) { return exp_f32(x); }
float mu_tanh(float x) {
    float ax = x < 0 ? -x : x, e = 2.0f * ax;
    exp_inplace(&e, 1);
    return tanh_from_exp(x, e);
}

#define CH 256 /* element-wise tails work in groups of CH through a stack buffer */

/* ------------------------------------------------------------------------------------------- */
/* element-wise tails, each in the op order of the torch reference (engine/forward.py) */

/* rms_norm scale: 1 / sqrt(mean(x^2) + eps) (ggml_rms_norm; the sum in the fixed order) */
static inline float rms_scale(const float *x, int64_t n, float eps) {
    float ms = dot_f32(x, x, n) / (float)n;
    return 1.0f / sqrtf(ms + eps);
}

/* out[r] = [res[r] +] (x[r] * scale) * w */
MU_CLONES void mu_norm_mul(const float *x, int64_t sx, const float *w, const float *res, int64_t sr, float *out,
                           int64_t so, int64_t R, int64_t N, float eps) {
    for (int64_t r = 0; r < R; r++) {
        const float *xr = x + r * sx;
        float sc = rms_scale(xr, N, eps);
        float *o = out + r * so;
        for (int64_t i = 0; i < N; i++) {
            float y = (xr[i] * sc) * w[i];
            o[i] = res ? y + res[r * sr + i] : y;
        }
    }
}

/* h = res + norm(x) * w; out2 = norm(h, eps2) * w2 (a sandwich tail and the next pre-norm) */
MU_CLONES void mu_norm2(const float *x, int64_t sx, const float *w, float eps, const float *res, int64_t sr,
                        const float *w2, float eps2, float *out, int64_t so, float *out2, int64_t so2, int64_t R,
                        int64_t N) {
    for (int64_t r = 0; r < R; r++) {
        const float *xr = x + r * sx;
        const float *rr = res + r * sr;
        float *o = out + r * so;
        float sc = rms_scale(xr, N, eps);
        for (int64_t i = 0; i < N; i++) o[i] = (xr[i] * sc) * w[i] + rr[i];
        float sc2 = rms_scale(o, N, eps2);
        float *o2 = out2 + r * so2;
        for (int64_t i = 0; i < N; i++) o2[i] = (o[i] * sc2) * w2[i];
    }
}

/* q, k heads of the stacked projection y [T, *] -> per-head norm * weight, then RoPE (NORM
 * pairing: dims 2i, 2i+1; book 9.7) when cos is given; q [T, H, D], k [T, KV, D] */
MU_CLONES void mu_qk_norm_rope(const float *y, int64_t sy, int64_t q_off, int64_t k_off, int64_t T, int64_t H,
                               int64_t KV, int64_t D, const float *qn, const float *kn, float eps, const float *cs,
                               const float *sn, float *q, float *k) {
    float buf[1024];
    for (int64_t t = 0; t < T; t++) {
        for (int64_t h = 0; h < H + KV; h++) {
            const float *src = y + t * sy + (h < H ? q_off + h * D : k_off + (h - H) * D);
            const float *wt = h < H ? qn : kn;
            float *dst = h < H ? q + (t * H + h) * D : k + (t * KV + (h - H)) * D;
            float sc = rms_scale(src, D, eps);
            for (int64_t i = 0; i < D; i++) buf[i] = (src[i] * sc) * wt[i];
            if (cs) {
                const float *c = cs + t * (D / 2), *s = sn + t * (D / 2);
                for (int64_t i = 0; i < D / 2; i++) {
                    float x0 = buf[2 * i], x1 = buf[2 * i + 1];
                    dst[2 * i] = x0 * c[i] - x1 * s[i];
                    dst[2 * i + 1] = x0 * s[i] + x1 * c[i];
                }
            } else {
                memcpy(dst, buf, sizeof(float) * (size_t)D);
            }
        }
    }
}

/* silu = 0: out = a * (1 / (1 + exp(-g)))       (ggml_vec_sigmoid_f32; attention gate, book 9.8)
 * silu = 1: out = (g / (1 + exp(-g))) * a       (ggml_silu_f32, then * up) */
MU_CLONES void mu_gate(const float *a, int64_t sa, const float *g, int64_t sg, float *out, int64_t so, int64_t R,
                       int64_t N, int silu) {
    float e[CH];
    for (int64_t r = 0; r < R; r++) {
        const float *ar = a + r * sa, *gr = g + r * sg;
        float *o = out + r * so;
        for (int64_t c = 0; c < N; c += CH) {
            int64_t m = N - c < CH ? N - c : CH;
            for (int64_t i = 0; i < m; i++) e[i] = -gr[c + i];
            exp_inplace(e, m);
            if (silu)
                for (int64_t i = 0; i < m; i++) o[c + i] = (gr[c + i] / (1.0f + e[i])) * ar[c + i];
            else
                for (int64_t i = 0; i < m; i++) o[c + i] = ar[c + i] * (1.0f / (1.0f + e[i]));
        }
    }
}

/* l = l * scale; then cap * tanh(l * inv_cap) when cap > 0 (book 9.10), in place */
MU_CLONES void mu_softcap(float *l, int64_t n, float scale, float inv_cap, float cap) {
    float u[CH], e[CH];
    for (int64_t c = 0; c < n; c += CH) {
        int64_t m = n - c < CH ? n - c : CH;
        for (int64_t i = 0; i < m; i++) l[c + i] = l[c + i] * scale;
        if (!(cap > 0)) continue;
        for (int64_t i = 0; i < m; i++) {
            u[i] = l[c + i] * inv_cap;
            e[i] = 2.0f * (u[i] < 0 ? -u[i] : u[i]);
        }
        exp_inplace(e, m);
        for (int64_t i = 0; i < m; i++) l[c + i] = tanh_from_exp(u[i], e[i]) * cap;
    }
}

/* ------------------------------------------------------------------------------------------- */
/* attention of T new rows over one plane plus the rows themselves (book 16; see
 * kernels/attention.py for the visibility rule). Row t (position p0 + t) of KV head g sees, in
 * position order, the plane's live logical positions [lo_t, origin_logical + len) and new rows
 * j <= t, lo_t and j limited by the window on sliding layers. Per query head: scores
 * s_i = dot(q, k_i) * scale (fixed-order dot over D), m = max, e_i = exp(s_i - m),
 * sum = e_0 + e_1 + ... in position order, p_i = e_i / sum, out = sum_i p_i * v_i in position
 * order. K/V elements: f32, or f16 (exact conversion). */

static float h2f_tab[65536];
static int h2f_ready = 0;

static float h2f_exact(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, u;
    if (e == 0x1f) {
        u = sign | 0x7f800000u | (m << 13);
    } else if (e == 0) {
        if (m == 0) {
            u = sign;
        } else {
            int s = -1;
            while (!(m & 0x400)) { m <<= 1; s++; }
            u = sign | ((uint32_t)(127 - 15 - s) << 23) | ((m & 0x3ff) << 13);
        }
    } else {
        u = sign | ((e + 127 - 15) << 23) | (m << 13);
    }
    union { uint32_t u; float f; } c = {u};
    return c.f;
}

void mu_init(void) {
    if (h2f_ready) return;
    for (uint32_t i = 0; i < 65536; i++) h2f_tab[i] = h2f_exact((uint16_t)i);
    nv_tables();
    h2f_ready = 1;
}

typedef struct {
    const float *q;
    int64_t T, H, KV, D;
    const void *kn, *vn;
    const void *kp, *vp;
    int64_t s_slot, s_head;
    int f16;
    int f16_ops; /* q and p rounded to f16 before their dots (ggml-cpu's mul_mat against f16 K/V) */
    int64_t ol, op, len, cap, p0, window;
    float scale;
    float *out;
} attn_args;

/* f32 -> f16 -> f32, round to nearest even (ggml_cpu_fp32_to_fp16 / vcvtps2ph); NaN kept */
static inline float f16_round(float x) {
    union { float f; uint32_t u; } c = {x};
    const uint32_t sign = c.u & 0x80000000u, a = c.u & 0x7fffffffu;
    if (a >= 0x7f800000u) return x;
    if (a >= 0x477ff000u) { /* >= 65520: past f16's largest finite value's rounding range */
        c.u = sign | 0x7f800000u;
        return c.f;
    }
    if (a < 0x38800000u) { /* below 2^-14: f16 subnormals, multiples of 2^-24 */
        union { float f; uint32_t u; } m = {0.0f};
        m.u = a;
        float t = m.f * 16777216.0f;             /* exact (power of two) */
        t = (t + 8388608.0f) - 8388608.0f;       /* round half even to an integer, t < 2^10 */
        m.f = t * (1.0f / 16777216.0f);          /* exact */
        c.u = sign | m.u;
        return c.f;
    }
    const uint32_t r = (a + 0x0fffu + ((a >> 13) & 1u)) & ~0x1fffu; /* 10 mantissa bits, RNE */
    c.u = sign | r;
    return c.f;
}

static inline const float *kv_row(const void *base, int64_t off, int f16, int64_t D, float *buf) {
    if (!f16) return (const float *)base + off;
    const uint16_t *h = (const uint16_t *)base + off;
    for (int64_t i = 0; i < D; i++) buf[i] = h2f_tab[h[i]];
    return buf;
}

MU_CLONES static void attn_task(void *p, int ith, int nth) {
    const attn_args *a = (const attn_args *)p;
    const int64_t D = a->D, hpk = a->H / a->KV;
    int64_t i0, i1;
    split_range(a->T * a->KV, ith, nth, 1, &i0, &i1);
    if (i0 >= i1) return;
    const int64_t S_max = a->len + a->T;
    float *sc = (float *)malloc(sizeof(float) * (size_t)(hpk * S_max + 2 * D + hpk * D));
    float *kb = sc + hpk * S_max, *vb = kb + D, *qb = vb + D;
    for (int64_t it = i0; it < i1; it++) {
        const int64_t t = it / a->KV, g = it % a->KV, pt = a->p0 + t;
        int64_t lo = a->ol;
        if (a->window && pt - a->window + 1 > lo) lo = pt - a->window + 1;
        const int64_t n_old = a->ol + a->len > lo ? a->ol + a->len - lo : 0;
        int64_t jlo = 0;
        if (a->window && t - a->window + 1 > 0) jlo = t - a->window + 1;
        const int64_t S = n_old + (t - jlo + 1);
        const float *qg = a->q + (t * a->H + g * hpk) * D;
        if (a->f16_ops) { /* Q enters K·Q as f16 (llama-graph.cpp build_attn_mha, f16 K) */
            for (int64_t i = 0; i < hpk * D; i++) qb[i] = f16_round(qg[i]);
            qg = qb;
        }
        /* scores: one K row read for the hpk heads of this KV head */
        for (int64_t i = 0; i < S; i++) {
            const float *kr;
            if (i < n_old) {
                int64_t slot = (a->op + (lo + i - a->ol)) % a->cap;
                kr = kv_row(a->kp, slot * a->s_slot + g * a->s_head, a->f16, D, kb);
            } else {
                int64_t j = jlo + (i - n_old);
                kr = kv_row(a->kn, (j * a->KV + g) * D, a->f16, D, kb);
            }
            for (int64_t hh = 0; hh < hpk; hh++) sc[hh * S + i] = dot_f32(qg + hh * D, kr, D) * a->scale;
        }
        for (int64_t hh = 0; hh < hpk; hh++) {
            float *s = sc + hh * S;
            float m = s[0];
            for (int64_t i = 1; i < S; i++) m = s[i] > m ? s[i] : m;
            for (int64_t i = 0; i < S; i++) s[i] = s[i] - m;
            exp_inplace(s, S);
            float sum = 0.0f;
            for (int64_t i = 0; i < S; i++) sum = sum + s[i];
            if (a->f16_ops) { /* ggml soft_max: p = e * (1/sum), then P enters V·P as f16 */
                const float inv = 1.0f / sum;
                for (int64_t i = 0; i < S; i++) s[i] = f16_round(s[i] * inv);
            } else {
                for (int64_t i = 0; i < S; i++) s[i] = s[i] / sum;
            }
            float *o = a->out + (t * a->H + g * hpk + hh) * D;
            for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
        }
        /* values: out = sum_i p_i * v_i in position order */
        for (int64_t i = 0; i < S; i++) {
            const float *vr;
            if (i < n_old) {
                int64_t slot = (a->op + (lo + i - a->ol)) % a->cap;
                vr = kv_row(a->vp, slot * a->s_slot + g * a->s_head, a->f16, D, vb);
            } else {
                int64_t j = jlo + (i - n_old);
                vr = kv_row(a->vn, (j * a->KV + g) * D, a->f16, D, vb);
            }
            for (int64_t hh = 0; hh < hpk; hh++) {
                float pi = sc[hh * S + i];
                float *o = a->out + (t * a->H + g * hpk + hh) * D;
                int64_t d = 0;
                v8 pv = splat(pi);
                for (; d + 8 <= D; d += 8) st8(o + d, ld8(o + d) + pv * ld8(vr + d));
                for (; d < D; d++) o[d] = o[d] + pi * vr[d];
            }
        }
    }
    free(sc);
}

int mu_attend(const float *q, int64_t T, int64_t H, int64_t KV, int64_t D, const void *kn, const void *vn,
              const void *kp, const void *vp, int64_t s_slot, int64_t s_head, int f16, int f16_ops, int64_t ol,
              int64_t op, int64_t len, int64_t cap, int64_t p0, int64_t window, float scale, float *out) {
    if (T < 1 || KV < 1 || H % KV || D < 1 || (len > 0 && cap < 1) || (f16_ops && !f16))
        return -1;
    mu_init();
    attn_args a = {q, T, H, KV, D, kn, vn, kp, vp, s_slot, s_head, f16, f16_ops, ol, op, len, cap, p0, window,
                   scale, out};
    run_tasks(attn_task, &a);
    return 0;
}

/* ------------------------------------------------------------------------------------------- */
/* The integer lane over Q8_0 activations (muser.quant.dot.matmul_ggml, ggml-cpu's
 * vec_dot_q8_0_q8_0 and vec_dot_q4_0_q8_0, bit for bit):
 *   x row -> Q8_0 per 32 as quantize_row_q8_0's AVX2 branch: amax, d = f16(amax / 127),
 *            id = 127 / amax (0 when amax is 0), q = saturate(round-half-even(x * id));
 *   weight codes int8 (Q8_0 qs as stored; Q4_0 nibble - 8, formed once by the caller), so each
 *   32-block's sum of code x code is an exact int32 whatever the lane order;
 *   term_b = f64(f32(wd_b * xd_b)) * f64(isum_b), summed in float64 per chunk of 1024 elements
 *   (+0.0, then + term block by block) and the chunks in order from +0.0, rounded to f32 once
 *   (dot.py _chunk_sum: the order kernels/qmatmul_i8.py keeps on CUDA).
 * Threads split output rows; a row's value depends on its own x row and weight row only. */

/* returns the flat index (t * K + k) + 1 of the first non-finite x, 0 when every x is finite */
static MU_CLONES int64_t quant_q8_0_rows(const float *x, int64_t ldx, int64_t T, int64_t K, int8_t *qs, float *d) {
    const int64_t nb = K / 32;
    for (int64_t t = 0; t < T; t++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *v = x + t * ldx + b * 32;
            float amax = 0.0f;
            int finite = 1;
            for (int i = 0; i < 32; i++) {
                const float a = fabsf(v[i]);
                finite &= a <= 3.40282347e38f; /* false for inf and NaN */
                amax = a > amax ? a : amax;
            }
            if (!finite) {
                for (int i = 0; i < 32; i++)
                    if (!(fabsf(v[i]) <= 3.40282347e38f)) return t * K + b * 32 + i + 1;
            }
            d[t * nb + b] = f16_round(amax / 127.0f);
            const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
            int8_t *q = qs + t * K + b * 32;
            for (int i = 0; i < 32; i++) {
                const float r = (v[i] * id + 12582912.0f) - 12582912.0f; /* ggml nearest_int: half even */
                const int c = (int)r;
                q[i] = (int8_t)(c > 127 ? 127 : (c < -128 ? -128 : c));
            }
        }
    }
    return 0;
}

typedef struct {
    const int8_t *wq; /* [N, K] codes */
    const float *wd;  /* [N, K / 32] weight scales (the f16 values) */
    const int8_t *aq; /* [T, K] */
    const float *ad;  /* [T, K / 32] */
    int64_t N, K, T;
    float *y;
    int64_t ldy;
} i8_args;

static MU_CLONES void i8_task(void *p, int ith, int nth) {
    const i8_args *a = (const i8_args *)p;
    int64_t lo, hi;
    split_range(a->N, ith, nth, 8, &lo, &hi);
    const int64_t nb = a->K / 32, per = 1024 / 32;
    for (int64_t n = lo; n < hi; n++) {
        const int8_t *w = a->wq + n * a->K;
        const float *wd = a->wd + n * nb;
        for (int64_t t = 0; t < a->T; t++) {
            const int8_t *xq = a->aq + t * a->K;
            const float *xd = a->ad + t * nb;
            double acc = 0.0;
            for (int64_t c0 = 0; c0 < nb; c0 += per) {
                const int64_t c1 = c0 + per < nb ? c0 + per : nb;
                double part = 0.0;
                for (int64_t b = c0; b < c1; b++) {
                    int32_t s = 0;
                    for (int i = 0; i < 32; i++) s += (int32_t)w[b * 32 + i] * (int32_t)xq[b * 32 + i];
                    const float sc = wd[b] * xd[b];
                    part = part + (double)sc * (double)s;
                }
                acc = acc + part;
            }
            a->y[t * a->ldy + n] = (float)acc;
        }
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
/* The same sums, four output rows at a time: each block's four integer sums from 16-bit
 * products (vpmaddwd: exact for any int8 codes, -128 included), reduced across lanes by
 * vphaddd (integer: order-free); the four rows' float64 terms and chunk sums are the four lanes
 * of one vector, each lane adding its own row's terms in block order, as the scalar form. */
MU_AVX2 static void i8_task_avx2(void *p, int ith, int nth) {
    const i8_args *a = (const i8_args *)p;
    int64_t lo, hi;
    split_range(a->N, ith, nth, 8, &lo, &hi);
    const int64_t K = a->K, nb = K / 32, per = 1024 / 32;
    for (int64_t n0 = lo; n0 < hi; n0 += 4) {
        const int8_t *w[4];
        const float *wd[4];
        for (int r = 0; r < 4; r++) { /* past the range's end: its last row again, not stored */
            const int64_t n = n0 + r < hi ? n0 + r : hi - 1;
            w[r] = a->wq + n * K;
            wd[r] = a->wd + n * nb;
        }
        for (int64_t t = 0; t < a->T; t++) {
            const int8_t *xq = a->aq + t * K;
            const float *xd = a->ad + t * nb;
            __m256d acc = _mm256_setzero_pd();
            for (int64_t c0 = 0; c0 < nb; c0 += per) {
                const int64_t c1 = c0 + per < nb ? c0 + per : nb;
                __m256d part = _mm256_setzero_pd();
                for (int64_t b = c0; b < c1; b++) {
                    const __m256i x0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(xq + b * 32)));
                    const __m256i x1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(xq + b * 32 + 16)));
                    __m256i s[4];
                    for (int r = 0; r < 4; r++) {
                        const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w[r] + b * 32)));
                        const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w[r] + b * 32 + 16)));
                        s[r] = _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1));
                    }
                    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
                    const __m128i isum = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
                    const __m128 sc = _mm_mul_ps(_mm_set_ps(wd[3][b], wd[2][b], wd[1][b], wd[0][b]), _mm_set1_ps(xd[b]));
                    part = _mm256_add_pd(part, _mm256_mul_pd(_mm256_cvtps_pd(sc), _mm256_cvtepi32_pd(isum)));
                }
                acc = _mm256_add_pd(acc, part);
            }
            float o[4];
            _mm_storeu_ps(o, _mm256_cvtpd_ps(acc));
            for (int r = 0; r < 4 && n0 + r < hi; r++) a->y[t * a->ldy + n0 + r] = o[r];
        }
    }
}
#endif

static task_fn i8_task_for_cpu(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    static int avx2 = -1;
    if (avx2 < 0) avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
    if (avx2 && !baseline_only) return i8_task_avx2;
#endif
    return i8_task;
}

/* y [T, N] (row stride ldy) = the integer lane's x [T, K] (row stride ldx) @ W^T; aq, ad: caller's
 * scratch of T * K and T * K / 32 elements. Returns 0; -1 for a bad shape; 1 + the flat index of
 * the first non-finite x (nothing written to y) */
int64_t mu_gemm_i8(const int8_t *wq, const float *wd, int64_t N, int64_t K, const float *x, int64_t ldx, int64_t T,
                   int8_t *aq, float *ad, float *y, int64_t ldy) {
    if (N < 0 || T < 0 || K < 32 || K % 32)
        return -1;
    const int64_t bad = quant_q8_0_rows(x, ldx, T, K, aq, ad);
    if (bad)
        return bad;
    i8_args a = {wq, wd, aq, ad, N, K, T, y, ldy};
    run_tasks(i8_task_for_cpu(), &a);
    return 0;
}
