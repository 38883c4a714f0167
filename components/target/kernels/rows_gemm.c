/* y[m][n] = sum_k x[m][k] * w[n][k] for a few rows m (float32, row-major; w as nn.Linear keeps it).
 *
 * A decode step multiplies 1..16 rows by every weight matrix once: the weights stream from
 * memory, so the kernel's job is to read each weight row once, as one sequential stream at the
 * memory's pace, and do every input row's dot product with it while it is in L1. Per weight
 * row: input rows in groups of up to 4, two AVX2 accumulators each (four for a lone row) so
 * that FMA latency hides behind the loads; K in steps of 16 with a prefetch 512 bytes ahead
 * (measured: bench/target_step.py), then 8, then a scalar tail. Threads split the weight rows
 * (OpenMP, static chunks: each thread streams its own contiguous part).
 * Needs AVX2 and FMA; the loader checks the CPU before building it.
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
