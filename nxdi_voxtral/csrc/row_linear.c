/* y = x @ w.T for a few rows (decode: 1, verify: K+1 <= 16), fp32 or bf16, on AVX-512 CPUs.
 *
 * Why not BLAS: CPU BLAS picks kernel and reduction order by the number of rows, so row j of a K+1-row verify
 * pass and the 1-row decode step of the same input get different bits, and a near-tie argmax flips between plain
 * greedy and speculation. Here every output y[r, n] is one accumulation chain over k in a fixed order (16 fp32 or
 * 32 bf16 lanes per step, a masked tail, then one fixed horizontal sum), whatever the number of rows, the tile it
 * lands in or the thread count. The weight is streamed from memory once per call for all rows, blocks ahead
 * prefetched while this one is multiplied, so a verify pass costs little more than a decode step while memory
 * bandwidth is the limit.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 8     /* output features per work item */
#define AHEAD 2     /* prefetch the weight rows of the work item this many items ahead */
#define ROW_CHUNK 8 /* rows per pass over a block */

int row_linear_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512bf16");
}

static inline uint16_t bf16_round(float v) { /* round to nearest even, as torch's float -> bfloat16 */
    uint32_t u;
    memcpy(&u, &v, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline __attribute__((always_inline)) __m512i load(const char *p, int64_t left, const int full,
                                                          const int bf16) {
    if (full) return _mm512_loadu_si512(p);
    return bf16 ? _mm512_maskz_loadu_epi16((__mmask32)((1ull << left) - 1), p)
                : _mm512_maskz_loadu_epi32((__mmask16)((1u << left) - 1), p);
}

static inline __attribute__((always_inline)) __m512 multiply_add(__m512 acc, __m512i w, __m512i x, const int bf16) {
    return bf16 ? _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x)
                : _mm512_fmadd_ps(_mm512_castsi512_ps(w), _mm512_castsi512_ps(x), acc);
}

/* one step of lanes along k (full, or the masked tail): nf weight vectors, each x vector loaded once and
 * multiplied into nf chains */
static inline __attribute__((always_inline)) void step(__m512 acc[][ROW_CHUNK], const char *x, const char *w,
                                                       int64_t K, int64_t n0, int64_t r0, int64_t k, const int full,
                                                       const int nf, const int rc, const int bf16) {
    const int64_t es = bf16 ? 2 : 4;
    __m512i wv[BLOCK];
    for (int f = 0; f < nf; f++) wv[f] = load(w + ((n0 + f) * K + k) * es, K - k, full, bf16);
    for (int r = 0; r < rc; r++) {
        __m512i xv = load(x + ((r0 + r) * K + k) * es, K - k, full, bf16);
        for (int f = 0; f < nf; f++) acc[f][r] = multiply_add(acc[f][r], wv[f], xv, bf16);
    }
}

/* rows r0..r0+rc-1 times features n0..n0+nf-1 over the whole of K; nf, rc and bf16 are constants where this is
 * inlined, so the nf * rc accumulators are registers. pf: the nf weight rows to prefetch, or NULL. */
static inline __attribute__((always_inline)) void tile(const char *x, const char *w, char *y, int64_t K, int64_t N,
                                                       int64_t n0, int64_t r0, const char *pf, const int nf,
                                                       const int rc, const int bf16) {
    const int64_t es = bf16 ? 2 : 4, lanes = 64 / es;
    __m512 acc[BLOCK][ROW_CHUNK];
    for (int f = 0; f < nf; f++)
        for (int r = 0; r < rc; r++) acc[f][r] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + lanes <= K; k += lanes) {
        if (pf)
            for (int f = 0; f < nf; f++) _mm_prefetch(pf + (f * K + k) * es, _MM_HINT_T1);
        step(acc, x, w, K, n0, r0, k, 1, nf, rc, bf16);
    }
    if (k < K) step(acc, x, w, K, n0, r0, k, 0, nf, rc, bf16);
    for (int f = 0; f < nf; f++)
        for (int r = 0; r < rc; r++) {
            float v = _mm512_reduce_add_ps(acc[f][r]);
            int64_t at = (r0 + r) * N + n0 + f;
            if (bf16) ((uint16_t *)y)[at] = bf16_round(v);
            else ((float *)y)[at] = v;
        }
}

/* Features per tile for rc rows: at least 8 independent chains to hide the FMA latency, at most 24 accumulators. */
#define TILES(bf16)                                                                                             \
    switch (rc) {                                                                                               \
    case 1: for (int s = 0; s < 8; s += 8) tile(x, w, y, K, N, n0 + s, r0, PF(s), 8, 1, bf16); break;          \
    case 2: for (int s = 0; s < 8; s += 8) tile(x, w, y, K, N, n0 + s, r0, PF(s), 8, 2, bf16); break;          \
    case 3: for (int s = 0; s < 8; s += 4) tile(x, w, y, K, N, n0 + s, r0, PF(s), 4, 3, bf16); break;          \
    case 4: for (int s = 0; s < 8; s += 4) tile(x, w, y, K, N, n0 + s, r0, PF(s), 4, 4, bf16); break;          \
    case 5: for (int s = 0; s < 8; s += 4) tile(x, w, y, K, N, n0 + s, r0, PF(s), 4, 5, bf16); break;          \
    case 6: for (int s = 0; s < 8; s += 4) tile(x, w, y, K, N, n0 + s, r0, PF(s), 4, 6, bf16); break;          \
    case 7: for (int s = 0; s < 8; s += 2) tile(x, w, y, K, N, n0 + s, r0, PF(s), 2, 7, bf16); break;          \
    default: for (int s = 0; s < 8; s += 2) tile(x, w, y, K, N, n0 + s, r0, PF(s), 2, 8, bf16); break;         \
    }
/* the last features when N is not a multiple of BLOCK: one at a time */
#define TAIL(bf16)                                                                                              \
    for (int64_t n = n0; n < N; n++) switch (rc) {                                                              \
        case 1: tile(x, w, y, K, N, n, r0, NULL, 1, 1, bf16); break;                                           \
        case 2: tile(x, w, y, K, N, n, r0, NULL, 1, 2, bf16); break;                                           \
        case 3: tile(x, w, y, K, N, n, r0, NULL, 1, 3, bf16); break;                                           \
        case 4: tile(x, w, y, K, N, n, r0, NULL, 1, 4, bf16); break;                                           \
        case 5: tile(x, w, y, K, N, n, r0, NULL, 1, 5, bf16); break;                                           \
        case 6: tile(x, w, y, K, N, n, r0, NULL, 1, 6, bf16); break;                                           \
        case 7: tile(x, w, y, K, N, n, r0, NULL, 1, 7, bf16); break;                                           \
        default: tile(x, w, y, K, N, n, r0, NULL, 1, 8, bf16); break;                                          \
        }

/* x [R, K], w [N, K], y [R, N], all contiguous; bf16: 0 = float32, 1 = bfloat16 (as uint16) */
void row_linear(const char *x, const char *w, char *y, int64_t R, int64_t N, int64_t K, int bf16, int threads) {
    const int64_t es = bf16 ? 2 : 4, blocks = (N + BLOCK - 1) / BLOCK;
    int nt = (N * K < (1 << 16)) ? 1 : threads; /* small products are not worth waking the thread pool */
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t n0 = b * BLOCK;
        for (int64_t r0 = 0; r0 < R; r0 += ROW_CHUNK) {
            int rc = (int)(R - r0 < ROW_CHUNK ? R - r0 : ROW_CHUNK);
            const char *next = (r0 == 0 && n0 + (AHEAD + 1) * BLOCK <= N) ? w + (n0 + AHEAD * BLOCK) * K * es : NULL;
#define PF(s) (next ? next + (s) * K * es : NULL)
            if (n0 + BLOCK > N) {
                if (bf16) TAIL(1) else TAIL(0)
            } else if (bf16) {
                TILES(1)
            } else {
                TILES(0)
            }
#undef PF
        }
    }
}
