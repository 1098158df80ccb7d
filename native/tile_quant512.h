/* Integer linear kernels on 512-bit lanes, a template: decode.c includes this file once per ISA that runs them
 * (AVX-512BW, AVX-512 VNNI), after tile_f32_512.h and after defining
 *
 *   KERNEL(name)          the function's name with the ISA's suffix
 *   KERNEL_TARGET         the functions' __attribute__((target(...)))
 *   DOT_BUS(acc, u, s)    acc (16 int32) + the sums of four neighbouring products of the unsigned bytes of u and
 *                         the signed bytes of s (AVX-512BW: maddubs then madd by ones; VNNI: one dpbusd)
 *
 * The math is tile_quant256.h's (the same sign trick for q8, so every integer product is exact); only the lanes
 * differ. A block of 32 of a tile's four rows is 128 bytes for q8 and 64 for q4:
 *   q8: two zmm of weights (rows 0-1, rows 2-3) against the activation block broadcast to both halves; 16 int32
 *       lanes, eight per row; the weight scales go to the lanes by a permute (s[b][0] x8, s[b][1] x8).
 *   q4: one zmm holds the four rows' 16 bytes; the low nibbles (elements 0..15 of each row) against activations
 *       0..15 broadcast to the four 128-bit lanes, the high nibbles (elements 16..31) against activations 16..31;
 *       16 int32 lanes, four per row.
 * AVX-512 has no sign_epi8: sign(x, w) is x with its bytes negated where w < 0 (where w == 0, |w| is 0 and the
 * product 0 whatever the sign). */

/* rows m .. m + R - 1 (R is 1 or 2) against tile t, each weight block prepared once for the R rows (the loops over
 * rows and halves are unrolled by pragma: left as loops, gcc kept the accumulator arrays on the stack) */
static inline __attribute__((always_inline)) KERNEL_TARGET void KERNEL(quant_rows)(const GemmTask *g, int t, int m,
                                                                                  const int R) {
    const Linear *L = g->L;
    const int kb = L->k / 32, q4 = L->kind == KIND_Q4, bytes = q4 ? 16 : 32;
    const uint8_t *w = (const uint8_t *)L->w + (size_t)t * kb * 4 * bytes;
    const float *s = L->s + (size_t)t * kb * 4, *sz = L->sz ? L->sz + (size_t)t * kb * 4 : NULL;
    const __m512i lanes8[2] = {_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                               _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2)};
    const __m512i lanes4 = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i nib = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
    const int8_t *xq[2];
    const float *xd[2], *xds[2];
    __m512 a[2][2]; /* q8: [row][rows 0-1, rows 2-3 of the tile]; q4: [row][0] */
    __m128 z[2];
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        xq[r] = g->xq + (size_t)(m + r) * L->k;
        xd[r] = g->xd + (size_t)(m + r) * kb;
        xds[r] = g->xds + (size_t)(m + r) * kb;
        z[r] = _mm_setzero_ps();
        a[r][0] = a[r][1] = _mm512_setzero_ps();
    }
    size_t step = 0;
    const char *next = R == 2 ? next_share(g, t, m, (size_t)kb * 4 * bytes, &step, kb) : NULL;
    for (int b = 0; b < kb; b++) {
        if (next) _mm_prefetch(next + step * b, _MM_HINT_T0);
        const uint8_t *wb = w + (size_t)b * 4 * bytes;
        const __m512 sb = _mm512_castps128_ps512(_mm_loadu_ps(s + 4 * b));
        if (q4) {
            const __m512i wv = _mm512_loadu_si512(wb);
            const __m512i lo = _mm512_and_si512(wv, nib), hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), nib);
            const __m512 sw = _mm512_permutexvar_ps(lanes4, sb);
            #pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const __m512i x0 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(xq[r] + 32 * b)));
                const __m512i x1 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(xq[r] + 32 * b + 16)));
                const __m512 p = _mm512_cvtepi32_ps(DOT_BUS(DOT_BUS(zero, lo, x0), hi, x1));
                a[r][0] = _mm512_fmadd_ps(p, _mm512_mul_ps(sw, _mm512_set1_ps(xd[r][b])), a[r][0]);
            }
        } else {
            __m512i x[2];
            #pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                x[r] = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(xq[r] + 32 * b)));
            #pragma GCC unroll 4
            for (int h = 0; h < 2; h++) {
                const __m512i wv = _mm512_loadu_si512(wb + 64 * h), u = _mm512_abs_epi8(wv);
                const __mmask64 negative = _mm512_movepi8_mask(wv);
                const __m512 sw = _mm512_permutexvar_ps(lanes8[h], sb);
                #pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    const __m512i sx = _mm512_mask_sub_epi8(x[r], negative, zero, x[r]);
                    const __m512 p = _mm512_cvtepi32_ps(DOT_BUS(zero, u, sx));
                    a[r][h] = _mm512_fmadd_ps(p, _mm512_mul_ps(sw, _mm512_set1_ps(xd[r][b])), a[r][h]);
                }
            }
        }
        if (sz) {
            const __m128 zb = _mm_loadu_ps(sz + 4 * b);
            #pragma GCC unroll 4
            for (int r = 0; r < R; r++) z[r] = _mm_fmadd_ps(zb, _mm_broadcast_ss(xds[r] + b), z[r]);
        }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        __m128 sums;
        if (q4) /* row i: the four lanes of 128-bit lane i */
            sums = _mm_hadd_ps(_mm_hadd_ps(_mm512_extractf32x4_ps(a[r][0], 0), _mm512_extractf32x4_ps(a[r][0], 1)),
                               _mm_hadd_ps(_mm512_extractf32x4_ps(a[r][0], 2), _mm512_extractf32x4_ps(a[r][0], 3)));
        else
            sums = hsum4x8(lo256(a[r][0]), hi256(a[r][0]), lo256(a[r][1]), hi256(a[r][1]));
        store4(g, m + r, t, _mm_sub_ps(sums, z[r]));
    }
}

static KERNEL_TARGET void KERNEL(quant_row)(const GemmTask *g, int t, int m) { KERNEL(quant_rows)(g, t, m, 1); }

static KERNEL_TARGET void KERNEL(quant_pair)(const GemmTask *g, int t, int m) { KERNEL(quant_rows)(g, t, m, 2); }
