/* The Q4_1 block products of rows_gemm_blocks.c on the tile unit of CPUs with AMX (Intel Xeon
 * since Sapphire Rapids), built in place of rows_gemm_512.c's Q4_1 products there (ROWS_GEMM_AMX;
 * its float32 panels and Q8_0 products stay). Passes of up to VECTOR_ROWS rows (a decode step, a
 * verify pass, a small batch round) take rows_gemm_512.c's vector tiles on this file's layout,
 * bit for bit as on the AVX-512 build; wider ones (a prompt, rollouts of many rows, a large
 * batch round) the tile unit.
 *
 * Why: on AVX-512 every extra row of a pass costs one FMA a weight, so a wide pass is priced by
 * the vector units' arithmetic (docs/results.md). AMX multiplies a tile of up to 16 rows by a tile
 * of weights in one instruction, but in bfloat16. The arithmetic stays float32's:
 *
 *   - a Q4_1 weight is d * q + m with q in 0..15, so a row's product over one 32-k record is
 *     d * sum_k x_k q_k + m * sum_k x_k: the integers q go into the tile unit (exact in
 *     bfloat16), d and m are applied per record in float32;
 *   - x is cut into three bfloat16 pieces, x = hi + mid + lo EXACTLY (each piece takes the next
 *     8 significant bits by truncation, so nothing is lost of float32's 24), and every
 *     product piece * q is exact (8 + 4 significant bits), summed in float32 by the tile unit.
 * So a product is the same arithmetic as float32's, summed in another order (its error against a
 * float64 reference is that of the float32 kernels or smaller: tests/components/target). On the
 * tile unit a row's result depends on that row alone (its pieces, its sums, its tile row).
 *
 * Layout (blocks.pack_panels, nibbles "amx"): panels of 16 weight rows, a record per 32 k: float
 * d[16], float m[16], then 8 lines of 32 bytes: byte i of line j holds element i of tile row 2j
 * (low nibble) and of tile row 2j + 1 (high nibble), where tile row r, element 2n + t is
 * q[weight row n][k = 2r + t] (the tile unit's pairs of k). A record's weights are decoded into a
 * 1 KB tile in memory (a lookup in a table of 0..15 as bfloat16), two panels at a time so the
 * input's tiles are loaded once for both. The tile unit needs the OS's leave (Linux's
 * ARCH_REQ_XCOMP_PERM), which the caller asks for once per process before any call
 * (kernels.request_amx). K must be a multiple of 32.
 */
#ifdef ROWS_GEMM_AMX
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE_ROWS 16 /* input rows per block: one tile */
#ifndef VECTOR_ROWS
#define VECTOR_ROWS 12 /* passes of up to this many rows take rows_gemm_512.c's vector tiles (docs/results.md) */
#endif
#define AHEAD_RECORDS 16 /* records prefetched ahead of the one decoded */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* tiles: 0, 1 the two panels' sums; 2, 3, 4 the input's pieces (hi, mid, lo); 5, 6 the panels' weights */
static void configure(int64_t rows) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 7; t++) c.colsb[t] = 64, c.rows[t] = (uint8_t)(t < 5 ? rows : 16);
    __asm__ volatile("" : : "m"(c) : "memory"); /* every byte stored first: GCC does not see ldtilecfg read them */
    _tile_loadconfig(&c);
}

/* rows [R, K] of x (stride ldx) → xa [G][3][16 rows][32] bfloat16 pieces (x = hi + mid + lo),
 * sx [G][16] = each record's sum of x (for Q4_1's m) */
static void split(const float *x, int64_t ldx, int64_t R, int64_t K, uint16_t *xa, float *sx) {
    const __m512i top = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int64_t r = 0; r < R; r++)
        for (int64_t g = 0; g < K >> 5; g++) {
            const float *xr = x + r * ldx + g * 32;
            __m512 s = _mm512_setzero_ps();
            for (int h = 0; h < 2; h++) {
                __m512 v = _mm512_loadu_ps(xr + 16 * h);
                s = _mm512_add_ps(s, v);
                __m512i hi = _mm512_and_si512(_mm512_castps_si512(v), top);
                __m512 r1 = _mm512_sub_ps(v, _mm512_castsi512_ps(hi)); /* exact */
                __m512i mid = _mm512_and_si512(_mm512_castps_si512(r1), top);
                __m512 r2 = _mm512_sub_ps(r1, _mm512_castsi512_ps(mid)); /* exact, <= 8 significant bits */
                __m512i lo = _mm512_castps_si512(r2);
                uint16_t *out = xa + (g * 3 * TILE_ROWS + r) * 32 + 16 * h;
                _mm256_storeu_si256((__m256i *)out, _mm512_cvtepi32_epi16(_mm512_srli_epi32(hi, 16)));
                _mm256_storeu_si256((__m256i *)(out + TILE_ROWS * 32), _mm512_cvtepi32_epi16(_mm512_srli_epi32(mid, 16)));
                _mm256_storeu_si256((__m256i *)(out + 2 * TILE_ROWS * 32), _mm512_cvtepi32_epi16(_mm512_srli_epi32(lo, 16)));
            }
            sx[g * TILE_ROWS + r] = _mm512_reduce_add_ps(s);
        }
}

/* one record's weights → the 16 x 32 bfloat16 tile t (q looked up in ``table``: 0..15 as bfloat16) */
#define q41_BYTES 384
static inline void decode(const uint8_t *rec, uint16_t *t, __m512i table) {
    const __m512i low = _mm512_set1_epi16(15);
    for (int j = 0; j < 8; j++) {
        __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(rec + 128 + j * 32)));
        _mm512_store_si512((__m512i *)(t + 64 * j), _mm512_permutexvar_epi16(_mm512_and_si512(w, low), table));
        _mm512_store_si512((__m512i *)(t + 64 * j + 32), _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table));
    }
}

/* a record's tile sums c (row r: 16 floats) scaled into acc: d times the sum plus m times the
 * record's sum of that row's x (sxg) */
static inline void scale(const uint8_t *rec, const float *c, const float *sxg, int64_t R, __m512 *acc) {
    const __m512 d = _mm512_load_ps((const float *)rec), m = _mm512_load_ps((const float *)rec + 16);
    for (int64_t r = 0; r < R; r++)
        acc[r] = _mm512_fmadd_ps(_mm512_load_ps(c + 16 * r), d, _mm512_fmadd_ps(m, _mm512_set1_ps(sxg[r]), acc[r]));
}

static inline void put_rows(float *y, int64_t ldy, int64_t R, int64_t cols, const __m512 *acc) {
    __mmask16 keep = (__mmask16)((1u << cols) - 1);
    for (int64_t r = 0; r < R; r++) _mm512_mask_storeu_ps(y + r * ldy, keep, acc[r]);
}

void rows_gemm_q41_vector(const float *x, const void *panels, float *y, int64_t M, int64_t K, int64_t N, int threads);

/* one record of a pair of panels on one block of R <= 16 rows: the tile sums of wa (and wb) with
 * the block's pieces xg, scaled into acc0 (acc1) */
static inline void record_pair(const uint16_t *wa, const uint16_t *wb, const uint16_t *xg, const float *sxg,
                               const uint8_t *r0, const uint8_t *r1, int64_t R, float sums[2][256],
                               __m512 *acc0, __m512 *acc1) {
    _tile_loadd(5, wa, 64);
    if (wb) _tile_loadd(6, wb, 64);
    _tile_loadd(2, xg, 64);
    _tile_loadd(3, xg + TILE_ROWS * 32, 64);
    _tile_loadd(4, xg + 2 * TILE_ROWS * 32, 64);
    _tile_zero(0);
    _tile_dpbf16ps(0, 4, 5); /* smallest pieces first */
    _tile_dpbf16ps(0, 3, 5);
    _tile_dpbf16ps(0, 2, 5);
    _tile_stored(0, sums[0], 64);
    if (wb) {
        _tile_zero(1);
        _tile_dpbf16ps(1, 4, 6);
        _tile_dpbf16ps(1, 3, 6);
        _tile_dpbf16ps(1, 2, 6);
        _tile_stored(1, sums[1], 64);
    }
    scale(r0, sums[0], sxg, R, acc0);
    if (wb) scale(r1, sums[1], sxg, R, acc1);
}

/* x [M, K], panels [ceil(N/16)][K/32][record], y [M, N]. Up to VECTOR_ROWS rows: the AVX-512
 * tiles (rows_gemm_512.c, on this layout). More: OpenMP over pairs of panels, each thread with
 * its own tiles, every block of 16 input rows against the pair; with more than one block, a
 * pair's records are decoded once into a buffer of the thread's (K/32 x 2 KB) and read by each. */
void rows_gemm_q41(const float *x, const void *panels, float *y, int64_t M, int64_t K, int64_t N, int threads) {
    if (M <= VECTOR_ROWS) {
        rows_gemm_q41_vector(x, panels, y, M, K, N, threads);
        return;
    }
    const int64_t G = K >> 5, count = (N + 15) / 16, stride = G * q41_BYTES;
    const int64_t blocks = (M + TILE_ROWS - 1) / TILE_ROWS, piece = G * 3 * TILE_ROWS * 32;
    uint16_t *xa = aligned_alloc(64, (size_t)blocks * piece * 2);
    float *sx = aligned_alloc(64, (size_t)blocks * G * TILE_ROWS * sizeof(float));
    for (int64_t b = 0; b < blocks; b++)
        split(x + b * TILE_ROWS * K, K, M - b * TILE_ROWS < TILE_ROWS ? M - b * TILE_ROWS : TILE_ROWS, K,
              xa + b * piece, sx + b * G * TILE_ROWS);
    #pragma omp parallel num_threads(threads)
    {
        __attribute__((aligned(64))) uint16_t wt[2][16 * 32];
        __attribute__((aligned(64))) float sums[2][16 * 16];
        uint16_t *decoded = blocks > 1 ? aligned_alloc(64, (size_t)G * 2 * 1024) : NULL;
        const __m512i nibble = _mm512_set_epi16(
            0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x4170, 0x4160, 0x4150, 0x4140,
            0x4130, 0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0);
        #pragma omp for schedule(static)
        for (int64_t q = 0; q < count; q += 2) {
            const int two = q + 1 < count;
            const uint8_t *p0 = (const uint8_t *)panels + q * stride, *p1 = p0 + stride;
            if (decoded)
                for (int64_t g = 0; g < G; g++) {
                    _mm_prefetch((const char *)p0 + (g + AHEAD_RECORDS) * q41_BYTES, _MM_HINT_T0);
                    decode(p0 + g * q41_BYTES, decoded + g * 1024, nibble);
                    if (two) {
                        _mm_prefetch((const char *)p1 + (g + AHEAD_RECORDS) * q41_BYTES, _MM_HINT_T0);
                        decode(p1 + g * q41_BYTES, decoded + g * 1024 + 512, nibble);
                    }
                }
            for (int64_t b = 0; b < blocks; b++) {
                const int64_t R = M - b * TILE_ROWS < TILE_ROWS ? M - b * TILE_ROWS : TILE_ROWS;
                configure(R);
                __m512 acc0[TILE_ROWS], acc1[TILE_ROWS];
                for (int r = 0; r < TILE_ROWS; r++) acc0[r] = acc1[r] = _mm512_setzero_ps();
                const float *sxb = sx + b * G * TILE_ROWS;
                for (int64_t g = 0; g < G; g++) {
                    const uint8_t *r0 = p0 + g * q41_BYTES, *r1 = p1 + g * q41_BYTES;
                    const uint16_t *wa = decoded ? decoded + g * 1024 : wt[0], *wb = decoded ? wa + 512 : wt[1];
                    if (!decoded) {
                        _mm_prefetch((const char *)r0 + AHEAD_RECORDS * q41_BYTES, _MM_HINT_T0);
                        decode(r0, wt[0], nibble);
                        if (two) {
                            _mm_prefetch((const char *)r1 + AHEAD_RECORDS * q41_BYTES, _MM_HINT_T0);
                            decode(r1, wt[1], nibble);
                        }
                    }
                    record_pair(wa, two ? wb : NULL, xa + b * piece + g * 3 * TILE_ROWS * 32, sxb + g * TILE_ROWS, r0, r1, R,
                                sums, acc0, acc1);
                }
                float *yq = y + b * TILE_ROWS * N + q * 16;
                put_rows(yq, N, R, N - q * 16 < 16 ? N - q * 16 : 16, acc0);
                if (two) put_rows(yq + 16, N, R, N - (q + 1) * 16 < 16 ? N - (q + 1) * 16 : 16, acc1);
            }
        }
        free(decoded);
        _tile_release();
    }
    free(xa);
    free(sx);
}
#endif
