/* y[m][n] = sum_k x[m][k] * w[n][k] for a few rows m (float32; w [N, K] as nn.Linear keeps it).
 *
 * A decode step multiplies 1..16 rows by every weight matrix once, and the weights are far larger
 * than the caches: every pass streams them from memory. The kernels' job is to read each weight
 * once, as one sequential stream at the memory's pace, and to do every row's products with it
 * while it is in cache, fast enough that the arithmetic of 2..16 rows hides behind the stream.
 *
 * Two entry points:
 *
 * rows_gemm (w as is, row-major [N, K]): per weight row, the input rows in groups of up to 4,
 *   dot products along K (two accumulators per row, four for a lone row). Per 16 floats of K a
 *   group of 4 rows does 2 weight loads + 8 input loads for 8 FMAs plus 8 horizontal sums per
 *   weight row: load-bound, so 4..16 rows cost 1.5..4.5x one row. Kept for unpacked weights.
 *
 * rows_gemm_packed (w packed once by rows_gemm_pack into panels of NR = 16 weight rows,
 *   [ceil(N/16)][K][16], zero-padded past N): an outer-product micro-kernel, BLIS-style. For one
 *   panel and a block of up to MR = 6 input rows, per k: 2 vector loads of the panel (16 output
 *   columns), one broadcast of x[m][k] per row, 2 FMAs per row into 2 x MR = 12 accumulators
 *   (+ 2 weight vectors + 1 broadcast = 15 of the 16 ymm registers). 8 loads for 12 FMAs: FMA-
 *   bound, not load-bound, and 12 independent accumulators cover the FMA latency (5 cycles x 2
 *   ports). No horizontal sums, no K tail (every k is one 64-byte panel line). The panel stream
 *   is as sequential as the row-major one, so one row still runs at the memory's pace.
 *   M rows go in blocks of 6 and one of the rest (8 = 6+2, 16 = 6+6+4); the first block reads
 *   the panel from memory, the others from L1/L2. A block of R <= 5 rows has 2R accumulators,
 *   so each k waits out the FMA latency: 5 cycles whatever R, and equal blocks (8 = 4+4: 10
 *   cycles per panel line) cost more than 6 + a small rest; blocks of 2 or 3 rows take k in
 *   pairs (4R accumulators, 2.5..3 cycles), one row k in fours (8 accumulators).
 *
 * Prefetch (measured, bench/gemm_rows.py --kernel): with one block, a line PD = 32 lines (2 KB)
 *   ahead into L1, as for a plain stream. With several blocks the blocks after the first compute
 *   from cache and the memory would idle: so every block prefetches a share of the *next* panel
 *   into L2 in proportion to its rows (rows m0..m0+R-1 of M: lines [K m0/M, K (m0+R)/M) of it,
 *   R/M of a line per iteration), which keeps the stream going at a steady pace across all the
 *   blocks' arithmetic. Into L1 it did worse
 *   (a whole panel of K = 576 is 36 KB, more than L1).
 *
 * Threads split the weight rows / panels (OpenMP, static chunks: each thread streams its own
 * contiguous part). Needs AVX2 and FMA; the loader checks the CPU before building it.
 */
#include <immintrin.h>
#include <stdint.h>

#define PREFETCH 128 /* floats ahead */

static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}

/* one weight row wr [K] against one input row x [K] */
static inline float dot1(const float *wr, const float *x, int64_t K) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        _mm_prefetch((const char *)(wr + k + PREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char *)(wr + k + PREFETCH + 16), _MM_HINT_T0);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(wr + k), _mm256_loadu_ps(x + k), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(wr + k + 8), _mm256_loadu_ps(x + k + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(wr + k + 16), _mm256_loadu_ps(x + k + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(wr + k + 24), _mm256_loadu_ps(x + k + 24), a3);
    }
    for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(wr + k), _mm256_loadu_ps(x + k), a0);
    float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; k < K; k++) s += wr[k] * x[k];
    return s;
}

/* one weight row wr [K] against MT input rows x[m * K ..], results to y[m * ldy] */
#define DOTS(MT)                                                                              \
    static inline void dots_##MT(const float *wr, const float *x, float *y, int64_t K,         \
                                 int64_t ldy) {                                               \
        __m256 a[MT][2];                                                                      \
        for (int m = 0; m < MT; m++) a[m][0] = a[m][1] = _mm256_setzero_ps();                 \
        int64_t k = 0;                                                                        \
        for (; k + 16 <= K; k += 16) {                                                        \
            _mm_prefetch((const char *)(wr + k + PREFETCH), _MM_HINT_T0);                     \
            __m256 w0 = _mm256_loadu_ps(wr + k), w1 = _mm256_loadu_ps(wr + k + 8);            \
            for (int m = 0; m < MT; m++) {                                                    \
                a[m][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * K + k), a[m][0]);       \
                a[m][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + m * K + k + 8), a[m][1]);   \
            }                                                                                 \
        }                                                                                     \
        for (; k + 8 <= K; k += 8) {                                                          \
            __m256 w0 = _mm256_loadu_ps(wr + k);                                              \
            for (int m = 0; m < MT; m++)                                                      \
                a[m][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * K + k), a[m][0]);       \
        }                                                                                     \
        for (int m = 0; m < MT; m++) {                                                        \
            float s = hsum(_mm256_add_ps(a[m][0], a[m][1]));                                  \
            for (int64_t j = k; j < K; j++) s += wr[j] * x[m * K + j];                        \
            y[m * ldy] = s;                                                                   \
        }                                                                                     \
    }

DOTS(2)
DOTS(3)
DOTS(4)

static inline void dots(const float *wr, const float *x, float *y, int64_t K, int64_t ldy, int64_t mt) {
    if (mt == 1) *y = dot1(wr, x, K);
    else if (mt == 2) dots_2(wr, x, y, K, ldy);
    else if (mt == 3) dots_3(wr, x, y, K, ldy);
    else dots_4(wr, x, y, K, ldy);
}

/* x [M, K], w [N, K], y [M, N], all contiguous float32; any M >= 1, threads >= 1. */
void rows_gemm(const float *x, const float *w, float *y, int64_t M, int64_t K, int64_t N, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n++)
        for (int64_t m0 = 0; m0 < M; m0 += 4)
            dots(w + n * K, x + m0 * K, y + m0 * N + n, K, N, M - m0 < 4 ? M - m0 : 4);
}

/* ---- packed weights: panels of NR rows, [ceil(N/NR)][K][NR] ---- */

#define NR 16 /* weight rows (output columns) per panel: two AVX2 vectors, one 64-byte line per k */
#define MR 6  /* input rows per block: 2 x MR accumulators */
#define PD 32 /* single block: prefetch distance in panel lines (2 KB) */

/* w [N, K] -> p [ceil(N/NR) * K * NR], rows past N zero. */
void rows_gemm_pack(const float *w, float *p, int64_t N, int64_t K, int threads) {
    int64_t panels = (N + NR - 1) / NR;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t q = 0; q < panels; q++) {
        float *dst = p + q * K * NR;
        for (int64_t j = 0; j < NR; j++) {
            int64_t n = q * NR + j;
            for (int64_t k = 0; k < K; k++) dst[k * NR + j] = n < N ? w[n * K + k] : 0.0f;
        }
    }
}

#ifndef ROWS_GEMM_AVX512 /* on AVX-512 CPUs rows_gemm_512.c's products take their place */

/* 16 results to y, or the first `cols` of them at the last panel */
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

/* The panel prefetch of iteration k: the line ((k * step) >> 16) past `pf` into L2 (several
 * blocks: `step` = 65536 R / M for a block of R rows), or line k past `pf` into L1 (one block:
 * step = 65536). The L2 one is written in asm: gcc 12 at -O3 silently dropped it as an
 * intrinsic (the product of 7+ rows then cost twice that of 6). */
static inline void prefetch(const float *pf, int64_t k, int64_t step) {
    if (step < 65536) __asm__ volatile("prefetcht1 %0" : : "m"(*(const char *)(pf + ((k * step) >> 16) * NR)));
    else _mm_prefetch((const char *)(pf + k * NR), _MM_HINT_T0);
}

/* One row: 2 accumulators would leave the FMAs latency-bound, so k in steps of 4 into 8. */
static inline void tile_1(const float *p, const float *x, int64_t ldx, float *y, int64_t ldy, int64_t K,
                          int64_t cols, const float *pf, int64_t step) {
    (void)ldx, (void)ldy;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0, d0 = a0, d1 = a0;
    int64_t k = 0;
    for (; k + 4 <= K; k += 4) {
        const float *q = p + k * NR;
        for (int i = 0; i < 4; i++) prefetch(pf, k + i, step);
        __m256 s0 = _mm256_broadcast_ss(x + k), s1 = _mm256_broadcast_ss(x + k + 1);
        __m256 s2 = _mm256_broadcast_ss(x + k + 2), s3 = _mm256_broadcast_ss(x + k + 3);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q), s0, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8), s0, a1);
        b0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 16), s1, b0);
        b1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 24), s1, b1);
        c0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 32), s2, c0);
        c1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 40), s2, c1);
        d0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 48), s3, d0);
        d1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 56), s3, d1);
    }
    for (; k < K; k++) {
        __m256 s = _mm256_broadcast_ss(x + k);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(p + k * NR), s, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(p + k * NR + 8), s, a1);
    }
    put16(y, cols, _mm256_add_ps(_mm256_add_ps(a0, b0), _mm256_add_ps(c0, d0)),
          _mm256_add_ps(_mm256_add_ps(a1, b1), _mm256_add_ps(c1, d1)));
}

/* R = 2..MR rows: accumulators as named variables (an array of them ends up on the stack). */
#define ACC(r) __m256 c##r##0 = _mm256_setzero_ps(), c##r##1 = c##r##0;
#define FMA(r)                                                                                  \
    if (rows > r) {                                                                             \
        __m256 s = _mm256_broadcast_ss(x + r * ldx + k);                                        \
        c##r##0 = _mm256_fmadd_ps(w0, s, c##r##0);                                              \
        c##r##1 = _mm256_fmadd_ps(w1, s, c##r##1);                                              \
    }
#define PUT(r) if (rows > r) put16(y + r * ldy, cols, c##r##0, c##r##1);
#define TILE(R)                                                                                 \
    static inline void tile_##R(const float *p, const float *x, int64_t ldx, float *y,          \
                                int64_t ldy, int64_t K, int64_t cols, const float *pf,          \
                                int64_t step) {                                                 \
        const int rows = R;                                                                     \
        ACC(0) ACC(1) ACC(2) ACC(3) ACC(4) ACC(5)                                               \
        for (int64_t k = 0; k < K; k++) {                                                       \
            prefetch(pf, k, step);                                                              \
            __m256 w0 = _mm256_loadu_ps(p + k * NR), w1 = _mm256_loadu_ps(p + k * NR + 8);     \
            FMA(0) FMA(1) FMA(2) FMA(3) FMA(4) FMA(5)                                           \
        }                                                                                       \
        PUT(0) PUT(1) PUT(2) PUT(3) PUT(4) PUT(5)                                               \
    }
/* R = 2, 3 rows: 2R accumulators would leave every k waiting out the FMA latency (5 cycles)
 * for only 2R FMAs, so k in pairs, even k into c, odd k into d: 4R accumulators. */
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
#define TILE_PAIRS(R)                                                                           \
    static inline void tile_##R(const float *p, const float *x, int64_t ldx, float *y,          \
                                int64_t ldy, int64_t K, int64_t cols, const float *pf,          \
                                int64_t step) {                                                 \
        const int rows = R;                                                                     \
        ACC2(0) ACC2(1) ACC2(2)                                                                 \
        int64_t k = 0;                                                                          \
        for (; k + 2 <= K; k += 2) {                                                            \
            prefetch(pf, k, step);                                                              \
            prefetch(pf, k + 1, step);                                                          \
            __m256 w0 = _mm256_loadu_ps(p + k * NR), w1 = _mm256_loadu_ps(p + k * NR + 8);     \
            __m256 v0 = _mm256_loadu_ps(p + k * NR + 16), v1 = _mm256_loadu_ps(p + k * NR + 24); \
            FMA2(0) FMA2(1) FMA2(2)                                                             \
        }                                                                                       \
        SUM2(0) SUM2(1) SUM2(2)                                                                 \
        for (; k < K; k++) {                                                                    \
            __m256 w0 = _mm256_loadu_ps(p + k * NR), w1 = _mm256_loadu_ps(p + k * NR + 8);     \
            FMA(0) FMA(1) FMA(2)                                                                \
        }                                                                                       \
        PUT(0) PUT(1) PUT(2)                                                                    \
    }
TILE_PAIRS(2)
TILE_PAIRS(3)
TILE(4)
TILE(5)
TILE(6)

/* x [M, K], p = rows_gemm_pack(w [N, K]), y [M, N], all contiguous float32; any M >= 1. */
void rows_gemm_packed(const float *x, const float *p, float *y, int64_t M, int64_t K, int64_t N, int threads) {
    int64_t panels = (N + NR - 1) / NR, blocks = (M + MR - 1) / MR;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t q = 0; q < panels; q++) {
        const float *panel = p + q * K * NR;
        int64_t cols = N - q * NR < NR ? N - q * NR : NR;
        for (int64_t b = 0, m0 = 0; b < blocks; b++) {
            int64_t rows = M - m0 < MR ? M - m0 : MR, step = 65536 * rows / M;
            /* this block's share of the next panel, in proportion to its rows (its time); past
             * the last panel the prefetches are harmless: they never fault */
            const float *pf = blocks == 1 ? panel + PD * NR : panel + (K + K * m0 / M) * NR;
            const float *xb = x + m0 * K;
            float *yb = y + m0 * N + q * NR;
            switch (rows) {
            case 1: tile_1(panel, xb, K, yb, N, K, cols, pf, step); break;
            case 2: tile_2(panel, xb, K, yb, N, K, cols, pf, step); break;
            case 3: tile_3(panel, xb, K, yb, N, K, cols, pf, step); break;
            case 4: tile_4(panel, xb, K, yb, N, K, cols, pf, step); break;
            case 5: tile_5(panel, xb, K, yb, N, K, cols, pf, step); break;
            default: tile_6(panel, xb, K, yb, N, K, cols, pf, step); break;
            }
            m0 += rows;
        }
    }
}

#endif

/* The FMA units' rate, for benchmarks: n iterations of 12 independent FMA chains of the build's
 * widest vectors (16 floats with ROWS_GEMM_AVX512, else 8) on each of `threads` threads; returns
 * the FLOPs done (out: a sum, so the work is not optimized away). */
#ifdef ROWS_GEMM_AVX512
#define PEAK_LANES 16
#define PEAK_VEC __m512
#define PEAK_SET _mm512_set1_ps
#define PEAK_FMA _mm512_fmadd_ps
#define PEAK_FIRST _mm512_cvtss_f32
#else
#define PEAK_LANES 8
#define PEAK_VEC __m256
#define PEAK_SET _mm256_set1_ps
#define PEAK_FMA _mm256_fmadd_ps
#define PEAK_FIRST _mm256_cvtss_f32
#endif
double fma_peak(int64_t n, int threads, float *out) {
    #pragma omp parallel num_threads(threads)
    {
        PEAK_VEC a[12], b = PEAK_SET(0.5f);
        for (int j = 0; j < 12; j++) a[j] = PEAK_SET((float)j);
        for (int64_t i = 0; i < n; i++)
            _Pragma("GCC unroll 12") for (int j = 0; j < 12; j++) a[j] = PEAK_FMA(a[j], b, b);
        float s = 0;
        for (int j = 0; j < 12; j++) s += PEAK_FIRST(a[j]);
        #pragma omp atomic
        *out += s;
    }
    return (double)n * 12 * 2 * PEAK_LANES * threads;
}
