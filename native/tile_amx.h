/* int8 linear layers on AMX (Sapphire Rapids and later), included by decode.c: passes of AMX_MIN_ROWS rows or
 * more (prompts) of q8 layers; everything else, and the tiles left over from groups of four, run on the AVX-512
 * VNNI kernels. The path is offered only when the CPU has AMX-TILE and AMX-INT8 and Linux granted the process
 * the tile data state (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)); otherwise "amx" is a path this CPU
 * lacks and nothing changes.
 *
 * The math: tdpbssd multiplies signed by signed bytes, so the stored weights (code - 128) and the activations
 * (-127..127) go in as they are, no sign trick. One block of 32 at a time, because each block has its own scales:
 *   A (tile 1): R activation rows x the block's 32 bytes, loaded straight from the quantized rows (stride k);
 *   B (tile 2): 8 x 64 bytes, B[j][4 n + i] = w[n][4 j + i] for 16 outputs n (four 4-row weight tiles): built by
 *               gathering dword j of each output's 32 bytes;
 *   C (tile 0): R x 16 int32, C[r][n] = sum over the block of x[r][.] w[n][.], exact;
 * then, in AVX-512, y[r][n] += C[r][n] s[b][n] d[r][b], and at the end the zero-point term (as tile_quant256.h)
 * and the bias. */

#include <sys/syscall.h>
#include <unistd.h>

#define TARGET_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")))
#define AMX_MIN_ROWS 16
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* the process's permission to use the tile data state, asked once: 1 granted, 0 refused */
static int amx_permitted(void) {
    static atomic_int state; /* 0: not asked yet, 1: granted, -1: refused */
    int s = atomic_load(&state);
    if (s == 0) {
        s = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        atomic_store(&state, s);
    }
    return s > 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* this thread's tiles for passes of R rows: C (R x 64 bytes), A (R x 32), B (8 x 64) */
static TARGET_AMX void amx_configure(int R) {
    TileConfig c __attribute__((aligned(64)));
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.rows[0] = R, c.colsb[0] = 64;
    c.rows[1] = R, c.colsb[1] = 32;
    c.rows[2] = 8, c.colsb[2] = 64;
    _tile_loadconfig(&c);
}

/* y[r0 .. r0 + R - 1][4t .. 4t + 15] from weight tiles t .. t + 3 (R <= 16, tiles as configured for R) */
static TARGET_AMX void amx_block16(const GemmTask *g, int t, int r0, int R) {
    const Linear *L = g->L;
    const int kb = L->k / 32;
    const int32_t *w = (const int32_t *)L->w + (size_t)t * kb * 32; /* tile t's first block, as dwords */
    const float *s = L->s + (size_t)t * kb * 4, *sz = L->sz ? L->sz + (size_t)t * kb * 4 : NULL;
    /* output n = 4 q + i: its block's dwords at q kb 32 + 8 i, its scale at q kb 4 + i (from tile t, block b) */
    const __m512i q = _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 2);
    const __m512i i = _mm512_and_si512(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                       _mm512_set1_epi32(3));
    const __m512i wi = _mm512_add_epi32(_mm512_mullo_epi32(q, _mm512_set1_epi32(kb * 32)), _mm512_slli_epi32(i, 3));
    const __m512i si = _mm512_add_epi32(_mm512_mullo_epi32(q, _mm512_set1_epi32(kb * 4)), i);
    int32_t bt[8 * 16] __attribute__((aligned(64))), ct[16 * 16] __attribute__((aligned(64)));
    __m512 acc[16], z[16];
    for (int r = 0; r < R; r++) acc[r] = z[r] = _mm512_setzero_ps();
    for (int b = 0; b < kb; b++) {
        const int32_t *wb = w + (size_t)b * 32;
        for (int j = 0; j < 8; j++)
            _mm512_store_si512(bt + 16 * j, _mm512_i32gather_epi32(_mm512_add_epi32(wi, _mm512_set1_epi32(j)), wb, 4));
        _tile_loadd(2, bt, 64);
        _tile_loadd(1, g->xq + (size_t)r0 * L->k + 32 * b, L->k);
        _tile_zero(0);
        _tile_dpbssd(0, 1, 2);
        _tile_stored(0, ct, 64);
        const __m512 sw = _mm512_i32gather_ps(si, s + 4 * b, 4);
        const __m512 zw = sz ? _mm512_i32gather_ps(si, sz + 4 * b, 4) : _mm512_setzero_ps();
        for (int r = 0; r < R; r++) {
            const size_t at = (size_t)(r0 + r) * kb + b;
            const __m512 p = _mm512_cvtepi32_ps(_mm512_load_si512(ct + 16 * r));
            acc[r] = _mm512_fmadd_ps(p, _mm512_mul_ps(sw, _mm512_set1_ps(g->xd[at])), acc[r]);
            z[r] = _mm512_fmadd_ps(zw, _mm512_set1_ps(g->xds[at]), z[r]);
        }
    }
    const int n = L->n - 4 * t < 16 ? L->n - 4 * t : 16;
    const __mmask16 valid = (__mmask16)((1u << n) - 1);
    const __m512 bias = L->bias ? _mm512_maskz_loadu_ps(valid, L->bias + 4 * t) : _mm512_setzero_ps();
    for (int r = 0; r < R; r++)
        _mm512_mask_storeu_ps(g->y + (size_t)(r0 + r) * g->ldy + 4 * t, valid,
                              _mm512_add_ps(_mm512_sub_ps(acc[r], z[r]), bias));
}

/* this thread's share of the groups of four weight tiles, every row in chunks of 16; the tiles past the last
 * whole group go to the last thread, on the AVX-512 VNNI kernels */
static TARGET_AMX void amx_task(const GemmTask *g, int ith, int nth) {
    const int groups = g->L->tiles / 4;
    int g0, g1;
    split(groups, ith, nth, &g0, &g1);
    for (int r0 = 0; r0 < g->m && g0 < g1; r0 += 16) {
        const int R = g->m - r0 < 16 ? g->m - r0 : 16;
        amx_configure(R);
        for (int grp = g0; grp < g1; grp++) amx_block16(g, 4 * grp, r0, R);
    }
    _tile_release();
    if (ith == nth - 1)
        for (int t = 4 * groups; t < g->L->tiles; t++) {
            int m = 0;
            for (; m + 2 <= g->m; m += 2) quant_pair_avx512vnni(g, t, m);
            if (m < g->m) quant_row_avx512vnni(g, t, m);
        }
}
