/* Attention for CPUs, fp32 or bf16: single-query (decode) attention over
 * kiln's paged KV cache (kiln_decode_layer), and the causal attention of
 * prefill chunks over the same cache (kiln_prefill_layer, at the end).
 *
 * Built by kiln.attention.cpu_attention with the machine's C compiler (-O3
 * -march=native -fopenmp) and called through ctypes by the torch attention
 * backend. It reads each request's keys and values where they lie in the
 * cache, block by block, with an online softmax, instead of gathering them
 * into a padded copy for SDPA.
 *
 * bf16 (kiln_decode_layer's bf16 = 1): query, keys, values and output in bf16, each
 * value widened to fp32 as it is loaded (a shift), scores, softmax and sums in
 * fp32, the output rounded once; the same loops otherwise.
 *
 * Layouts (all contiguous unless a stride is given):
 *   query, out    rows of [H, D]; row b's data at ptr + rows[b] * stride
 *   key, value    [num_blocks, block_size, KV, D]
 *   block_table   [B, bt_stride] int32: block ids of request b, in order
 *   seq_lens      [B] int32: context length of request b (its keys 0..len-1)
 * Query head h reads KV head h / (H / KV) (grouped-query attention).
 *
 * One work item is a request and some of its KV heads: all of them when
 * there are enough requests to keep the threads busy (a key row of every head
 * is then read in one sweep), one head otherwise; and where even that leaves
 * threads idle, a run of the request's blocks, the runs' softmaxes merged
 * after (share_work). The items are shared among `threads` OpenMP threads,
 * a contiguous run each of about equal cost in positions (thread_share).
 * With AVX2 and a head dim that is a multiple of 64, a head's query and its
 * accumulator stay in registers across a block's rows
 * (scores64, weighted64): 1.3-1.8x the plain loops, which load and store the
 * accumulator at every row (bench/results/decode-attention-cpu-20261201-211354.json
 * against -195303.json). With AVX-512 a block is taken a KV head at a time
 * for all its query heads (group_scores, group_weighted: each key and value
 * row loaded and widened once for the group, 16 rows' scores summed across
 * lanes together). The softmax's exponentials run in vectors (exp_sum): the
 * compiler had left them scalar, a fifth of the kernel's time. One layer of
 * the 135M shape, 64 requests x 192 tokens, its cache in the CPU's caches:
 * fp32 0.89 -> 0.61 ms, bf16 0.96 -> 0.50 ms; the AVX2 build 0.92 -> 0.72 and
 * 0.99 -> 0.75 ms (scratch runs of python -m bench.cpu_kernels --only
 * decode-attention's cases). In an engine each layer's cache comes from DRAM:
 * the next block is prefetched while one is computed, a line at a time
 * between its rows (Prefetch).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define KILN_MAX_HEADS 32  /* query heads of one work item (kept on the stack) */
#define KILN_MAX_DIM 256
#define KILN_MAX_BLOCK 128
/* The fewest blocks a run of a split request takes (share_work): one request
 * of 40 tokens (3 blocks of 16) in two runs took 11.1 us a layer against 10.6
 * as a head an item (the scratch A/B quoted there). */
#define KILN_MIN_RUN 4
/* Lines of the next block asked for before a block's first row (Prefetch):
 * 4 and 32 did as well in the A/B quoted there. */
#define KILN_PREFETCH_AHEAD 16

static inline float bf16_to_f32(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);  /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* Element i of a row of fp32 (bf16 == 0) or bf16 values. */
static inline float elem(const void *p, int64_t i, const int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* exp(x) for x <= 0 (a score minus its running maximum), written so that the
   compiler vectorises it: x = n ln2 + f, exp(x) = 2^n p(f). */
static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    const float f = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * f + 1.3981999507e-3f;
    p = p * f + 8.3334519073e-3f;
    p = p * f + 4.1665795894e-2f;
    p = p * f + 1.6666665459e-1f;
    p = p * f + 5.0000001201e-1f;
    p = p * f * f + f + 1.0f;
    int32_t bits;
    memcpy(&bits, &p, 4);
    bits += ((int32_t)n) << 23;
    memcpy(&p, &bits, 4);
    return p;
}

/* The next block's keys and values, asked for a cache line of each at a time
 * between the rows of the block being computed (prefetch_row), its rows
 * lying anywhere in the cache, where the hardware's prefetchers do not
 * follow. Asked for all at once before a block (one prefetch a line: 192 for
 * a block of the 135M shape), the prefetches stalled the core once its few
 * line-fill buffers were taken, so the block's reads and its arithmetic took
 * turns; spread over the rows they overlap. A 64-request bf16 step of the 135M
 * shape (96-216 tokens, 2 threads of an Intel Xeon, scratch A/B taking
 * turns): attention 16.5-17.4 -> 13.2-13.9 ms, the step 42.4-44.5 -> 38.9-41.0
 * ms. Asking for every second line (the adjacent-line prefetcher to bring the
 * other) made the step 41.1-42.3 -> 49.6-52.2 ms; two lines a row with none
 * ahead of the first row, 14.6-15.0 ms of attention. The 64 requests of
 * python -m bench.decode --throughput 64 --dtype bfloat16: 1189-1205 ->
 * 1231-1265 tok/s (bench/results/decode-throughput-cpu-20261206-020857.json
 * and the three runs after it, taking turns). */
typedef struct {
    const char *k, *v;   /* the block's row 0 at the work item's first KV head */
    int64_t row, span;   /* bytes from a row to the next; bytes a row to fetch */
    int64_t rows, r, o;  /* rows to fetch (0: nothing), the next line's row and offset */
    int64_t per;         /* lines a row step asks for (prefetch_row) */
} Prefetch;

static inline void prefetch_start(Prefetch *pf, const void *key, const void *value, int64_t blk, int64_t bs,
                                  int64_t pos_stride, int64_t offset, int64_t span, size_t esize) {
    pf->rows = blk >= 0 ? bs : 0;  /* blk -1: no block to ask for */
    pf->r = pf->o = 0;
    pf->row = pos_stride * (int64_t)esize;
    pf->span = span * (int64_t)esize;
    const int64_t at = blk >= 0 ? (blk * bs * pos_stride + offset) * (int64_t)esize : 0;
    pf->k = (const char *)key + at;
    pf->v = (const char *)value + at;
}

/* The next n lines of the block's keys and of its values. */
static inline __attribute__((always_inline)) void prefetch_some(Prefetch *pf, int64_t n) {
    for (int64_t i = 0; i < n && pf->r < pf->rows; ++i) {
        __builtin_prefetch(pf->k + pf->r * pf->row + pf->o, 0, 3);
        __builtin_prefetch(pf->v + pf->r * pf->row + pf->o, 0, 3);
        pf->o += 64;
        if (pf->o >= pf->span) { pf->o = 0; pf->r++; }
    }
}

/* What one step of a loop over the rows of the block being computed asks for:
 * the lines left after KILN_PREFETCH_AHEAD, shared evenly over the steps the
 * block's loops take (block_steps), so that the last are asked for near its
 * end, not in a burst at its start. */
static inline __attribute__((always_inline)) void prefetch_row(Prefetch *pf) { prefetch_some(pf, pf->per); }

static inline int64_t prefetch_lines(const Prefetch *pf) { return pf->rows * ((pf->span + 63) / 64); }

static inline void prefetch_spread(Prefetch *pf, int64_t steps) {
    const int64_t left = prefetch_lines(pf) - KILN_PREFETCH_AHEAD;
    pf->per = left <= 0 || steps <= 0 ? 0 : (left + steps - 1) / steps;
}

#if defined(__AVX2__) && defined(__FMA__)
static inline float hsum8(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}
#endif

/* 8 values of a row as fp32 lanes. */
#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 load8(const void *p, int64_t i, const int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)p + i);
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#endif

/* a[0:n] . b[0:n], a fp32, b fp32 or bf16 */
static inline __attribute__((always_inline)) float dot(const float *a, const void *b, int64_t n, const int bf16) {
#if defined(__AVX2__) && defined(__FMA__)
    if ((n & 15) == 0) {  /* two accumulators: the FMA latency is not the limit */
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
        for (int64_t d = 0; d < n; d += 16) {
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), load8(b, d, bf16), s0);
            s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), load8(b, d + 8, bf16), s1);
        }
        return hsum8(_mm256_add_ps(s0, s1));
    }
#endif
    float s = 0.f;
    for (int64_t d = 0; d < n; ++d) s += a[d] * elem(b, d, bf16);
    return s;
}

#if defined(__AVX512F__)
/* With AVX-512 a block is computed a KV head at a time for all the query heads
 * that read it (grouped-query attention): each key and value row is loaded
 * (and for bf16 widened) once for the group, and the scores of 16 rows are
 * summed across their lanes together (sums16) instead of row by row. */

/* 16 values of a row as fp32 lanes. */
static inline __m512 load16(const void *p, int64_t i, const int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float *)p + i);
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* The horizontal sums of v[0..15], in order: 45 shuffles and adds for 16 rows
 * where a sum per row costs about 8. */
static inline __m512 sums16(const __m512 *v) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; ++i)  /* per 128-bit chunk: [a0+a2, b0+b2, a1+a3, b1+b3] */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i)  /* per chunk: the chunk's sums of 4 rows */
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

/* s[h][j] = q_h . k_j for NH query heads (q: their scaled queries, D each)
 * and rows j in [lo, hi) of one KV head (k: its row 0; rows `stride` apart). */
static inline __attribute__((always_inline)) void group_scores(
        const float *q, const void *k, int64_t stride, int64_t D, int64_t lo, int64_t hi,
        float (*s)[KILN_MAX_BLOCK], Prefetch *pf, const int NH, const int bf16) {
    for (int64_t j0 = lo; j0 < hi; j0 += 16) {
        const int64_t nr = hi - j0 < 16 ? hi - j0 : 16;
        __m512 part[8][16];
        for (int64_t r = 0; r < 16; ++r) {
            __m512 a[8], b[8];
            for (int g = 0; g < NH; ++g) a[g] = b[g] = _mm512_setzero_ps();
            if (r < nr) prefetch_row(pf);
            if (r < nr)
                for (int64_t d = 0; d < D; d += 32) {
                    const int64_t at = (j0 + r) * stride + d;
                    const __m512 k0 = load16(k, at, bf16), k1 = load16(k, at + 16, bf16);
                    for (int g = 0; g < NH; ++g) {
                        a[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + d), k0, a[g]);
                        b[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + d + 16), k1, b[g]);
                    }
                }
            for (int g = 0; g < NH; ++g) part[g][r] = _mm512_add_ps(a[g], b[g]);
        }
        for (int g = 0; g < NH; ++g)
            _mm512_mask_storeu_ps(s[g] + j0, (__mmask16)((1u << nr) - 1), sums16(part[g]));
    }
}

/* acc_h[0:D] += sum_j s[h][j] v_j for NH query heads and rows j in [lo, hi)
 * of one KV head, 64 dims at a time with the accumulators in registers. */
static inline __attribute__((always_inline)) void group_weighted(
        const float (*s)[KILN_MAX_BLOCK], const void *v, int64_t stride, int64_t D, int64_t lo, int64_t hi,
        float *acc, Prefetch *pf, const int NH, const int bf16) {
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
        __m512 av[6][4];
        for (int g = 0; g < NH; ++g)
            for (int i = 0; i < 4; ++i) av[g][i] = _mm512_loadu_ps(acc + g * D + d0 + 16 * i);
        for (int64_t j = lo; j < hi; ++j) {
            prefetch_row(pf);
            __m512 vv[4];
            for (int i = 0; i < 4; ++i) vv[i] = load16(v, j * stride + d0 + 16 * i, bf16);
            for (int g = 0; g < NH; ++g) {
                const __m512 p = _mm512_set1_ps(s[g][j]);
                for (int i = 0; i < 4; ++i) av[g][i] = _mm512_fmadd_ps(p, vv[i], av[g][i]);
            }
        }
        for (int g = 0; g < NH; ++g)
            for (int i = 0; i < 4; ++i) _mm512_storeu_ps(acc + g * D + d0 + 16 * i, av[g][i]);
    }
}

/* exp_nonpos in 16 lanes, the same operations in the same order. */
static inline __m512 exp16_nonpos(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                                        _mm512_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_add_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f))),
                                   _mm512_mul_ps(n, _mm512_set1_ps(2.12194440e-4f)));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, f), f), f), _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_add_epi32(_mm512_castps_si512(p), _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23));
    return _mm512_castsi512_ps(bits);
}

/* s[j] = exp(s[j] - mx) for j in [lo, hi); returns their sum. */
static inline float exp_sum(float *s, int64_t lo, int64_t hi, float mx) {
    __m512 sum = _mm512_setzero_ps();
    const __m512 m = _mm512_set1_ps(mx);
    for (int64_t j = lo; j < hi; j += 16) {
        const __mmask16 k = hi - j >= 16 ? 0xffff : (__mmask16)((1u << (hi - j)) - 1);
        const __m512 e = exp16_nonpos(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), m));
        _mm512_mask_storeu_ps(s + j, k, e);
        sum = _mm512_mask_add_ps(sum, k, sum, e);
    }
    return _mm512_reduce_add_ps(sum);
}

/* The NH argument as a constant (the arrays above then stay in registers). */
#define CALL_NH(n, CALL) switch (n) { \
    case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; case 4: CALL(4); break; \
    case 5: CALL(5); break; case 6: CALL(6); break; case 7: CALL(7); break; default: CALL(8); break; }

/* The block's scores s[h][j] (h: the item's nkv * group query heads, qs their
 * scaled queries; kb: the item's first KV head in the block's row 0). */
static inline __attribute__((always_inline)) void block_scores(
        const float *qs, const void *kb, int64_t stride, int64_t nkv, int64_t group, int64_t D, int64_t lo,
        int64_t hi, float (*s)[KILN_MAX_BLOCK], size_t esize, Prefetch *pf, const int bf16) {
    for (int64_t k = 0; k < nkv; ++k)
        for (int64_t h0 = 0; h0 < group; h0 += 8) {
            const int64_t h = k * group + h0, nh = group - h0 < 8 ? group - h0 : 8;
            const void *kr = (const char *)kb + k * D * esize;
#define SCORES(NH) group_scores(qs + h * D, kr, stride, D, lo, hi, s + h, pf, NH, bf16)
            CALL_NH(nh, SCORES)
#undef SCORES
        }
}

/* acc[h] += the block's rows weighted by s[h] (vb: as kb above, of values). */
static inline __attribute__((always_inline)) void block_weighted(
        const float (*s)[KILN_MAX_BLOCK], const void *vb, int64_t stride, int64_t nkv, int64_t group, int64_t D,
        int64_t lo, int64_t hi, float *acc, size_t esize, Prefetch *pf, const int bf16) {
    for (int64_t k = 0; k < nkv; ++k)
        for (int64_t h0 = 0; h0 < group; h0 += 6) {
            const int64_t h = k * group + h0, nh = group - h0 < 6 ? group - h0 : 6;
            const void *vr = (const char *)vb + k * D * esize;
#define WEIGHTED(NH) group_weighted(s + h, vr, stride, D, lo, hi, acc + h * D, pf, NH, bf16)
            CALL_NH(nh, WEIGHTED)
#undef WEIGHTED
        }
}
#define KILN_BLOCKED 1
/* The row steps (prefetch_row) of block_scores and block_weighted over `rows` rows. */
static inline int64_t block_steps(int64_t nkv, int64_t group, int64_t D, int64_t rows) {
    return nkv * ((group + 7) / 8) * rows + nkv * ((group + 5) / 6) * (D / 64) * rows;
}

#elif defined(__AVX2__) && defined(__FMA__)

/* s[j] += q[0:64] . k_j[0:64] for rows j in [lo, hi), q held in registers
   (the loops over 8 vectors unroll fully at -O3). */
static inline __attribute__((always_inline)) void scores64(const float *q, const void *k, int64_t stride, int64_t lo,
                                                           int64_t hi, float *s, Prefetch *pf, const int bf16) {
    __m256 qv[8];
    for (int i = 0; i < 8; ++i) qv[i] = _mm256_loadu_ps(q + 8 * i);
    for (int64_t j = lo; j < hi; ++j) {
        prefetch_row(pf);
        const int64_t r = j * stride;
        __m256 a = _mm256_mul_ps(qv[0], load8(k, r, bf16)), b = _mm256_mul_ps(qv[1], load8(k, r + 8, bf16));
        for (int i = 2; i < 8; i += 2) {  /* two chains: the FMA latency is not the limit */
            a = _mm256_fmadd_ps(qv[i], load8(k, r + 8 * i, bf16), a);
            b = _mm256_fmadd_ps(qv[i + 1], load8(k, r + 8 * i + 8, bf16), b);
        }
        s[j] += hsum8(_mm256_add_ps(a, b));
    }
}

/* acc[0:64] += sum_j p[j] v_j[0:64] for rows j in [lo, hi), acc held in registers. */
static inline __attribute__((always_inline)) void weighted64(const float *p, const void *v, int64_t stride, int64_t lo,
                                                             int64_t hi, float *acc, Prefetch *pf, const int bf16) {
    __m256 av[8];
    for (int i = 0; i < 8; ++i) av[i] = _mm256_loadu_ps(acc + 8 * i);
    for (int64_t j = lo; j < hi; ++j) {
        prefetch_row(pf);
        const __m256 w = _mm256_set1_ps(p[j]);
        for (int i = 0; i < 8; ++i) av[i] = _mm256_fmadd_ps(w, load8(v, j * stride + 8 * i, bf16), av[i]);
    }
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(acc + 8 * i, av[i]);
}

/* The block's scores s[h][j], a query head at a time. */
static inline __attribute__((always_inline)) void block_scores(
        const float *qs, const void *kb, int64_t stride, int64_t nkv, int64_t group, int64_t D, int64_t lo,
        int64_t hi, float (*s)[KILN_MAX_BLOCK], size_t esize, Prefetch *pf, const int bf16) {
    for (int64_t h = 0; h < nkv * group; ++h) {
        for (int64_t j = lo; j < hi; ++j) s[h][j] = 0.f;
        for (int64_t d0 = 0; d0 < D; d0 += 64)
            scores64(qs + h * D + d0, (const char *)kb + ((h / group) * D + d0) * esize, stride, lo, hi, s[h], pf,
                     bf16);
    }
}

/* acc[h] += the block's rows weighted by s[h], a query head at a time. */
static inline __attribute__((always_inline)) void block_weighted(
        const float (*s)[KILN_MAX_BLOCK], const void *vb, int64_t stride, int64_t nkv, int64_t group, int64_t D,
        int64_t lo, int64_t hi, float *acc, size_t esize, Prefetch *pf, const int bf16) {
    for (int64_t h = 0; h < nkv * group; ++h)
        for (int64_t d0 = 0; d0 < D; d0 += 64)
            weighted64(s[h], (const char *)vb + ((h / group) * D + d0) * esize, stride, lo, hi, acc + h * D + d0,
                       pf, bf16);
}
#define KILN_BLOCKED 1
/* The row steps (prefetch_row) of block_scores and block_weighted over `rows` rows. */
static inline int64_t block_steps(int64_t nkv, int64_t group, int64_t D, int64_t rows) {
    return 2 * nkv * group * (D / 64) * rows;
}
#else
#define KILN_BLOCKED 0
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* exp_nonpos in 8 lanes, the same operations in the same order. */
static inline __m256 exp8_nonpos(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                                   _mm256_set1_ps(0.5f)));
    const __m256 f = _mm256_add_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f))),
                                   _mm256_mul_ps(n, _mm256_set1_ps(2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, f), f), f), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23));
    return _mm256_castsi256_ps(bits);
}

/* s[j] = exp(s[j] - mx) for j in [lo, hi); returns their sum. */
static inline float exp_sum(float *s, int64_t lo, int64_t hi, float mx) {
    __m256 sum = _mm256_setzero_ps();
    const __m256 m = _mm256_set1_ps(mx);
    int64_t j = lo;
    for (; j + 8 <= hi; j += 8) {
        const __m256 e = exp8_nonpos(_mm256_sub_ps(_mm256_loadu_ps(s + j), m));
        _mm256_storeu_ps(s + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    float total = hsum8(sum);
    for (; j < hi; ++j) { s[j] = exp_nonpos(s[j] - mx); total += s[j]; }
    return total;
}
#elif !defined(__AVX512F__)
/* s[j] = exp(s[j] - mx) for j in [lo, hi); returns their sum. */
static inline float exp_sum(float *s, int64_t lo, int64_t hi, float mx) {
    float sum = 0.f;
    for (int64_t j = lo; j < hi; ++j) { s[j] = exp_nonpos(s[j] - mx); sum += s[j]; }
    return sum;
}
#endif

/* One work item's share of a request: query heads of KV heads kh0 ..
 * kh0 + heads - 1 (nq = heads * group of them) against the positions pos_lo
 * .. pos_hi - 1, block by block with an online softmax. Leaves each query
 * head's running maximum ``m``, sum of exponentials ``l`` and unnormalised
 * output ``acc`` (nothing attended: m = -3e38, l = 0, acc = 0). */
static inline __attribute__((always_inline)) void attend(
        const float *qs, const void *key, const void *value, const int32_t *bt, int64_t pos_lo, int64_t pos_hi,
        int64_t kh0, int64_t heads, int64_t group, int64_t D, int64_t bs, int64_t pos_stride, float *acc, float *m,
        float *l, const int64_t next[2], const int bf16)
{
    const size_t esize = bf16 ? 2 : 4;
    const int64_t nq = heads * group;
    const int blocked = KILN_BLOCKED && D % 64 == 0;  /* head dims 64, 128, 256: the register-blocked loops */
    (void)blocked;  /* unused where neither AVX2 nor AVX-512 is there */
    float s[KILN_MAX_HEADS][KILN_MAX_BLOCK];
    for (int64_t i = 0; i < nq * D; ++i) acc[i] = 0.f;
    for (int64_t h = 0; h < nq; ++h) { m[h] = -3.0e38f; l[h] = 0.f; }
    for (int64_t p0 = pos_lo - pos_lo % bs; p0 < pos_hi; p0 += bs) {
        const int64_t blk = bt[p0 / bs];
        const int64_t lo = p0 < pos_lo ? pos_lo - p0 : 0;
        const int64_t hi = pos_hi - p0 < bs ? pos_hi - p0 : bs;
        const char *kb = (const char *)key + (blk * bs * pos_stride + kh0 * D) * esize;
        const char *vb = (const char *)value + (blk * bs * pos_stride + kh0 * D) * esize;
        /* the next block while this one is computed; after the last, the first
           of the thread's next work item (a block's lines are not in the caches:
           8 layers' caches taking turns, 64 requests x 144 tokens, bf16 0.86 ->
           0.45 ms a layer on an AMD EPYC with a whole block asked for ahead) */
        Prefetch pf;
        if (p0 + bs < pos_hi)
            prefetch_start(&pf, key, value, bt[p0 / bs + 1], bs, pos_stride, kh0 * D, heads * D, esize);
        else
            prefetch_start(&pf, key, value, next[0], bs, pos_stride, next[1], heads * D, esize);
        prefetch_some(&pf, KILN_PREFETCH_AHEAD);
        int64_t steps = 2 * (hi - lo);  /* the plain loops' */
#if KILN_BLOCKED
        if (blocked) steps = block_steps(heads, group, D, hi - lo);
#endif
        prefetch_spread(&pf, steps);
#if KILN_BLOCKED
        if (blocked) {
            block_scores(qs, kb, pos_stride, heads, group, D, lo, hi, s, esize, &pf, bf16);
        } else
#endif
        {
            for (int64_t j = lo; j < hi; ++j, prefetch_row(&pf))
                for (int64_t h = 0; h < nq; ++h)
                    s[h][j] = dot(qs + h * D, kb + (j * pos_stride + (h / group) * D) * esize, D, bf16);
        }
        for (int64_t h = 0; h < nq; ++h) {  /* online softmax: rescale what came before */
            float mx = m[h];
            for (int64_t j = lo; j < hi; ++j) mx = s[h][j] > mx ? s[h][j] : mx;
            const float sum = exp_sum(s[h], lo, hi, mx);
            const float corr = exp_nonpos(m[h] - mx);
            l[h] = l[h] * corr + sum;
            m[h] = mx;
            float *ah = acc + h * D;
            #pragma omp simd
            for (int64_t d = 0; d < D; ++d) ah[d] *= corr;
        }
#if KILN_BLOCKED
        if (blocked) {
            block_weighted((const float (*)[KILN_MAX_BLOCK])s, vb, pos_stride, heads, group, D, lo, hi, acc, esize,
                           &pf, bf16);
        } else
#endif
        {
            for (int64_t j = lo; j < hi; ++j, prefetch_row(&pf))
                for (int64_t h = 0; h < nq; ++h) {
                    const void *v = vb + (j * pos_stride + (h / group) * D) * esize;
                    const float p = s[h][j];
                    float *ah = acc + h * D;
                    for (int64_t d = 0; d < D; ++d) ah[d] += p * elem(v, d, bf16);
                }
        }
        prefetch_some(&pf, prefetch_lines(&pf));  /* what the rows left unasked */
    }
}

/* The query heads of a work item, scaled, as fp32. */
static inline void load_query(const void *query, int64_t qh, int64_t n, float scale, float *qs, const int bf16) {
    for (int64_t i = 0; i < n; ++i) qs[i] = elem(query, qh + i, bf16) * scale;
}

/* out[h] = acc[h] / l[h] for nq heads of D values. */
static inline void store_heads(const float *acc, const float *l, int64_t nq, int64_t D, void *out, int64_t oh,
                               const int bf16) {
    for (int64_t h = 0; h < nq; ++h) {
        const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
        for (int64_t d = 0; d < D; ++d) {
            const float o = acc[h * D + d] * inv;
            if (bf16) ((uint16_t *)out)[oh + h * D + d] = f32_to_bf16(o);
            else ((float *)out)[oh + h * D + d] = o;
        }
    }
}

/* The positions a request attends to: the last ``window`` (all when 0). */
static inline int64_t first_position(int64_t len, int64_t window) {
    return (window > 0 && len > window) ? len - window : 0;
}

/* The run of a request's blocks that work item (b, c, p) takes: its positions
 * [*lo, *hi) (empty: *lo >= *hi). */
static inline void item_run(const int32_t *seq_lens, int64_t window, int64_t bs, int64_t parts, int64_t b, int64_t p,
                            int64_t *lo, int64_t *hi) {
    const int64_t len = seq_lens[b], start = first_position(len, window);
    const int64_t first = start / bs, blocks = len > start ? (len - 1) / bs - first + 1 : 0;
    const int64_t b0 = first + blocks * p / parts, b1 = first + blocks * (p + 1) / parts;
    *lo = b0 * bs > start ? b0 * bs : start;
    *hi = b1 * bs < len ? b1 * bs : len;
}

/* Work item ``item``'s first block and the offset of its first KV head in a
 * cache row (next[0] = -1: no such item, or one with nothing to attend). */
static inline void item_first_block(const int32_t *block_table, int64_t bt_stride, const int32_t *seq_lens,
                                    int64_t window, int64_t bs, int64_t chunks, int64_t parts, int64_t heads,
                                    int64_t D, int64_t items, int64_t item, int64_t next[2]) {
    next[0] = -1;
    next[1] = 0;
    if (item >= items) return;
    const int64_t b = item / (chunks * parts), c = item / parts % chunks, p = item % parts;
    int64_t lo, hi;
    item_run(seq_lens, window, bs, parts, b, p, &lo, &hi);
    if (lo >= hi) return;
    next[0] = block_table[b * bt_stride + lo / bs];
    next[1] = c * heads * D;
}

/* Work item ``item``'s cost in positions read, plus one block's worth for
 * what an item pays whatever its length (its query, its output). */
static inline int64_t item_cost(const int32_t *seq_lens, int64_t window, int64_t bs, int64_t chunks, int64_t parts,
                                int64_t item) {
    int64_t lo, hi;
    item_run(seq_lens, window, bs, parts, item / (chunks * parts), item % parts, &lo, &hi);
    return (hi > lo ? hi - lo : 0) + bs;
}

/* The cost of items [0, items). */
static int64_t items_cost(const int32_t *seq_lens, int64_t window, int64_t bs, int64_t chunks, int64_t parts,
                          int64_t items) {
    int64_t total = 0;
    for (int64_t i = 0; i < items; ++i) total += item_cost(seq_lens, window, bs, chunks, parts, i);
    return total;
}

/* Thread ``t`` of ``nt``: the work items [*first, *last) it takes, a
 * contiguous run of them (its next item's first block can be prefetched) of
 * about a ``nt``-th of the step's cost: an item goes to the thread in whose
 * share the middle of its cost falls. A share of equal item counts
 * (schedule(static)) left one thread waiting where the lengths differ, as
 * they do in a server's batch, its oldest and longest requests first: 64
 * requests of the 135M shape in bf16, one layer: 670 falling to 40 positions
 * 1844-1953 -> 1340-1383 us, 32 of 600 then 32 of 60 2139-2434 -> 1194-1299
 * us, 330 each 1162-1224 -> 1108-1127 us (scratch, 2 threads, two rounds
 * taking turns with the build before). ``total``: items_cost of all
 * of them, computed once a call. */
static void thread_share(const int32_t *seq_lens, int64_t window, int64_t bs, int64_t chunks, int64_t parts,
                         int64_t items, int64_t total, int64_t t, int64_t nt, int64_t *first, int64_t *last) {
    *first = *last = items;
    if (total == 0) return;
    int64_t before = 0;
    for (int64_t i = 0; i < items; ++i) {
        const int64_t cost = item_cost(seq_lens, window, bs, chunks, parts, i);
        /* the owner of item i: floor((before + cost / 2) * nt / total), monotone in i */
        const int64_t owner = ((2 * before + cost) * nt) / (2 * total);
        if (owner == t && *first == items) *first = i;
        if (owner > t) { *last = i; break; }
        before += cost;
    }
    if (*first == items) *last = items;
}

/* Returns 0, or -1 when the shapes exceed the limits above (nothing written).
 * Strides are in elements; bf16: every tensor holds bf16 values.
 *
 * ``parts`` > 1 splits each request's blocks into that many runs, a work item
 * each (split-K, as flash-decoding does on GPUs), and merges their partial
 * softmaxes: with fewer work items than threads (one request, its KV heads in
 * one item, against 2 threads) a thread would otherwise sit idle, or with 3
 * items one thread take two. ``partial``: room for B * chunks * parts items'
 * (m, l, acc), nq * (D + 2) floats each. */
static inline __attribute__((always_inline)) int paged_decode(
        const void *query, int64_t q_stride, const void *key, const void *value, const int32_t *block_table,
        int64_t bt_stride, const int32_t *seq_lens, const int64_t *rows, void *out, int64_t out_stride, int64_t B,
        int64_t H, int64_t KV, int64_t D, int64_t bs, float scale, int64_t window, int64_t heads_per_item,
        int64_t parts, float *partial, int64_t threads, const int bf16)
{
    const int64_t group = KV > 0 ? H / KV : 0;
    if (group < 1 || group * KV != H || D > KILN_MAX_DIM || bs > KILN_MAX_BLOCK || heads_per_item < 1
        || KV % heads_per_item != 0 || heads_per_item * group > KILN_MAX_HEADS || parts < 1
        || (parts > 1 && !partial)) return -1;
    const int64_t pos_stride = KV * D, chunks = KV / heads_per_item, nq = heads_per_item * group;
    const int64_t item_floats = nq * (D + 2);
    /* threads: torch's count, passed in; the caller's OpenMP default is not it
       in a thread torch did not set up (an engine thread of a server) */
    const int64_t n_items = B * chunks * parts;
    const int64_t total = items_cost(seq_lens, window, bs, chunks, parts, n_items);
    #pragma omp parallel num_threads(threads < 1 ? 1 : threads)
    {
        int64_t first, last;
        thread_share(seq_lens, window, bs, chunks, parts, n_items, total, omp_get_thread_num(),
                     omp_get_num_threads(), &first, &last);
        for (int64_t item = first; item < last; ++item) {
            const int64_t b = item / (chunks * parts), c = item / parts % chunks, p = item % parts;
            const int64_t kh0 = c * heads_per_item;
            int64_t lo, hi, next[2];  /* this part's run of the request's blocks, as positions */
            item_run(seq_lens, window, bs, parts, b, p, &lo, &hi);
            /* the item after it: this thread's next, but at the end of its share */
            item_first_block(block_table, bt_stride, seq_lens, window, bs, chunks, parts, heads_per_item, D,
                             n_items, item + 1, next);
            float qs[KILN_MAX_HEADS * KILN_MAX_DIM], acc[KILN_MAX_HEADS * KILN_MAX_DIM];
            float m[KILN_MAX_HEADS], l[KILN_MAX_HEADS];
            load_query(query, rows[b] * q_stride + kh0 * group * D, nq * D, scale, qs, bf16);
            attend(qs, key, value, block_table + b * bt_stride, lo, hi, kh0, heads_per_item, group, D, bs,
                   pos_stride, acc, m, l, next, bf16);
            if (parts == 1) {
                store_heads(acc, l, nq, D, out, rows[b] * out_stride + kh0 * group * D, bf16);
            } else {
                float *part = partial + item * item_floats;
                memcpy(part, m, sizeof(float) * nq);
                memcpy(part + nq, l, sizeof(float) * nq);
                memcpy(part + 2 * nq, acc, sizeof(float) * nq * D);
            }
        }
        if (parts > 1) {
            #pragma omp barrier
            /* each request's parts merged: rescaled to their common maximum */
            #pragma omp for collapse(2) schedule(static)
            for (int64_t b = 0; b < B; ++b) {
                for (int64_t c = 0; c < chunks; ++c) {
                    const float *items = partial + (b * chunks + c) * parts * item_floats;
                    float acc[KILN_MAX_HEADS * KILN_MAX_DIM], l[KILN_MAX_HEADS];
                    for (int64_t h = 0; h < nq; ++h) {
                        float mx = -3.0e38f;
                        for (int64_t p = 0; p < parts; ++p) {
                            const float mp = items[p * item_floats + h];
                            mx = mp > mx ? mp : mx;
                        }
                        float *ah = acc + h * D;
                        for (int64_t d = 0; d < D; ++d) ah[d] = 0.f;
                        l[h] = 0.f;
                        for (int64_t p = 0; p < parts; ++p) {
                            const float *item = items + p * item_floats;
                            if (item[nq + h] == 0.f) continue;  /* a part with no positions */
                            const float w = exp_nonpos(item[h] - mx);
                            l[h] += w * item[nq + h];
                            const float *ap = item + 2 * nq + h * D;
                            #pragma omp simd
                            for (int64_t d = 0; d < D; ++d) ah[d] += w * ap[d];
                        }
                    }
                    store_heads(acc, l, nq, D, out, rows[b] * out_stride + c * heads_per_item * group * D, bf16);
                }
            }
        }
    }
    return 0;
}

/* How a step's work is shared among the threads: ``*heads`` KV heads a work
 * item and ``*parts`` runs of blocks a request (paged_decode). With the
 * requests outnumbering the threads twice over, an item is a request with all
 * its KV heads (one sweep over each key row); with requests x KV heads enough
 * for the threads, a request's head; else (one request and 3 KV heads on 2
 * threads: one thread took two items, the other one) an item is a run of at
 * least KILN_MIN_RUN of a request's blocks with all its heads, as many runs
 * as it takes to give every thread one. Never more query heads than an item
 * holds. One request of the 135M shape on 2 threads, each layer's cache
 * evicted by a 4 MB read before its call as a step's weights do, one scratch
 * A/B a layer: 160 tokens 20.2 -> 19.2 us, 400 tokens 42.3 -> 39.1 us, 1000
 * tokens 99.7 -> 95.9 us (about 5 us of each is the Python call). */
static void share_work(int64_t B, int64_t H, int64_t KV, int64_t bs, int64_t window, const int32_t *seq_lens,
                       int64_t threads, int64_t *heads, int64_t *parts)
{
    const int64_t group = H / KV;
    int64_t all = 1;
    for (int64_t n = 1; n <= KV; ++n)
        if (KV % n == 0 && n * group <= KILN_MAX_HEADS) all = n;
    *parts = 1;
    if (B >= 2 * threads) { *heads = all; return; }
    *heads = 1;
    if (B * KV >= 2 * threads) return;
    *heads = all;
    const int64_t items = B * (KV / all);
    int64_t most = 0;  /* blocks of the longest request */
    for (int64_t b = 0; b < B; ++b) {
        const int64_t len = seq_lens[b], start = first_position(len, window);
        const int64_t blocks = len > start ? (len - 1) / bs - start / bs + 1 : 0;
        most = blocks > most ? blocks : most;
    }
    const int64_t want = (threads + items - 1) / items, most_runs = most / KILN_MIN_RUN;
    *parts = want < most_runs ? want : most_runs;
    if (*parts < 2) { *parts = 1; *heads = 1; }  /* too short to split: a head an item */
}

/* share_work's choice, for tests: out[0] KV heads an item, out[1] runs a request. */
void kiln_decode_share(int64_t B, int64_t H, int64_t KV, int64_t bs, int64_t window, const int32_t *seq_lens,
                       int64_t threads, int64_t *out)
{
    share_work(B, H, KV, bs, window, seq_lens, threads, &out[0], &out[1]);
}

/* thread_share's choice, for tests: out[0], out[1] the items thread t of nt takes. */
void kiln_decode_thread_share(const int32_t *seq_lens, int64_t window, int64_t bs, int64_t chunks, int64_t parts,
                              int64_t items, int64_t t, int64_t nt, int64_t *out)
{
    thread_share(seq_lens, window, bs, chunks, parts, items, items_cost(seq_lens, window, bs, chunks, parts, items),
                 t, nt, &out[0], &out[1]);
}

/* Write n tokens' keys and values ([n, KV, D] rows, row strides in elements,
 * heads side by side) into the cache at their slots (block * block_size +
 * offset): one copy of KV * D elements of esize bytes per token and tensor.
 * What index_copy_ does, without its per-call cost (about 20 us a tensor,
 * twice a layer). */
static int write_kv(const void *key, int64_t k_stride, const void *value, int64_t v_stride, const int64_t *slots,
                    int64_t n, void *key_cache, void *value_cache, int64_t row, int64_t num_slots, int64_t esize)
{
    for (int64_t t = 0; t < n; ++t)
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;
    for (int64_t t = 0; t < n; ++t) {
        memcpy((char *)key_cache + slots[t] * row * esize, (const char *)key + t * k_stride * esize, esize * row);
        memcpy((char *)value_cache + slots[t] * row * esize, (const char *)value + t * v_stride * esize, esize * row);
    }
    return 0;
}

/* What every layer of a step shares, filled once a step by the caller
 * (kiln.attention.cpu_attention.DecodeStep): the query rows (a single-query
 * request's token, or one token of a short prefill chunk), each one's block
 * table and context length, and the cache slots of the step's new tokens. */
typedef struct {
    const int64_t *rows;
    const int32_t *block_table;
    int64_t bt_stride;
    const int32_t *seq_lens;
    int64_t B;
    const int64_t *slots;
    int64_t n;
    int64_t threads;
} kiln_step;

/* One layer of a step: its n new keys and values ([n, KV, D] rows) written
 * into cache ([2, num_slots / bs, bs, KV, D]), then every query row attended
 * to (all of the new keys are in place first: a chunk's rows see each other).
 * One call from Python where there were two, each with its own checks.
 * Returns 0; -1 when a slot is outside the cache, -2 when the shapes exceed
 * the limits (nothing written either way: the caller's torch path takes the
 * layer). */
int kiln_decode_layer(const kiln_step *st, const void *query, int64_t q_stride, const void *key, int64_t k_stride,
                      const void *value, int64_t v_stride, void *cache, int64_t num_slots, void *out,
                      int64_t out_stride, int64_t H, int64_t KV, int64_t D, int64_t bs, int32_t scale_bits,
                      int64_t window, int64_t bf16)
{
    float scale;  /* passed as its bits: every argument an integer (kiln.graphs.cpu replays the call from C) */
    memcpy(&scale, &scale_bits, sizeof scale);
    const int64_t group = KV > 0 ? H / KV : 0;
    if (group < 1 || group * KV != H || group > KILN_MAX_HEADS || D > KILN_MAX_DIM || bs > KILN_MAX_BLOCK) return -2;
    const int64_t esize = bf16 ? 2 : 4;
    char *key_cache = cache, *value_cache = (char *)cache + num_slots * KV * D * esize;
    if (write_kv(key, k_stride, value, v_stride, st->slots, st->n, key_cache, value_cache, KV * D, num_slots,
                 esize) != 0)
        return -1;
    if (st->B == 0) return 0;
    int64_t heads, parts;
    share_work(st->B, H, KV, bs, window, st->seq_lens, st->threads, &heads, &parts);
    float *partial = NULL;
    if (parts > 1) {
        partial = malloc(sizeof(float) * (size_t)(st->B * (KV / heads) * parts * heads * group * (D + 2)));
        if (!partial) { heads = 1; parts = 1; }  /* a head an item, unsplit */
    }
    const int rc = bf16 ? paged_decode(query, q_stride, key_cache, value_cache, st->block_table, st->bt_stride,
                                       st->seq_lens, st->rows, out, out_stride, st->B, H, KV, D, bs, scale, window,
                                       heads, parts, partial, st->threads, 1)
                        : paged_decode(query, q_stride, key_cache, value_cache, st->block_table, st->bt_stride,
                                       st->seq_lens, st->rows, out, out_stride, st->B, H, KV, D, bs, scale, window,
                                       heads, parts, partial, st->threads, 0);
    free(partial);
    return rc;
}

/* ------------------------------------------------------------------ prefill
 * Causal attention of a step's prefill chunks over the paged cache, after the
 * step's keys and values were written there (kiln_decode_layer). Chunk r is
 * query rows first .. first + n - 1 of q, the last n positions of a context
 * of len positions (a fresh prompt: len = n) whose blocks are row `table` of
 * the block table: chunks[4r .. 4r + 3] = first, n, len, table. The chunk's
 * query i, at position len - n + i, attends to positions 0 .. len - n + i.
 * What the torch backend ran as one SDPA call a chunk (with its keys gathered
 * from the blocks where it had a cached prefix): the first prefill step of
 * bench.decode --throughput 64 (30 prompts of 16-128 tokens, 9 query and 3 KV
 * heads of 64) took 3.22 ms a layer that way in fp32 and 1.82 with this
 * kernel; 2.23 and 1.48 ms in bf16 (2 threads of an Intel Xeon,
 * bench/results/prefill-attention-cpu-20261207-160843.json).
 *
 * A work item is a tile of a chunk's query rows (48 / group of them) for the
 * query heads of one KV head: 48 query vectors, the lanes of three vectors of
 * 16. The queries are transposed once an item (qt[d][lane], scaled), so that
 * a key's dot products with all 48 are 3 fused multiply-adds a dimension with
 * the key's element broadcast, and 8 keys' scores (24 accumulators) end in
 * registers with a query a lane: the online softmax then runs across keys
 * within each lane, 16 queries at once, with no horizontal sums. The weighted
 * values go into each query's output 6 queries and 64 dimensions at a time
 * (24 accumulators), each value row loaded once for the 6. Keys past a
 * query's position are masked on the steps that cross the diagonal, and no
 * step reads past the tile's last position. bf16 rows are widened to fp32 a
 * step of 8 keys at a time, the output rounded once. Items go to the threads
 * costliest first (dynamic schedule). */
#if defined(__AVX512F__)
#define PF_LANES 48  /* query vectors of a work item */
#define PF_KEYS 8    /* keys a step of the item's loop */
#define PF_GROUP 6   /* queries whose outputs a step of the weighted sum keeps in registers */

/* r[i][j] -> r[j][i]: the 16 x 16 floats of 16 vectors transposed. */
static inline void transpose16(__m512 *r) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {  /* pairs of rows interleaved by elements */
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  /* then by pairs of elements */
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int h = 0; h < 16; h += 8)  /* then by 128-bit quarters, twice */
        for (int i = 0; i < 4; ++i) {
            t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
            t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xDD);
        }
    for (int i = 0; i < 8; ++i) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    }
}

/* qt[d][l] = scale * query vector l's element d for l < nq (lane l: row i0 + l / g of the request, head
   c * g + l % g), zero for the other lanes; 16 lanes and 16 dims at a time through a 16 x 16 transpose. */
static void prefill_queries(const void *q, int64_t qs, int64_t i0, int64_t nq, int64_t c, int64_t g, int64_t D,
                            float scale, float (*qt)[PF_LANES], const int bf16) {
    const __m512 sv = _mm512_set1_ps(scale);
    for (int64_t l0 = 0; l0 < PF_LANES; l0 += 16)
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
            __m512 r[16];
            for (int i = 0; i < 16; ++i) {
                const int64_t l = l0 + i;
                r[i] = l < nq ? _mm512_mul_ps(sv, load16(q, (i0 + l / g) * qs + (c * g + l % g) * D + d0, bf16))
                              : _mm512_setzero_ps();
            }
            transpose16(r);  /* r[j]: element d0 + j of lanes l0 .. l0 + 15 */
            for (int j = 0; j < 16; ++j) _mm512_store_ps(qt[d0 + j] + l0, r[j]);
        }
}

/* The rows of positions [j0, j0 + PF_KEYS) of KV head c in one half of the cache (base: its block 0; rows of
   `row` elements, blocks of bs rows, bt the chunk's block table), as fp32 row pointers: where they lie in an
   fp32 cache, else widened from bf16 into buf. Positions from nk on repeat j0 (their scores are masked). */
static inline void step_rows(const void *base, const int32_t *bt, int64_t bs, int64_t row, int64_t c, int64_t D,
                             int64_t j0, int nk, float (*buf)[KILN_MAX_DIM], const float *rows[PF_KEYS],
                             const int bf16) {
    for (int j = 0; j < PF_KEYS; ++j) {
        const int64_t pos = j0 + (j < nk ? j : 0);
        const int64_t at = (bt[pos / bs] * bs + pos % bs) * row + c * D;
        if (!bf16) {
            rows[j] = (const float *)base + at;
            continue;
        }
        for (int64_t d = 0; d < D; d += 16) _mm512_store_ps(buf[j] + d, load16(base, at + d, 1));
        rows[j] = buf[j];
    }
}

/* The scores of a step's PF_KEYS keys (rows kr) with the item's queries: s[j][t], lane i the query vector
   16 t + i. */
static inline __attribute__((always_inline)) void prefill_scores(
        const float (*qt)[PF_LANES], const float *const kr[PF_KEYS], int64_t D, __m512 s[PF_KEYS][3]) {
    for (int j = 0; j < PF_KEYS; ++j) s[j][0] = s[j][1] = s[j][2] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
        const __m512 q0 = _mm512_load_ps(qt[d]), q1 = _mm512_load_ps(qt[d] + 16), q2 = _mm512_load_ps(qt[d] + 32);
        for (int j = 0; j < PF_KEYS; ++j) {
            const __m512 kb = _mm512_set1_ps(kr[j][d]);
            s[j][0] = _mm512_fmadd_ps(q0, kb, s[j][0]);
            s[j][1] = _mm512_fmadd_ps(q1, kb, s[j][1]);
            s[j][2] = _mm512_fmadd_ps(q2, kb, s[j][2]);
        }
    }
}

/* o_l = o_l * corr[l] + sum_j p[j][l] v_j (o_l: D floats at o + l * D; v_j at vr[j]) for queries [l0, l0 +
   PF_GROUP), dims [d0, d0 + 16 VECS) and the step's first nk keys, the sums in registers. */
static inline __attribute__((always_inline)) void weighted_block(
        const float (*p)[PF_LANES], const float *corr, const float *const vr[PF_KEYS], int nk, int64_t l0,
        int64_t d0, int64_t D, float *o, const int VECS) {
    __m512 acc[PF_GROUP][4];
    for (int l = 0; l < PF_GROUP; ++l) {
        const __m512 c = _mm512_set1_ps(corr[l0 + l]);
        for (int i = 0; i < VECS; ++i) acc[l][i] = _mm512_mul_ps(c, _mm512_load_ps(o + (l0 + l) * D + d0 + 16 * i));
    }
    for (int j = 0; j < nk; ++j) {
        __m512 vv[4];
        for (int i = 0; i < VECS; ++i) vv[i] = _mm512_loadu_ps(vr[j] + d0 + 16 * i);
        for (int l = 0; l < PF_GROUP; ++l) {
            const __m512 pj = _mm512_set1_ps(p[j][l0 + l]);
            for (int i = 0; i < VECS; ++i) acc[l][i] = _mm512_fmadd_ps(pj, vv[i], acc[l][i]);
        }
    }
    for (int l = 0; l < PF_GROUP; ++l)
        for (int i = 0; i < VECS; ++i) _mm512_store_ps(o + (l0 + l) * D + d0 + 16 * i, acc[l][i]);
}

/* The weighted sums of a step for the item's first ``lanes`` queries (a multiple of PF_GROUP): 64 dims at a
   time, or 16 where D is not a multiple of 64. */
static inline void prefill_weighted(const float (*p)[PF_LANES], const float *corr, const float *const vr[PF_KEYS],
                                    int nk, int64_t lanes, int64_t D, float *o) {
    for (int64_t l0 = 0; l0 < lanes; l0 += PF_GROUP) {
        if (D % 64 == 0)
            for (int64_t d0 = 0; d0 < D; d0 += 64) weighted_block(p, corr, vr, nk, l0, d0, D, o, 4);
        else
            for (int64_t d0 = 0; d0 < D; d0 += 16) weighted_block(p, corr, vr, nk, l0, d0, D, o, 1);
    }
}

/* What every work item of a call shares. */
typedef struct {
    const void *q, *key, *value;  /* the query rows; the cache's key and value halves */
    void *out;
    int64_t qs, os, row, bs, g, D;  /* row strides (elements); a cache row's elements; block size; group */
    float scale;
    int bf16;
} prefill_args;

/* One work item: query rows [i0, i1) of a chunk whose first query row is `first`, at positions from `at` on
   (len - n), block table bt, the query heads of KV head c. */
static void prefill_item(const prefill_args *a, int64_t first, int64_t at, const int32_t *bt, int64_t i0, int64_t i1,
                         int64_t c) {
    const int64_t g = a->g, D = a->D, nq = (i1 - i0) * g, lanes = (nq + PF_GROUP - 1) / PF_GROUP * PF_GROUP;
    const size_t esize = a->bf16 ? 2 : 4;
    const void *q = (const char *)a->q + first * a->qs * esize;
    _Alignas(64) float qt[KILN_MAX_DIM][PF_LANES];
    _Alignas(64) float o[PF_LANES * KILN_MAX_DIM];  /* query l's output at o + l * D (D: a multiple of 16) */
    _Alignas(64) float p[PF_KEYS][PF_LANES];
    _Alignas(64) float corr[PF_LANES];
    _Alignas(64) float kbuf[PF_KEYS][KILN_MAX_DIM], vbuf[PF_KEYS][KILN_MAX_DIM];  /* bf16 rows, widened */
    prefill_queries(q, a->qs, i0, nq, c, g, D, a->scale, qt, a->bf16);
    memset(o, 0, sizeof(float) * (size_t)(lanes * D));  /* lanes past nq: summed, never stored */
    __m512 m[3], sum[3], pos[3];  /* per lane: running maximum, sum of exponentials, the query's position */
    for (int t = 0; t < 3; ++t) {
        m[t] = _mm512_set1_ps(-3.0e38f);
        sum[t] = _mm512_setzero_ps();
        float where[16];
        for (int i = 0; i < 16; ++i) where[i] = (float)(at + i0 + (16 * t + i) / g);
        pos[t] = _mm512_loadu_ps(where);
    }
    const int64_t end = at + i1;  /* positions the tile's last query sees */
    for (int64_t j0 = 0; j0 < end; j0 += PF_KEYS) {
        const int nk = end - j0 < PF_KEYS ? (int)(end - j0) : PF_KEYS;
        const int masked = j0 + PF_KEYS - 1 > at + i0;  /* a key of this step lies past some query's position */
        const float *kr[PF_KEYS], *vr[PF_KEYS];
        step_rows(a->key, bt, a->bs, a->row, c, D, j0, nk, kbuf, kr, a->bf16);
        __m512 s[PF_KEYS][3];
        prefill_scores((const float (*)[PF_LANES])qt, kr, D, s);
        __mmask16 live[PF_KEYS][3];
        for (int j = 0; j < PF_KEYS; ++j)
            for (int t = 0; t < 3; ++t) {
                live[j][t] = !masked ? (__mmask16)0xffff
                                     : j < nk ? _mm512_cmp_ps_mask(_mm512_set1_ps((float)(j0 + j)), pos[t], _CMP_LE_OQ)
                                              : (__mmask16)0;
                s[j][t] = _mm512_mask_blend_ps(live[j][t], _mm512_set1_ps(-3.0e38f), s[j][t]);
            }
        for (int t = 0; t < 3; ++t) {
            __m512 mx = m[t];
            for (int j = 0; j < PF_KEYS; ++j) mx = _mm512_max_ps(mx, s[j][t]);
            const __m512 cf = exp16_nonpos(_mm512_sub_ps(m[t], mx));
            __m512 add = _mm512_setzero_ps();
            for (int j = 0; j < PF_KEYS; ++j) {
                const __m512 e = _mm512_maskz_mov_ps(live[j][t], exp16_nonpos(_mm512_sub_ps(s[j][t], mx)));
                _mm512_store_ps(p[j] + 16 * t, e);
                add = _mm512_add_ps(add, e);
            }
            sum[t] = _mm512_fmadd_ps(sum[t], cf, add);
            m[t] = mx;
            _mm512_store_ps(corr + 16 * t, cf);
        }
        step_rows(a->value, bt, a->bs, a->row, c, D, j0, nk, vbuf, vr, a->bf16);
        prefill_weighted((const float (*)[PF_LANES])p, corr, vr, nk, lanes, D, o);
    }
    _Alignas(64) float total[PF_LANES];
    for (int t = 0; t < 3; ++t) _mm512_store_ps(total + 16 * t, sum[t]);
    for (int64_t l = 0; l < nq; ++l) {
        const int64_t to = (first + i0 + l / g) * a->os + (c * g + l % g) * D;
        const float inv = 1.f / total[l];  /* position 0 is every query's: the sum is positive */
        for (int64_t d = 0; d < D; ++d) {
            const float x = o[l * D + d] * inv;
            if (a->bf16) ((uint16_t *)a->out)[to + d] = f32_to_bf16(x);
            else ((float *)a->out)[to + d] = x;
        }
    }
}

/* A work item: query rows [i0, end) of chunk r for KV head c; its cost grows with the positions its last row
   sees (cost), times its rows. The threads take the items costliest first, so that none is left with a long
   one at the end. */
typedef struct {
    int64_t cost, r, i0, end, c;
} prefill_work;

static int costliest_first(const void *a, const void *b) {
    const int64_t x = ((const prefill_work *)a)->cost, y = ((const prefill_work *)b)->cost;
    return (x < y) - (x > y);
}
#endif

/* Whether this build has the prefill kernel (an AVX-512 target): kiln_prefill_layer returns -2 without. */
int kiln_prefill_available(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* One layer's attention of B prefill chunks (above) over cache ([2, num_slots / bs, bs, KV, D]); q and out
 * rows of H heads of D values side by side, `rows` of them; the block table `bt_rows` rows of bt_stride.
 * Returns 0; -1 for a chunk outside those (rows, table rows, blocks) or empty; -2 where the kernel does not
 * take the shapes (D not a multiple of 16 or over KILN_MAX_DIM, more than PF_LANES query heads to a KV head)
 * or the CPU lacks AVX-512 (the caller's SDPA path then runs); -3 when a buffer could not be allocated.
 * Nothing is written unless it returns 0. */
int kiln_prefill_layer(const void *q, int64_t qs, const void *cache, int64_t num_slots, const int32_t *bt,
                       int64_t bt_stride, int64_t bt_rows, const int64_t *chunks, int64_t B, void *out, int64_t os,
                       int64_t rows, int64_t H, int64_t KV, int64_t D, int64_t bs, int32_t scale_bits, int64_t bf16,
                       int64_t threads)
{
#if defined(__AVX512F__)
    const int64_t g = KV > 0 ? H / KV : 0;
    if (g < 1 || g * KV != H || g > PF_LANES || D < 16 || D % 16 || D > KILN_MAX_DIM || B < 1 || bs < 1)
        return -2;
    const int64_t blocks = num_slots / bs;
    for (int64_t r = 0; r < B; ++r) {
        const int64_t *ch = chunks + 4 * r;
        if (ch[0] < 0 || ch[1] < 1 || ch[1] > rows - ch[0] || ch[2] < ch[1] || ch[3] < 0 || ch[3] >= bt_rows
            || (ch[2] - 1) / bs >= bt_stride)
            return -1;
        for (int64_t b = 0; b <= (ch[2] - 1) / bs; ++b)
            if (bt[ch[3] * bt_stride + b] < 0 || bt[ch[3] * bt_stride + b] >= blocks) return -1;
    }
    prefill_args a = {q, cache, (const char *)cache + num_slots * KV * D * (bf16 ? 2 : 4), out, qs, os, KV * D, bs,
                      g, D, 0.f, (int)bf16};
    memcpy(&a.scale, &scale_bits, sizeof a.scale);
    const int64_t per = PF_LANES / g;  /* query rows a work item */
    int64_t items = 0;
    for (int64_t r = 0; r < B; ++r) items += (chunks[4 * r + 1] + per - 1) / per * KV;
    prefill_work *work = malloc(sizeof(prefill_work) * (size_t)items);
    if (!work) return -3;
    int64_t n = 0;
    for (int64_t r = 0; r < B; ++r) {
        const int64_t len = chunks[4 * r + 1], at = chunks[4 * r + 2] - len;
        for (int64_t i0 = 0; i0 < len; i0 += per) {
            const int64_t end = i0 + per < len ? i0 + per : len;
            for (int64_t c = 0; c < KV; ++c) work[n++] = (prefill_work){(at + end) * (end - i0), r, i0, end, c};
        }
    }
    qsort(work, (size_t)items, sizeof(prefill_work), costliest_first);
    #pragma omp parallel for num_threads(threads < 1 ? 1 : threads) schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
        const prefill_work w = work[it];
        const int64_t *ch = chunks + 4 * w.r;
        prefill_item(&a, ch[0], ch[2] - ch[1], bt + ch[3] * bt_stride, w.i0, w.end, w.c);
    }
    free(work);
    return 0;
#else
    (void)q, (void)qs, (void)cache, (void)num_slots, (void)bt, (void)bt_stride, (void)bt_rows, (void)chunks, (void)B,
        (void)out, (void)os, (void)rows, (void)H, (void)KV, (void)D, (void)bs, (void)scale_bits, (void)bf16,
        (void)threads;
    return -2;
#endif
}
