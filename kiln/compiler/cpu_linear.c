/* Small-batch linear layers (1 to 8 rows of activations) for CPUs: fp32, bf16
 * and kiln's packed int8, q8_0 and q4 weights, fp32 accumulation.
 *
 * Built by kiln.compiler.cpu_linear with the machine's C compiler (-O3
 * -march=native -fopenmp) and called through ctypes from the few-token CPU
 * pieces (the ``kiln::cpu_linear`` op) and the LM head. At one to a few tokens
 * a linear layer reads each weight once and does a multiply-add with it per
 * row: its speed is the memory bandwidth. This code streams a block of weight
 * rows, converts each vector of weights to fp32 once (bf16: a shift; packed:
 * shifts, a mask, an int->float conversion) and multiplies it into every
 * activation row, with the accumulators in registers. Inductor's reduction of
 * the same product runs the rows of a 2- or 4-token piece one after another
 * (bench/results/cpu-linear-cpu-*.json).
 *
 * Two builds of the same driver, picked by the compiler's target (-march=native):
 * with AVX-512 (F, BW, VL, DQ), vectors of 16 floats, packed words widened
 * by one load-and-extend instruction in memory order with the activations
 * permuted to match once per call, and bf16 products by AVX512-BF16's dot
 * product instruction where the CPU has it; otherwise AVX2 vectors of 8
 * floats, packed words unpacked lane by lane. Both sum every product in fp32.
 *
 * Layouts (rows contiguous; row strides in elements):
 *   x      [M, K] fp32 or bf16 (x_bf16), row m at x + m * x_stride
 *   out    [M, N] fp32 or bf16 (out_bf16), row m at out + m * out_stride
 *   bias   [N] in out's dtype, or NULL
 *   fp32 / bf16 weights   [N, K]
 *   packed weights        words [N, K / G, 8] int32 (G = 32 elements for 8-bit,
 *                         64 for 4-bit): byte (nibble) b of the 8 words of a
 *                         group holds elements 8b .. 8b + 7 of the group;
 *                         scales [N, S] fp32 (S = 1 for int8, K / 32 for q8_0
 *                         and q4); offsets [N, K / 32] fp32 for q4.
 *   value of a packed element: int8, q8_0: scale * q (q signed);
 *                              q4: scale * q + offset (q in 0..15).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if !(defined(__AVX2__) && defined(__FMA__))
#error "cpu_linear.c needs AVX2 and FMA (kiln falls back to its compiled reductions without them)"
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define KILN_AVX512 1
#else
#define KILN_AVX512 0
#endif
#if KILN_AVX512 && defined(__AVX512BF16__)
#define KILN_DPBF16 1  /* bf16 pairs multiplied and summed into fp32 by one instruction */
#else
#define KILN_DPBF16 0
#endif

#define KILN_MAX_ROWS 8
/* How far ahead of the weights being read to ask for them (into L2). A kernel
 * that does real work per weight byte (bf16, packed) otherwise reads DRAM and
 * computes in turn: from DRAM the int8 LM head took the time of reading it
 * plus the time of computing it from cache (4.1 = 2.0 + 2.2 ms on one core).
 * With the prefetch, 2 threads: int8 2.56 -> 1.29 ms, q4 1.60 -> 1.09 ms;
 * 1 to 16 KB ahead all did about as well. */
#define KILN_PREFETCH_AHEAD 4096
#define prefetch_ahead(p) _mm_prefetch((const char *)(p) + KILN_PREFETCH_AHEAD, _MM_HINT_T1)
#define KILN_MAX_K 65536

enum { KIND_F32 = 0, KIND_BF16 = 1, KIND_INT8 = 2, KIND_Q8_0 = 3, KIND_Q4 = 4,
       KIND_BF16_DP = 5 /* internal: bf16 weights and activations, AVX512-BF16 */ };

static inline float hsum8(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

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

/* Vectors of VW floats: 16 with AVX-512, else 8. */
#if KILN_AVX512
#define VW 16
typedef __m512 vfloat;
#define vzero _mm512_setzero_ps
#define vload _mm512_loadu_ps
#define vfmadd _mm512_fmadd_ps
#define vmul _mm512_mul_ps
#define vadd _mm512_add_ps
#define vhsum _mm512_reduce_add_ps
static inline __m512 load_bf16(const uint16_t *p) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
#else
#define VW 8
typedef __m256 vfloat;
#define vzero _mm256_setzero_ps
#define vload _mm256_loadu_ps
#define vfmadd _mm256_fmadd_ps
#define vmul _mm256_mul_ps
#define vadd _mm256_add_ps
#define vhsum hsum8
static inline __m256 load_bf16(const uint16_t *p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#endif

/* ------------------------------------------------------------ dense weights
 * One weight row at a time, each vector of it multiplied into all M
 * activation rows; two accumulators per activation row (K unrolled by two
 * vectors) while M <= 4, one beyond, so that they all stay in registers. A
 * block of several weight rows at once was slower (1.1-1.7x; several streams
 * instead of one). */
#define DENSE_ROW(NAME, WTYPE, LOADW, TOF)                                                     \
static inline __attribute__((always_inline)) void NAME(                                      \
        const float *x, int64_t k, const WTYPE *w, const int m, float *res) {                \
    vfloat a0[KILN_MAX_ROWS], a1[KILN_MAX_ROWS];                                             \
    _Pragma("GCC unroll 8") for (int i = 0; i < m; i++) a0[i] = a1[i] = vzero();             \
    int64_t c = 0;                                                                           \
    if (m <= 4)                                                                              \
        for (; c + 2 * VW <= k; c += 2 * VW) {                                               \
            prefetch_ahead(w + c);                                                           \
            const vfloat w0 = LOADW(w + c), w1 = LOADW(w + c + VW);                          \
            _Pragma("GCC unroll 8") for (int i = 0; i < m; i++) {                            \
                a0[i] = vfmadd(vload(x + i * k + c), w0, a0[i]);                             \
                a1[i] = vfmadd(vload(x + i * k + c + VW), w1, a1[i]);                        \
            }                                                                                \
        }                                                                                    \
    for (; c + VW <= k; c += VW) {                                                           \
        prefetch_ahead(w + c);                                                               \
        const vfloat w0 = LOADW(w + c);                                                      \
        _Pragma("GCC unroll 8") for (int i = 0; i < m; i++)                                  \
            a0[i] = vfmadd(vload(x + i * k + c), w0, a0[i]);                                 \
    }                                                                                        \
    _Pragma("GCC unroll 8") for (int i = 0; i < m; i++) {                                    \
        float s = vhsum(vadd(a0[i], a1[i]));                                                 \
        for (int64_t t = c; t < k; t++) s += x[i * k + t] * TOF(w[t]);                       \
        res[i] = s;                                                                          \
    }                                                                                        \
}

static inline float f32_id(float v) { return v; }
DENSE_ROW(dense_f32, float, vload, f32_id)
DENSE_ROW(dense_bf16, uint16_t, load_bf16, bf16_to_f32)

#if KILN_DPBF16
/* bf16 weights and bf16 activations: 32 products a vector, summed in pairs
 * into 16 fp32 lanes by one instruction (no conversion of either side). The
 * tail past the last full vector is a masked load, zero-filled. */
static inline __attribute__((always_inline)) void dense_bf16_dp(
        const uint16_t *x, int64_t k, const uint16_t *w, const int m, float *res) {
    __m512 a0[KILN_MAX_ROWS], a1[KILN_MAX_ROWS];
    _Pragma("GCC unroll 8") for (int i = 0; i < m; i++) a0[i] = a1[i] = _mm512_setzero_ps();
    int64_t c = 0;
    if (m <= 4)
        for (; c + 64 <= k; c += 64) {
            prefetch_ahead(w + c);
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + c), w1 = (__m512bh)_mm512_loadu_si512(w + c + 32);
            _Pragma("GCC unroll 8") for (int i = 0; i < m; i++) {
                a0[i] = _mm512_dpbf16_ps(a0[i], (__m512bh)_mm512_loadu_si512(x + i * k + c), w0);
                a1[i] = _mm512_dpbf16_ps(a1[i], (__m512bh)_mm512_loadu_si512(x + i * k + c + 32), w1);
            }
        }
    for (; c < k; c += 32) {
        prefetch_ahead(w + c);
        const __mmask32 mask = k - c >= 32 ? 0xffffffffu : (__mmask32)((1u << (k - c)) - 1);
        const __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + c);
        _Pragma("GCC unroll 8") for (int i = 0; i < m; i++)
            a0[i] = _mm512_dpbf16_ps(a0[i], (__m512bh)_mm512_maskz_loadu_epi16(mask, x + i * k + c), w0);
    }
    _Pragma("GCC unroll 8") for (int i = 0; i < m; i++) res[i] = _mm512_reduce_add_ps(_mm512_add_ps(a0[i], a1[i]));
}
#endif

/* ----------------------------------------------------------- packed weights
 * One weight row of a packed format against M activation rows: the sums of
 * scale * q * x, with q8_0's and q4's scales per 32 elements applied;
 * packed_finish adds int8's row scale and q4's offsets (taken from the
 * activations' block sums). */
#if KILN_AVX512
/* Sixteen bytes of words (four words) widened to 16 int32 lanes in memory
 * order, so lane 4j + b holds byte b of word j: element 8b + j of an 8-bit
 * group (words 0-3 of it; 8b + j + 4 for words 4-7), and for 4-bit words
 * nibbles 2b (low) and 2b + 1 (high): elements 16b + j and 16b + 8 + j. The
 * activations are permuted into the same order once per call
 * (permute_packed), so each vector of weights multiplies a plain vector
 * load. */
static inline __attribute__((always_inline)) void packed_row(
        int kind, const float *x, int64_t k, const int32_t *words, const float *scales, int m, float *res) {
    __m512 acc[KILN_MAX_ROWS];
    _Pragma("GCC unroll 8") for (int i = 0; i < m; i++) acc[i] = _mm512_setzero_ps();
    const uint8_t *bytes = (const uint8_t *)words;
    if (kind == KIND_Q4) {
        const __m512i low = _mm512_set1_epi32(15);
        for (int64_t g = 0; g < k / 64; g++) {
            const uint8_t *p = bytes + g * 32;
            prefetch_ahead(p);
            const __m512i r0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
            const __m512i r1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16)));
            const __m512 f0 = _mm512_cvtepi32_ps(_mm512_and_si512(r0, low));
            const __m512 f1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(r0, 4));
            const __m512 f2 = _mm512_cvtepi32_ps(_mm512_and_si512(r1, low));
            const __m512 f3 = _mm512_cvtepi32_ps(_mm512_srli_epi32(r1, 4));
            /* byte b < 2 of a word: the group's first 32 elements, else its second */
            const __m512 d = _mm512_mask_blend_ps(0xCCCC, _mm512_set1_ps(scales[g * 2]),
                                                  _mm512_set1_ps(scales[g * 2 + 1]));
            _Pragma("GCC unroll 8") for (int i = 0; i < m; i++) {
                const float *xp = x + i * k + g * 64;
                const __m512 p0 = _mm512_fmadd_ps(f1, _mm512_loadu_ps(xp + 16), _mm512_mul_ps(f0, _mm512_loadu_ps(xp)));
                const __m512 p1 = _mm512_fmadd_ps(f3, _mm512_loadu_ps(xp + 48),
                                                  _mm512_mul_ps(f2, _mm512_loadu_ps(xp + 32)));
                acc[i] = _mm512_fmadd_ps(_mm512_add_ps(p0, p1), d, acc[i]);
            }
        }
    } else {
        for (int64_t g = 0; g < k / 32; g++) {
            const int8_t *p = (const int8_t *)bytes + g * 32;
            prefetch_ahead(p);
            const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
            const __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
            _Pragma("GCC unroll 8") for (int i = 0; i < m; i++) {
                const float *xp = x + i * k + g * 32;
                const __m512 t = _mm512_fmadd_ps(f1, _mm512_loadu_ps(xp + 16), _mm512_mul_ps(f0, _mm512_loadu_ps(xp)));
                acc[i] = kind == KIND_Q8_0 ? _mm512_fmadd_ps(t, _mm512_set1_ps(scales[g]), acc[i])
                                           : _mm512_add_ps(t, acc[i]);
            }
        }
    }
    for (int i = 0; i < m; i++) res[i] = _mm512_reduce_add_ps(acc[i]);
}

/* The activations in the packed words' lane order (packed_row above):
 * row-major [M, K] in, the same size out. */
static void permute_packed(int kind, const float *x, float *xp, int64_t m, int64_t k) {
    for (int64_t i = 0; i < m; i++) {
        const float *src = x + i * k;
        float *dst = xp + i * k;
        if (kind == KIND_Q4) {
            for (int64_t g = 0; g < k / 64; g++)  /* vector v = 2h + part: words 4h.., low (0) or high (1) nibbles */
                for (int h = 0; h < 2; h++)
                    for (int part = 0; part < 2; part++)
                        for (int j = 0; j < 4; j++)
                            for (int b = 0; b < 4; b++)
                                dst[g * 64 + (2 * h + part) * 16 + 4 * j + b] = src[g * 64 + 16 * b + 8 * part + 4 * h + j];
        } else {
            for (int64_t g = 0; g < k / 32; g++)  /* vector h: words 4h .. 4h + 3 */
                for (int h = 0; h < 2; h++)
                    for (int j = 0; j < 4; j++)
                        for (int b = 0; b < 4; b++)
                            dst[g * 32 + h * 16 + 4 * j + b] = src[g * 32 + 8 * b + 4 * h + j];
        }
    }
}
#else
static inline __m256 byte_lane(__m256i v, int b) {  /* signed byte b of each word */
    return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_sllv_epi32(v, _mm256_set1_epi32(24 - 8 * b)), 24));
}

static inline __m256 nibble_lane(__m256i v, int b) {  /* nibble b of each word, 0..15 */
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(v, _mm256_set1_epi32(4 * b)),
                                               _mm256_set1_epi32(15)));
}

/* The 32 products of one group's unpacked weights (f[b]: elements 8b .. 8b + 7)
 * with 32 activations, summed pairwise: two short chains instead of one of
 * four multiply-adds, which bound the loop by their latency (int8: 0.92x
 * Inductor's reduction on the 135M LM head with one chain). */
static inline __m256 dot32(const __m256 f[4], const float *xp) {
    const __m256 p0 = _mm256_fmadd_ps(f[2], _mm256_loadu_ps(xp + 16), _mm256_mul_ps(f[0], _mm256_loadu_ps(xp)));
    const __m256 p1 = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xp + 24), _mm256_mul_ps(f[1], _mm256_loadu_ps(xp + 8)));
    return _mm256_add_ps(p0, p1);
}

/* Byte (nibble) b of 8 words gives 8 consecutive elements: the activations
 * stay in their own order. */
static inline __attribute__((always_inline)) void packed_row(
        int kind, const float *x, int64_t k, const int32_t *words, const float *scales, int m, float *res) {
    __m256 acc[KILN_MAX_ROWS];
    _Pragma("GCC unroll 8") for (int i = 0; i < m; i++) acc[i] = _mm256_setzero_ps();
    if (kind == KIND_Q4) {
        for (int64_t g = 0; g < k / 64; g++) {
            prefetch_ahead(words + g * 64 / 8);
            const __m256i v = _mm256_loadu_si256((const __m256i *)(words + g * 64 / 8));
            for (int half = 0; half < 2; half++) {
                __m256 f[4];
                for (int b = 0; b < 4; b++) f[b] = nibble_lane(v, half * 4 + b);
                const __m256 d = _mm256_broadcast_ss(scales + g * 2 + half);
                _Pragma("GCC unroll 8") for (int i = 0; i < m; i++)
                    acc[i] = _mm256_fmadd_ps(dot32(f, x + i * k + g * 64 + half * 32), d, acc[i]);
            }
        }
    } else {
        for (int64_t g = 0; g < k / 32; g++) {
            prefetch_ahead(words + g * 8);
            const __m256i v = _mm256_loadu_si256((const __m256i *)(words + g * 8));
            __m256 f[4];
            for (int b = 0; b < 4; b++) f[b] = byte_lane(v, b);
            _Pragma("GCC unroll 8") for (int i = 0; i < m; i++) {
                const __m256 t = dot32(f, x + i * k + g * 32);
                acc[i] = kind == KIND_Q8_0 ? _mm256_fmadd_ps(t, _mm256_broadcast_ss(scales + g), acc[i])
                                           : _mm256_add_ps(t, acc[i]);
            }
        }
    }
    for (int i = 0; i < m; i++) res[i] = hsum8(acc[i]);
}
#endif

/* q4's offsets against the activations' block sums: sum over blocks of
 * offsets[b] * xsum[b], in vectors. Written as a scalar loop it was a chain of
 * k / 32 dependent multiply-adds per weight row that the compiler may not
 * reorder: a whole step's q4 layers (30 x 3.5M weights, 2 threads) took
 * 6.5-7.3 ms with it, 5.2-5.9 ms in vectors (scratch runs, an AMD EPYC with
 * AVX-512). */
static inline float offsets_dot(const float *offsets, const float *xsum, int64_t blocks) {
    int64_t b = 0;
#if KILN_AVX512
    __m512 a = _mm512_setzero_ps();
    for (; b + 16 <= blocks; b += 16)
        a = _mm512_fmadd_ps(_mm512_loadu_ps(offsets + b), _mm512_loadu_ps(xsum + b), a);
    if (b < blocks) {
        const __mmask16 tail = (__mmask16)((1u << (blocks - b)) - 1);
        a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, offsets + b), _mm512_maskz_loadu_ps(tail, xsum + b), a);
    }
    return _mm512_reduce_add_ps(a);
#else
    __m256 a = _mm256_setzero_ps();
    for (; b + 8 <= blocks; b += 8)
        a = _mm256_fmadd_ps(_mm256_loadu_ps(offsets + b), _mm256_loadu_ps(xsum + b), a);
    float s = hsum8(a);
    for (; b < blocks; b++) s += offsets[b] * xsum[b];
    return s;
#endif
}

/* The offsets' and the row scale's share, after packed_row's sum. */
static inline float packed_finish(int kind, float s, const float *scales, const float *offsets, const float *xsum,
                                  int64_t k) {
    if (kind == KIND_INT8) s *= scales[0];
    if (kind == KIND_Q4) s += offsets_dot(offsets, xsum, k / 32);
    return s;
}

/* ------------------------------------------------------------------ driver */
static inline void store(void *out, int out_bf16, int64_t index, float v) {
    if (out_bf16) ((uint16_t *)out)[index] = f32_to_bf16(v);
    else ((float *)out)[index] = v;
}

static inline float bias_at(const void *bias, int out_bf16, int64_t j) {
    if (!bias) return 0.0f;
    return out_bf16 ? bf16_to_f32(((const uint16_t *)bias)[j]) : ((const float *)bias)[j];
}

/* Rows [j0, j1) of the output for every activation row; M is a constant at
 * each call (SWITCH_M), so that the accumulators can live in registers.
 * ``xa``: the activations as the row function takes them (fp32, or bf16 for
 * KIND_BF16_DP). */
static inline __attribute__((always_inline)) void rows_dense(
        int kind, const void *xa, const int m, int64_t k, const void *w, int64_t j0, int64_t j1,
        const void *bias, void *out, int out_bf16, int64_t out_stride) {
    float res[KILN_MAX_ROWS];
    for (int64_t j = j0; j < j1; j++) {
        if (kind == KIND_F32) dense_f32((const float *)xa, k, (const float *)w + j * k, m, res);
#if KILN_DPBF16
        else if (kind == KIND_BF16_DP) dense_bf16_dp((const uint16_t *)xa, k, (const uint16_t *)w + j * k, m, res);
#endif
        else dense_bf16((const float *)xa, k, (const uint16_t *)w + j * k, m, res);
        _Pragma("GCC unroll 8") for (int i = 0; i < m; i++)
            store(out, out_bf16, i * out_stride + j, res[i] + bias_at(bias, out_bf16, j));
    }
}

static inline __attribute__((always_inline)) void rows_packed(
        int kind, const float *xf, const float *xsum, const int m, int64_t k, const int32_t *words,
        const float *scales, const float *offsets, int64_t j0, int64_t j1, const void *bias, void *out,
        int out_bf16, int64_t out_stride) {
    const int64_t per_row_scales = kind == KIND_INT8 ? 1 : k / 32;
    float res[KILN_MAX_ROWS];
    for (int64_t j = j0; j < j1; j++) {
        const int32_t *wp = words + j * (kind == KIND_Q4 ? k / 8 : k / 4);
        const float *sp = scales + j * per_row_scales;
        const float *op = offsets ? offsets + j * (k / 32) : NULL;
        if (kind == KIND_Q4) packed_row(KIND_Q4, xf, k, wp, sp, m, res);
        else if (kind == KIND_Q8_0) packed_row(KIND_Q8_0, xf, k, wp, sp, m, res);
        else packed_row(KIND_INT8, xf, k, wp, sp, m, res);
        for (int i = 0; i < m; i++)
            store(out, out_bf16, i * out_stride + j,
                  packed_finish(kind, res[i], sp, op, xsum + i * (k / 32), k) + bias_at(bias, out_bf16, j));
    }
}

#define SWITCH_M(m, CALL) switch (m) { \
    case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; case 4: CALL(4); break; \
    case 5: CALL(5); break; case 6: CALL(6); break; case 7: CALL(7); break; default: CALL(8); break; }

static void rows(int kind, const void *xa, const float *xsum, int m, int64_t k, const void *w, const float *scales,
                 const float *offsets, int64_t j0, int64_t j1, const void *bias, void *out, int out_bf16,
                 int64_t out_stride) {
#define DENSE(M) rows_dense(kind, xa, M, k, w, j0, j1, bias, out, out_bf16, out_stride)
#define PACKED(M) rows_packed(kind, (const float *)xa, xsum, M, k, (const int32_t *)w, scales, offsets, j0, j1, \
                              bias, out, out_bf16, out_stride)
    if (kind <= KIND_BF16 || kind == KIND_BF16_DP) { SWITCH_M(m, DENSE) } else { SWITCH_M(m, PACKED) }
#undef DENSE
#undef PACKED
}

/* A buffer of ``need`` elements of ``size`` bytes: ``local`` when it fits
 * (``have`` elements), else the heap (freed by the caller when it differs). */
static void *buffer(void *local, int64_t have, int64_t need, size_t size) {
    return need <= have ? local : malloc(size * (size_t)need);
}

/* out[M, N] = x[M, K] @ W[N, K]^T + bias. Returns 0, -1 for arguments
 * outside the kernel's limits (the caller checks them first), -2 when a
 * buffer could not be allocated. */
int kiln_linear(int kind, const void *x, int x_bf16, int64_t x_stride, int64_t m, const void *w,
                const float *scales, const float *offsets, int64_t n, int64_t k, const void *bias, void *out,
                int out_bf16, int64_t out_stride, int threads) {
    if (m < 1 || m > KILN_MAX_ROWS || k < 1 || k > KILN_MAX_K || n < 1 || kind < KIND_F32 || kind > KIND_Q4)
        return -1;
    if ((kind == KIND_INT8 || kind == KIND_Q8_0) && k % 32) return -1;
    if (kind == KIND_Q4 && (k % 64 || !offsets)) return -1;
    /* The activations as the rows take them: contiguous fp32 rows (packed
     * kinds with AVX-512: permuted into the words' order), or bf16 rows for
     * the bf16 dot product; and their 32-element block sums for q4. */
    float xf[KILN_MAX_ROWS * 1024], xp[KILN_MAX_ROWS * 1024], xs[KILN_MAX_ROWS * 32];
    const int64_t local = KILN_MAX_ROWS * 1024;
    float *xbuf = buffer(xf, local, m * k, sizeof(float));
    float *sbuf = buffer(xs, KILN_MAX_ROWS * 32, m * (k / 32 + 1), sizeof(float));
    void *xa = xbuf, *heap = NULL;
    int rc = -2;
    if (!xbuf || !sbuf) goto done;
    if (KILN_DPBF16 && kind == KIND_BF16 && x_bf16) {
        uint16_t *xh = (uint16_t *)xbuf;  /* half the fp32 buffer's bytes */
        for (int64_t i = 0; i < m; i++)
            memcpy(xh + i * k, (const uint16_t *)x + i * x_stride, sizeof(uint16_t) * k);
        kind = KIND_BF16_DP;
    } else {
        for (int64_t i = 0; i < m; i++)
            for (int64_t t = 0; t < k; t++)
                xbuf[i * k + t] = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[i * x_stride + t])
                                         : ((const float *)x)[i * x_stride + t];
    }
    if (kind == KIND_Q4)
        for (int64_t i = 0; i < m; i++)
            for (int64_t blk = 0; blk < k / 32; blk++) {
                float s = 0.0f;
                for (int t = 0; t < 32; t++) s += xbuf[i * k + blk * 32 + t];
                sbuf[i * (k / 32) + blk] = s;
            }
#if KILN_AVX512
    if (kind >= KIND_INT8 && kind <= KIND_Q4) {
        float *perm = buffer(xp, local, m * k, sizeof(float));
        if (!perm) goto done;
        if (perm != xp) heap = perm;
        permute_packed(kind, xbuf, perm, m, k);
        xa = perm;
    }
#else
    (void)xp;
#endif
    /* each thread takes a contiguous share of the output rows, a multiple of 4 */
    const int64_t chunks = (n + 3) / 4;
#pragma omp parallel num_threads(threads)
    {
#ifdef _OPENMP
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
#else
        const int nt = 1, id = 0;
#endif
        const int64_t c0 = chunks * id / nt, c1 = chunks * (id + 1) / nt;
        const int64_t j0 = c0 * 4, j1 = c1 * 4 < n ? c1 * 4 : n;
        if (j0 < j1) rows(kind, xa, sbuf, (int)m, k, w, scales, offsets, j0, j1, bias, out, out_bf16, out_stride);
    }
    rc = 0;
done:
    if (xbuf && xbuf != xf) free(xbuf);
    if (sbuf && sbuf != xs) free(sbuf);
    free(heap);
    return rc;
}

/* The instruction set this library was built for, for kiln's reports. */
const char *kiln_linear_isa(void) {
    return KILN_DPBF16 ? "avx512-bf16" : KILN_AVX512 ? "avx512" : "avx2";
}
