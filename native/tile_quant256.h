/* Integer linear kernels on 256-bit lanes, a template: decode.c includes this file once per ISA that runs them
 * (AVX2, AVX-VNNI), after defining
 *
 *   KERNEL(name)          the function's name with the ISA's suffix
 *   KERNEL_TARGET         the functions' __attribute__((target(...))), empty for the build's own AVX2 + FMA
 *   DOT_BUS(acc, u, s)    acc (8 int32) + the sums of four neighbouring products of the unsigned bytes of u
 *                         and the signed bytes of s (AVX2: maddubs then madd by ones; VNNI: one dpbusd)
 *
 * The math, per output row i of a tile and block b of 32: the integer dot  sum_j w[j] x[j]  of the block's weight
 * integers (q8: signed, code - 128; q4: unsigned nibbles 0..15) and the activation row's integers (-127..127),
 * times the weight scale s[b][i] and the activation scale d[b]; the zero-point term  sum_b sz[b][i] dsum[b]
 * (sz = scale x (zero - storage offset), dsum = d x the block's integer sum) is subtracted at the end.
 *
 * DOT_BUS wants one unsigned operand. q4 nibbles are unsigned already. For q8 the sign trick moves the weight's
 * sign onto the activation:  w x = |w| sign(x, w),  |w| <= 128 fits an unsigned byte and sign(x, w) stays in
 * -127..127, so a pair of products is at most 2 x 128 x 127 = 32512 and maddubs cannot saturate; VNNI's dpbusd
 * sums into 32 bits and never saturates. (The alternative, x + 128 unsigned against signed w with a correction of
 * 128 x sum(w) per block, would need the weights' block sums stored at load; the sign trick needs nothing stored
 * and keeps every integer product exact.)
 */

/* the zero-point terms of rows m .. m + n - 1 (n: 3 or 4) against tile t: sum over blocks of sz[b][i] dsum[r][b]
 * (zero when the layer has none), kept out of the wide kernels' loops so that their accumulators keep the
 * registers; independent sums in registers (through an array, gcc stored each step to memory: a fifth of an int4
 * pass) */
static KERNEL_TARGET void KERNEL(zero_terms)(const GemmTask *g, int t, int m, int n, __m128 *z) {
    const Linear *L = g->L;
    const int kb = L->k / 32;
    __m128 z0 = _mm_setzero_ps(), z1 = z0, z2 = z0, z3 = z0;
    if (L->sz) {
        const float *sz = L->sz + (size_t)t * kb * 4, *x0 = g->xds + (size_t)m * kb;
        for (int b = 0; b < kb; b++) {
            const __m128 zb = _mm_loadu_ps(sz + 4 * b);
            z0 = _mm_fmadd_ps(zb, _mm_broadcast_ss(x0 + b), z0);
            z1 = _mm_fmadd_ps(zb, _mm_broadcast_ss(x0 + kb + b), z1);
            z2 = _mm_fmadd_ps(zb, _mm_broadcast_ss(x0 + 2 * kb + b), z2);
            if (n > 3) z3 = _mm_fmadd_ps(zb, _mm_broadcast_ss(x0 + 3 * kb + b), z3);
        }
    }
    z[0] = z0; z[1] = z1; z[2] = z2; z[3] = z3;
}

/* row r's four outputs of q8 block b: one vector of integers (two horizontal adds put output i's partial sums in
 * lane i of each 128-bit half), converted and scaled once into the row's accumulator. The weights are read again
 * for each row's signs, through a pointer hidden from the compiler (an empty asm): kept in registers for the
 * four rows, they pushed an accumulator onto the stack. */
#define Q8_QUAD_ROW(r, acc)                                                                                       \
    do {                                                                                                          \
        const __m256i x = _mm256_loadu_si256((const __m256i *)(x0 + (size_t)(r) * L->k + 32 * b));               \
        const __m256i *wr = wb;                                                                                   \
        __asm__ volatile("" : "+r"(wr));                                                                          \
        const __m256i p0 = DOT_BUS(_mm256_setzero_si256(), u0, _mm256_sign_epi8(x, _mm256_loadu_si256(wr)));     \
        const __m256i p1 = DOT_BUS(_mm256_setzero_si256(), u1, _mm256_sign_epi8(x, _mm256_loadu_si256(wr + 1))); \
        const __m256i p2 = DOT_BUS(_mm256_setzero_si256(), u2, _mm256_sign_epi8(x, _mm256_loadu_si256(wr + 2))); \
        const __m256i p3 = DOT_BUS(_mm256_setzero_si256(), u3, _mm256_sign_epi8(x, _mm256_loadu_si256(wr + 3))); \
        const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(p0, p1), _mm256_hadd_epi32(p2, p3));              \
        const __m256 sr = _mm256_mul_ps(sb, _mm256_broadcast_ss(d0 + (size_t)(r) * kb + b));                     \
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h), sr, acc);                                                     \
    } while (0)

/* the block's four weight vectors' |w|, and its four weight scales in both halves */
#define Q8_QUAD_BLOCK()                                                                                           \
    const __m256i *wb = (const __m256i *)(w + (size_t)b * 128);                                                   \
    const __m256i u0 = _mm256_abs_epi8(_mm256_loadu_si256(wb)), u1 = _mm256_abs_epi8(_mm256_loadu_si256(wb + 1)); \
    const __m256i u2 = _mm256_abs_epi8(_mm256_loadu_si256(wb + 2)), u3 = _mm256_abs_epi8(_mm256_loadu_si256(wb + 3)); \
    const __m256 sb = _mm256_broadcast_ps((const __m128 *)(s + 4 * b))

/* rows m .. m + n - 1: the accumulators' halves added, the zero-point term subtracted, stored */
static KERNEL_TARGET void KERNEL(q8_rows_store)(const GemmTask *g, int t, int m, int n, const __m256 *acc) {
    __m128 z[4];
    KERNEL(zero_terms)(g, t, m, n, z);
    for (int r = 0; r < n; r++)
        store4(g, m + r, t, _mm_sub_ps(_mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1)), z[r]));
}

/* rows m .. m + n - 1 (n: 3 or 4, a constant where it is inlined), each block's |w| shared by the rows; prefetch: ahead
 * in the tile as the single-row kernel does (three rows: decode steps that check two drafted tokens) */
static inline __attribute__((always_inline)) KERNEL_TARGET void KERNEL(q8_rows)(const GemmTask *g, int t, int m,
                                                                                 const int n, const int prefetch) {
    const Linear *L = g->L;
    const int kb = L->k / 32;
    const uint8_t *w = (const uint8_t *)L->w + (size_t)t * kb * 128;
    const float *s = L->s + (size_t)t * kb * 4, *d0 = g->xd + (size_t)m * kb;
    const int8_t *x0 = g->xq + (size_t)m * L->k;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int b = 0; b < kb; b++) {
        if (prefetch) {
            _mm_prefetch((const char *)w + (size_t)b * 128 + 2048, _MM_HINT_T0);
            _mm_prefetch((const char *)w + (size_t)b * 128 + 2048 + 64, _MM_HINT_T0);
        }
        Q8_QUAD_BLOCK();
        Q8_QUAD_ROW(0, a0);
        Q8_QUAD_ROW(1, a1);
        Q8_QUAD_ROW(2, a2);
        if (n > 3) Q8_QUAD_ROW(3, a3);
    }
    const __m256 acc[4] = {a0, a1, a2, a3};
    KERNEL(q8_rows_store)(g, t, m, n, acc);
}

static KERNEL_TARGET void KERNEL(q8_quad)(const GemmTask *g, int t, int m) { KERNEL(q8_rows)(g, t, m, 4, 0); }

static KERNEL_TARGET void KERNEL(q8_three)(const GemmTask *g, int t, int m) { KERNEL(q8_rows)(g, t, m, 3, 1); }

/* row r's four outputs of q4 block b: the activation block's halves broadcast to both 128-bit lanes (no permute),
 * two outputs' low and high nibbles to one DOT_BUS2 each, the two results' lanes paired by one
 * horizontal add ([o0 o0 o2 o2 | o1 o1 o3 o3]), converted and scaled once into the row's accumulator */
#define Q4_QUAD_ROW(r, acc)                                                                                       \
    do {                                                                                                          \
        const int8_t *xr = x0 + (size_t)(r) * L->k + 32 * b;                                                      \
        const __m256i xl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)xr));                    \
        const __m256i xh = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(xr + 16)));            \
        const __m256i h = _mm256_hadd_epi32(DOT_BUS2(lo01, xl, hi01, xh), DOT_BUS2(lo23, xl, hi23, xh));        \
        const __m256 sr = _mm256_mul_ps(sb, _mm256_broadcast_ss(d0 + (size_t)(r) * kb + b));                     \
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h), sr, acc);                                                     \
    } while (0)

/* the block's four outputs' nibbles, and its four weight scales in the accumulators' lane order */
#define Q4_QUAD_BLOCK()                                                                                           \
    const __m256i v01 = _mm256_loadu_si256((const __m256i *)(w + (size_t)b * 64));                               \
    const __m256i v23 = _mm256_loadu_si256((const __m256i *)(w + (size_t)b * 64 + 32));                          \
    const __m256i lo01 = _mm256_and_si256(v01, low), hi01 = _mm256_and_si256(_mm256_srli_epi16(v01, 4), low);    \
    const __m256i lo23 = _mm256_and_si256(v23, low), hi23 = _mm256_and_si256(_mm256_srli_epi16(v23, 4), low);    \
    const __m256 sb = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(s + 4 * b)), order)

/* rows m .. m + n - 1 of a q4 layer: each accumulator's lanes [o0 o0 o2 o2 | o1 o1 o3 o3] summed in output order,
 * the zero-point term subtracted, stored */
static KERNEL_TARGET void KERNEL(q4_rows_store)(const GemmTask *g, int t, int m, int n, const __m256 *acc) {
    __m128 z[4];
    KERNEL(zero_terms)(g, t, m, n, z);
    for (int r = 0; r < n; r++) {
        const __m128 h = _mm_hadd_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
        store4(g, m + r, t, _mm_sub_ps(_mm_shuffle_ps(h, h, _MM_SHUFFLE(3, 1, 2, 0)), z[r]));
    }
}

/* rows m .. m + n - 1 of a q4 layer (n: 3 or 4, a constant where it is inlined), each block's nibbles shared */
static inline __attribute__((always_inline)) KERNEL_TARGET void KERNEL(q4_rows)(const GemmTask *g, int t, int m,
                                                                                 const int n) {
    const Linear *L = g->L;
    const int kb = L->k / 32;
    const uint8_t *w = (const uint8_t *)L->w + (size_t)t * kb * 64;
    const float *s = L->s + (size_t)t * kb * 4, *d0 = g->xd + (size_t)m * kb;
    const int8_t *x0 = g->xq + (size_t)m * L->k;
    const __m256i low = _mm256_set1_epi8(0x0F), order = _mm256_setr_epi32(0, 0, 2, 2, 1, 1, 3, 3);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int b = 0; b < kb; b++) {
        _mm_prefetch((const char *)w + (size_t)b * 64 + 2048, _MM_HINT_T0);
        Q4_QUAD_BLOCK();
        Q4_QUAD_ROW(0, a0);
        Q4_QUAD_ROW(1, a1);
        Q4_QUAD_ROW(2, a2);
        if (n > 3) Q4_QUAD_ROW(3, a3);
    }
    const __m256 acc[4] = {a0, a1, a2, a3};
    KERNEL(q4_rows_store)(g, t, m, n, acc);
}

static KERNEL_TARGET void KERNEL(q4_quad)(const GemmTask *g, int t, int m) { KERNEL(q4_rows)(g, t, m, 4); }

static KERNEL_TARGET void KERNEL(q4_three)(const GemmTask *g, int t, int m) { KERNEL(q4_rows)(g, t, m, 3); }

/* Decode steps (passes of fewer than 16 rows) run the four-row kernels' block math one or two rows at a time, so a
 * row's float sums run in the same order as in a prompt: a row's four outputs summed in integers first, then one
 * convert, one multiply and one FMA per block (the kernels before this gave each output its own). The zero-point
 * term runs in the loop, in zero_terms' order. Pairs share each block's |w| (q8) or nibbles (q4) between their
 * rows and prefetch their share of the next tile (next_share) when a pass has six rows or more. */

/* row m's zero-point sum for tile t's block b, or nothing for a layer without zero points */
#define ZERO_TERM(z, r) \
    if (sz) z = _mm_fmadd_ps(_mm_loadu_ps(sz + 4 * b), _mm_broadcast_ss(g->xds + (size_t)(m + (r)) * kb + b), z)

static KERNEL_TARGET void KERNEL(q8_one)(const GemmTask *g, int t, int m) {
    const Linear *L = g->L;
    const int kb = L->k / 32;
    const uint8_t *w = (const uint8_t *)L->w + (size_t)t * kb * 128;
    const float *s = L->s + (size_t)t * kb * 4, *d0 = g->xd + (size_t)m * kb;
    const float *sz = L->sz ? L->sz + (size_t)t * kb * 4 : NULL;
    const int8_t *x0 = g->xq + (size_t)m * L->k;
    __m256 a0 = _mm256_setzero_ps();
    __m128 z0 = _mm_setzero_ps();
    for (int b = 0; b < kb; b++) {
        _mm_prefetch((const char *)w + (size_t)b * 128 + 2048, _MM_HINT_T0);
        _mm_prefetch((const char *)w + (size_t)b * 128 + 2048 + 64, _MM_HINT_T0);
        Q8_QUAD_BLOCK();
        Q8_QUAD_ROW(0, a0);
        ZERO_TERM(z0, 0);
    }
    store4(g, m, t, _mm_sub_ps(_mm_add_ps(_mm256_castps256_ps128(a0), _mm256_extractf128_ps(a0, 1)), z0));
}

/* Q8_QUAD_ROW with the block's weights w0 .. w3 kept in registers for their signs (two rows leave room for them:
 * 5-10% faster than reading them again at 6 and 8 rows, one thread; the same bits) */
#define Q8_PAIR_ROW(r, acc)                                                                                       \
    do {                                                                                                          \
        const __m256i x = _mm256_loadu_si256((const __m256i *)(x0 + (size_t)(r) * L->k + 32 * b));               \
        const __m256i p0 = DOT_BUS(_mm256_setzero_si256(), u0, _mm256_sign_epi8(x, w0));                         \
        const __m256i p1 = DOT_BUS(_mm256_setzero_si256(), u1, _mm256_sign_epi8(x, w1));                         \
        const __m256i p2 = DOT_BUS(_mm256_setzero_si256(), u2, _mm256_sign_epi8(x, w2));                         \
        const __m256i p3 = DOT_BUS(_mm256_setzero_si256(), u3, _mm256_sign_epi8(x, w3));                         \
        const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(p0, p1), _mm256_hadd_epi32(p2, p3));              \
        const __m256 sr = _mm256_mul_ps(sb, _mm256_broadcast_ss(d0 + (size_t)(r) * kb + b));                     \
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h), sr, acc);                                                     \
    } while (0)

static KERNEL_TARGET void KERNEL(q8_two)(const GemmTask *g, int t, int m) {
    const Linear *L = g->L;
    const int kb = L->k / 32;
    const uint8_t *w = (const uint8_t *)L->w + (size_t)t * kb * 128;
    const float *s = L->s + (size_t)t * kb * 4, *d0 = g->xd + (size_t)m * kb;
    const float *sz = L->sz ? L->sz + (size_t)t * kb * 4 : NULL;
    const int8_t *x0 = g->xq + (size_t)m * L->k;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    __m128 z0 = _mm_setzero_ps(), z1 = z0;
    size_t step = 0;
    const char *next = next_share(g, t, m, (size_t)kb * 128, &step, kb);
    for (int b = 0; b < kb; b++) {
        if (next) _mm_prefetch(next + step * b, _MM_HINT_T0);
        else {
            _mm_prefetch((const char *)w + (size_t)b * 128 + 2048, _MM_HINT_T0);
            _mm_prefetch((const char *)w + (size_t)b * 128 + 2048 + 64, _MM_HINT_T0);
        }
        const __m256i *wb = (const __m256i *)(w + (size_t)b * 128);
        const __m256i w0 = _mm256_loadu_si256(wb), w1 = _mm256_loadu_si256(wb + 1);
        const __m256i w2 = _mm256_loadu_si256(wb + 2), w3 = _mm256_loadu_si256(wb + 3);
        const __m256i u0 = _mm256_abs_epi8(w0), u1 = _mm256_abs_epi8(w1);
        const __m256i u2 = _mm256_abs_epi8(w2), u3 = _mm256_abs_epi8(w3);
        const __m256 sb = _mm256_broadcast_ps((const __m128 *)(s + 4 * b));
        Q8_PAIR_ROW(0, a0);
        Q8_PAIR_ROW(1, a1);
        ZERO_TERM(z0, 0);
        ZERO_TERM(z1, 1);
    }
    store4(g, m, t, _mm_sub_ps(_mm_add_ps(_mm256_castps256_ps128(a0), _mm256_extractf128_ps(a0, 1)), z0));
    store4(g, m + 1, t, _mm_sub_ps(_mm_add_ps(_mm256_castps256_ps128(a1), _mm256_extractf128_ps(a1, 1)), z1));
}

/* a q4 accumulator's lanes [o0 o0 o2 o2 | o1 o1 o3 o3] summed in output order, less the zero-point term */
static inline KERNEL_TARGET __m128 KERNEL(q4_finish)(__m256 acc, __m128 z) {
    const __m128 h = _mm_hadd_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    return _mm_sub_ps(_mm_shuffle_ps(h, h, _MM_SHUFFLE(3, 1, 2, 0)), z);
}

static KERNEL_TARGET void KERNEL(q4_one)(const GemmTask *g, int t, int m) {
    const Linear *L = g->L;
    const int kb = L->k / 32;
    const uint8_t *w = (const uint8_t *)L->w + (size_t)t * kb * 64;
    const float *s = L->s + (size_t)t * kb * 4, *d0 = g->xd + (size_t)m * kb;
    const float *sz = L->sz ? L->sz + (size_t)t * kb * 4 : NULL;
    const int8_t *x0 = g->xq + (size_t)m * L->k;
    const __m256i low = _mm256_set1_epi8(0x0F), order = _mm256_setr_epi32(0, 0, 2, 2, 1, 1, 3, 3);
    __m256 a0 = _mm256_setzero_ps();
    __m128 z0 = _mm_setzero_ps();
    for (int b = 0; b < kb; b++) {
        _mm_prefetch((const char *)w + (size_t)b * 64 + 2048, _MM_HINT_T0);
        Q4_QUAD_BLOCK();
        Q4_QUAD_ROW(0, a0);
        ZERO_TERM(z0, 0);
    }
    store4(g, m, t, KERNEL(q4_finish)(a0, z0));
}

static KERNEL_TARGET void KERNEL(q4_two)(const GemmTask *g, int t, int m) {
    const Linear *L = g->L;
    const int kb = L->k / 32;
    const uint8_t *w = (const uint8_t *)L->w + (size_t)t * kb * 64;
    const float *s = L->s + (size_t)t * kb * 4, *d0 = g->xd + (size_t)m * kb;
    const float *sz = L->sz ? L->sz + (size_t)t * kb * 4 : NULL;
    const int8_t *x0 = g->xq + (size_t)m * L->k;
    const __m256i low = _mm256_set1_epi8(0x0F), order = _mm256_setr_epi32(0, 0, 2, 2, 1, 1, 3, 3);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    __m128 z0 = _mm_setzero_ps(), z1 = z0;
    size_t step = 0;
    const char *next = next_share(g, t, m, (size_t)kb * 64, &step, kb);
    for (int b = 0; b < kb; b++) {
        _mm_prefetch(next ? next + step * b : (const char *)w + (size_t)b * 64 + 2048, _MM_HINT_T0);
        Q4_QUAD_BLOCK();
        Q4_QUAD_ROW(0, a0);
        Q4_QUAD_ROW(1, a1);
        ZERO_TERM(z0, 0);
        ZERO_TERM(z1, 1);
    }
    store4(g, m, t, KERNEL(q4_finish)(a0, z0));
    store4(g, m + 1, t, KERNEL(q4_finish)(a1, z1));
}

/* one row m of the quantized activations against tile t (decode steps, and a pass's last odd row) */
static KERNEL_TARGET void KERNEL(quant_row)(const GemmTask *g, int t, int m) {
    if (g->L->kind == KIND_Q4) KERNEL(q4_one)(g, t, m);
    else KERNEL(q8_one)(g, t, m);
}

/* rows m .. m + 2 against tile t (decode steps of three rows or a multiple, and the rows the four-row kernels
 * leave) */
static KERNEL_TARGET void KERNEL(quant_three)(const GemmTask *g, int t, int m) {
    if (g->L->kind == KIND_Q4) KERNEL(q4_three)(g, t, m);
    else KERNEL(q8_three)(g, t, m);
}

/* rows m and m + 1 against tile t (decode steps, and the pairs the four-row kernels leave) */
static KERNEL_TARGET void KERNEL(quant_pair)(const GemmTask *g, int t, int m) {
    if (g->L->kind == KIND_Q4) KERNEL(q4_two)(g, t, m);
    else KERNEL(q8_two)(g, t, m);
}

#undef ZERO_TERM
#undef Q8_PAIR_ROW
#undef Q8_QUAD_ROW
#undef Q8_QUAD_BLOCK
#undef Q4_QUAD_ROW
#undef Q4_QUAD_BLOCK
