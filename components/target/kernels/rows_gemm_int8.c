/* The Q4_1 and Q8_0 block products of rows_gemm_512.c with their inputs quantized to integers per
 * block of 32, on the integer dot product unit of CPUs with AVX-512 VNNI and VBMI (ROWS_GEMM_INT8 /
 * ROWS_GEMM_INT16, target.step_precision: int8 / int16; built in place of rows_gemm_512.c's block
 * products, its float32 panels stay). int8 is the arithmetic of llama.cpp's Q4_1 x Q8_1 product.
 *
 * Why: a float32 product pays one FMA (16 multiply-adds a register) per weight and input row,
 * and on such a CPU those FMAs price every extra row of a verify pass (docs/results.md). One
 * integer dot product does 64 multiply-adds of 8-bit numbers a register: a quarter of the
 * instructions, and the 4-bit weights need no conversion to float.
 *
 * What it computes, row by row: each record g of 32 inputs x_k becomes a_k = round(x_k / e_g),
 * integers in -LIMIT..LIMIT with e_g = max |x_k| / LIMIT (e_g = 0, a = 0 for a record of zeros).
 * Then y = sum over g of e_g * (d_g * sum_k q_k a_k + m_g * sum_k a_k), the sums of integers exact
 * (int32), d_g and m_g the record's float32 scales, the rest in float32. The weights stay the
 * checkpoint's own; the inputs keep about 7 (int8: LIMIT 127) or 15 bits (ROWS_GEMM_INT16, "int16":
 * LIMIT 32639, each a taken as two 8-bit parts, each part its own dot product) of their record's
 * largest, so the error is about 2^-8 or 2^-16 of sum |x w| at worst. Output is no longer
 * float32's: a greedy continuation can differ from one computed in float32 (with int16 rarely:
 * docs/results.md).
 *
 * Every row's bits are its own: a row's integer sums are exact whatever the order, and its
 * float32 steps run in one order per row, whatever the pass's row count or its block of rows,
 * so a verify pass gives a row the bits that a one-row step gives it (tests/components/target).
 * Layout: blocks.pack_panels "amx", as rows_gemm_bf16.c reads it (records of float d[16], float
 * m[16], 8 lines of 32 bytes; byte 2n + t of line j holds weight row n's q of k = 4j + t in its
 * low nibble and of k = 4j + 2 + t in its high one). A line widened to 16 bits and its nibbles
 * split gives 32-bit lane n the bytes q of k = 4j, 4j + 2, 4j + 1, 4j + 3, so the inputs are
 * stored in that order. Q8_0 records are rows_gemm_512.c's. K must be a multiple of 32. Does not
 * know attention or the float32 panels.
 */
#if defined(ROWS_GEMM_INT8) || defined(ROWS_GEMM_INT16)
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define NR 16 /* weight rows per panel: one zmm */
#define MR 8  /* input rows per block: PARTS int32 sums and a float32 sum each */
/* int8: each input one 8-bit integer, |a| <= LIMIT = 127. int16 (ROWS_GEMM_INT16): a 16-bit one,
 * |a| <= LIMIT = 127 * 257, taken as two 8-bit parts a = 256 h + l (h, l in -128..127), each part
 * its own dot product: twice the instructions, about 2^-16 of the record's largest input. */
#ifdef ROWS_GEMM_INT16
#define PARTS 2
#define LIMIT 32639
#else
#define PARTS 1
#define LIMIT 127
#endif
#define q41_BYTES 384
#ifndef AHEAD
#define AHEAD 6144 /* bytes prefetched ahead of the record in use (16 records) */
#endif

/* rows [M, K] of x → a [PARTS, M, K] int8 in the lines' order (k = 4j, 4j + 2, 4j + 1, 4j + 3;
 * int16: the high parts, then the low ones), and per row and record e (the step), s = e * sum a
 * (what Q4_1's m multiplies) and c = 128 * sum a */
static void quantize_rows(const float *x, int64_t M, int64_t K, int8_t *a, float *e, float *s, int32_t *c) {
    const __m128i order = _mm_setr_epi8(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15);
    const int64_t G = K >> 5;
    for (int64_t r = 0; r < M; r++)
        for (int64_t g = 0; g < G; g++) {
            const float *xr = x + r * K + g * 32;
            __m512 lo = _mm512_loadu_ps(xr), hi = _mm512_loadu_ps(xr + 16);
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
            float step = amax / (float)LIMIT, inv = amax > 0 ? (float)LIMIT / amax : 0.0f;
            /* nearest, ties to even (the default rounding); |x * inv| <= LIMIT up to rounding: clamped */
            __m512i ilo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)));
            __m512i ihi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)));
            const __m512i top = _mm512_set1_epi32(LIMIT), bottom = _mm512_set1_epi32(-LIMIT);
            ilo = _mm512_max_epi32(_mm512_min_epi32(ilo, top), bottom);
            ihi = _mm512_max_epi32(_mm512_min_epi32(ihi, top), bottom);
            int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(ilo, ihi));
            int8_t *ar = a + r * K + g * 32;
#if PARTS == 2 /* l = ((a + 128) & 255) - 128, h = (a - l) / 256: both in -127..127 for |a| <= LIMIT */
            const __m512i half = _mm512_set1_epi32(128), byte = _mm512_set1_epi32(255);
            __m512i llo = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(ilo, half), byte), half);
            __m512i lhi = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(ihi, half), byte), half);
            int8_t *al = ar + M * K;
            _mm_storeu_si128((__m128i *)al, _mm_shuffle_epi8(_mm512_cvtepi32_epi8(llo), order));
            _mm_storeu_si128((__m128i *)(al + 16), _mm_shuffle_epi8(_mm512_cvtepi32_epi8(lhi), order));
            ilo = _mm512_srai_epi32(_mm512_sub_epi32(ilo, llo), 8);
            ihi = _mm512_srai_epi32(_mm512_sub_epi32(ihi, lhi), 8);
#endif
            _mm_storeu_si128((__m128i *)ar, _mm_shuffle_epi8(_mm512_cvtepi32_epi8(ilo), order));
            _mm_storeu_si128((__m128i *)(ar + 16), _mm_shuffle_epi8(_mm512_cvtepi32_epi8(ihi), order));
            e[r * G + g] = step;
            s[r * G + g] = step * (float)sum;
            c[r * G + g] = 128 * sum;
        }
}

/* One record's line j (k = 4j .. 4j + 3) as the dot product's unsigned bytes, lane n = weight
 * row n in the inputs' order (k = 4j, 4j + 2, 4j + 1, 4j + 3), per format:
 *  - Q4_1 ("amx" records: d[16], m[16], 8 lines of 32 bytes): a line's word [b, 0] becomes bytes
 *    [b & 15, b >> 4], i.e. (w | w << 4) & 0x0F0F;
 *  - Q8_0 (d[16], then 32 k x 16 int8, k by k): the 4 k's 64 bytes gathered into rows by one byte
 *    permute and their signs flipped (w + 128, unsigned), the 128 * sum a this adds taken back
 *    per record. */
#define q41_LINE(b, j)                                                                          \
    ({                                                                                          \
        __m512i w_ = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)((b) + 128 + (j) * 32))); \
        _mm512_ternarylogic_epi32(w_, _mm512_slli_epi16(w_, 4), _mm512_set1_epi16(0x0F0F), 0xA8); \
    })
#define q80_BYTES 576
#define q80_LINE(b, j)                                                                          \
    _mm512_xor_si512(_mm512_permutexvar_epi8(rows_, _mm512_loadu_si512((const void *)((b) + 64 + (j) * 64))), \
                     _mm512_set1_epi8((char)0x80))

/* A block of R rows of format F (int8 a at stride K, its parts `plane` bytes apart; their e, s and
 * c = 128 * sum a) against one panel p, y at stride ldy. The m of Q4_1 is Q8_0's flipped sign:
 * m * s added, or c taken away. */
#define TILE(F, R)                                                                              \
    static inline void F##_tile_##R(const uint8_t *p, const int8_t *a, int64_t plane, const float *e, \
                                    const float *s, const int32_t *c, float *y, int64_t ldy, int64_t K, \
                                    int64_t cols) {                                             \
        const int64_t G = K >> 5;                                                               \
        __m512i rows_ = _mm512_setzero_si512();                                                 \
        if (F##_BYTES == q80_BYTES) { /* byte 4n + t ← byte 16 order[t] + n */                  \
            uint8_t at[64];                                                                     \
            for (int i = 0; i < 64; i++) at[i] = (uint8_t)(16 * ((i & 3) == 1 ? 2 : (i & 3) == 2 ? 1 : (i & 3)) + (i >> 2)); \
            rows_ = _mm512_loadu_si512((const void *)at);                                       \
        }                                                                                       \
        (void)rows_, (void)s, (void)c, (void)plane;                                             \
        __m512 acc[R];                                                                          \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();       \
        for (int64_t g = 0; g < G; g++) {                                                       \
            const uint8_t *b = p + g * F##_BYTES;                                               \
            _Pragma("GCC unroll 9") for (int l = 0; l < F##_BYTES; l += 64)                     \
                _mm_prefetch((const char *)b + AHEAD + l, _MM_HINT_T0);                         \
            __m512i sum[R][PARTS];                                                              \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                 \
                _Pragma("GCC unroll 2") for (int h = 0; h < PARTS; h++) sum[r][h] = _mm512_setzero_si512(); \
            _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) {                               \
                const __m512i w = F##_LINE(b, j);                                               \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                             \
                    _Pragma("GCC unroll 2") for (int h = 0; h < PARTS; h++) {                   \
                        const int32_t *ar = (const int32_t *)(a + h * plane + r * K + g * 32 + 4 * j); \
                        sum[r][h] = _mm512_dpbusd_epi32(sum[r][h], w, _mm512_set1_epi32(*ar));  \
                    }                                                                           \
            }                                                                                   \
            const __m512 d = _mm512_load_ps((const float *)b);                                  \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                               \
                __m512i n = PARTS == 2 ? _mm512_add_epi32(_mm512_slli_epi32(sum[r][0], 8), sum[r][PARTS - 1]) \
                                       : sum[r][0];                                             \
                if (F##_BYTES == q80_BYTES) n = _mm512_sub_epi32(n, _mm512_set1_epi32(c[r * G + g])); \
                else acc[r] = _mm512_fmadd_ps(_mm512_load_ps((const float *)b + 16), _mm512_set1_ps(s[r * G + g]), acc[r]); \
                __m512 q = _mm512_cvtepi32_ps(n); /* exact below 2^24 (int16 Q8_0: rounded) */ \
                acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(q, _mm512_set1_ps(e[r * G + g])), d, acc[r]); \
            }                                                                                   \
        }                                                                                       \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                   \
            if (cols == NR) _mm512_storeu_ps(y + r * ldy, acc[r]);                              \
            else _mm512_mask_storeu_ps(y + r * ldy, (__mmask16)((1u << cols) - 1), acc[r]);    \
        }                                                                                       \
    }

#define CASE(F, R) case R: F##_tile_##R(panel, ar, M * K, er, sr, cr, yb, N, K, cols); break;

/* x [M, K], w's panels (blocks.pack_panels, "amx" for Q4_1), y [M, N]; any M >= 1, in near-equal
 * blocks of at most MR rows. Every block reads the panel (from cache after the first). */
#define GEMM(F, NAME)                                                                           \
    TILE(F, 1) TILE(F, 2) TILE(F, 3) TILE(F, 4) TILE(F, 5) TILE(F, 6) TILE(F, 7) TILE(F, 8)     \
    void NAME(const float *x, const void *panels, float *y, int64_t M, int64_t K, int64_t N, int threads) { \
        const int64_t G = K >> 5, count = (N + NR - 1) / NR, stride = G * F##_BYTES, blocks = (M + MR - 1) / MR; \
        int8_t *a = aligned_alloc(64, (size_t)((PARTS * M * K + 63) / 64 * 64));              \
        float *e = malloc((size_t)(M * G) * sizeof *e), *s = malloc((size_t)(M * G) * sizeof *s); \
        int32_t *c = malloc((size_t)(M * G) * sizeof *c);                                       \
        if (!a || !e || !s || !c) abort(); /* at most a pass's inputs: a few hundred KB */      \
        quantize_rows(x, M, K, a, e, s, c);                                                     \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                       \
        for (int64_t q = 0; q < count; q++) {                                                   \
            const uint8_t *panel = (const uint8_t *)panels + q * stride;                        \
            int64_t cols = N - q * NR < NR ? N - q * NR : NR;                                   \
            for (int64_t blk = 0, m0 = 0; blk < blocks; blk++) {                                \
                int64_t rows = (M - m0 + blocks - blk - 1) / (blocks - blk);                    \
                const int8_t *ar = a + m0 * K;                                                  \
                const float *er = e + m0 * G, *sr = s + m0 * G;                                 \
                const int32_t *cr = c + m0 * G;                                                 \
                float *yb = y + m0 * N + q * NR;                                                \
                switch (rows) {                                                                 \
                CASE(F, 1) CASE(F, 2) CASE(F, 3) CASE(F, 4) CASE(F, 5) CASE(F, 6) CASE(F, 7)    \
                default: F##_tile_8(panel, ar, M * K, er, sr, cr, yb, N, K, cols); break;       \
                }                                                                               \
                m0 += rows;                                                                     \
            }                                                                                   \
        }                                                                                       \
        free(a);                                                                                \
        free(e);                                                                                \
        free(s);                                                                                \
        free(c);                                                                                \
    }

GEMM(q41, rows_gemm_q41)
GEMM(q80, rows_gemm_q80)
#endif
