/* The fp32 linear kernel on 512-bit lanes (AVX-512F), included by decode.c; chosen at run time (prunus_set_isa)
 * on CPUs that have AVX-512, the rest of the library being built for AVX2 + FMA.
 *
 * A tile's weights are (k / 8, 4, 8) floats: step j holds eight inputs of each of its four output rows, 32 floats,
 * two zmm registers (rows 0-1, rows 2-3). The row's eight inputs x[8j .. 8j + 7] are broadcast to both halves of a
 * zmm, so one FMA advances two output rows: acc[half] += w[j][2 half .. 2 half + 1][.] * x[8j + .]. Two steps run
 * interleaved on separate accumulators to hide the FMA latency; output row i is the sum of the eight lanes of
 * its half. */

#define TARGET_AVX512F __attribute__((target("avx512f")))

static inline __attribute__((always_inline)) TARGET_AVX512F __m256 lo256(__m512 v) { return _mm512_castps512_ps256(v); }

static inline __attribute__((always_inline)) TARGET_AVX512F __m256 hi256(__m512 v) {
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

/* eight floats in both 256-bit halves */
static inline __attribute__((always_inline)) TARGET_AVX512F __m512 twice8(const float *p) {
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(p))));
}

/* rows m .. m + R - 1 (R is 1 or 2) of x against tile t, each weight vector loaded once for the R rows (the loops
 * over rows, halves and steps are unrolled by pragma: left as loops, gcc kept the accumulator arrays on the stack) */
static inline __attribute__((always_inline)) TARGET_AVX512F void f32_rows_avx512(const GemmTask *g, int t, int m,
                                                                                 const int R) {
    const Linear *L = g->L;
    const int kk = L->k / 8;
    const float *w = (const float *)L->w + (size_t)t * kk * 32, *x[2];
    __m512 a[2][4]; /* [row][2 u + half]: step parity u, tile rows 2 half, 2 half + 1 */
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        x[r] = g->x + (size_t)(m + r) * L->k;
        #pragma GCC unroll 4
        for (int i = 0; i < 4; i++) a[r][i] = _mm512_setzero_ps();
    }
    size_t step = 0;
    const char *next = R == 2 ? next_share(g, t, m, (size_t)kk * 128, &step, kk) : NULL;
    int j = 0;
    for (; j + 2 <= kk; j += 2) {
        if (next) _mm_prefetch(next + step * j, _MM_HINT_T0);
        #pragma GCC unroll 4
        for (int u = 0; u < 2; u++) {
            const float *wj = w + 32 * (j + u);
            const __m512 w01 = _mm512_loadu_ps(wj), w23 = _mm512_loadu_ps(wj + 16);
            #pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const __m512 xv = twice8(x[r] + 8 * (j + u));
                a[r][2 * u] = _mm512_fmadd_ps(w01, xv, a[r][2 * u]);
                a[r][2 * u + 1] = _mm512_fmadd_ps(w23, xv, a[r][2 * u + 1]);
            }
        }
    }
    for (; j < kk; j++) { /* an odd step count: the last one */
        const __m512 w01 = _mm512_loadu_ps(w + 32 * j), w23 = _mm512_loadu_ps(w + 32 * j + 16);
        #pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const __m512 xv = twice8(x[r] + 8 * j);
            a[r][0] = _mm512_fmadd_ps(w01, xv, a[r][0]);
            a[r][1] = _mm512_fmadd_ps(w23, xv, a[r][1]);
        }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        const __m512 h01 = _mm512_add_ps(a[r][0], a[r][2]), h23 = _mm512_add_ps(a[r][1], a[r][3]);
        store4(g, m + r, t, hsum4x8(lo256(h01), hi256(h01), lo256(h23), hi256(h23)));
    }
}

static TARGET_AVX512F void f32_row_avx512(const GemmTask *g, int t, int m) { f32_rows_avx512(g, t, m, 1); }

static TARGET_AVX512F void f32_pair_avx512(const GemmTask *g, int t, int m) { f32_rows_avx512(g, t, m, 2); }
