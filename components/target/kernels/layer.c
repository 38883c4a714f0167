/* One decoder layer of a Llama-family model (Llama, Qwen3's q/k norms), in place on x [T, H]:
 * T new tokens of one or more sequences, flattened. Row t belongs to sequence seq[t] (its row of
 * this layer's KV slab kc/vc [B, h_kv, S, d]) and sits at position pos[t], which is also its
 * cache slot (RoPE: cos/sin tables [S, d]). One sequence's verify pass is seq = 0.., pos =
 * start..start+T-1; a batch's decode step is one row per sequence. One call per layer replaces
 * ~25 torch ops whose dispatch costs more than their arithmetic at decode sizes.
 *
 *   h = rms(x) * norm1;  q|k|v = h Wqkvᵀ;  (q, k: rms per head * q_norm/k_norm);  RoPE(q, k)
 *   cache[seq[t], pos[t]] = k, v;  a = softmax(q kᵀ / sqrt(d)) v over slots 0..pos[t] of seq[t]
 *   x += a Woᵀ;  h = rms(x) * norm2;  g|u = h Wguᵀ;  x += (silu(g) * u) Wdownᵀ
 *
 * Every row's keys/values are written before any row attends, so rows of one sequence see each
 * other causally (a row reads slots up to its own position, whatever the call order). With
 * `upto` (else NULL), row t reads slots 0..upto[t] instead: a block drafter's block, whose rows
 * all read each other and the context before them.
 *
 * The weights come packed in panels of 16 rows, each product's in its own format (`formats`:
 * float32 panels, rows_gemm.c; or the checkpoint's Q4_1 / Q8_0 blocks, rows_gemm_blocks.c; on AVX-512 CPUs
 * rows_gemm_512.c's); attention runs one (key/value head, chunk of keys, token) per OpenMP
 * iteration, its query heads together over each key and value row (one (head, chunk, token)
 * where a pass has fewer such units than twice the threads), 8 keys at a time, its exponentials
 * (and SiLU's) by a vectorized expf within 2 ulp; a query's bits are the same either way and at
 * any thread count. A query over more than ATTEND_CHUNK keys reads them in chunks of near-equal
 * size (the split depends on its key count alone), merged by their softmax statistics: a long
 * context's keys spread over the threads, each read once. Same arithmetic as the torch path in
 * float32, summed in another order.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vexp.h"

/* keys and values prefetched this many rows ahead of the one read (past a head's last row too:
 * a prefetch never faults) */
#ifndef ATTEND_AHEAD
#define ATTEND_AHEAD 16
#endif
#ifndef ATTEND_CHUNK /* the most keys a query's attention reads per unit of work (kernels.ATTEND_CHUNK) */
#define ATTEND_CHUNK 256
#endif

void rows_gemm_packed(const float *x, const float *panels, float *y, int64_t M, int64_t K, int64_t N, int threads);
void rows_gemm_q41(const float *x, const void *panels, float *y, int64_t M, int64_t K, int64_t N, int threads);
void rows_gemm_q80(const float *x, const void *panels, float *y, int64_t M, int64_t K, int64_t N, int threads);

/* a product through the kernel of the weight's format: 0 float32 panels, 1 Q4_1, 2 Q8_0 */
static void gemm(int format, const float *x, const void *w, float *y, int64_t M, int64_t K, int64_t N, int threads) {
    if (format == 1) rows_gemm_q41(x, w, y, M, K, N, threads);
    else if (format == 2) rows_gemm_q80(x, w, y, M, K, N, threads);
    else rows_gemm_packed(x, w, y, M, K, N, threads);
}

static inline float hsum8(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    return _mm_cvtss_f32(_mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1)));
}

/* a · b over n floats: AVX2, two accumulators (a scalar loop would not vectorize: a float
 * reduction may not be reordered without -ffast-math) */
static inline float dot(const float *a, const float *b, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    float total = hsum8(_mm256_add_ps(s0, s1));
    for (; i < n; i++) total += a[i] * b[i];
    return total;
}

static void rms_rows(const float *x, const float *w, float *y, int64_t rows, int64_t n, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *yr = y + r * n;
        float ss = dot(xr, xr, n);
        float inv = 1.f / sqrtf(ss / (float)n + eps);
        for (int64_t i = 0; i < n; i++) yr[i] = w[i] * (xr[i] * inv);
    }
}


/* s[j] = q · keys[j] * scale for 8 keys (rows of [.., d], d % 8 == 0): one accumulator per key,
 * the q chunk loaded once per 8 dims, then the 8 sums taken across lanes together. */
static inline void scores8(const float *q, const float *keys, int64_t d, float scale, float *s) {
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
        __m256 qi = _mm256_loadu_ps(q + i);
        for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qi, _mm256_loadu_ps(keys + j * d + i), a[j]);
    }
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3); /* [s0..s3 of lanes 0-3 | of lanes 4-7], .. */
    __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
    _mm256_storeu_ps(s, _mm256_mul_ps(sum, _mm256_set1_ps(scale)));
}

/* sc [n] scores → their softmax's numerators e^(s - max) in place; returns 1 / Σ (the caller
 * scales); stats[0], stats[1] = max, Σ (what merging key chunks needs). */
static inline float softmax_numerators(float *sc, int64_t n, float *stats) {
    int64_t j;
    float top = -INFINITY, sum = 0.f;
    __m256 tops = _mm256_set1_ps(-INFINITY);  /* exact in any order (a NaN score makes the output NaN either way) */
    for (j = 0; j + 8 <= n; j += 8) tops = _mm256_max_ps(tops, _mm256_loadu_ps(sc + j));
    for (; j < n; j++) top = sc[j] > top ? sc[j] : top;
    __m128 t4 = _mm_max_ps(_mm256_castps256_ps128(tops), _mm256_extractf128_ps(tops, 1));
    t4 = _mm_max_ps(t4, _mm_movehl_ps(t4, t4));
    t4 = _mm_max_ss(t4, _mm_shuffle_ps(t4, t4, 1));
    top = _mm_cvtss_f32(t4) > top ? _mm_cvtss_f32(t4) : top;
    __m256 total = _mm256_setzero_ps(), shift = _mm256_set1_ps(top);
    for (j = 0; j + 8 <= n; j += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), shift));
        _mm256_storeu_ps(sc + j, e);
        total = _mm256_add_ps(total, e);
    }
    for (; j < n; j++) sum += (sc[j] = exp1(sc[j] - top));
    sum += hsum8(total);
    stats[0] = top, stats[1] = sum;
    return 1.f / sum;
}

/* G queries q [G, d] (the query heads sharing one key/value head) over keys/values ks/vs [n, d]
 * → out [G, d] = softmax(q kᵀ scale) v; sc: G rows of `span` ≥ n floats of scratch. Each key
 * and value row is loaded once for all G queries (it is read from memory once, not G times);
 * every query's arithmetic is the one-query order (8 keys at a time, exp8, values summed 64
 * dims at a time), so its result is bit for bit what it would be alone. G is a constant where
 * this is inlined (the accumulators stay in registers); d % 8 == 0. stats [G, 2]: each query's
 * score max and Σ e^(s - max) (softmax_numerators). */
static inline __attribute__((always_inline)) void attend_group(const float *q, const float *ks, const float *vs,
                                                               int64_t n, int64_t d, float scale, const int G,
                                                               int64_t span, float *sc, float *out, float *stats) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {  /* the 8 keys stay in L1 across the G queries */
        for (int64_t l = 0; l < 8 * d; l += 16)  /* keys ATTEND_AHEAD on (prefetching changes no bits) */
            _mm_prefetch((const char *)(ks + (j + ATTEND_AHEAD) * d + l), _MM_HINT_T0);
        for (int g = 0; g < G; g++) scores8(q + g * d, ks + j * d, d, scale, sc + g * span + j);
    }
    for (; j < n; j++)
        for (int g = 0; g < G; g++) sc[g * span + j] = dot(q + g * d, ks + j * d, d) * scale;
    float inv[4];
    for (int g = 0; g < G; g++) inv[g] = softmax_numerators(sc + g * span, n, stats + 2 * g);
    for (int64_t i0 = 0; i0 < d; i0 += 64) {
        int64_t width = d - i0 < 64 ? (d - i0) / 8 : 8;
        __m256 a[4][8];
        for (int g = 0; g < G; g++)
            for (int c = 0; c < 8; c++) a[g][c] = _mm256_setzero_ps();
        for (j = 0; j < n; j++) {
            const float *v = vs + j * d + i0;
            for (int64_t l = 0; l < 8 * width; l += 16) _mm_prefetch((const char *)(v + ATTEND_AHEAD * d + l), _MM_HINT_T0);
            if (width == 8) {
                for (int c = 0; c < 8; c++) {
                    __m256 vc = _mm256_loadu_ps(v + 8 * c);
                    for (int g = 0; g < G; g++) a[g][c] = _mm256_fmadd_ps(_mm256_set1_ps(sc[g * span + j]), vc, a[g][c]);
                }
            } else {
                for (int c = 0; c < width; c++) {
                    __m256 vc = _mm256_loadu_ps(v + 8 * c);
                    for (int g = 0; g < G; g++) a[g][c] = _mm256_fmadd_ps(_mm256_set1_ps(sc[g * span + j]), vc, a[g][c]);
                }
            }
        }
        for (int g = 0; g < G; g++)
            for (int c = 0; c < width; c++)
                _mm256_storeu_ps(out + g * d + i0 + 8 * c, _mm256_mul_ps(a[g][c], _mm256_set1_ps(inv[g])));
    }
}

/* One query q [d] over keys/values ks/vs [n, d] → out [d] = softmax(q kᵀ scale) v; sc: n floats
 * of scratch. Vectorized for d % 8 == 0 (8 keys a time, exp8, the values summed 64 dims at a time). */
static void attend(const float *q, const float *ks, const float *vs, int64_t n, int64_t d, float scale,
                   float *sc, float *out, float *stats) {
    if (d % 8 == 0) {
        attend_group(q, ks, vs, n, d, scale, 1, n, sc, out, stats);
        return;
    }
    for (int64_t j = 0; j < n; j++) sc[j] = dot(q, ks + j * d, d) * scale;
    float inv = softmax_numerators(sc, n, stats);
    memset(out, 0, sizeof(float) * d);
    for (int64_t j = 0; j < n; j++)
        for (int64_t i = 0; i < d; i++) out[i] += sc[j] * vs[j * d + i];
    for (int64_t i = 0; i < d; i++) out[i] *= inv;
}

/* The `group` query heads of key/value head `kv`, one row: attend_group with G a constant where
 * the model's grouping allows (2, 3, 4 heads a key/value head), else one head at a time. */
static void attend_heads(const float *q, const float *ks, const float *vs, int64_t n, int64_t d, float scale,
                         int64_t group, int64_t span, float *sc, float *out, float *stats) {
    if (d % 8 == 0 && group == 2) attend_group(q, ks, vs, n, d, scale, 2, span, sc, out, stats);
    else if (d % 8 == 0 && group == 3) attend_group(q, ks, vs, n, d, scale, 3, span, sc, out, stats);
    else if (d % 8 == 0 && group == 4) attend_group(q, ks, vs, n, d, scale, 4, span, sc, out, stats);
    else
        for (int64_t g = 0; g < group; g++)
            attend(q + g * d, ks, vs, n, d, scale, sc + g * span, out + g * d, stats + 2 * g);
}

/* A query over n keys reads them in chunk_count(n) = ceil(n / ATTEND_CHUNK) chunks of near-equal
 * size (the first ones one key longer): its chunk c is keys [c0, c1). The split depends on n alone. */
static inline int64_t chunk_count(int64_t n) { return (n + ATTEND_CHUNK - 1) / ATTEND_CHUNK; }

static inline void chunk_of(int64_t n, int64_t c, int64_t *c0, int64_t *c1) {
    int64_t chunks = chunk_count(n), base = n / chunks, extra = n % chunks;
    *c0 = c * base + (c < extra ? c : extra);
    *c1 = *c0 + base + (c < extra);
}

/* out [d] = a query's attention from its per-chunk results part [chunks, d] (each normalized
 * over its own keys) and stats [chunks, 2] (their score max and Σ e^(s - max)): chunk c weighs
 * Σ_c e^(max_c - M) over the same summed over the chunks (M the largest max), summed in chunk
 * order. One chunk is copied as it is (the bits of an unchunked attention). */
static void merge_chunks(const float *part, const float *stats, int64_t chunks, int64_t d, float *out) {
    if (chunks == 1) {
        memcpy(out, part, sizeof(float) * d);
        return;
    }
    float top = -INFINITY, total = 0.f, w[chunks];
    for (int64_t c = 0; c < chunks; c++) top = stats[2 * c] > top ? stats[2 * c] : top;
    for (int64_t c = 0; c < chunks; c++) total += (w[c] = stats[2 * c + 1] * exp1(stats[2 * c] - top));
    for (int64_t c = 0; c < chunks; c++) w[c] /= total;
    for (int64_t i = 0; i < d; i++) {
        float acc = 0.f;
        for (int64_t c = 0; c < chunks; c++) acc += w[c] * part[c * d + i];
        out[i] = acc;
    }
}

/* rotate_half RoPE on one head vector v [d] at table row c/s [d] */
static void rope(float *v, const float *c, const float *s, int64_t d) {
    int64_t half = d / 2;
    for (int64_t i = 0; i < half; i++) {
        float a = v[i], b = v[i + half];
        v[i] = a * c[i] - b * s[i];
        v[i + half] = b * c[i + half] + a * s[i + half];
    }
}

void llama_layer(float *x, int64_t T, const int64_t *seq, const int64_t *pos, int64_t H, int64_t hq, int64_t hkv, int64_t d,
                 int64_t inter, float eps, const float *norm1, const void *wqkv, const float *q_norm,
                 const float *k_norm, const void *wo, const float *norm2, const void *wgu,
                 const void *wdown, float *kc, float *vc, int64_t S, const float *cos, const float *sin,
                 int threads, const int32_t *formats /* [4]: qkv, o, gate|up, down */, const int64_t *upto) {
    int64_t width = (hq + 2 * hkv) * d, group = hq / hkv, span = 0;
    if (!upto) upto = pos;
    for (int64_t t = 0; t < T; t++) span = upto[t] + 1 > span ? upto[t] + 1 : span;
    int64_t chunks = chunk_count(span);  /* key chunks of the longest row */
    float scale = 1.f / sqrtf((float)d);
    float *h = malloc(sizeof(float) * T * H);
    float *qkv = malloc(sizeof(float) * T * width);
    float *att = malloc(sizeof(float) * T * hq * d);
    float *tmp = malloc(sizeof(float) * T * (H > 2 * inter ? H : 2 * inter));
    float *act = malloc(sizeof(float) * T * inter);
    float *scores = malloc(sizeof(float) * T * hq * chunks * ATTEND_CHUNK);
    float *part = malloc(sizeof(float) * T * hq * chunks * d);  /* [T, hq, chunks, d]: each chunk's result */
    float *stats = malloc(sizeof(float) * T * hq * chunks * 2);  /* [T, hq, chunks, 2]: its max and Σ */

    rms_rows(x, norm1, h, T, H, eps);
    gemm(formats[0], h, wqkv, qkv, T, H, width, threads);
    for (int64_t t = 0; t < T; t++) {
        float *row = qkv + t * width;
        const float *c = cos + pos[t] * d, *s = sin + pos[t] * d;
        for (int64_t j = 0; j < hq + hkv; j++) {
            float *v = row + j * d;
            const float *nw = j < hq ? q_norm : k_norm;
            if (nw) rms_rows(v, nw, v, 1, d, eps);
            rope(v, c, s, d);
        }
        for (int64_t g = 0; g < hkv; g++) {
            int64_t at = ((seq[t] * hkv + g) * S + pos[t]) * d;
            memcpy(kc + at, row + (hq + g) * d, sizeof(float) * d);
            memcpy(vc + at, row + (hq + hkv + g) * d, sizeof(float) * d);
        }
    }
    /* attention in units of (key/value head, chunk of keys, row): a head's keys and values read
     * once for all its query heads (and, rows of one sequence being neighbours, from cache for the
     * next row), a long context spread over the threads; (head, chunk, row) units where a pass has
     * fewer than twice the threads of those. Each query's chunks are then merged (merge_chunks).
     * A query's bits are the same either way, at any thread count. */
    if (T * hkv * chunks >= 2 * threads) {
        #pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t it = 0; it < hkv * chunks * T; it++) {
            int64_t t = it % T, c = it / T % chunks, kv = it / (T * chunks), c0, c1;
            if (c >= chunk_count(upto[t] + 1)) continue;  /* a row shorter than the longest */
            chunk_of(upto[t] + 1, c, &c0, &c1);
            int64_t n = c1 - c0;
            const float *ks = kc + ((seq[t] * hkv + kv) * S + c0) * d, *vs = vc + ((seq[t] * hkv + kv) * S + c0) * d;
            float out[group * d], st[group * 2];
            attend_heads(qkv + t * width + kv * group * d, ks, vs, n, d, scale, group, ATTEND_CHUNK,
                         scores + it * group * ATTEND_CHUNK, out, st);
            for (int64_t g = 0; g < group; g++) {
                int64_t at = (t * hq + kv * group + g) * chunks + c;
                memcpy(part + at * d, out + g * d, sizeof(float) * d);
                stats[2 * at] = st[2 * g], stats[2 * at + 1] = st[2 * g + 1];
            }
        }
    } else {
        #pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t it = 0; it < hq * chunks * T; it++) {
            int64_t t = it % T, c = it / T % chunks, head = it / (T * chunks), c0, c1;
            if (c >= chunk_count(upto[t] + 1)) continue;
            chunk_of(upto[t] + 1, c, &c0, &c1);
            int64_t n = c1 - c0;
            int64_t kv = head / group, at = (t * hq + head) * chunks + c;
            const float *ks = kc + ((seq[t] * hkv + kv) * S + c0) * d, *vs = vc + ((seq[t] * hkv + kv) * S + c0) * d;
            attend(qkv + t * width + head * d, ks, vs, n, d, scale, scores + it * ATTEND_CHUNK, part + at * d,
                   stats + 2 * at);
        }
    }
    if (chunks == 1)
        memcpy(att, part, sizeof(float) * T * hq * d);  /* [T, hq, 1, d] is [T, hq * d] */
    else {
        #pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t th = 0; th < T * hq; th++)
            merge_chunks(part + th * chunks * d, stats + th * chunks * 2, chunk_count(upto[th / hq] + 1), d,
                         att + th * d);
    }
    gemm(formats[1], att, wo, tmp, T, hq * d, H, threads);
    for (int64_t i = 0; i < T * H; i++) x[i] += tmp[i];
    rms_rows(x, norm2, h, T, H, eps);
    gemm(formats[2], h, wgu, tmp, T, H, 2 * inter, threads);
    for (int64_t t = 0; t < T; t++) { /* silu(g) * u = g / (1 + e^-g) * u */
        const float *g = tmp + t * 2 * inter, *u = g + inter;
        float *a = act + t * inter;
        int64_t i = 0;
        for (; i + 8 <= inter; i += 8) {
            __m256 gi = _mm256_loadu_ps(g + i);
            __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gi));
            _mm256_storeu_ps(a + i, _mm256_mul_ps(_mm256_div_ps(gi, _mm256_add_ps(_mm256_set1_ps(1.f), e)),
                                                  _mm256_loadu_ps(u + i)));
        }
        for (; i < inter; i++) a[i] = g[i] / (1.f + exp1(-g[i])) * u[i];
    }
    gemm(formats[3], act, wdown, tmp, T, inter, H, threads);
    for (int64_t i = 0; i < T * H; i++) x[i] += tmp[i];
    free(h), free(qkv), free(att), free(tmp), free(act), free(scores), free(part), free(stats);
}

/* A stack of L layers in one call: llama_layer for i = 0..L-1, layer i's pointers at
 * ptrs[10 i ..]: norm1, wqkv, q_norm, k_norm, wo, norm2, wgu, wdown, kc, vc; its formats at
 * formats[4 i ..]. After layer i, where tap_of[i] >= 0, x is copied into taps [T, n_taps, H] at
 * tap tap_of[i]. The same arithmetic as L calls of llama_layer (the same bits); what it saves is
 * the caller's per-call overhead (a decode step is 30 calls on SmolLM2).
 * Where `table` is given, x's rows are first set to the embedding rows table[ids[t]] ([vocab, H]);
 * an id outside 0..vocab-1 stops the call before any work and its row t is returned (else -1).
 * Where `final_norm` is given, the last R rows of x after the last layer are RMS-normalised into
 * `normed` [R, H] (the rows the head reads). Each would otherwise be a torch op of its own between
 * two kernel calls, and right after a pass has streamed every weight through the caches a torch
 * op's first call costs tens of microseconds more than its arithmetic (docs/results.md). */
int64_t llama_layers(float *x, int64_t T, const int64_t *seq, const int64_t *pos, int64_t H, int64_t hq, int64_t hkv,
                  int64_t d, int64_t inter, float eps, int64_t L, void *const *ptrs, const int32_t *formats,
                  int64_t S, const float *cos, const float *sin, int threads, const int64_t *upto,
                  const int64_t *tap_of, float *taps, int64_t n_taps, const int64_t *ids, const float *table,
                  int64_t vocab, const float *final_norm, float *normed, int64_t R) {
    if (table) {
        for (int64_t t = 0; t < T; t++)
            if (ids[t] < 0 || ids[t] >= vocab) return t;
        for (int64_t t = 0; t < T; t++) memcpy(x + t * H, table + ids[t] * H, sizeof(float) * H);
    }
    for (int64_t i = 0; i < L; i++) {
        void *const *p = ptrs + 10 * i;
        llama_layer(x, T, seq, pos, H, hq, hkv, d, inter, eps, p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7],
                    p[8], p[9], S, cos, sin, threads, formats + 4 * i, upto);
        if (tap_of[i] >= 0)
            for (int64_t t = 0; t < T; t++)
                memcpy(taps + (t * n_taps + tap_of[i]) * H, x + t * H, sizeof(float) * H);
    }
    if (final_norm) rms_rows(x + (T - R) * H, final_norm, normed, R, H, eps);
    return -1;
}
