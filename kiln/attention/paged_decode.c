/* Single-query (decode) attention over kiln's paged KV cache, fp32 or bf16, for CPUs.
 *
 * Built by kiln.attention.cpu_decode with the machine's C compiler (-O3
 * -march=native -fopenmp) and called through ctypes by the torch attention
 * backend. It reads each request's keys and values where they lie in the
 * cache, block by block, with an online softmax, instead of gathering them
 * into a padded copy for SDPA.
 *
 * bf16 (kiln_paged_decode_bf16): query, keys, values and output in bf16, each
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
 * One work item is a request and heads_per_item KV heads: all KV heads when
 * there are enough requests to keep the threads busy (a key row of every head
 * is then read in one sweep), one head otherwise. The items are shared among
 * `threads` OpenMP threads. With AVX2 and a head dim that is a multiple of 64,
 * a head's query and its accumulator stay in registers across a block's rows
 * (scores64, weighted64): 1.3-1.8x the plain loops, which load and store the
 * accumulator at every row (bench/results/decode-attention-cpu-20261201-211354.json
 * against -195303.json).
 */
#include <stdint.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define KILN_MAX_HEADS 32  /* query heads of one work item (kept on the stack) */
#define KILN_MAX_DIM 256
#define KILN_MAX_BLOCK 128

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

#if defined(__AVX2__) && defined(__FMA__)

/* s[j] += q[0:64] . k_j[0:64] for rows j in [lo, hi), q held in registers
   (the loops over 8 vectors unroll fully at -O3). */
static inline __attribute__((always_inline)) void scores64(const float *q, const void *k, int64_t stride, int64_t lo,
                                                           int64_t hi, float *s, const int bf16) {
    __m256 qv[8];
    for (int i = 0; i < 8; ++i) qv[i] = _mm256_loadu_ps(q + 8 * i);
    for (int64_t j = lo; j < hi; ++j) {
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
                                                             int64_t hi, float *acc, const int bf16) {
    __m256 av[8];
    for (int i = 0; i < 8; ++i) av[i] = _mm256_loadu_ps(acc + 8 * i);
    for (int64_t j = lo; j < hi; ++j) {
        const __m256 w = _mm256_set1_ps(p[j]);
        for (int i = 0; i < 8; ++i) av[i] = _mm256_fmadd_ps(w, load8(v, j * stride + 8 * i, bf16), av[i]);
    }
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(acc + 8 * i, av[i]);
}
#define KILN_BLOCKED 1
#else
#define KILN_BLOCKED 0
#endif

/* Returns 0, or -1 when the shapes exceed the limits above (nothing written).
 * Strides are in elements; bf16: every tensor holds bf16 values. */
static inline __attribute__((always_inline)) int paged_decode(
        const void *query, int64_t q_stride, const void *key, const void *value, const int32_t *block_table,
        int64_t bt_stride, const int32_t *seq_lens, const int64_t *rows, void *out, int64_t out_stride, int64_t B,
        int64_t H, int64_t KV, int64_t D, int64_t bs, float scale, int64_t window, int64_t heads_per_item,
        int64_t threads, const int bf16)
{
    const size_t esize = bf16 ? 2 : 4;
    const int64_t group = KV > 0 ? H / KV : 0;
    if (group < 1 || group * KV != H || D > KILN_MAX_DIM || bs > KILN_MAX_BLOCK || heads_per_item < 1
        || KV % heads_per_item != 0 || heads_per_item * group > KILN_MAX_HEADS) return -1;
    const int64_t pos_stride = KV * D, chunks = KV / heads_per_item, nq = heads_per_item * group;
    const int blocked = KILN_BLOCKED && D % 64 == 0;  /* head dims 64, 128, 256: the register-blocked loops */
    /* threads: torch's count, passed in; the caller's OpenMP default is not it
       in a thread torch did not set up (an engine thread of a server) */
    #pragma omp parallel for collapse(2) schedule(static) num_threads(threads < 1 ? 1 : threads)
    for (int64_t b = 0; b < B; ++b) {
        for (int64_t c = 0; c < chunks; ++c) {
            const int64_t len = seq_lens[b];
            const int64_t start = (window > 0 && len > window) ? len - window : 0;
            const int64_t kh0 = c * heads_per_item;
            const int64_t qh = rows[b] * q_stride + kh0 * group * D;  /* element offsets */
            const int64_t oh = rows[b] * out_stride + kh0 * group * D;
            float qs[KILN_MAX_HEADS * KILN_MAX_DIM], acc[KILN_MAX_HEADS * KILN_MAX_DIM];
            float m[KILN_MAX_HEADS], l[KILN_MAX_HEADS], s[KILN_MAX_HEADS][KILN_MAX_BLOCK];
            for (int64_t i = 0; i < nq * D; ++i) { qs[i] = elem(query, qh + i, bf16) * scale; acc[i] = 0.f; }
            for (int64_t h = 0; h < nq; ++h) { m[h] = -3.0e38f; l[h] = 0.f; }
            const int32_t *bt = block_table + b * bt_stride;
            for (int64_t p0 = start - start % bs; p0 < len; p0 += bs) {
                const int64_t blk = bt[p0 / bs];
                const int64_t lo = p0 < start ? start - p0 : 0;
                const int64_t hi = len - p0 < bs ? len - p0 : bs;
                const char *kb = (const char *)key + (blk * bs * pos_stride + kh0 * D) * esize;
                const char *vb = (const char *)value + (blk * bs * pos_stride + kh0 * D) * esize;
                if (blocked) {  /* per head, its query in registers across the block's rows */
                    for (int64_t h = 0; h < nq; ++h) {
                        for (int64_t j = lo; j < hi; ++j) s[h][j] = 0.f;
                        for (int64_t d0 = 0; d0 < D; d0 += 64)
                            scores64(qs + h * D + d0, kb + ((h / group) * D + d0) * esize, pos_stride, lo, hi, s[h], bf16);
                    }
                } else {
                    for (int64_t j = lo; j < hi; ++j)
                        for (int64_t h = 0; h < nq; ++h)
                            s[h][j] = dot(qs + h * D, kb + (j * pos_stride + (h / group) * D) * esize, D, bf16);
                }
                for (int64_t h = 0; h < nq; ++h) {  /* online softmax: rescale what came before */
                    float mx = m[h];
                    for (int64_t j = lo; j < hi; ++j) mx = s[h][j] > mx ? s[h][j] : mx;
                    float sum = 0.f;
                    #pragma omp simd reduction(+:sum)
                    for (int64_t j = lo; j < hi; ++j) { s[h][j] = exp_nonpos(s[h][j] - mx); sum += s[h][j]; }
                    const float corr = exp_nonpos(m[h] - mx);
                    l[h] = l[h] * corr + sum;
                    m[h] = mx;
                    float *ah = acc + h * D;
                    #pragma omp simd
                    for (int64_t d = 0; d < D; ++d) ah[d] *= corr;
                }
                if (blocked) {  /* per head, its accumulator in registers across the block's rows */
                    for (int64_t h = 0; h < nq; ++h)
                        for (int64_t d0 = 0; d0 < D; d0 += 64)
                            weighted64(s[h], vb + ((h / group) * D + d0) * esize, pos_stride, lo, hi, acc + h * D + d0,
                                       bf16);
                } else {
                    for (int64_t j = lo; j < hi; ++j)
                        for (int64_t h = 0; h < nq; ++h) {
                            const void *v = vb + (j * pos_stride + (h / group) * D) * esize;
                            const float p = s[h][j];
                            float *ah = acc + h * D;
                            for (int64_t d = 0; d < D; ++d) ah[d] += p * elem(v, d, bf16);
                        }
                }
            }
            for (int64_t h = 0; h < nq; ++h) {
                const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
                for (int64_t d = 0; d < D; ++d) {
                    const float o = acc[h * D + d] * inv;
                    if (bf16) ((uint16_t *)out)[oh + h * D + d] = f32_to_bf16(o);
                    else ((float *)out)[oh + h * D + d] = o;
                }
            }
        }
    }
    return 0;
}

int kiln_paged_decode_f32(const float *query, int64_t q_stride, const float *key, const float *value,
                          const int32_t *block_table, int64_t bt_stride, const int32_t *seq_lens,
                          const int64_t *rows, float *out, int64_t out_stride,
                          int64_t B, int64_t H, int64_t KV, int64_t D, int64_t bs,
                          float scale, int64_t window, int64_t heads_per_item, int64_t threads)
{
    return paged_decode(query, q_stride, key, value, block_table, bt_stride, seq_lens, rows, out, out_stride, B, H,
                        KV, D, bs, scale, window, heads_per_item, threads, 0);
}

int kiln_paged_decode_bf16(const uint16_t *query, int64_t q_stride, const uint16_t *key, const uint16_t *value,
                           const int32_t *block_table, int64_t bt_stride, const int32_t *seq_lens,
                           const int64_t *rows, uint16_t *out, int64_t out_stride,
                           int64_t B, int64_t H, int64_t KV, int64_t D, int64_t bs,
                           float scale, int64_t window, int64_t heads_per_item, int64_t threads)
{
    return paged_decode(query, q_stride, key, value, block_table, bt_stride, seq_lens, rows, out, out_stride, B, H,
                        KV, D, bs, scale, window, heads_per_item, threads, 1);
}

/* Write n tokens' keys and values ([n, KV, D] rows, row strides in elements,
 * heads side by side) into the cache at their slots (block * block_size +
 * offset): one copy of KV * D elements of esize bytes per token and tensor.
 * What index_copy_ does, without its per-call cost (about 20 us a tensor,
 * twice a layer). */
int kiln_write_kv(const void *key, int64_t k_stride, const void *value, int64_t v_stride, const int64_t *slots,
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
