/* prunus native decode: a Llama-family decoder step on the CPU (AVX2 + FMA + F16C, and the linear layers on
 * AVX-VNNI, AVX-512, AVX-512 VNNI or AMX where the CPU has them: prunus_set_isa), over a genai export's weights.
 *
 * One call, prunus_forward, runs every layer of a pass: rows of new tokens at their own positions, keys and
 * values written into the caller's KV buffers (n_slots, kv_heads, max_len, head_dim) per layer, floats or
 * halves (Model.kv_f16), the logits of each row's last token out. Linear layers are fp32, or int8 / int4 in blocks of 32 with a float scale (and a
 * float scale x zero point) per block, repacked at load (prunus/native/weights.py) four output rows at a time:
 *
 *   f32: (tiles, k / 8, 4, 8) floats
 *   q8:  (tiles, k / 32, 4, 32) int8, the block's integers minus 128 for unsigned storage
 *   q4:  (tiles, k / 32, 4, 16) bytes: element j in the low nibble of byte j, element j + 16 in its high nibble
 *   s, sz: (tiles, k / 32, 4) floats: scale, and scale x zero point (NULL: no zero point)
 *
 * so one tile's blocks are one sequential stream. Activations are quantized per block of 32 (scale
 * max|x| / 127, as llama.cpp's Q8_0 and ONNX Runtime's MatMulNBits at accuracy level 4 do). The int8 dot
 * products use the sign trick (|w| unsigned times sign(x, w) signed) so that _mm256_maddubs_epi16 cannot
 * saturate without VNNI, and VNNI's dpbusd gets the unsigned operand it needs; int4 nibbles are unsigned and their
 * products are small. The linear kernels of each ISA are instances of templates (tile_*.h), chosen at run time.
 */
#define _GNU_SOURCE /* syscall, for the AMX permission (tile_amx.h) */
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- thread pool */

typedef void (*task_fn)(void *ctx, int ith, int nth);

typedef struct Pool {
    int n;
    pthread_t *tid;
    atomic_int gen, done, stop;
    task_fn fn;
    void *ctx;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    void *arena; /* the passes' buffers (scratch_new) */
    size_t arena_size;
} Pool;

typedef struct { Pool *p; int ith; } WorkerArg;

#define SPIN_ROUNDS (1 << 16) /* pause instructions before a worker sleeps: about a millisecond */
#define WAIT_SPINS (1 << 12)  /* pause instructions before the caller, waiting for the workers, yields its core */

static void *worker(void *arg) {
    WorkerArg *wa = (WorkerArg *)arg;
    Pool *p = wa->p;
    int ith = wa->ith, seen = 0;
    free(wa);
    for (;;) {
        int spins = 0;
        while (atomic_load_explicit(&p->gen, memory_order_acquire) == seen) {
            if (atomic_load(&p->stop)) return NULL;
            if (++spins < SPIN_ROUNDS) { _mm_pause(); continue; }
            pthread_mutex_lock(&p->mu);
            while (atomic_load(&p->gen) == seen && !atomic_load(&p->stop)) pthread_cond_wait(&p->cv, &p->mu);
            pthread_mutex_unlock(&p->mu);
        }
        seen = atomic_load(&p->gen);
        p->fn(p->ctx, ith, p->n);
        atomic_fetch_add_explicit(&p->done, 1, memory_order_release);
    }
}

Pool *prunus_pool_new(int n) {
    Pool *p = calloc(1, sizeof(Pool));
    p->n = n < 1 ? 1 : n;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    p->tid = calloc(p->n, sizeof(pthread_t));
    for (int i = 1; i < p->n; i++) {
        WorkerArg *wa = malloc(sizeof(WorkerArg));
        wa->p = p; wa->ith = i;
        pthread_create(&p->tid[i], NULL, worker, wa);
    }
    return p;
}

void prunus_pool_free(Pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->stop, 1);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; i < p->n; i++) pthread_join(p->tid[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    free(p->tid);
    free(p->arena);
    free(p);
}

static void pool_run(Pool *p, task_fn fn, void *ctx) {
    if (p->n == 1) { fn(ctx, 0, 1); return; }
    p->fn = fn; p->ctx = ctx;
    atomic_store(&p->done, 0);
    atomic_fetch_add_explicit(&p->gen, 1, memory_order_release);
    pthread_mutex_lock(&p->mu);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    fn(ctx, 0, p->n);
    /* spin, then yield: on a CPU shared with other processes a worker may have lost its core, and spinning on
     * can keep it from getting one back for a whole time slice (docs/native.md, "Threads and buffers") */
    for (int spins = 0; atomic_load_explicit(&p->done, memory_order_acquire) < p->n - 1;)
        if (++spins < WAIT_SPINS) _mm_pause(); else sched_yield();
}

static void split(int n, int ith, int nth, int *a, int *b) {
    int per = n / nth, rem = n % nth;
    *a = ith * per + (ith < rem ? ith : rem);
    *b = *a + per + (ith < rem);
}

/* ---------------------------------------------------------------- helpers */

static inline float hsum8(__m256 v) {
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));
    t = _mm_add_ss(t, _mm_movehdup_ps(t));
    return _mm_cvtss_f32(t);
}

/* the four sums of a0..a3 as one vector */
static inline __m128 hsum4x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

static float dot(const float *a, const float *b, int n) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum8(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* e^x for 8 floats: x = n ln 2 + r, |r| <= ln 2 / 2, a degree-6 polynomial for e^r (Cephes' expf, within 2 ulp),
 * 2^n through the exponent bits; x clamped to [-87.3, 88.3] so that 2^n stays a normal float */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    static const float c[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                              1.6666665459e-1f, 5.0000001201e-1f};
    __m256 y = _mm256_set1_ps(c[0]);
    for (int i = 1; i < 6; i++) y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c[i]));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* a[i] = silu(g[i]) * u[i] = g[i] / (1 + e^-g[i]) * u[i] */
static void swiglu(const float *g, const float *u, int n, float *a) {
    int i = 0;
    const __m256 one = _mm256_set1_ps(1.f), neg = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= n; i += 8) {
        __m256 gv = _mm256_loadu_ps(g + i);
        __m256 e = exp8(_mm256_xor_ps(gv, neg));
        _mm256_storeu_ps(a + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++) a[i] = g[i] / (1.f + expf(-g[i])) * u[i];
}

/* x (k floats) -> q (k int8), d (k / 32 scales), dsum (k / 32: scale x sum of the block's integers) */
static void quantize_row(const float *x, int k, int8_t *q, float *d, float *dsum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int b = 0; b < k / 32; b++) {
        const float *p = x + 32 * b;
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(p + 8 * j);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
        }
        __m128 t = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        t = _mm_max_ps(t, _mm_movehl_ps(t, t));
        t = _mm_max_ss(t, _mm_movehdup_ps(t));
        float a = _mm_cvtss_f32(t), id = a > 0.f ? 127.f / a : 0.f;
        __m256 vid = _mm256_set1_ps(id);
        __m256i i32[4];
        for (int j = 0; j < 4; j++)
            i32[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        __m256i s = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        s4 = _mm_hadd_epi32(s4, s4);
        s4 = _mm_hadd_epi32(s4, s4);
        __m256i b8 = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
        b8 = _mm256_permutevar8x32_epi32(b8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + 32 * b), b8);
        d[b] = a / 127.f;
        dsum[b] = d[b] * (float)_mm_cvtsi128_si32(s4);
    }
}

/* ---------------------------------------------------------------- linear layers */

enum { KIND_F32 = 0, KIND_Q4 = 4, KIND_Q8 = 8 };

typedef struct {
    int32_t kind, n, k, tiles;
    const void *w;
    const float *s, *sz, *bias;
    const uint8_t *plan; /* PLAN_ROWS groupings (PLAN_*) by row count, measured on this machine (prunus.native.plan);
                          * NULL: the fixed rules of grouping() */
} Linear;

typedef struct {
    const Linear *L;
    int m;
    const float *x;    /* (m, k) floats: f32 layers */
    const int8_t *xq;  /* (m, k) quantized: q8 / q4 layers */
    const float *xd, *xds; /* (m, k / 32) */
    float *y;
    int ldy;
    int plan; /* how this pass groups its rows (PLAN_* bits, grouping()) */
} GemmTask;

#define PLAN_ROWS 17 /* a Linear's plan has one entry per row count 0..16, the last for 16 rows or more */
enum { PLAN_WIDE = 1, PLAN_PAIRS = 2, PLAN_PREFETCH = 4, PLAN_THREE = 8 }; /* the wide (three / four-row) kernels
                            * first; then int8 / int4 three rows at a time (THREE); then pairs (else single rows);
                            * pairs prefetch the next tile */

static void store4(const GemmTask *g, int m, int t, __m128 r) {
    const Linear *L = g->L;
    float out[4];
    _mm_storeu_ps(out, r);
    float *y = g->y + (size_t)m * g->ldy;
    for (int i = 0; i < 4 && 4 * t + i < L->n; i++) y[4 * t + i] = out[i] + (L->bias ? L->bias[4 * t + i] : 0.f);
}

/* A pass of several rows goes over each tile once per pair of rows. The first pass streams the tile from memory
 * and the others find it in cache, so each pass prefetches its share of the next tile, spread over its iterations
 * (every pass then reads memory at the same pace). NULL unless the pass's grouping prefetches (PLAN_PREFETCH). */
#define NEXT_SHARE_ROWS 6 /* the fixed rules: passes of fewer rows prefetch nothing */

static inline const char *next_share(const GemmTask *g, int t, int m, size_t tile_bytes, size_t *step, int iters) {
    const int passes = g->m / 2;
    if (!(g->plan & PLAN_PREFETCH) || passes < 1 || t + 1 >= g->L->tiles) return NULL;
    *step = tile_bytes / iters / passes;
    return (const char *)g->L->w + (t + 1) * tile_bytes + tile_bytes * (m / 2) / passes;
}

/* one row m of x against tile t */
static void tile_f32_row(const GemmTask *g, int t, int m) {
    const Linear *L = g->L;
    const int kk = L->k / 8;
    const float *w = (const float *)L->w + (size_t)t * kk * 32;
    {
        const float *x = g->x + (size_t)m * L->k;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int j = 0; j < kk; j++) {
            __m256 xv = _mm256_loadu_ps(x + 8 * j);
            const float *wj = w + 32 * j;
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(wj), xv, a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(wj + 8), xv, a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(wj + 16), xv, a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(wj + 24), xv, a3);
        }
        store4(g, m, t, hsum4x8(a0, a1, a2, a3));
    }
}

/* rows m and m + 1 of x against tile t: each weight vector loaded once for both */
static void tile_f32_pair(const GemmTask *g, int t, int m) {
    const Linear *L = g->L;
    const int kk = L->k / 8;
    const float *w = (const float *)L->w + (size_t)t * kk * 32;
    {
        const int m1 = m + 1;
        const float *x0 = g->x + (size_t)m * L->k, *x1 = g->x + (size_t)m1 * L->k;
        __m256 a[2][4];
        for (int i = 0; i < 4; i++) a[0][i] = a[1][i] = _mm256_setzero_ps();
        size_t step = 0;
        const char *next = next_share(g, t, m, (size_t)kk * 128, &step, kk);
        for (int j = 0; j < kk; j++) {
            __m256 v0 = _mm256_loadu_ps(x0 + 8 * j), v1 = _mm256_loadu_ps(x1 + 8 * j);
            const float *wj = w + 32 * j;
            if (next) _mm_prefetch(next + step * j, _MM_HINT_T0);
            for (int i = 0; i < 4; i++) {
                __m256 wv = _mm256_loadu_ps(wj + 8 * i);
                a[0][i] = _mm256_fmadd_ps(wv, v0, a[0][i]);
                a[1][i] = _mm256_fmadd_ps(wv, v1, a[1][i]);
            }
        }
        store4(g, m, t, hsum4x8(a[0][0], a[0][1], a[0][2], a[0][3]));
        store4(g, m1, t, hsum4x8(a[1][0], a[1][1], a[1][2], a[1][3]));
    }
}

/* rows m, m + 1 and m + 2 against tile t (prompts): twelve accumulators, so that the FMAs' latency hides behind
 * twelve independent chains where a pair has eight, each weight vector taken from L1 by the FMA itself (twelve
 * accumulators and four weight registers would leave none for the row's eight inputs). Every output's sum runs
 * in the same order as in tile_f32_row and tile_f32_pair, so the results are the same bits. */
static void tile_f32_triple(const GemmTask *g, int t, int m) {
    const Linear *L = g->L;
    const int kk = L->k / 8;
    const float *w = (const float *)L->w + (size_t)t * kk * 32;
    const float *x0 = g->x + (size_t)m * L->k, *x1 = x0 + L->k, *x2 = x1 + L->k;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    __m256 c0 = a0, c1 = a0, c2 = a0, c3 = a0;
    for (int j = 0; j < kk; j++) {
        const float *wj = w + 32 * j;
        const __m256 v0 = _mm256_loadu_ps(x0 + 8 * j);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(wj), v0, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(wj + 8), v0, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(wj + 16), v0, a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(wj + 24), v0, a3);
        const __m256 v1 = _mm256_loadu_ps(x1 + 8 * j);
        b0 = _mm256_fmadd_ps(_mm256_loadu_ps(wj), v1, b0);
        b1 = _mm256_fmadd_ps(_mm256_loadu_ps(wj + 8), v1, b1);
        b2 = _mm256_fmadd_ps(_mm256_loadu_ps(wj + 16), v1, b2);
        b3 = _mm256_fmadd_ps(_mm256_loadu_ps(wj + 24), v1, b3);
        const __m256 v2 = _mm256_loadu_ps(x2 + 8 * j);
        c0 = _mm256_fmadd_ps(_mm256_loadu_ps(wj), v2, c0);
        c1 = _mm256_fmadd_ps(_mm256_loadu_ps(wj + 8), v2, c1);
        c2 = _mm256_fmadd_ps(_mm256_loadu_ps(wj + 16), v2, c2);
        c3 = _mm256_fmadd_ps(_mm256_loadu_ps(wj + 24), v2, c3);
    }
    store4(g, m, t, hsum4x8(a0, a1, a2, a3));
    store4(g, m + 1, t, hsum4x8(b0, b1, b2, b3));
    store4(g, m + 2, t, hsum4x8(c0, c1, c2, c3));
}

/* the 32 nibbles of a q4 weight block as 32 bytes 0..15, in element order */
static inline __m256i unpack_q4(const uint8_t *p) {
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m256i v = _mm256_set_m128i(_mm_srli_epi16(b, 4), b);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}

/* [sum of a's lanes 0-3, of a's 4-7, of b's 0-3, of b's 4-7]: four outputs held two to an accumulator */
static inline __m128 sum_halves(__m256 a, __m256 b) {
    const __m128 x = _mm_hadd_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 y = _mm_hadd_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
    return _mm_hadd_ps(x, y);
}

/* The integer kernels, one instance per ISA from the templates (their comments give the math). The library is
 * built for AVX2 + FMA; the other ISAs' functions carry target attributes and run only when prunus_set_isa
 * chose them on a CPU that has them. */
#define KERNEL(name) name##_avx2
#define KERNEL_TARGET
#define DOT_BUS(acc, u, s) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
/* u0 s0 + u1 s1 in four-product 32-bit sums, for small unsigned u (q4: the 16-bit sums cannot overflow) */
#define DOT_BUS2(u0, s0, u1, s1) \
    _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1)), _mm256_set1_epi16(1))
#include "tile_quant256.h"
#undef DOT_BUS2
#undef KERNEL
#undef KERNEL_TARGET
#undef DOT_BUS

#define KERNEL(name) name##_avxvnni
#define KERNEL_TARGET __attribute__((target("avxvnni")))
#define DOT_BUS(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#define DOT_BUS2(u0, s0, u1, s1) _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u0, s0), u1, s1)
#include "tile_quant256.h"
#undef DOT_BUS2
#undef KERNEL
#undef KERNEL_TARGET
#undef DOT_BUS

#include "tile_f32_512.h"

#define KERNEL(name) name##_avx512
#define KERNEL_TARGET __attribute__((target("avx512f,avx512bw,avx512vl")))
#define DOT_BUS(acc, u, s) _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)))
#include "tile_quant512.h"
#undef KERNEL
#undef KERNEL_TARGET
#undef DOT_BUS

#define KERNEL(name) name##_avx512vnni
#define KERNEL_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#define DOT_BUS(acc, u, s) _mm512_dpbusd_epi32(acc, u, s)
#include "tile_quant512.h"
#undef KERNEL
#undef KERNEL_TARGET
#undef DOT_BUS

#include "tile_amx.h"

/* ---------------------------------------------------------------- run-time dispatch */

typedef void (*tile_fn)(const GemmTask *g, int t, int m);

typedef struct {
    const char *name;
    tile_fn f32_row, f32_pair, quant_row, quant_pair;
    tile_fn f32_triple; /* three rows at once for the row blocks of prompts; NULL: pairs */
    tile_fn q8_quad, q4_quad; /* four rows at once for the row blocks of prompts; NULL: pairs */
    tile_fn quant_three; /* three int8 / int4 rows at once (PLAN_THREE); NULL: pairs */
    int amx; /* q8 passes of AMX_MIN_ROWS rows or more on AMX tiles (amx_task) */
    int invariant; /* 1: every kernel of the path sums a row in the same order, so a row's outputs are the same
                    * bits whatever rows share its pass (its row, pair and four-row kernels share their block math) */
} Kernels;

/* in order of preference: the first one the CPU has is the default */
static const Kernels KERNELS[] = {
    {"amx", f32_row_avx512, f32_pair_avx512, quant_row_avx512vnni, quant_pair_avx512vnni, NULL, NULL, NULL, NULL, 1,
     0},
    {"avx512vnni", f32_row_avx512, f32_pair_avx512, quant_row_avx512vnni, quant_pair_avx512vnni, NULL, NULL, NULL,
     NULL, 0, 0},
    {"avx512", f32_row_avx512, f32_pair_avx512, quant_row_avx512, quant_pair_avx512, NULL, NULL, NULL, NULL, 0, 0},
    {"avxvnni", tile_f32_row, tile_f32_pair, quant_row_avxvnni, quant_pair_avxvnni, tile_f32_triple, q8_quad_avxvnni,
     q4_quad_avxvnni, quant_three_avxvnni, 0, 1},
    {"avx2", tile_f32_row, tile_f32_pair, quant_row_avx2, quant_pair_avx2, tile_f32_triple, q8_quad_avx2,
     q4_quad_avx2, quant_three_avx2, 0, 1},
};
#define N_KERNELS ((int)(sizeof(KERNELS) / sizeof(KERNELS[0])))

static _Atomic(const Kernels *) kernels = &KERNELS[N_KERNELS - 1];

/* whether this CPU (and its OS: __builtin_cpu_supports checks that the AVX-512 state is enabled) runs kernels i */
static int kernels_run_here(int i) {
    __builtin_cpu_init();
    const char *n = KERNELS[i].name;
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const int avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("avx512vl");
    const int vnni512 = avx512 && __builtin_cpu_supports("avx512vnni");
    if (!strcmp(n, "amx"))
        return vnni512 && __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-int8") && amx_permitted();
    if (!strcmp(n, "avx512vnni")) return vnni512;
    if (!strcmp(n, "avx512")) return avx512;
    if (!strcmp(n, "avxvnni")) return avx2 && __builtin_cpu_supports("avxvnni");
    return avx2;
}

static int kernels_index(const char *name) {
    for (int i = 0; i < N_KERNELS; i++)
        if (!strcmp(KERNELS[i].name, name)) return i;
    return -1;
}

/* the i-th kernel path's name (NULL past the last), for the caller to list them */
const char *prunus_isa_name(int i) { return i >= 0 && i < N_KERNELS ? KERNELS[i].name : NULL; }

/* 1 when this CPU runs the named path, 0 when it lacks it, -1 for a name that is no path */
int prunus_isa_supported(const char *name) {
    const int i = kernels_index(name);
    return i < 0 ? -1 : kernels_run_here(i);
}

/* the path the linear layers run now */
const char *prunus_isa(void) { return atomic_load(&kernels)->name; }

/* 1 when the named path is batch invariant (a row's outputs the same bits at every row count), 0 when not, -1 for
 * a name that is no path */
int prunus_isa_invariant(const char *name) {
    const int i = kernels_index(name);
    return i < 0 ? -1 : KERNELS[i].invariant;
}

/* the default path: the first batch-invariant one this CPU runs, in order of preference (a request's answer must
 * not depend on its neighbours; the 512-bit and AMX paths are chosen only by name) */
const char *prunus_best_isa(void) {
    for (int i = 0; i < N_KERNELS; i++)
        if (KERNELS[i].invariant && kernels_run_here(i)) return KERNELS[i].name;
    return KERNELS[N_KERNELS - 1].name;
}

/* run the linear layers with the named path from now on: 0, -1 for a name that is no path, -2 when this CPU
 * lacks it (nothing changed) */
int prunus_set_isa(const char *name) {
    const int i = kernels_index(name);
    if (i < 0) return -1;
    if (!kernels_run_here(i)) return -2;
    atomic_store(&kernels, &KERNELS[i]);
    return 0;
}

#define ROW_BLOCK_BYTES (192 << 10) /* activation rows a pass keeps in L2 while its tiles go over them */

/* A pass of many rows (a prompt) goes over its tiles once per block of rows, an even count whose activations
 * fit in ROW_BLOCK_BYTES: every tile then finds its rows in L2 instead of streaming all of them from L3 or
 * memory (SmolLM2's 1536-input layer at 512 rows: 3 MB of fp32 rows). A tile is read once per block, from L2
 * or L3: a few KB against the block's thousands of products. */
#define TRIPLE_MIN_ROWS 16 /* fewer rows (decode steps) keep the pair kernels and their prefetch (int8 / int4: but
                            * for four or five rows); more: fp32 three rows at a time, int8 / int4 four */

static int row_block(const Linear *L) {
    const size_t row = (size_t)L->k * (L->kind == KIND_F32 ? 4 : 1);
    const size_t rows = ROW_BLOCK_BYTES / (row ? row : 1);
    return rows < 8 ? 8 : (int)(rows & ~(size_t)1);
}

/* The fixed rules, where a Linear has no plan (or the path is not batch invariant): decode steps of four or five
 * int8 / int4 rows take the four-row kernels (one pass over each tile instead of two); from NEXT_SHARE_ROWS rows up
 * to TRIPLE_MIN_ROWS the pairs, which then prefetch each next tile (next_share); the measurements behind them are in
 * docs/native.md ("Row groupings"). On a batch-invariant path every grouping gives a row the same bits, so a plan
 * measured on this machine may choose another one per row count. */
static int grouping(const Kernels *k, const Linear *L, int m) {
    if (L->plan && k->invariant) return L->plan[m < PLAN_ROWS ? m : PLAN_ROWS - 1];
    const int many = m >= TRIPLE_MIN_ROWS;
    const int wide = L->kind == KIND_F32 ? many : many || (m >= 4 && m < NEXT_SHARE_ROWS);
    return (wide ? PLAN_WIDE : 0) | PLAN_PAIRS | (m >= NEXT_SHARE_ROWS ? PLAN_PREFETCH : 0);
}

static void gemm_task(void *ctx, int ith, int nth) {
    const GemmTask *g = (const GemmTask *)ctx;
    const Kernels *k = atomic_load(&kernels);
    if (k->amx && g->L->kind == KIND_Q8 && g->m >= AMX_MIN_ROWS) {
        amx_task(g, ith, nth);
        return;
    }
    int t0, t1;
    split(g->L->tiles, ith, nth, &t0, &t1);
    const int f32 = g->L->kind == KIND_F32;
    const tile_fn pair = g->plan & PLAN_PAIRS ? (f32 ? k->f32_pair : k->quant_pair) : NULL;
    const tile_fn one = f32 ? k->f32_row : k->quant_row;
    const tile_fn wide = !(g->plan & PLAN_WIDE) ? NULL : f32 ? k->f32_triple
                         : g->L->kind == KIND_Q8 ? k->q8_quad : k->q4_quad;
    const tile_fn three = g->plan & PLAN_THREE && !f32 ? k->quant_three : NULL;
    const int width = f32 ? 3 : 4; /* rows wide takes at once */
    const int rb = row_block(g->L);
    for (int r0 = 0; r0 < g->m; r0 += rb) {
        const int r1 = r0 + rb < g->m ? r0 + rb : g->m;
        for (int t = t0; t < t1; t++) {
            int m = r0;
            if (wide)
                for (; m + width <= r1; m += width) wide(g, t, m);
            if (three)
                for (; m + 3 <= r1; m += 3) three(g, t, m);
            if (pair)
                for (; m + 2 <= r1; m += 2) pair(g, t, m);
            for (; m < r1; m++) one(g, t, m);
        }
    }
}

/* y (m, ldy) = x @ W^T (+ bias); xq / xd / xds: x quantized by quantize_row (unused for f32 layers) */
static void linear(Pool *p, const Linear *L, int m, const float *x, const int8_t *xq, const float *xd,
                   const float *xds, float *y, int ldy) {
    GemmTask g = {L, m, x, xq, xd, xds, y, ldy, grouping(atomic_load(&kernels), L, m)};
    pool_run(p, gemm_task, &g);
}

/* ---------------------------------------------------------------- the model */

typedef struct {
    Linear q, k, v, o, gate, up, down; /* packed q/k/v: q holds all three (k.n == 0); packed gate/up: gate holds both */
    const float *attn_norm, *ffn_norm;
    int32_t window; /* keys a query sees, its own included (0: all) */
} Layer;

typedef struct {
    int32_t n_layers, dim, n_heads, n_kv_heads, head_dim, hidden, vocab, max_len, n_slots, rope_len;
    float eps, scale;
    const float *emb, *cos, *sin, *norm;
    const Layer *layers;
    Linear head;
    void **kc, **vc; /* per layer (n_slots, kv_heads, max_len, head_dim): floats, or halves when kv_f16 */
    int32_t kv_f16;
} Model;

#define ATTN_CHUNK 256 /* positions one attention item covers at most: a longer context is split into chunks, so
                          * that both threads share even one row's few KV heads, and the chunks are merged after */

typedef struct {
    const Model *m;
    int T, layer, chunks;
    const int32_t *slot, *pos; /* per token */
    const float *qkv;
    float *out;    /* chunks == 1: (T, H * hd) */
    float *part;   /* chunks > 1: (T, H, chunks, 2 + hd): a chunk's max score, sum of exponentials, unscaled output */
    float *scores; /* per thread ATTN_GROUP x ATTN_CHUNK floats */
    atomic_int next; /* the next item a thread takes */
} AttnTask;

static void rmsnorm(const float *x, const float *w, int n, float eps, float *y) {
    float ss = dot(x, x, n) / n;
    float r = 1.f / sqrtf(ss + eps);
    for (int i = 0; i < n; i++) y[i] = x[i] * r * w[i];
}

static void rope(float *x, const float *cos, const float *sin, int half) {
    for (int i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i] + a * sin[i];
    }
}

/* ---------------------------------------------------------------- the KV cache: floats, or halves (F16C) */

/* element at of a KV buffer, f16: halves, else floats */
static inline const void *kv_at(const void *buf, size_t at, int f16) { return (const char *)buf + at * (f16 ? 2 : 4); }

/* q . k for one key of hd elements; halves are widened to floats 8 at a time (vcvtph2ps, exact) */
static inline float dot_kv(const float *q, const void *k, int hd, int f16) {
    if (!f16) return dot(q, (const float *)k, hd);
    const uint16_t *h = (const uint16_t *)k;
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= hd; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))), acc);
    float sum = hsum8(acc);
    for (; i < hd; i++) sum += q[i] * _cvtsh_ss(h[i]);
    return sum;
}

/* o += w v for one value of hd elements */
static inline void axpy_kv(float *o, float w, const void *v, int hd, int f16) {
    if (!f16) {
        const float *f = (const float *)v;
        for (int e = 0; e < hd; e++) o[e] += w * f[e];
        return;
    }
    const uint16_t *h = (const uint16_t *)v;
    const __m256 wv = _mm256_set1_ps(w);
    int e = 0;
    for (; e + 8 <= hd; e += 8) {
        const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + e)));
        _mm256_storeu_ps(o + e, _mm256_fmadd_ps(wv, x, _mm256_loadu_ps(o + e)));
    }
    for (; e < hd; e++) o[e] += w * _cvtsh_ss(h[e]);
}

/* one key or value of hd floats stored at element at: copied, or rounded to the nearest half (vcvtps2ph) */
static inline void store_kv(void *buf, size_t at, const float *x, int hd, int f16) {
    if (!f16) {
        memcpy((float *)buf + at, x, hd * sizeof(float));
        return;
    }
    uint16_t *h = (uint16_t *)buf + at;
    int e = 0;
    for (; e + 8 <= hd; e += 8)
        _mm_storeu_si128((__m128i *)(h + e), _mm256_cvtps_ph(_mm256_loadu_ps(x + e), _MM_FROUND_TO_NEAREST_INT));
    for (; e < hd; e++) h[e] = _cvtss_sh(x[e], _MM_FROUND_TO_NEAREST_INT);
}

/* eight floats of a key or value at element e: loaded, or widened from halves (exact) */
static inline __m256 kv8(const void *p, int e, int f16) {
    return f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + e)))
               : _mm256_loadu_ps((const float *)p + e);
}

/* the eight sums of a[0..7] as one vector */
static inline __m256 hsum8x8(const __m256 *a) {
    const __m256 g0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 g1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(g0, g1, 0x20), _mm256_permute2f128_ps(g0, g1, 0x31));
}

/* sc[j] = q . K[j0 + j] x scale for j < n (hd a multiple of 8): eight keys at a time, eight accumulators, one
 * transposing sum for the eight; returns the largest */
static float scores(const float *q, const void *K, int f16, int j0, int n, int hd, float scale, float *sc) {
    __m256 top = _mm256_set1_ps(-INFINITY);
    const __m256 vs = _mm256_set1_ps(scale);
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 a[8];
        const void *k[8];
        for (int u = 0; u < 8; u++) {
            a[u] = _mm256_setzero_ps();
            k[u] = kv_at(K, (size_t)(j0 + j + u) * hd, f16);
        }
        for (int e = 0; e < hd; e += 8) {
            const __m256 qv = _mm256_loadu_ps(q + e);
            for (int u = 0; u < 8; u++) a[u] = _mm256_fmadd_ps(qv, kv8(k[u], e, f16), a[u]);
        }
        const __m256 s = _mm256_mul_ps(hsum8x8(a), vs);
        _mm256_storeu_ps(sc + j, s);
        top = _mm256_max_ps(top, s);
    }
    float mx = -INFINITY;
    float t[8];
    _mm256_storeu_ps(t, top);
    for (int u = 0; u < 8; u++) mx = t[u] > mx ? t[u] : mx;
    for (; j < n; j++) {
        sc[j] = dot_kv(q, kv_at(K, (size_t)(j0 + j) * hd, f16), hd, f16) * scale;
        if (sc[j] > mx) mx = sc[j];
    }
    return mx;
}

/* o (hd, a multiple of 8) = sum over j < n of w[j] V[j0 + j]: 32 outputs at a time held in registers */
static void weighted_values(const float *w, const void *V, int f16, int j0, int n, int hd, float *o) {
    int e = 0;
    for (; e + 32 <= hd; e += 32) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int j = 0; j < n; j++) {
            const void *v = kv_at(V, (size_t)(j0 + j) * hd, f16);
            const __m256 wj = _mm256_broadcast_ss(w + j);
            a0 = _mm256_fmadd_ps(wj, kv8(v, e, f16), a0);
            a1 = _mm256_fmadd_ps(wj, kv8(v, e + 8, f16), a1);
            a2 = _mm256_fmadd_ps(wj, kv8(v, e + 16, f16), a2);
            a3 = _mm256_fmadd_ps(wj, kv8(v, e + 24, f16), a3);
        }
        _mm256_storeu_ps(o + e, a0);
        _mm256_storeu_ps(o + e + 8, a1);
        _mm256_storeu_ps(o + e + 16, a2);
        _mm256_storeu_ps(o + e + 24, a3);
    }
    for (; e < hd; e += 8) {
        __m256 a = _mm256_setzero_ps();
        for (int j = 0; j < n; j++)
            a = _mm256_fmadd_ps(_mm256_broadcast_ss(w + j), kv8(kv_at(V, (size_t)(j0 + j) * hd, f16), e, f16), a);
        _mm256_storeu_ps(o + e, a);
    }
}

#define ATTN_GROUP 3 /* query heads of one KV head that attend_group takes together */

/* sc[h][j] = q[h] . K[j0 + j] x scale for the G (2 or 3) query heads of one KV head, j < n, hd a multiple of 8:
 * four keys at a time, each key's vectors loaded once for the G heads (one head at a time read each key from L2
 * per head); top[h] = the largest score of head h */
static inline __attribute__((always_inline)) void scores_group(const float *const *q, const int G, const void *K,
                                                               int f16, int j0, int n, int hd, float scale,
                                                               float *sc, float *top) {
    const __m128 vs = _mm_set1_ps(scale);
    __m128 mx[ATTN_GROUP];
    for (int h = 0; h < G; h++) mx[h] = _mm_set1_ps(-INFINITY);
    int j = 0;
    for (; j + 4 <= (n & ~7); j += 4) { /* the keys scores() takes eight at a time; the rest as it does, by dot_kv */
        __m256 a[ATTN_GROUP][4];
        #pragma GCC unroll 3
        for (int h = 0; h < G; h++) a[h][0] = a[h][1] = a[h][2] = a[h][3] = _mm256_setzero_ps();
        const void *k = kv_at(K, (size_t)(j0 + j) * hd, f16);
        for (int e = 0; e < hd; e += 8) {
            #pragma GCC unroll 4
            for (int u = 0; u < 4; u++) {
                const __m256 kv = kv8(k, u * hd + e, f16);
                #pragma GCC unroll 3
                for (int h = 0; h < G; h++) a[h][u] = _mm256_fmadd_ps(kv, _mm256_loadu_ps(q[h] + e), a[h][u]);
            }
        }
        #pragma GCC unroll 3
        for (int h = 0; h < G; h++) {
            const __m128 s4 = _mm_mul_ps(hsum4x8(a[h][0], a[h][1], a[h][2], a[h][3]), vs);
            _mm_storeu_ps(sc + h * ATTN_CHUNK + j, s4);
            mx[h] = _mm_max_ps(mx[h], s4);
        }
    }
    for (int h = 0; h < G; h++) {
        float t[4];
        _mm_storeu_ps(t, mx[h]);
        top[h] = fmaxf(fmaxf(t[0], t[1]), fmaxf(t[2], t[3]));
        for (int i = j; i < n; i++) {
            const float v = dot_kv(q[h], kv_at(K, (size_t)(j0 + i) * hd, f16), hd, f16) * scale;
            sc[h * ATTN_CHUNK + i] = v;
            top[h] = v > top[h] ? v : top[h];
        }
    }
}

/* o[h] (hd, a multiple of 16) = sum over j < n of w[h][j] V[j0 + j] for G (2 or 3) heads: 16 outputs of every
 * head at a time, each value's vectors loaded once for the G heads */
static inline __attribute__((always_inline)) void values_group(const float *w, const int G, const void *V, int f16,
                                                               int j0, int n, int hd, float *const *o) {
    for (int e = 0; e < hd; e += 16) {
        __m256 a[ATTN_GROUP][2];
        #pragma GCC unroll 3
        for (int h = 0; h < G; h++) a[h][0] = a[h][1] = _mm256_setzero_ps();
        for (int j = 0; j < n; j++) {
            const void *v = kv_at(V, (size_t)(j0 + j) * hd, f16);
            const __m256 v0 = kv8(v, e, f16), v1 = kv8(v, e + 8, f16);
            #pragma GCC unroll 3
            for (int h = 0; h < G; h++) {
                const __m256 wj = _mm256_broadcast_ss(w + h * ATTN_CHUNK + j);
                a[h][0] = _mm256_fmadd_ps(wj, v0, a[h][0]);
                a[h][1] = _mm256_fmadd_ps(wj, v1, a[h][1]);
            }
        }
        #pragma GCC unroll 3
        for (int h = 0; h < G; h++) {
            _mm256_storeu_ps(o[h] + e, a[h][0]);
            _mm256_storeu_ps(o[h] + e + 8, a[h][1]);
        }
    }
}

/* sc (n) = e^(sc - top), returns their sum */
static float exp_shift(float *sc, int n, float top) {
    __m256 vm = _mm256_set1_ps(top), vs = _mm256_setzero_ps();
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), vm));
        _mm256_storeu_ps(sc + j, e);
        vs = _mm256_add_ps(vs, e);
    }
    float sum = hsum8(vs);
    for (; j < n; j++) { sc[j] = expf(sc[j] - top); sum += sc[j]; }
    return sum;
}

/* attend for G (2 or 3) query heads of one KV head at once (hd a multiple of 16): sum[h], mx[h] and o[h] as
 * attend's, sc holding ATTN_CHUNK scores per head */
static void attend_group(const float *const *q, int G, const void *K, const void *V, int f16, int j0, int j1, int hd,
                         float scale, float *sc, float *const *o, float *mx, float *sum) {
    const int n = j1 - j0;
    if (n <= 0) {
        for (int h = 0; h < G; h++) { mx[h] = -INFINITY; sum[h] = 0.f; memset(o[h], 0, hd * sizeof(float)); }
        return;
    }
    if (G == 3) scores_group(q, 3, K, f16, j0, n, hd, scale, sc, mx);
    else scores_group(q, 2, K, f16, j0, n, hd, scale, sc, mx);
    for (int h = 0; h < G; h++) sum[h] = exp_shift(sc + h * ATTN_CHUNK, n, mx[h]);
    if (G == 3) values_group(sc, 3, V, f16, j0, n, hd, o);
    else values_group(sc, 2, V, f16, j0, n, hd, o);
}

/* One query head over keys j0..j1-1 of K / V (the slot's KV head, floats or halves): o (hd) = sum of
 * e^(score - mx) v_j; returns the sum of e^(score - mx) and sets *mx (-inf and 0 for an empty range) */
static float attend(const float *q, const void *K, const void *V, int f16, int j0, int j1, int hd, float scale,
                    float *sc, float *o, float *mx) {
    float top = -INFINITY;
    const int n = j1 - j0, blocked = hd % 8 == 0;
    if (blocked) {
        top = n > 0 ? scores(q, K, f16, j0, n, hd, scale, sc) : -INFINITY;
    } else {
        for (int j = 0; j < n; j++) {
            sc[j] = dot_kv(q, kv_at(K, (size_t)(j0 + j) * hd, f16), hd, f16) * scale;
            if (sc[j] > top) top = sc[j];
        }
    }
    const float sum = exp_shift(sc, n, top);
    if (blocked) {
        weighted_values(sc, V, f16, j0, n, hd, o);
    } else {
        memset(o, 0, hd * sizeof(float));
        for (int j = 0; j < n; j++) axpy_kv(o, sc[j], kv_at(V, (size_t)(j0 + j) * hd, f16), hd, f16);
    }
    *mx = top;
    return sum;
}

/* query heads h .. h + n - 1 (at most ATTN_GROUP taken) of token t over chunk c (keys j0..j1-1 of K / V): the
 * row's output (one chunk) or the chunk's partial results. A prompt's pass takes a KV head's query heads together
 * (attend_group: each key read once for them; the same sums in the same order, so the same bits as attend). */
static void attend_heads(const AttnTask *a, int t, int c, int h, int n, const void *K, const void *V, int j0, int j1,
                         float *sc) {
    const Model *m = a->m;
    const int H = m->n_heads, hd = m->head_dim, width = (H + 2 * m->n_kv_heads) * hd, C = a->chunks;
    const int G = n < ATTN_GROUP ? n : ATTN_GROUP;
    const float *q[ATTN_GROUP];
    float *o[ATTN_GROUP], mx[ATTN_GROUP], sum[ATTN_GROUP];
    for (int i = 0; i < G; i++) {
        q[i] = a->qkv + (size_t)t * width + (h + i) * hd;
        o[i] = C == 1 ? a->out + ((size_t)t * H + h + i) * hd : a->part + (((size_t)t * H + h + i) * C + c) * (2 + hd) + 2;
    }
    if (G == 1)
        sum[0] = attend(q[0], K, V, m->kv_f16, j0, j1 > j0 ? j1 : j0, hd, m->scale, sc, o[0], mx);
    else
        attend_group(q, G, K, V, m->kv_f16, j0, j1, hd, m->scale, sc, o, mx, sum);
    for (int i = 0; i < G; i++) {
        if (C == 1) { /* divided as merge_chunks divides: a row gives the same bits whether or not a longer row in its
                       * pass splits the pass's attention into chunks (its own one chunk then merged alone) */
            for (int e = 0; e < hd; e++) o[i][e] /= sum[i];
        } else {
            o[i][-1] = sum[i];
            o[i][-2] = mx[i];
        }
    }
}

/* Items are (token, KV head, chunk of positions): the KV head's query heads one after another, so its keys and
 * values are read from memory once and from cache for the others */
static void attn_task(void *ctx, int ith, int nth) {
    const AttnTask *a = (const AttnTask *)ctx;
    const Model *m = a->m;
    const int G = m->n_kv_heads, hd = m->head_dim, per = m->n_heads / G, C = a->chunks;
    const int window = m->layers[a->layer].window;
    float *sc = a->scores + (size_t)ith * ATTN_GROUP * ATTN_CHUNK;
    const int items = a->T * G * C;
    (void)nth;
    /* Items are taken one at a time from a shared counter: a prompt's late tokens see more keys than its early ones
     * (equal ranges gave the thread with the prompt's second half three times the first's work at 512 tokens).
     * Each item writes its own outputs, so the results do not depend on who takes it. */
    for (int it = atomic_fetch_add_explicit((atomic_int *)&a->next, 1, memory_order_relaxed); it < items;
         it = atomic_fetch_add_explicit((atomic_int *)&a->next, 1, memory_order_relaxed)) {
        const int t = it / (G * C), g = it / C % G, c = it % C, pos = a->pos[t];
        const size_t base = ((size_t)a->slot[t] * G + g) * m->max_len * hd;
        const int f16 = m->kv_f16;
        const void *K = kv_at(m->kc[a->layer], base, f16), *V = kv_at(m->vc[a->layer], base, f16);
        const int first = window > 0 && pos + 1 > window ? pos + 1 - window : 0;
        const int j0 = first > c * ATTN_CHUNK ? first : c * ATTN_CHUNK;
        const int j1 = pos + 1 < (c + 1) * ATTN_CHUNK ? pos + 1 : (c + 1) * ATTN_CHUNK;
        const int grouped = a->T >= TRIPLE_MIN_ROWS && hd % 16 == 0;
        for (int h = g * per; h < (g + 1) * per; h += grouped ? ATTN_GROUP : 1)
            attend_heads(a, t, c, h, grouped ? (g + 1) * per - h : 1, K, V, j0, j1, sc);
    }
}

/* row t's attention output from its chunks' partial results */
static void merge_chunks(const float *part, int H, int C, int hd, float *out) {
    for (int h = 0; h < H; h++) {
        const float *p = part + (size_t)h * C * (2 + hd);
        float top = -INFINITY, sum = 0.f;
        for (int c = 0; c < C; c++)
            if (p[c * (2 + hd)] > top) top = p[c * (2 + hd)];
        float *o = out + (size_t)h * hd;
        memset(o, 0, hd * sizeof(float));
        for (int c = 0; c < C; c++) {
            const float *pc = p + (size_t)c * (2 + hd);
            if (pc[0] == -INFINITY) continue;
            const float w = expf(pc[0] - top);
            sum += w * pc[1];
            for (int e = 0; e < hd; e++) o[e] += w * pc[2 + e];
        }
        for (int e = 0; e < hd; e++) o[e] /= sum;
    }
}

typedef struct {
    float *h, *x, *qkv, *att, *ff, *act, *xd, *xds, *scores, *last, *part;
    int8_t *xq;
    int chunks; /* attention chunks (ATTN_CHUNK positions each) of the pass's longest row */
} Scratch;

static void *zalloc(size_t n) { return calloc(n ? n : 1, 1); }

/* The pass's buffers, carved from the pool's arena: kept from pass to pass (a fresh allocation per pass cost page
 * faults on every decode step) and grown when a pass needs more. Returns 0 when it cannot be allocated. */
static int scratch_new(Pool *p, const Model *m, int T, int chunks, Scratch *s) {
    const size_t width = (size_t)(m->n_heads + 2 * m->n_kv_heads) * m->head_dim, att = (size_t)m->n_heads * m->head_dim;
    size_t kmax = m->hidden > m->dim ? m->hidden : m->dim;
    if (att > kmax) kmax = att;
    const size_t dim = m->dim, F = m->hidden, kb = kmax / 32 + 1;
    const size_t sizes[] = {T * dim * 4, T * dim * 4, T * width * 4, T * att * 4, T * 2 * F * 4, T * F * 4, T * kmax,
                            T * kb * 4, T * kb * 4, (size_t)p->n * ATTN_GROUP * ATTN_CHUNK * 4, T * dim * 4,
                            chunks > 1 ? T * att * chunks * 4 + T * m->n_heads * chunks * 8 : 0};
    void **slots[] = {(void **)&s->h, (void **)&s->x, (void **)&s->qkv, (void **)&s->att, (void **)&s->ff,
                      (void **)&s->act, (void **)&s->xq, (void **)&s->xd, (void **)&s->xds, (void **)&s->scores,
                      (void **)&s->last, (void **)&s->part};
    const int n = sizeof(sizes) / sizeof(sizes[0]);
    size_t total = 0;
    for (int i = 0; i < n; i++) total += (sizes[i] + 63) & ~(size_t)63;
    if (total > p->arena_size) {
        free(p->arena);
        p->arena = aligned_alloc(64, total);
        p->arena_size = p->arena ? total : 0;
        if (!p->arena) return 0;
    }
    char *at = p->arena;
    s->chunks = chunks;
    for (int i = 0; i < n; i++) {
        *slots[i] = at;
        at += (sizes[i] + 63) & ~(size_t)63;
    }
    return 1;
}

/* ---------------------------------------------------------------- per-row work between the linear layers */

enum { ROW_NONE, ROW_NORM, ROW_ADD_NORM, ROW_SWIGLU, ROW_ROPE, ROW_MERGE };

/* One row's work: op, then (qx != NULL) the row of qx, qk wide, quantized into the scratch for integer layers */
typedef struct {
    const Model *m;
    const Scratch *s;
    int op, li;
    const float *w;                /* ROW_NORM (x = norm(h) * w), ROW_ADD_NORM (h += x first) */
    const int32_t *slot, *pos;     /* ROW_ROPE: rotate the row's q and k, store its k and v in layer li's buffers */
                                   /* ROW_MERGE: the row's attention output from its chunks (Scratch.part) */
    const float *qx;
    int qk;
} RowJob;

static void rope_row(const RowJob *r, int t) {
    const Model *m = r->m;
    const int H = m->n_heads, G = m->n_kv_heads, hd = m->head_dim, half = hd / 2, width = (H + 2 * G) * hd;
    float *row = r->s->qkv + (size_t)t * width;
    const float *c = m->cos + (size_t)r->pos[t] * half, *sn = m->sin + (size_t)r->pos[t] * half;
    for (int h = 0; h < H + G; h++) rope(row + h * hd, c, sn, half);
    for (int g = 0; g < G; g++) {
        size_t at = (((size_t)r->slot[t] * G + g) * m->max_len + r->pos[t]) * hd;
        store_kv(m->kc[r->li], at, row + (H + g) * hd, hd, m->kv_f16);
        store_kv(m->vc[r->li], at, row + (H + G + g) * hd, hd, m->kv_f16);
    }
}

static void row_job(const RowJob *r, int t) {
    const Model *m = r->m;
    const Scratch *s = r->s;
    float *h = s->h + (size_t)t * m->dim, *x = s->x + (size_t)t * m->dim;
    if (r->op == ROW_ADD_NORM)
        for (int i = 0; i < m->dim; i++) h[i] += x[i];
    if (r->op == ROW_NORM || r->op == ROW_ADD_NORM) rmsnorm(h, r->w, m->dim, m->eps, x);
    if (r->op == ROW_SWIGLU) {
        const float *g = s->ff + (size_t)t * 2 * m->hidden;
        swiglu(g, g + m->hidden, m->hidden, s->act + (size_t)t * m->hidden);
    }
    if (r->op == ROW_ROPE) rope_row(r, t);
    if (r->op == ROW_MERGE) {
        const size_t H = m->n_heads, hd = m->head_dim;
        merge_chunks(s->part + t * H * s->chunks * (2 + hd), H, s->chunks, hd, s->att + t * H * hd);
    }
    if (r->qx) {
        const int k = r->qk;
        quantize_row(r->qx + (size_t)t * k, k, s->xq + (size_t)t * k, s->xd + (size_t)t * (k / 32), s->xds + (size_t)t * (k / 32));
    }
}

typedef struct { const RowJob *job; int T; } RowsTask;

static void rows_task(void *ctx, int ith, int nth) {
    const RowsTask *r = (const RowsTask *)ctx;
    int t0, t1;
    split(r->T, ith, nth, &t0, &t1);
    for (int t = t0; t < t1; t++) row_job(r->job, t);
}

/* the job over rows 0..T-1, shared across the pool when there are two rows or more */
static void rows(Pool *p, const RowJob *job, int T) {
    if (job->op == ROW_NONE && !job->qx) return;
    if (T < 2) {
        for (int t = 0; t < T; t++) row_job(job, t);
        return;
    }
    RowsTask r = {job, T};
    pool_run(p, rows_task, &r);
}

static void run_linear(Pool *p, const Scratch *s, const Linear *L, int T, const float *x, float *y, int ldy) {
    if (L->n == 0) return;
    linear(p, L, T, x, s->xq, s->xd, s->xds, y, ldy);
}

static int quantized(const Linear *L) { return L->n > 0 && L->kind != KIND_F32; }

/* x (T, k) quantized for the layers that read it when any of them is an integer one */
static const float *quant_for(int needed, const float *x) { return needed ? x : NULL; }

static void attention_block(const Model *m, Pool *p, const Scratch *s, int li, int T, const int32_t *slot,
                            const int32_t *pos) {
    const Layer *L = &m->layers[li];
    const int H = m->n_heads, G = m->n_kv_heads, hd = m->head_dim, width = (H + 2 * G) * hd;
    run_linear(p, s, &L->q, T, s->x, s->qkv, width);
    run_linear(p, s, &L->k, T, s->x, s->qkv + H * hd, width);
    run_linear(p, s, &L->v, T, s->x, s->qkv + (H + G) * hd, width);
    RowJob r = {m, s, ROW_ROPE, li, NULL, slot, pos, NULL, 0};
    rows(p, &r, T);
    AttnTask a = {m, T, li, s->chunks, slot, pos, s->qkv, s->att, s->part, s->scores, 0};
    pool_run(p, attn_task, &a);
    RowJob q = {m, s, s->chunks > 1 ? ROW_MERGE : ROW_NONE, li, NULL, NULL, NULL, quant_for(quantized(&L->o), s->att), H * hd};
    rows(p, &q, T);
    run_linear(p, s, &L->o, T, s->att, s->x, m->dim);
}

static void feed_forward_block(const Model *m, Pool *p, const Scratch *s, int li, int T) {
    const Layer *L = &m->layers[li];
    const int F = m->hidden;
    run_linear(p, s, &L->gate, T, s->x, s->ff, 2 * F);
    run_linear(p, s, &L->up, T, s->x, s->ff + F, 2 * F);
    RowJob r = {m, s, ROW_SWIGLU, li, NULL, NULL, NULL, quant_for(quantized(&L->down), s->act), F};
    rows(p, &r, T);
    run_linear(p, s, &L->down, T, s->act, s->x, m->dim);
}

/* x = norm(h (+= x)) * w, quantized for the next block's first layers when any of them is an integer one */
static void norm_rows(const Model *m, Pool *p, const Scratch *s, int T, int op, const float *w, int next_quantized) {
    RowJob r = {m, s, op, 0, w, NULL, NULL, quant_for(next_quantized, s->x), m->dim};
    rows(p, &r, T);
}

static int attn_quantized(const Layer *L) { return quantized(&L->q) || quantized(&L->k) || quantized(&L->v); }

static void layers(const Model *m, Pool *p, const Scratch *s, int T, const int32_t *slot, const int32_t *pos) {
    norm_rows(m, p, s, T, ROW_NORM, m->layers[0].attn_norm, attn_quantized(&m->layers[0]));
    for (int li = 0; li < m->n_layers; li++) {
        const Layer *L = &m->layers[li];
        attention_block(m, p, s, li, T, slot, pos);
        norm_rows(m, p, s, T, ROW_ADD_NORM, L->ffn_norm, quantized(&L->gate) || quantized(&L->up));
        feed_forward_block(m, p, s, li, T);
        const int last = li + 1 == m->n_layers;
        norm_rows(m, p, s, T, ROW_ADD_NORM, last ? m->norm : m->layers[li + 1].attn_norm,
                  !last && attn_quantized(&m->layers[li + 1]));
    }
}

/* A pass over b rows: row i's count[i] tokens ids[i * seq + j] at positions start[i] + j, in buffer slot
 * slots[i] (the rows' slots distinct, in any order). Writes each row's last-token logits to logits (b, vocab), or
 * with every_position the logits of every token, row after row (sum of count, vocab). hidden, when not NULL: every
 * token's final-norm output (the head's input), row after row (sum of count, dim), what an EAGLE draft reads.
 * Returns 0, -1 on a bad argument, -2 when its buffers cannot be allocated. */
static int forward_rows(const Model *m, Pool *p, int b, int seq, const int64_t *ids, const float *x,
                        const int32_t *start, const int32_t *count, const int32_t *slots, float *logits,
                        int every_position, float *hidden) {
    int T = 0;
    for (int i = 0; i < b; i++) {
        if (count[i] < 1 || count[i] > seq || start[i] < 0 || start[i] + count[i] > m->max_len ||
            start[i] + count[i] > m->rope_len || slots[i] < 0 || slots[i] >= m->n_slots) return -1;
        for (int j = 0; j < i; j++)
            if (slots[j] == slots[i]) return -1;
        T += count[i];
    }
    int ctx = 0;
    for (int i = 0; i < b; i++)
        if (start[i] + count[i] > ctx) ctx = start[i] + count[i];
    Scratch s;
    if (!scratch_new(p, m, T, (ctx + ATTN_CHUNK - 1) / ATTN_CHUNK, &s)) return -2;
    int32_t *slot = malloc(sizeof(int32_t) * T), *pos = malloc(sizeof(int32_t) * T), *last = malloc(sizeof(int32_t) * b);
    const int rows_out = every_position ? T : b;
    int t = 0, bad = 0;
    for (int i = 0; i < b; i++)
        for (int j = 0; j < count[i]; j++, t++) {
            const int64_t id = x ? 0 : ids[(size_t)i * seq + j];
            if (id < 0 || id >= m->vocab) bad = 1;
            slot[t] = slots[i]; pos[t] = start[i] + j;
            const float *in = x ? x + (size_t)t * m->dim : m->emb + (size_t)(bad ? 0 : id) * m->dim;
            memcpy(s.h + (size_t)t * m->dim, in, m->dim * sizeof(float));
            if (j == count[i] - 1) last[i] = t;
        }
    if (!bad) {
        layers(m, p, &s, T, slot, pos);
        if (hidden) memcpy(hidden, s.x, (size_t)T * m->dim * sizeof(float));
        for (int i = 0; i < rows_out; i++)
            memcpy(s.last + (size_t)i * m->dim, s.x + (size_t)(every_position ? i : last[i]) * m->dim, m->dim * sizeof(float));
        RowJob q = {m, &s, ROW_NONE, 0, NULL, NULL, NULL, quant_for(quantized(&m->head), s.last), m->dim};
        rows(p, &q, rows_out);
        run_linear(p, &s, &m->head, rows_out, s.last, logits, m->vocab);
    }
    free(slot); free(pos); free(last);
    return bad ? -1 : 0;
}

int prunus_forward_at(const Model *m, Pool *p, int b, int seq, const int64_t *ids, const int32_t *start,
                      const int32_t *count, const int32_t *slots, float *logits, int every_position, float *hidden) {
    return forward_rows(m, p, b, seq, ids, NULL, start, count, slots, logits, every_position, hidden);
}

/* prunus_forward_at over input vectors in place of token embeddings: row i's count[i] rows of x (sum of count, dim),
 * row after row (an EAGLE draft's block reads fc(h, e), not an embedding) */
int prunus_forward_x(const Model *m, Pool *p, int b, const float *x, const int32_t *start, const int32_t *count,
                     const int32_t *slots, float *logits, int every_position, float *hidden) {
    int seq = 0;
    for (int i = 0; i < b; i++)
        if (count[i] > seq) seq = count[i];
    return x ? forward_rows(m, p, b, seq, NULL, x, start, count, slots, logits, every_position, hidden) : -1;
}

/* prunus_forward_at with row i in buffer slot slot0 + i */
int prunus_forward(const Model *m, Pool *p, int b, int seq, const int64_t *ids, const int32_t *start,
                   const int32_t *count, int slot0, float *logits, int every_position, float *hidden) {
    if (b < 0 || slot0 < 0) return -1;
    int32_t *slots = malloc(sizeof(int32_t) * (b > 0 ? b : 1));
    if (!slots) return -2;
    for (int i = 0; i < b; i++) slots[i] = slot0 + i;
    int rc = prunus_forward_at(m, p, b, seq, ids, start, count, slots, logits, every_position, hidden);
    free(slots);
    return rc;
}

/* one linear layer alone, for tests and the kernel benchmark: y (m, n) = x (m, k) @ W^T */
void prunus_linear(const Linear *L, Pool *p, int m, const float *x, float *y) {
    int kb = L->k / 32;
    int8_t *xq = zalloc((size_t)m * L->k);
    float *xd = zalloc((size_t)m * (kb + 1) * 4), *xds = zalloc((size_t)m * (kb + 1) * 4);
    if (L->kind != KIND_F32)
        for (int t = 0; t < m; t++) quantize_row(x + (size_t)t * L->k, L->k, xq + (size_t)t * L->k, xd + (size_t)t * kb, xds + (size_t)t * kb);
    linear(p, L, m, x, xq, xd, xds, y, L->n);
    free(xq); free(xd); free(xds);
}

int prunus_abi(void) { return 9; }

/* PLAN_ROWS: the length of a Linear's plan */
int prunus_plan_rows(void) { return PLAN_ROWS; }
