/* The packed products of rows_gemm.c (float32 panels) and rows_gemm_blocks.c (the checkpoint's
 * Q4_1 / Q8_0 blocks) for CPUs with AVX-512: the same entry points, panels and record layouts
 * (packing is shared), built in their place where the CPU declares AVX-512 (ROWS_GEMM_AVX512).
 *
 * Why a second set: once a step reads 4-bit blocks, its one-row product is bound by the
 * instructions that decode and multiply, not by the memory, and every extra row of a verify pass
 * by its FMAs (docs/results.md). One zmm register holds a whole panel line (the 16 weight rows of
 * one k) where AVX2 needs two: per k and row one FMA instead of two, the input's broadcast folded
 * into it, and a Q4_1 line decoded in about half the instructions. Its 32 registers also let a
 * block hold up to MR = 16 input rows, so a pass of up to 16 rows reads and decodes each panel once.
 *
 * Tiles: R rows of a block, each with S accumulators taking the k in turn (S = 4 for one row, 2
 * for two or three, 1 from four: enough independent sums to cover the FMA latency), added at the
 * end in a fixed order. The float32 and the block tiles are one macro over the format's decoding,
 * so a product through the blocks equals, bit for bit, the float32 panels' product with the
 * decoded weights, at every row count. Sums run in another order than the AVX2 kernels' (the same
 * arithmetic in float32). K must be a multiple of 32 for blocks; float32 panels take any K.
 */
#ifdef ROWS_GEMM_AVX512
#include <immintrin.h>
#include <stdint.h>

#define NR 16 /* weight rows per panel: one zmm */
#define MR 16 /* input rows per block */
#ifndef AHEAD
#define AHEAD 6144 /* bytes prefetched ahead of the record in use (16 Q4_1 records; bench/target_step.py) */
#endif

/* One record = 32 k of a panel. Per format: its bytes; SCALES(b) declares what a record
 * holds once; LINES(b, kk, w) decodes the lines of k = kk .. kk + 7 of record b into w[0..7]
 * (kk a multiple of 8; the loops below are unrolled, so shifts and offsets are constants). */
#define f32_BYTES (32 * NR * 4)
#define f32_SCALES(b)
#define f32_LINES(b, kk, w)                                                                     \
    _Pragma("GCC unroll 8") for (int i_ = 0; i_ < 8; i_++) w[i_] = _mm512_loadu_ps((const float *)(b) + ((kk) + i_) * NR);

#define q41_BYTES 384 /* float d[16], float m[16], then per 8 k 16 words: word j = row j's 8 q, 4 bits each */
#define q41_SCALES(b)                                                                           \
    const __m512 d_ = _mm512_load_ps((const float *)(b)), m_ = _mm512_load_ps((const float *)(b) + 16); \
    Q41_TABLE
/* k = kk + i: bits 4i of the words of its group of 8, shifted in place, then turned into floats
 * in one of two ways (the same values, so the same products):
 *  - Q41_PERMUTE (Intel cores: kernels.Q41_DECODES): q picked out of the float table 0..15 by a
 *    cross-lane permute, which reads only the index's low 4 bits, so no mask and no conversion:
 *    4 vector instructions a line instead of 5, on cores whose 512-bit units are two ports;
 *  - else masked and converted: no shuffles (a Zen core runs few of those a cycle). */
#if defined(Q41_PERMUTE) || defined(ROWS_GEMM_AMX) /* the AMX build's layout is read by permutes */
#define Q41_TABLE const __m512 iota_ = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
#define Q41_FLOAT(v, i) _mm512_permutexvar_ps((i) ? _mm512_srli_epi32(v, 4 * (i)) : (v), iota_)
#else
#define Q41_TABLE const __m512i low_ = _mm512_set1_epi32(15);
#define Q41_FLOAT(v, i) _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 4 * (i)), low_))
#endif
#ifndef ROWS_GEMM_AMX
#define q41_LINES(b, kk, w)                                                                     \
    {                                                                                           \
        const __m512i v_ = _mm512_loadu_si512((const void *)((b) + 128 + ((kk) >> 3) * 64));   \
        _Pragma("GCC unroll 8") for (int i_ = 0; i_ < 8; i_++)                                  \
            w[i_] = _mm512_fmadd_ps(Q41_FLOAT(v_, i_), d_, m_);                                 \
    }
#else
/* rows_gemm_amx.c's layout (blocks.pack_panels "amx"): row n's q of k = 4j + 2h + t sit in byte 2n + t
 * of line j, nibble h; widened to 16 bits, 32-bit lane n holds them at bits 16t + 4h. */
#define q41_LINES(b, kk, w)                                                                     \
    _Pragma("GCC unroll 2") for (int j_ = 0; j_ < 2; j_++) {                                    \
        const __m512i v_ = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)((b) + 128 + (((kk) >> 2) + j_) * 32))); \
        w[4 * j_] = _mm512_fmadd_ps(_mm512_permutexvar_ps(v_, iota_), d_, m_);                 \
        w[4 * j_ + 1] = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v_, 16), iota_), d_, m_); \
        w[4 * j_ + 2] = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v_, 4), iota_), d_, m_); \
        w[4 * j_ + 3] = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v_, 20), iota_), d_, m_); \
    }
#endif

#define q80_BYTES 576 /* float d[16], then 32 k x 16 int8 */
#define q80_SCALES(b) const __m512 d_ = _mm512_load_ps((const float *)(b));
#define q80_LINES(b, kk, w)                                                                     \
    _Pragma("GCC unroll 8") for (int i_ = 0; i_ < 8; i_++)                                      \
        w[i_] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(                          \
                    _mm_loadu_si128((const __m128i *)((b) + 64 + ((kk) + i_) * 16)))), d_);

static inline void put(float *y, int64_t cols, __m512 v) {
    if (cols == NR) _mm512_storeu_ps(y, v);
    else _mm512_mask_storeu_ps(y, (__mmask16)((1u << cols) - 1), v);
}

/* A block of R input rows (x at stride ldx, y at stride ldy) against one panel p of format F. */
#define TILE(F, R, S)                                                                           \
    static inline void F##_tile_##R(const uint8_t *p, const float *x, int64_t ldx, float *y,    \
                                    int64_t ldy, int64_t K, int64_t cols) {                     \
        __m512 acc[R][S];                                                                       \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                    \
            _Pragma("GCC unroll 4") for (int s = 0; s < S; s++) acc[r][s] = _mm512_setzero_ps(); \
        int64_t g = 0;                                                                          \
        for (; g < K >> 5; g++) {                                                               \
            const uint8_t *b = p + g * F##_BYTES;                                               \
            F##_SCALES(b)                                                                       \
            _Pragma("GCC unroll 4") for (int kk = 0; kk < 32; kk += 8) {                        \
                _Pragma("GCC unroll 8") for (int l_ = 0; l_ < F##_BYTES / 4; l_ += 64) /* this quarter, AHEAD on */ \
                    _mm_prefetch((const char *)b + AHEAD + kk * (F##_BYTES / 32) + l_, _MM_HINT_T0); \
                __m512 w[8];                                                                    \
                F##_LINES(b, kk, w)                                                             \
                const float *xk = x + g * 32 + kk;                                              \
                _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                            \
                    _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++)                         \
                        acc[r][i % S] = _mm512_fmadd_ps(w[i], _mm512_set1_ps(xk[r * ldx + i]), acc[r][i % S]); \
            }                                                                                   \
        }                                                                                       \
        for (int64_t k = g * 32; k < K; k++) { /* float32 panels only: K past a multiple of 32 */ \
            __m512 w = _mm512_loadu_ps((const float *)p + k * NR);                              \
            _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                \
                acc[r][0] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[r * ldx + k]), acc[r][0]);      \
        }                                                                                       \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {                                  \
            __m512 v = acc[r][0];                                                               \
            if (S == 2) v = _mm512_add_ps(v, acc[r][S - 1]);                                    \
            if (S == 4) v = _mm512_add_ps(_mm512_add_ps(v, acc[r][1 % S]), _mm512_add_ps(acc[r][2 % S], acc[r][S - 1])); \
            put(y + r * ldy, cols, v);                                                          \
        }                                                                                       \
    }

#define CASE(F, R) case R: F##_tile_##R(panel, xb, K, yb, N, K, cols); break;

/* x [M, K], w's panels (rows_gemm_pack or blocks.pack_panels), y [M, N]; any M >= 1. M rows go
 * in ceil(M / MR) blocks of near-equal size; every block reads the panel (from cache after the
 * first). */
#define GEMM(F, NAME, STRIDE)                                                                   \
    TILE(F, 1, 4) TILE(F, 2, 4) TILE(F, 3, 4) TILE(F, 4, 2) TILE(F, 5, 2) TILE(F, 6, 2)         \
    TILE(F, 7, 2) TILE(F, 8, 1) TILE(F, 9, 1) TILE(F, 10, 1) TILE(F, 11, 1) TILE(F, 12, 1)      \
    TILE(F, 13, 1) TILE(F, 14, 1) TILE(F, 15, 1) TILE(F, 16, 1)                                 \
    void NAME(const float *x, const void *panels, float *y, int64_t M, int64_t K, int64_t N,    \
              int threads) {                                                                    \
        int64_t count = (N + NR - 1) / NR, stride = (STRIDE), blocks = (M + MR - 1) / MR;       \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                       \
        for (int64_t q = 0; q < count; q++) {                                                   \
            const uint8_t *panel = (const uint8_t *)panels + q * stride;                        \
            int64_t cols = N - q * NR < NR ? N - q * NR : NR;                                   \
            for (int64_t b = 0, m0 = 0; b < blocks; b++) {                                      \
                int64_t rows = (M - m0 + blocks - b - 1) / (blocks - b);                        \
                const float *xb = x + m0 * K;                                                   \
                float *yb = y + m0 * N + q * NR;                                                \
                switch (rows) {                                                                 \
                CASE(F, 1) CASE(F, 2) CASE(F, 3) CASE(F, 4) CASE(F, 5) CASE(F, 6) CASE(F, 7)    \
                CASE(F, 8) CASE(F, 9) CASE(F, 10) CASE(F, 11) CASE(F, 12) CASE(F, 13)           \
                CASE(F, 14) CASE(F, 15) default: F##_tile_16(panel, xb, K, yb, N, K, cols); break; \
                }                                                                               \
                m0 += rows;                                                                     \
            }                                                                                   \
        }                                                                                       \
    }

GEMM(f32, rows_gemm_packed, K * NR * 4)
#ifdef ROWS_GEMM_AMX /* a few rows on rows_gemm_amx.c's layout; that file's rows_gemm_q41 takes more */
GEMM(q41, rows_gemm_q41_vector, (K >> 5) * q41_BYTES)
#elif !defined(ROWS_GEMM_BF16) && !defined(ROWS_GEMM_INT8) && !defined(ROWS_GEMM_INT16) /* rows_gemm_bf16.c's or _int8.c's there */
GEMM(q41, rows_gemm_q41, (K >> 5) * q41_BYTES)
#endif
#if !defined(ROWS_GEMM_INT8) && !defined(ROWS_GEMM_INT16) /* rows_gemm_int8.c's take its place there */
GEMM(q80, rows_gemm_q80, (K >> 5) * q80_BYTES)
#endif
#endif
