/* The default drafter loss's per-position terms over the readout vocabulary, fused: for each row
 * m of target logits t and draft logits d ([M, V], float32 or bfloat16),
 *
 *   p = softmax(t / T),  q = softmax(d),  alpha = sum min(p, q),  tv = 1/2 sum |p - q|,
 *   logq = log q[tok[m]],
 *
 * in one visit of the row (it stays in cache: the torch path makes about a dozen passes over
 * [M, V] buffers and four of them), keeping what the backward needs: q (float32), s = sign(p - q)
 * (int8) and r = <q, s>. With upstream gradients g_alpha, g_tv, g_logq per row and
 * c = (g_alpha - g_tv) / 2 (ties take 1/2, as torch.minimum's backward does):
 *
 *   d loss / d d_v = q_v (c (s_v - r) - g_logq) + g_logq [v == tok]
 *
 * (overlap.py derives the first part; the second is log-softmax's). Rows are spread over OpenMP
 * threads; exponentials by exp8 (within 2 ulp of expf). Knows nothing of masks or weights.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vexp.h"

static void load_row(const void *src, int bf16, int64_t v, float scale, float *dst) {
    int64_t i = 0;
    if (bf16) {
        const uint16_t *s = (const uint16_t *)src;
        __m256 k = _mm256_set1_ps(scale);
        for (; i + 8 <= v; i += 8) {
            __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + i)));
            _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)), k));
        }
        for (; i < v; i++) {
            uint32_t bits = (uint32_t)s[i] << 16;
            float f;
            __builtin_memcpy(&f, &bits, 4);
            dst[i] = f * scale;
        }
    } else {
        const float *s = (const float *)src;
        for (; i < v; i++) dst[i] = s[i] * scale;
    }
}

static float row_max(const float *x, int64_t v) {
    __m256 m = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= v; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
    float lanes[8], top = -INFINITY;
    _mm256_storeu_ps(lanes, m);
    for (int j = 0; j < 8; j++) top = lanes[j] > top ? lanes[j] : top;
    for (; i < v; i++) top = x[i] > top ? x[i] : top;
    return top;
}

static float hsum(__m256 x) {
    float lanes[8], s = 0.f;
    _mm256_storeu_ps(lanes, x);
    for (int j = 0; j < 8; j++) s += lanes[j];
    return s;
}

/* x[i] <- e^(x[i] - top) in place; returns their sum. */
static float exp_shift(float *x, int64_t v, float top) {
    __m256 sum = _mm256_setzero_ps(), shift = _mm256_set1_ps(top);
    int64_t i = 0;
    for (; i + 8 <= v; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), shift));
        _mm256_storeu_ps(x + i, e);
        sum = _mm256_add_ps(sum, e);
    }
    float s = hsum(sum);
    for (; i < v; i++) s += (x[i] = _mm256_cvtss_f32(exp8(_mm256_set1_ps(x[i] - top))));
    return s;
}

/* out[m] = {alpha, tv, logq, r}; q [M, V] and sign [M, V] written for the backward. */
void tv_ce_forward(const void *target, int target_bf16, const void *draft, int draft_bf16, const int64_t *tok,
                   int64_t rows, int64_t v, float inv_temp, float *q, int8_t *sign, float *out, int threads) {
#pragma omp parallel num_threads(threads)
    {
        float *p = (float *)malloc((size_t)v * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t m = 0; m < rows; m++) {
            float *qm = q + m * v;
            int8_t *sm = sign + m * v;
            load_row((const char *)target + m * v * (target_bf16 ? 2 : 4), target_bf16, v, inv_temp, p);
            load_row((const char *)draft + m * v * (draft_bf16 ? 2 : 4), draft_bf16, v, 1.f, qm);
            float ip = 1.f / exp_shift(p, v, row_max(p, v));
            float dmax = row_max(qm, v), dtok = qm[tok[m]];
            float zq = exp_shift(qm, v, dmax), iq = 1.f / zq;
            __m256 a = _mm256_setzero_ps(), l1 = _mm256_setzero_ps(), r = _mm256_setzero_ps();
            __m256 vp = _mm256_set1_ps(ip), vq = _mm256_set1_ps(iq), zero = _mm256_setzero_ps();
            __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
            int64_t i = 0;
            for (; i + 8 <= v; i += 8) {
                __m256 pi = _mm256_mul_ps(_mm256_loadu_ps(p + i), vp);
                __m256 qi = _mm256_mul_ps(_mm256_loadu_ps(qm + i), vq);
                _mm256_storeu_ps(qm + i, qi);
                __m256 diff = _mm256_sub_ps(pi, qi);
                a = _mm256_add_ps(a, _mm256_min_ps(pi, qi));
                l1 = _mm256_add_ps(l1, _mm256_and_ps(diff, absmask));
                int gt = _mm256_movemask_ps(_mm256_cmp_ps(diff, zero, _CMP_GT_OQ));
                int lt = _mm256_movemask_ps(_mm256_cmp_ps(diff, zero, _CMP_LT_OQ));
                for (int j = 0; j < 8; j++) sm[i + j] = (int8_t)(((gt >> j) & 1) - ((lt >> j) & 1));
                __m256 s = _mm256_sub_ps(_mm256_and_ps(_mm256_cmp_ps(diff, zero, _CMP_GT_OQ), _mm256_set1_ps(1.f)),
                                         _mm256_and_ps(_mm256_cmp_ps(diff, zero, _CMP_LT_OQ), _mm256_set1_ps(1.f)));
                r = _mm256_fmadd_ps(qi, s, r);
            }
            float alpha = hsum(a), l1s = hsum(l1), rs = hsum(r);
            for (; i < v; i++) {
                float pi = p[i] * ip, qi = qm[i] * iq, diff = pi - qi;
                qm[i] = qi;
                alpha += pi < qi ? pi : qi;
                l1s += fabsf(diff);
                sm[i] = (int8_t)((diff > 0.f) - (diff < 0.f));
                rs += qi * (float)sm[i];
            }
            out[4 * m] = alpha;
            out[4 * m + 1] = 0.5f * l1s;
            out[4 * m + 2] = dtok - dmax - logf(zq);
            out[4 * m + 3] = rs;
        }
        free(p);
    }
}

/* float32 -> bfloat16, rounded to nearest even (8 lanes; finite values). */
static inline __m128i to_bf16x8(__m256 x) {
    __m256i bits = _mm256_castps_si256(x);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i up = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(up, up), 0x08);  /* lanes 0..7 in the low half */
    return _mm256_castsi256_si128(packed);
}

static inline uint16_t to_bf16(float x) {
    uint32_t bits;
    __builtin_memcpy(&bits, &x, 4);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* grad [M, V] = q (c (s - r) - g) + g [v == tok]; coef[m] = {c, g, r}; grad float32, or
 * bfloat16 (rounded to nearest even) where grad_bf16. */
void tv_ce_backward(const float *q, const int8_t *sign, const float *coef, const int64_t *tok, int64_t rows,
                    int64_t v, void *grad, int grad_bf16, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t m = 0; m < rows; m++) {
        const float *qm = q + m * v;
        const int8_t *sm = sign + m * v;
        float c = coef[3 * m], g = coef[3 * m + 1], r = coef[3 * m + 2];
        __m256 vc = _mm256_set1_ps(c), vr = _mm256_set1_ps(r), vg = _mm256_set1_ps(g);
        int64_t i = 0, t = tok[m];
        for (; i + 8 <= v; i += 8) {
            __m256 s = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sm + i))));
            __m256 k = _mm256_fmsub_ps(vc, _mm256_sub_ps(s, vr), vg);
            __m256 y = _mm256_mul_ps(_mm256_loadu_ps(qm + i), k);
            if (t >= i && t < i + 8) {  /* the data token's log-softmax term */
                float lanes[8];
                _mm256_storeu_ps(lanes, y);
                lanes[t - i] += g;
                y = _mm256_loadu_ps(lanes);
            }
            if (grad_bf16)
                _mm_storeu_si128((__m128i *)((uint16_t *)grad + m * v + i), to_bf16x8(y));
            else
                _mm256_storeu_ps((float *)grad + m * v + i, y);
        }
        for (; i < v; i++) {
            float y = qm[i] * (c * ((float)sm[i] - r) - g) + (i == t ? g : 0.f);
            if (grad_bf16)
                ((uint16_t *)grad)[m * v + i] = to_bf16(y);
            else
                ((float *)grad)[m * v + i] = y;
        }
    }
}
