/* The Q4_1 block products of rows_gemm_512.c with their inputs rounded to bfloat16, on the dot
 * product unit of CPUs with AVX-512 BF16 (ROWS_GEMM_BF16, target.step_precision: bfloat16; built
 * in place of rows_gemm_512.c's Q4_1 products, its float32 panels and Q8_0 products stay).
 *
 * Why: a float32 product pays one FMA per weight and input row, and on such a CPU those FMAs,
 * not the memory, price a step's Q4_1 products and every extra row of a verify pass
 * (docs/results.md). One bfloat16 dot product takes two weights per lane: half the instructions.
 *
 * What it computes, row by row: y = sum over records g of d_g * sum_k q_k x~_k + m_g * sum_k x~_k,
 * where x~ is the input rounded to bfloat16 (to nearest even, once per call), q the record's
 * integers 0..15 (exact in bfloat16: a lookup in a table), every product q * x~ exact and summed
 * in float32 (the instruction flushes subnormal inputs to zero). So the weights stay the
 * checkpoint's own and only the inputs lose bits (8 of float32's 24 significant ones are kept):
 * an error of about 2^-9 of sum |x w| at worst, where float32's is about 2^-24 per term. Output
 * is no longer float32's: a greedy continuation can differ from one computed in float32.
 *
 * Every row's bits are its own: each block of up to MR rows runs the same S = 4 sums per row in
 * the same order, whatever the pass's row count, so a verify pass gives a row the bits that a
 * one-row step gives it (tests/components/target). Layout: blocks.pack_panels "amx" (records of
 * float d[16], float m[16], 8 lines of 32 bytes; byte 2n + t of line j holds weight row n's q of
 * k = 4j + t in its low nibble and of k = 4j + 2 + t in its high one), so a line widened to 16
 * bits and looked up gives the pairs of k a dot product multiplies. K must be a multiple of 32.
 */
#ifdef ROWS_GEMM_BF16
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define NR 16 /* weight rows per panel: one zmm */
#define MR 4  /* input rows per block: 4 sums each, 16 registers */
#define S 4   /* sums per row, taking the lines of a record in turn */
#define q41_BYTES 384
#ifndef AHEAD
#define AHEAD 6144 /* bytes prefetched ahead of the record in use (16 records) */
#endif

/* rows [M, K] of x → xb [M, K] bfloat16 (nearest even), sx [M, K / 32]: each record's sum of the
 * rounded inputs (for Q4_1's m) */
static void round_rows(const float *x, int64_t M, int64_t K, uint16_t *xb, float *sx) {
    for (int64_t r = 0; r < M; r++)
        for (int64_t g = 0; g < K >> 5; g++) {
            const float *xr = x + r * K + g * 32;
            __m512i h = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + 16), _mm512_loadu_ps(xr)); /* low half: xr[0..15] */
            _mm512_storeu_si512((void *)(xb + r * K + g * 32), h);
            __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
            __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
            sx[r * (K >> 5) + g] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
        }
}

/* A block of R rows (bfloat16 x at stride K, their record sums sx, y at stride ldy) against one panel p. */
#define TILE(R)                                                                                 \
    static inline void tile_##R(const uint8_t *p, const uint16_t *x, const float *sx, float *y, \
                                int64_t ldy, int64_t K, int64_t cols) {                         \
        /* 0..15 as bfloat16, twice: the lookup reads 5 bits of an index, ours are 0..15 */  \
        const __m512i low = _mm512_set1_epi16(15), table = _mm512_set_epi16(                    \
            0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0,     \
            0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0, 0x4170, 0x4160, 0x4150, 0x4140, 0x4130,  \
            0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0); \
        const int64_t G = K >> 5;                                                               \
        __m512 acc[R];                                                                          \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();       \
        for (int64_t g = 0; g < G; g++) {                                                       \
            const uint8_t *b = p + g * q41_BYTES;                                               \
            _Pragma("GCC unroll 6") for (int l = 0; l < q41_BYTES; l += 64)                     \
                _mm_prefetch((const char *)b + AHEAD + l, _MM_HINT_T0);                         \
            __m512 s[R][S];                                                                     \
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)                                 \
                _Pragma("GCC unroll 4") for (int t = 0; t < S; t++) s[r][t] = _mm512_setzero_ps(); \
            _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) {                               \
                __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 128 + j * 32))); \
                __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(w, low), table); /* k = 4j + t */ \
                __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table);  /* k = 4j + 2 + t */ \
                _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                           \
                    const uint32_t *xr = (const uint32_t *)(x + r * K + g * 32 + 4 * j);        \
                    s[r][(2 * j) % S] = _mm512_dpbf16_ps(s[r][(2 * j) % S], lo, (__m512bh)_mm512_set1_epi32((int)xr[0])); \
                    s[r][(2 * j + 1) % S] = _mm512_dpbf16_ps(s[r][(2 * j + 1) % S], hi, (__m512bh)_mm512_set1_epi32((int)xr[1])); \
                }                                                                               \
            }                                                                                   \
            const __m512 d = _mm512_load_ps((const float *)b), m = _mm512_load_ps((const float *)b + 16); \
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                               \
                __m512 v = _mm512_add_ps(_mm512_add_ps(s[r][0], s[r][1]), _mm512_add_ps(s[r][2], s[r][3])); \
                acc[r] = _mm512_fmadd_ps(v, d, _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r * G + g]), acc[r])); \
            }                                                                                   \
        }                                                                                       \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                   \
            if (cols == NR) _mm512_storeu_ps(y + r * ldy, acc[r]);                              \
            else _mm512_mask_storeu_ps(y + r * ldy, (__mmask16)((1u << cols) - 1), acc[r]);    \
        }                                                                                       \
    }

TILE(1) TILE(2) TILE(3) TILE(4)

/* x [M, K], w's panels (blocks.pack_panels, "amx"), y [M, N]; any M >= 1, in blocks of MR rows
 * (the last one shorter). Every block reads the panel (from cache after the first). */
void rows_gemm_q41(const float *x, const void *panels, float *y, int64_t M, int64_t K, int64_t N, int threads) {
    const int64_t G = K >> 5, count = (N + NR - 1) / NR, stride = G * q41_BYTES;
    uint16_t *xb = malloc((size_t)(M * K) * sizeof *xb);
    float *sx = malloc((size_t)(M * G) * sizeof *sx);
    if (!xb || !sx) abort(); /* at most a pass's inputs: a few hundred KB */
    round_rows(x, M, K, xb, sx);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t q = 0; q < count; q++) {
        const uint8_t *panel = (const uint8_t *)panels + q * stride;
        int64_t cols = N - q * NR < NR ? N - q * NR : NR;
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const uint16_t *xr = xb + m0 * K;
            const float *sr = sx + m0 * G;
            float *yb = y + m0 * N + q * NR;
            switch (M - m0 < MR ? M - m0 : MR) {
            case 1: tile_1(panel, xr, sr, yb, N, K, cols); break;
            case 2: tile_2(panel, xr, sr, yb, N, K, cols); break;
            case 3: tile_3(panel, xr, sr, yb, N, K, cols); break;
            default: tile_4(panel, xr, sr, yb, N, K, cols); break;
            }
        }
    }
    free(xb);
    free(sx);
}
#endif
