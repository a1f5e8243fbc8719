/* The decode and verify passes' CPU kernels (decode: b rows, verify: b x (K+1) rows), fp32 or bf16, AVX-512:
 * row_linear (y = x @ w.T) and decode_attention. Each computes every output row by one fixed sequence of
 * operations whatever the number of rows beside it, so a verify row gets the bits its decode step gets.
 *
 * row_linear. Why not BLAS: CPU BLAS picks kernel and reduction order by the number of rows, so row j of a K+1-row verify
 * pass and the 1-row decode step of the same input get different bits, and a near-tie argmax flips between plain
 * greedy and speculation. Here every output y[r, n] is one accumulation chain over k in a fixed order (16 fp32 or
 * 32 bf16 lanes per step, a masked tail, then one fixed horizontal sum), whatever the number of rows, the tile it
 * lands in or the thread count. The weight is streamed from memory once per call for all rows, blocks ahead
 * prefetched while this one is multiplied, so a verify pass costs little more than a decode step while memory
 * bandwidth is the limit.
 */
#include <immintrin.h>
#include <stdint.h>
#include <math.h>
#include <omp.h>
#include <string.h>

#define BLOCK 8     /* output features per work item */
#define AHEAD 2     /* prefetch the weight rows of the work item this many items ahead */
#define ROW_CHUNK 8 /* rows per pass over a block */

int kernels_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") &&
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

/* ------------------------------------------------------------------------------------------------------------
 * decode_attention: out[t, h] = softmax(scale * q[t, h] . k[g]^T, visible[t]) @ v[g], g = h / (Hq / Hkv)
 * (grouped-query attention without repeating k/v). torch's CPU SDPA picks kernel and blocking by the query
 * count (and calls per row cost one kernel launch each); here each (row, head) is one work item: scores over
 * the visible keys (each a fixed-order dot product), max, exp, sum and the weighted sum of v rows in key order.
 * Rows that see no key get zeros. */

/* 16 elements (those in mask) as float32 */
static inline __attribute__((always_inline)) __m512 load16(const char *p, __mmask16 mask, const int bf16) {
    if (!bf16) return _mm512_maskz_loadu_ps(mask, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

static inline __m512 exp_nonpositive(__m512 x) { /* exp(x) for x <= 0, ~1 ulp: 2^n * Taylor(r), |r| <= ln2/2 */
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

#define MAX_HEAD_DIM 256

/* one (row t, head h) of decode_attention; bf16 is a constant where this is inlined */
static inline __attribute__((always_inline)) void attention_item(
    const char *q, const char *k, const char *v, char *out, const uint8_t *visible, int64_t t, int64_t h, int64_t Hq,
    int64_t group, int64_t D, int64_t S, int64_t k_head_stride, int64_t v_head_stride, int64_t key_base, float scale,
    float *score, const int bf16) {
    const int64_t es = bf16 ? 2 : 4, dv = (D + 15) / 16, g = h / group;
    const __mmask16 tail = (__mmask16)(D % 16 ? (1u << (D % 16)) - 1 : 0xffff);
#define LANES(i) ((i) == dv - 1 ? tail : (__mmask16)0xffff)
    const uint8_t *vis = visible + t * S;
    const char *kg = k + (g * k_head_stride + key_base * D) * es, *vg = v + (g * v_head_stride + key_base * D) * es;
    __m512 qv[MAX_HEAD_DIM / 16];
    for (int64_t i = 0; i < dv; i++) qv[i] = load16(q + ((t * Hq + h) * D + i * 16) * es, LANES(i), bf16);
    float m = -INFINITY;
    for (int64_t j = 0; j < S; j++) {
        if (!vis[j]) {
            score[j] = -INFINITY;
            continue;
        }
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < dv; i++)
            acc = _mm512_fmadd_ps(qv[i], load16(kg + (j * D + i * 16) * es, LANES(i), bf16), acc);
        score[j] = _mm512_reduce_add_ps(acc) * scale;
        m = score[j] > m ? score[j] : m;
    }
    __m512 sum = _mm512_setzero_ps(), mv = _mm512_set1_ps(m);
    for (int64_t j = 0; j < S; j += 16) {
        __mmask16 in = (__mmask16)(S - j >= 16 ? 0xffff : (1u << (S - j)) - 1);
        __m512 s = _mm512_maskz_loadu_ps(in, score + j);
        __mmask16 seen = _mm512_mask_cmp_ps_mask(in, s, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
        __m512 p = _mm512_maskz_mov_ps(seen, exp_nonpositive(_mm512_sub_ps(s, mv)));
        _mm512_mask_storeu_ps(score + j, in, p);
        sum = _mm512_add_ps(sum, p);
    }
    float l = _mm512_reduce_add_ps(sum);
    __m512 o[MAX_HEAD_DIM / 16];
    for (int64_t i = 0; i < dv; i++) o[i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < S; j++) {
        if (!vis[j]) continue;
        __m512 p = _mm512_set1_ps(score[j]);
        for (int64_t i = 0; i < dv; i++)
            o[i] = _mm512_fmadd_ps(p, load16(vg + (j * D + i * 16) * es, LANES(i), bf16), o[i]);
    }
    __m512 inv = _mm512_set1_ps(l > 0 ? 1.0f / l : 0.0f);
    for (int64_t i = 0; i < dv; i++) {
        __m512 r = _mm512_mul_ps(o[i], inv);
        char *dst = out + ((t * Hq + h) * D + i * 16) * es;
        if (!bf16) {
            _mm512_mask_storeu_ps(dst, LANES(i), r);
            continue;
        }
        float tmp[16];
        _mm512_storeu_ps(tmp, r);
        for (int e = 0; e < 16 && i * 16 + e < D; e++) ((uint16_t *)dst)[e] = bf16_round(tmp[e]);
    }
#undef LANES
}

/* q [T, Hq, D] contiguous; k, v: key j of query row t in kv head g at k + (g * head_stride + (key_base[t] + j) * D)
 * * element size (a batch: each row reads its own sequence's slot of one cache); visible [T, S] bytes; out
 * [T, Hq, D]; scratch: threads * S floats; D <= MAX_HEAD_DIM. */
void decode_attention(const char *q, const char *k, const char *v, char *out, const uint8_t *visible,
                      const int64_t *key_base, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t S,
                      int64_t k_head_stride, int64_t v_head_stride, float scale, int bf16, int threads,
                      float *scratch) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t item = 0; item < T * Hq; item++) {
        float *score = scratch + (int64_t)omp_get_thread_num() * S;
        if (bf16)
            attention_item(q, k, v, out, visible, item / Hq, item % Hq, Hq, Hq / Hkv, D, S, k_head_stride,
                           v_head_stride, key_base[item / Hq], scale, score, 1);
        else
            attention_item(q, k, v, out, visible, item / Hq, item % Hq, Hq, Hq / Hkv, D, S, k_head_stride,
                           v_head_stride, key_base[item / Hq], scale, score, 0);
    }
}
