/* y[m][n] = sum_k x[m][k] * w[n][k] for a few rows m, with w kept in the block-quantized format
 * the target's checkpoint stores it in (GGUF's Q4_1 and Q8_0), decoded to float32 on the fly.
 *
 * Where a checkpoint is block-quantized, its float32 weights are d * q + m per block of 32
 * (Q4_1: 4-bit q, float16 d and m; Q8_0: 8-bit signed q, float16 d, no m): every one of them is
 * exactly representable, and d * q is exact in float32 (11 + 4 or 11 + 7 significant bits), so
 * fma(q, d, m) rounds once, as the float32 conversion did. Decoding is exact; a pass reads 0.75
 * (Q4_1) or 1.125 (Q8_0) bytes a weight instead of 4, and the step's floor falls with it.
 *
 * Layout: panels of NR = 16 weight rows as rows_gemm.c packs them, and within a panel one
 * record per 32 k:
 *   Q4_1: float d[16], float m[16], then 32 k x 8 bytes: byte j = q[row j] | q[row j + 8] << 4
 *         (384 bytes for 512 weights);
 *   Q8_0: float d[16], then 32 k x 16 int8 (576 bytes for 512 weights).
 * Decoding one k gives the two vectors of 16 weights the float32 panel would hold, and the tiles
 * below are rows_gemm.c's (same accumulators, same order of sums), so a product through this
 * kernel equals, bit for bit, the float32 packed kernel's product with the decoded weights.
 * K must be a multiple of 32. Needs AVX2 and FMA.
 */
#ifndef ROWS_GEMM_AVX512 /* on AVX-512 CPUs rows_gemm_512.c's products take their place */
#include <immintrin.h>
#include <stdint.h>

#define NR 16
#define MR 6
#define Q41_BYTES 384 /* one 32-k record of a Q4_1 panel */
#define Q80_BYTES 576 /* one 32-k record of a Q8_0 panel */

/* One record's scales, loaded once per 32 k: D(b) declares them; W(b, kk, w0, w1) decodes the 16
 * weights of k = record * 32 + kk into w0 (rows 0..7 of the panel) and w1 (rows 8..15). */
#define q41_D(b)                                                                                \
    const __m256 dl = _mm256_load_ps((const float *)(b)), dh = _mm256_load_ps((const float *)(b) + 8); \
    const __m256 ml = _mm256_load_ps((const float *)(b) + 16), mh = _mm256_load_ps((const float *)(b) + 24);
#define q41_W(b, kk, w0, w1)                                                                    \
    {                                                                                           \
        __m256i v_ = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)((b) + 128 + (kk) * 8))); \
        w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v_, _mm256_set1_epi32(15))), dl, ml); \
        w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v_, 4)), dh, mh);           \
    }
#define q80_D(b)                                                                                \
    const __m256 dl = _mm256_load_ps((const float *)(b)), dh = _mm256_load_ps((const float *)(b) + 8);
#define q80_W(b, kk, w0, w1)                                                                    \
    {                                                                                           \
        const __m128i *q_ = (const __m128i *)((b) + 64 + (kk) * 16);                            \
        w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(q_))), dl);  \
        w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const uint8_t *)q_ + 8)))), dh); \
    }

static inline void put16(float *y, int64_t cols, __m256 lo, __m256 hi) {
    if (cols == NR) {
        _mm256_storeu_ps(y, lo);
        _mm256_storeu_ps(y + 8, hi);
        return;
    }
    float t[NR];
    _mm256_storeu_ps(t, lo);
    _mm256_storeu_ps(t + 8, hi);
    for (int64_t j = 0; j < cols; j++) y[j] = t[j];
}

/* The tiles of rows_gemm.c, record by record: a record's scales are loaded once, then its 32 k
 * decoded as the float32 tile would load them, into the same accumulators in the same order.
 * The record PDB ahead is prefetched as the record starts. */
#define PDB 2
#define PF(F, b)                                                                                \
    for (int l_ = 0; l_ < F##_BYTES; l_ += 64)                                                  \
        _mm_prefetch((const char *)(b) + PDB * F##_BYTES + l_, _MM_HINT_T0);

#define ACC(r) __m256 c##r##0 = _mm256_setzero_ps(), c##r##1 = c##r##0;
#define FMA(r)                                                                                  \
    if (rows > r) {                                                                             \
        __m256 s = _mm256_broadcast_ss(x + r * ldx + k);                                        \
        c##r##0 = _mm256_fmadd_ps(w0, s, c##r##0);                                              \
        c##r##1 = _mm256_fmadd_ps(w1, s, c##r##1);                                              \
    }
#define PUT(r) if (rows > r) put16(y + r * ldy, cols, c##r##0, c##r##1);
#define ACC2(r) __m256 c##r##0 = _mm256_setzero_ps(), c##r##1 = c##r##0, d##r##0 = c##r##0, d##r##1 = c##r##0;
#define FMA2(r)                                                                                 \
    if (rows > r) {                                                                             \
        __m256 s = _mm256_broadcast_ss(x + r * ldx + k), t = _mm256_broadcast_ss(x + r * ldx + k + 1); \
        c##r##0 = _mm256_fmadd_ps(w0, s, c##r##0);                                              \
        c##r##1 = _mm256_fmadd_ps(w1, s, c##r##1);                                              \
        d##r##0 = _mm256_fmadd_ps(v0, t, d##r##0);                                              \
        d##r##1 = _mm256_fmadd_ps(v1, t, d##r##1);                                              \
    }
#define SUM2(r) if (rows > r) c##r##0 = _mm256_add_ps(c##r##0, d##r##0), c##r##1 = _mm256_add_ps(c##r##1, d##r##1);

/* one row: k in fours into 8 accumulators (rows_gemm.c's tile_1) */
#define TILE1(F)                                                                                \
    static inline void F##_tile_1(const uint8_t *p, const float *x, int64_t ldx, float *y,      \
                                  int64_t ldy, int64_t K, int64_t cols) {                       \
        (void)ldx, (void)ldy;                                                                   \
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0, d0 = a0, d1 = a0; \
        for (int64_t g = 0; g < K >> 5; g++) {                                                  \
            const uint8_t *b = p + g * F##_BYTES;                                               \
            PF(F, b)                                                                            \
            F##_D(b)                                                                            \
            for (int kk = 0; kk < 32; kk += 4) {                                                \
                const float *xk = x + g * 32 + kk;                                              \
                __m256 w0, w1;                                                                  \
                F##_W(b, kk, w0, w1)                                                            \
                __m256 s = _mm256_broadcast_ss(xk);                                             \
                a0 = _mm256_fmadd_ps(w0, s, a0), a1 = _mm256_fmadd_ps(w1, s, a1);               \
                F##_W(b, kk + 1, w0, w1)                                                        \
                s = _mm256_broadcast_ss(xk + 1);                                                \
                b0 = _mm256_fmadd_ps(w0, s, b0), b1 = _mm256_fmadd_ps(w1, s, b1);               \
                F##_W(b, kk + 2, w0, w1)                                                        \
                s = _mm256_broadcast_ss(xk + 2);                                                \
                c0 = _mm256_fmadd_ps(w0, s, c0), c1 = _mm256_fmadd_ps(w1, s, c1);               \
                F##_W(b, kk + 3, w0, w1)                                                        \
                s = _mm256_broadcast_ss(xk + 3);                                                \
                d0 = _mm256_fmadd_ps(w0, s, d0), d1 = _mm256_fmadd_ps(w1, s, d1);               \
            }                                                                                   \
        }                                                                                       \
        put16(y, cols, _mm256_add_ps(_mm256_add_ps(a0, b0), _mm256_add_ps(c0, d0)),             \
              _mm256_add_ps(_mm256_add_ps(a1, b1), _mm256_add_ps(c1, d1)));                     \
    }
/* 2..6 rows: one k at a time into 2R accumulators (rows_gemm.c's TILE; rows_gemm.c takes 2 and 3
 * rows k in pairs, which here would spill registers: the scales take 4 of the 16) */
#define TILE(F, R)                                                                              \
    static inline void F##_tile_##R(const uint8_t *p, const float *x, int64_t ldx, float *y,    \
                                    int64_t ldy, int64_t K, int64_t cols) {                     \
        const int rows = R;                                                                     \
        ACC(0) ACC(1) ACC(2) ACC(3) ACC(4) ACC(5)                                               \
        for (int64_t g = 0; g < K >> 5; g++) {                                                  \
            const uint8_t *b = p + g * F##_BYTES;                                               \
            PF(F, b)                                                                            \
            F##_D(b)                                                                            \
            for (int kk = 0; kk < 32; kk++) {                                                   \
                const int64_t k = g * 32 + kk;                                                  \
                __m256 w0, w1;                                                                  \
                F##_W(b, kk, w0, w1)                                                            \
                FMA(0) FMA(1) FMA(2) FMA(3) FMA(4) FMA(5)                                       \
            }                                                                                   \
        }                                                                                       \
        PUT(0) PUT(1) PUT(2) PUT(3) PUT(4) PUT(5)                                               \
    }
/* Rows per block for M rows: blocks of MR, but 7 and 8 rows as 4+3 and 4+4 (every block decodes
 * the panel again, in registers, and a block of 1 or 2 rows costs nearly what 4 do). */
static inline int64_t block_rows(int64_t left) {
    return left <= MR ? left : left <= 8 ? 4 : MR;
}

#define GEMM(F)                                                                                 \
    TILE1(F) TILE(F, 2) TILE(F, 3) TILE(F, 4) TILE(F, 5) TILE(F, 6)                             \
    /* x [M, K], panels as above for w [N, K] (K % 32 == 0), y [M, N]; any M >= 1 */            \
    void rows_gemm_##F(const float *x, const uint8_t *panels, float *y, int64_t M, int64_t K,   \
                       int64_t N, int threads) {                                                \
        int64_t count = (N + NR - 1) / NR, stride = (K >> 5) * F##_BYTES;                       \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                       \
        for (int64_t q = 0; q < count; q++) {                                                   \
            const uint8_t *panel = panels + q * stride;                                         \
            int64_t cols = N - q * NR < NR ? N - q * NR : NR;                                   \
            for (int64_t m0 = 0; m0 < M;) {                                                     \
                int64_t rows = block_rows(M - m0);                                              \
                const float *xb = x + m0 * K;                                                   \
                float *yb = y + m0 * N + q * NR;                                                \
                switch (rows) {                                                                 \
                case 1: F##_tile_1(panel, xb, K, yb, N, K, cols); break;                        \
                case 2: F##_tile_2(panel, xb, K, yb, N, K, cols); break;                        \
                case 3: F##_tile_3(panel, xb, K, yb, N, K, cols); break;                        \
                case 4: F##_tile_4(panel, xb, K, yb, N, K, cols); break;                        \
                case 5: F##_tile_5(panel, xb, K, yb, N, K, cols); break;                        \
                default: F##_tile_6(panel, xb, K, yb, N, K, cols); break;                       \
                }                                                                               \
                m0 += rows;                                                                     \
            }                                                                                   \
        }                                                                                       \
    }

#define q41_BYTES Q41_BYTES
#define q80_BYTES Q80_BYTES
GEMM(q41)
GEMM(q80)
#endif
