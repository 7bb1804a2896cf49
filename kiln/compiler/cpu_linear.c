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
 * The library every CPU entry builds also carries the other loops a decode
 * step runs in C: the MLP's SiLU times up (kiln_silu_mul), the greedy
 * sampler's argmax (kiln_argmax) and the replay of a CPU call graph's calls
 * (kiln_replay, kiln.graphs.cpu).
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
 *                         scales: int8 [N, 1] fp32; q8_0 and q4 [N, K / 32]
 *                         fp16 (GGUF's own); offsets [N, K / 32] fp16 for q4
 *                         (converted by F16C in the loops, see rows_packed).
 *   value of a packed element: int8, q8_0: scale * q (q signed);
 *                              q4: scale * q + offset (q in 0..15).
 *
 * A packed kind or'ed with KILN_ROUND_X takes its activations rounded to int8
 * per 32 elements (round_blocks; kiln.models.quant.round_activations is the
 * same rounding in torch), as llama.cpp's quantized products do. With
 * AVX512-VNNI the integer products are then summed by vpdpbusd, four at a time
 * (vnni_row); elsewhere the rounded values are multiplied in fp32
 * (packed_row): the same numbers either way, up to the order of the fp32 sums.
 * Without the flag the activations are used as they are (packed_row).
 */
#define _DEFAULT_SOURCE /* syscall(), which asks Linux for the AMX tiles (kiln_amx) */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <immintrin.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if !(defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#error "cpu_linear.c needs AVX2, FMA and F16C (kiln falls back to its compiled reductions without them)"
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

#if KILN_AVX512 && defined(__AVX512VNNI__)
#define KILN_VNNI 1  /* unsigned x signed bytes, summed by fours into int32 by one instruction */
#else
#define KILN_VNNI 0
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
/* The kinds this library takes, one bit per kind's code (KIND_BF16's bit
 * covers KIND_BF16_DP): kiln builds a model's library with the kinds its
 * linears use (-DKILN_KINDS=...), and the compiler then leaves out the rest.
 * With all five, gcc -O3 took 7.3 s here; with fp32 alone, 2.2 s. */
#ifndef KILN_KINDS
#define KILN_KINDS 0x1f
#endif
#define KILN_HAS(kind) ((KILN_KINDS >> ((kind) == KIND_BF16_DP ? KIND_BF16 : (kind))) & 1)
/* Or'ed into a packed kind: its activations rounded to int8 per 32 elements
 * (kiln.models.quant's ``-a8`` formats), multiplied as integers with VNNI. */
#define KILN_ROUND_X 16

static inline float hsum8(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

static inline float half_at(const uint16_t *p, int64_t i) { return _cvtsh_ss(p[i]); }

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
#define vstore _mm512_storeu_ps
#define vset1 _mm512_set1_ps
#define vsub _mm512_sub_ps
#define vmin _mm512_min_ps
#define vmax _mm512_max_ps
#define vfnmadd _mm512_fnmadd_ps
#define vround(v) _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
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
#define vstore _mm256_storeu_ps
#define vset1 _mm256_set1_ps
#define vsub _mm256_sub_ps
#define vmin _mm256_min_ps
#define vmax _mm256_max_ps
#define vfnmadd _mm256_fnmadd_ps
#define vround(v) _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
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
 * vectors) while M <= 4, one beyond, so that they all stay in registers
 * (``order``: the M whose order of sums a call follows, M itself but for the
 * greedy screen's recheck of one row, kiln_greedy_screen). A
 * block of several weight rows at once was slower (1.1-1.7x; several streams
 * instead of one). */
#define DENSE_ROW(NAME, WTYPE, LOADW, TOF)                                                     \
static inline __attribute__((always_inline)) void NAME(                                      \
        const float *x, int64_t k, const WTYPE *w, const int m, const int order, float *res) { \
    vfloat a0[KILN_MAX_ROWS], a1[KILN_MAX_ROWS];                                             \
    _Pragma("GCC unroll 8") for (int i = 0; i < m; i++) a0[i] = a1[i] = vzero();             \
    int64_t c = 0;                                                                           \
    if (order <= 4)                                                                          \
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

/* ------------------------------------------------------ fp32, 9 to 16 rows
 * DENSE_ROW loads each activation vector for one multiply-add: rebuilt for 16
 * rows it was bound by the load ports (a step's fp32 linears of the 135M
 * shape 51-56 ms at 16 rows against 28-30 at 8, scratch probe). Here a pass
 * multiplies a block of 4 weight rows by XB activation rows, each vector
 * loaded once for 4 (weights) or XB (activations) multiply-adds, and the
 * block's later passes read its weights from L1. The stream of weights from
 * memory is asked for ahead, spread over the passes: the block after this
 * one, a share of it each pass (block_f32). The rows are padded with zeros
 * to a multiple of XB. A step's linears at 16 rows: 27.9 ms, oneDNN's on
 * reordered weights 27.5 (bench/results/step-linears-cpu-20261207-012709.json,
 * 2 threads of an Intel Xeon); what kiln gains is a step that stays under a
 * CPU call graph, which oneDNN's torch work refuses: 16-request fp32 decode
 * steps of the demo model 51.4 -> 40.3 ms (decode-throughput-cpu-20261207-*). */
#define KILN_DENSE_MAX_ROWS 16 /* fp32 rows one call takes; the other kinds KILN_MAX_ROWS */
#if KILN_AVX512
#define XB 4 /* activation rows a pass: 16 accumulators, 4 weight vectors, of 32 registers */
#else
#define XB 2 /* AVX2's 16 registers: 8 accumulators and 4 weight vectors */
#endif
#define CACHE_LINE_FLOATS 16

/* The lane sums of 4 vectors, in each 128-bit lane (AVX-512): a transposing
 * tree of shuffles and adds, with quad_sums below a third of the
 * instructions of 16 horizontal sums (which at K = 576 were a fifth of a
 * pass's work). */
#if KILN_AVX512
static inline __attribute__((always_inline)) __m512 quad_lanes(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    return _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
}

/* Lanes 4q .. 4q + 3 of the result: the sums of the four vectors whose
 * quad_lanes is ``q<q>`` (the 128-bit lanes added: pairs, then halves). */
static inline __attribute__((always_inline)) __m512 quad_sums(__m512 q0, __m512 q1, __m512 q2, __m512 q3) {
    const __m512 h0 = _mm512_add_ps(_mm512_shuffle_f32x4(q0, q1, _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(q0, q1, _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 h1 = _mm512_add_ps(_mm512_shuffle_f32x4(q2, q3, _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(q2, q3, _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(h0, h1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(h0, h1, _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

/* res[r * KILN_DENSE_MAX_ROWS + i]: weight row r of the block at ``w`` (4
 * rows of k) times activation row i of ``x`` (mp rows, a multiple of XB).
 * ``next``: the following block's weights, asked for into L1 over the passes
 * (pass p the p-th share of its 4k floats), or NULL. */
static inline __attribute__((always_inline)) void block_f32(
        const float *x, int64_t k, int mp, const float *w, const float *next, float *res) {
    const int passes = mp / XB;
    const int64_t kv = k / VW * VW;
    for (int p = 0; p < passes; p++) {
        const float *xp = x + (int64_t)p * XB * k;
        vfloat acc[4][XB];
        _Pragma("GCC unroll 4") for (int r = 0; r < 4; r++)
            _Pragma("GCC unroll 4") for (int i = 0; i < XB; i++) acc[r][i] = vzero();
        /* this pass's share of ``next``, [ask, until): one line a step of K, two
         * where the share has more lines than the pass has steps (3 passes) */
        const float *ask = next ? next + 4 * k * p / passes : NULL;
        const float *until = next ? next + 4 * k * (p + 1) / passes : NULL;
        const int64_t steps = kv / VW > 0 ? kv / VW : 1;
        const int two = (until - ask) / CACHE_LINE_FLOATS > steps;
        for (int64_t c = 0; c < kv; c += VW) {
            if (ask < until) {
                _mm_prefetch((const char *)ask, _MM_HINT_T0);
                if (two) _mm_prefetch((const char *)(ask + CACHE_LINE_FLOATS), _MM_HINT_T0);
                ask += (1 + two) * CACHE_LINE_FLOATS;
            }
            const vfloat w0 = vload(w + c), w1 = vload(w + k + c), w2 = vload(w + 2 * k + c),
                         w3 = vload(w + 3 * k + c);
            _Pragma("GCC unroll 4") for (int i = 0; i < XB; i++) {
                const vfloat xv = vload(xp + i * k + c);
                acc[0][i] = vfmadd(w0, xv, acc[0][i]);
                acc[1][i] = vfmadd(w1, xv, acc[1][i]);
                acc[2][i] = vfmadd(w2, xv, acc[2][i]);
                acc[3][i] = vfmadd(w3, xv, acc[3][i]);
            }
        }
        float sums[4 * XB];  /* sums[r * XB + i]: acc[r][i]'s lanes added */
#if KILN_AVX512
        _mm512_storeu_ps(sums, quad_sums(quad_lanes(acc[0][0], acc[0][1], acc[0][2], acc[0][3]),
                                         quad_lanes(acc[1][0], acc[1][1], acc[1][2], acc[1][3]),
                                         quad_lanes(acc[2][0], acc[2][1], acc[2][2], acc[2][3]),
                                         quad_lanes(acc[3][0], acc[3][1], acc[3][2], acc[3][3])));
#else
        _Pragma("GCC unroll 4") for (int r = 0; r < 4; r++)
            _Pragma("GCC unroll 4") for (int i = 0; i < XB; i++) sums[r * XB + i] = hsum8(acc[r][i]);
#endif
        _Pragma("GCC unroll 4") for (int r = 0; r < 4; r++)
            _Pragma("GCC unroll 4") for (int i = 0; i < XB; i++) {
                float s = sums[r * XB + i];
                for (int64_t t = kv; t < k; t++) s += xp[i * k + t] * w[r * k + t];
                res[r * KILN_DENSE_MAX_ROWS + p * XB + i] = s;
            }
    }
}

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
/* One group of a packed row (32 elements of int8 or q8_0, 64 of q4) into the
 * accumulators ``acc``. ``scales``: the row's fp16 block scales (int8: unused). */
static inline __attribute__((always_inline)) void packed_group(
        int kind, const float *x, int64_t k, const uint8_t *bytes, const uint16_t *scales, int64_t g, int m,
        __m512 *acc) {
    if (kind == KIND_Q4) {
        const __m512i low = _mm512_set1_epi32(15);
        const uint8_t *p = bytes + g * 32;
        prefetch_ahead(p);
        const __m512i r0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
        const __m512i r1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16)));
        const __m512 f0 = _mm512_cvtepi32_ps(_mm512_and_si512(r0, low));
        const __m512 f1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(r0, 4));
        const __m512 f2 = _mm512_cvtepi32_ps(_mm512_and_si512(r1, low));
        const __m512 f3 = _mm512_cvtepi32_ps(_mm512_srli_epi32(r1, 4));
        /* byte b < 2 of a word: the group's first 32 elements (scale 0 of the
         * pair), else its second (scale 1): one 4-byte load, one conversion */
        uint32_t pair;
        memcpy(&pair, scales + g * 2, 4);
        const __m512i which = _mm512_setr_epi32(0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1);
        const __m512 d = _mm512_permutexvar_ps(which, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128((int)pair))));
        _Pragma("GCC unroll 8") for (int i = 0; i < m; i++) {
            const float *xp = x + i * k + g * 64;
            const __m512 p0 = _mm512_fmadd_ps(f1, _mm512_loadu_ps(xp + 16), _mm512_mul_ps(f0, _mm512_loadu_ps(xp)));
            const __m512 p1 = _mm512_fmadd_ps(f3, _mm512_loadu_ps(xp + 48), _mm512_mul_ps(f2, _mm512_loadu_ps(xp + 32)));
            acc[i] = _mm512_fmadd_ps(_mm512_add_ps(p0, p1), d, acc[i]);
        }
    } else {
        const int8_t *p = (const int8_t *)bytes + g * 32;
        prefetch_ahead(p);
        const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
        const __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
        const __m512 d = kind == KIND_Q8_0 ? _mm512_set1_ps(half_at(scales, g)) : _mm512_setzero_ps();
        _Pragma("GCC unroll 8") for (int i = 0; i < m; i++) {
            const float *xp = x + i * k + g * 32;
            const __m512 t = _mm512_fmadd_ps(f1, _mm512_loadu_ps(xp + 16), _mm512_mul_ps(f0, _mm512_loadu_ps(xp)));
            acc[i] = kind == KIND_Q8_0 ? _mm512_fmadd_ps(t, d, acc[i]) : _mm512_add_ps(t, acc[i]);
        }
    }
}

/* Up to four activation rows, groups alternate between two sets of
 * accumulators: with one, each group's last multiply-add waited for the
 * previous group's (4 cycles), and at one row that chain was the loop's
 * speed, about 8 bytes of weights a cycle a core (q8_0 from cache: a step's
 * worth of 135M linears in 2.0 ms, 60 GB/s, on 2 cores of an AMD EPYC that
 * reads DRAM at about 58 GB/s). */
static inline __attribute__((always_inline)) void packed_row(
        int kind, const float *x, int64_t k, const int32_t *words, const uint16_t *scales, int m, float *res) {
    __m512 acc[KILN_MAX_ROWS], acc2[KILN_MAX_ROWS];
    _Pragma("GCC unroll 8") for (int i = 0; i < m; i++) acc[i] = acc2[i] = _mm512_setzero_ps();
    const uint8_t *bytes = (const uint8_t *)words;
    const int64_t groups = k / (kind == KIND_Q4 ? 64 : 32);
    int64_t g = 0;
    if (m <= 4)
        for (; g + 2 <= groups; g += 2) {
            packed_group(kind, x, k, bytes, scales, g, m, acc);
            packed_group(kind, x, k, bytes, scales, g + 1, m, acc2);
        }
    for (; g < groups; g++) packed_group(kind, x, k, bytes, scales, g, m, acc);
    _Pragma("GCC unroll 8") for (int i = 0; i < m; i++) res[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i], acc2[i]));
}

#else  /* AVX2 */
static inline __m256 nibble_lane(__m256i v, int b) {  /* nibble b of each word, 0..15 */
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(v, _mm256_set1_epi32(4 * b)),
                                               _mm256_set1_epi32(15)));
}

/* The 32 products of one group's unpacked weights (f[v] against activations
 * 8v .. 8v + 7, in the order the weights take them) summed pairwise: two
 * short chains instead of one of four multiply-adds, which bound the loop by
 * their latency (int8: 0.92x Inductor's reduction on the 135M LM head with
 * one chain). */
static inline __m256 dot32(const __m256 f[4], const float *xp) {
    const __m256 p0 = _mm256_fmadd_ps(f[2], _mm256_loadu_ps(xp + 16), _mm256_mul_ps(f[0], _mm256_loadu_ps(xp)));
    const __m256 p1 = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xp + 24), _mm256_mul_ps(f[1], _mm256_loadu_ps(xp + 8)));
    return _mm256_add_ps(p0, p1);
}

/* q4: nibble b of 8 words gives 8 consecutive elements, so the activations
 * stay in their own order; int8 and q8_0: below. */
static inline __attribute__((always_inline)) void packed_row(
        int kind, const float *x, int64_t k, const int32_t *words, const uint16_t *scales, int m, float *res) {
    __m256 acc[KILN_MAX_ROWS];
    _Pragma("GCC unroll 8") for (int i = 0; i < m; i++) acc[i] = _mm256_setzero_ps();
    if (kind == KIND_Q4) {
        for (int64_t g = 0; g < k / 64; g++) {
            prefetch_ahead(words + g * 64 / 8);
            const __m256i v = _mm256_loadu_si256((const __m256i *)(words + g * 64 / 8));
            for (int half = 0; half < 2; half++) {
                __m256 f[4];
                for (int b = 0; b < 4; b++) f[b] = nibble_lane(v, half * 4 + b);
                const __m256 d = _mm256_set1_ps(half_at(scales, g * 2 + half));
                _Pragma("GCC unroll 8") for (int i = 0; i < m; i++)
                    acc[i] = _mm256_fmadd_ps(dot32(f, x + i * k + g * 64 + half * 32), d, acc[i]);
            }
        }
    } else {
        /* eight bytes (two words) widened at a time, lane 4j + b holding byte b
         * of word j, against the activations permuted as for AVX-512
         * (permute_packed: its vectors' halves are these): two instructions per
         * 8 weights where taking byte b of 8 words (shift, shift, convert) took
         * three */
        const int8_t *bytes = (const int8_t *)words;
        for (int64_t g = 0; g < k / 32; g++) {
            const int8_t *p = bytes + g * 32;
            prefetch_ahead(p);
            __m256 f[4];
            for (int h = 0; h < 4; h++)
                f[h] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * h))));
            const __m256 d = kind == KIND_Q8_0 ? _mm256_set1_ps(half_at(scales, g)) : _mm256_setzero_ps();
            _Pragma("GCC unroll 8") for (int i = 0; i < m; i++) {
                const __m256 t = dot32(f, x + i * k + g * 32);
                acc[i] = kind == KIND_Q8_0 ? _mm256_fmadd_ps(t, d, acc[i]) : _mm256_add_ps(t, acc[i]);
            }
        }
    }
    for (int i = 0; i < m; i++) res[i] = hsum8(acc[i]);
}
#endif

/* The activations in the packed words' lane order (packed_row: AVX-512's
 * vectors of 16, and AVX2's of 8 for int8 and q8_0, the halves of those):
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

/* q4's offsets against the activations' block sums: sum over blocks of
 * offsets[b] * xsum[b], in vectors. Written as a scalar loop it was a chain of
 * k / 32 dependent multiply-adds per weight row that the compiler may not
 * reorder: a whole step's q4 layers (30 x 3.5M weights, 2 threads) took
 * 6.5-7.3 ms with it, 5.2-5.9 ms in vectors (scratch runs, an AMD EPYC with
 * AVX-512). */
static inline float offsets_dot(const uint16_t *offsets, const float *xsum, int64_t blocks) {
    int64_t b = 0;
#if KILN_AVX512
    __m512 a = _mm512_setzero_ps();
    for (; b + 16 <= blocks; b += 16)
        a = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(offsets + b))),
                            _mm512_loadu_ps(xsum + b), a);
    if (b < blocks) {
        const __mmask16 tail = (__mmask16)((1u << (blocks - b)) - 1);
        a = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(tail, offsets + b)),
                            _mm512_maskz_loadu_ps(tail, xsum + b), a);
    }
    return _mm512_reduce_add_ps(a);
#else
    __m256 a = _mm256_setzero_ps();
    for (; b + 8 <= blocks; b += 8)
        a = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(offsets + b))),
                            _mm256_loadu_ps(xsum + b), a);
    float s = hsum8(a);
    for (; b < blocks; b++) s += half_at(offsets, b) * xsum[b];
    return s;
#endif
}

/* The offsets' and the row scale's share, after packed_row's sum. */
static inline float packed_finish(int kind, int vnni, float s, const float *row_scale, const uint16_t *offsets,
                                  const float *xsum, int64_t k) {
    if (kind == KIND_INT8) s *= *row_scale;
    if (kind == KIND_Q4 && !vnni) s += offsets_dot(offsets, xsum, k / 32);  /* vnni_row adds its own */
    return s;
}

/* ------------------------------------------------ activations rounded to int8
 * Each block of 32 activations of a row: d = max|x| / 127, q = rint(x * (1 /
 * d)) in -127..127 (0 for a block of zeros), and the block's sum d * sum(q).
 * Blocks are contiguous: row i's block b is block i * (k / 32) + b. */
static void round_blocks(const float *x, int64_t blocks, int8_t *q, float *d, float *xsum) {
    for (int64_t b = 0; b < blocks; b++) {
        const float *src = x + b * 32;
#if KILN_AVX512
        const __m512 a0 = _mm512_loadu_ps(src), a1 = _mm512_loadu_ps(src + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a0), _mm512_abs_ps(a1)));
        const float scale = amax / 127.0f, inv = scale > 0.0f ? 1.0f / scale : 0.0f;
        const __m512 vi = _mm512_set1_ps(inv);
        const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
        /* the conversion rounds to nearest even (the default rounding mode), as torch.round */
        const __m512i q0 = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(a0, vi)), lo), hi);
        const __m512i q1 = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(a1, vi)), lo), hi);
        _mm_storeu_si128((__m128i *)(q + b * 32), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(q + b * 32 + 16), _mm512_cvtepi32_epi8(q1));
        const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#else
        float amax = 0.0f;
        for (int t = 0; t < 32; t++) amax = fmaxf(amax, fabsf(src[t]));
        const float scale = amax / 127.0f, inv = scale > 0.0f ? 1.0f / scale : 0.0f;
        int sum = 0;
        for (int t = 0; t < 32; t++) {
            const float r = nearbyintf(src[t] * inv);
            const int v = r > 127.0f ? 127 : r < -127.0f ? -127 : (int)r;
            q[b * 32 + t] = (int8_t)v;
            sum += v;
        }
#endif
        d[b] = scale;
        xsum[b] = scale * (float)sum;
    }
}

#if KILN_VNNI
/* ----------------------------------------------- integer products (VNNI)
 * A chunk is 64 bytes of packed words: two groups, 64 int8 (q8_0, int8) or
 * 128 q4 elements. vpdpbusd multiplies the 4 bytes of a 32-bit lane of
 * weights by the 4 bytes of the same lane of activations and adds the sum to
 * the lane, so the activations are laid out per chunk in the weights' byte
 * order (vnni_layout), with zeros past the last group:
 *
 * - int8, q8_0: byte 4j + c of a group is element 8c + j; one 64-byte vector
 *   of activations a chunk. vpdpbusd takes unsigned weights: the kernel flips
 *   their sign bit (q + 128), and each lane's sum starts at -128 times the sum
 *   of its four activations (``corr``) to take the 128 back out. A lane is in
 *   one block of 32: lanes 0-7 the chunk's first group, 8-15 its second.
 * - q4: the low nibble of byte 4j + c of a group is element 16c + j, the high
 *   nibble element 16c + 8 + j. Bytes c = 0, 1 of a word are in the group's
 *   first block of 32 and c = 2, 3 in its second, so a lane of words mixes
 *   two scales: the kernel first shuffles the bytes of each 16 (words j0 ..
 *   j0 + 3) so that their c = 0, 1 bytes fill the first two lanes and their
 *   c = 2, 3 bytes the last two (Q4_SOURCE). A lane is then in one block:
 *   lane d of a chunk in block 2 * (2t + d / 8) + (d % 4 >= 2). Two 64-byte
 *   vectors of activations a chunk, for the low and the high nibbles.
 *
 * ``dxe``: the activations' scale of each lane's block, 16 floats a chunk. */
typedef struct {
    int8_t *xq;    /* [m][xq_row] */
    int32_t *corr; /* [m][chunks * 16], int8 and q8_0 only */
    float *dxe;    /* [m][dxe_row] */
    const float *xsum; /* [m][k / 32]: the blocks' sums, for q4's offsets */
    int64_t chunks, xq_row, dxe_row;
} VnniRows;

static int64_t vnni_chunks(int kind, int64_t k) { return (k / (kind == KIND_Q4 ? 64 : 32) + 1) / 2; }

/* Byte p of 16 after the q4 shuffle came from byte Q4_SOURCE(p): word p / 2,
 * byte p % 2 (the first block's bytes), then word (p - 8) / 2, byte 2 +
 * p % 2 (the second block's). */
#define Q4_SOURCE(p) ((p) < 8 ? 4 * ((p) / 2) + (p) % 2 : 4 * (((p) - 8) / 2) + 2 + (p) % 2)

/* Where byte B of a chunk's activations comes from, as an element of the
 * chunk (64 for int8 and q8_0, 128 for q4: its low nibble's; the high
 * nibble's is 8 further). A table, so that laying out a row is a plain copy:
 * computed per byte, the layout of one 1536-element q8_0 row took about 4 us
 * of a 4-row call's 8 (scratch timing). */
#define Q8_ELEMENT(B) ((B) / 32 * 32 + 8 * ((B) % 4) + (B) % 32 / 4)
#define Q4_ELEMENT(B) ((B) / 32 * 64 + 16 * (Q4_SOURCE((B) % 16) % 4) + (B) % 32 / 16 * 4 + Q4_SOURCE((B) % 16) / 4)
#define TABLE4(F, B) F(B), F(B + 1), F(B + 2), F(B + 3)
#define TABLE16(F, B) TABLE4(F, B), TABLE4(F, B + 4), TABLE4(F, B + 8), TABLE4(F, B + 12)
#define TABLE64(F) TABLE16(F, 0), TABLE16(F, 16), TABLE16(F, 32), TABLE16(F, 48)
static const uint8_t q8_element[64] = {TABLE64(Q8_ELEMENT)};
static const uint8_t q4_element[64] = {TABLE64(Q4_ELEMENT)};

static void vnni_layout(int kind, const int8_t *q, const float *d, int64_t m, int64_t k, const VnniRows *v) {
    const int q4 = kind == KIND_Q4;
    const int64_t group = q4 ? 64 : 32, groups = k / group, blocks = k / 32;
    for (int64_t i = 0; i < m; i++) {
        const int8_t *qi = q + i * k;
        const float *di = d + i * blocks;
        int8_t *xq = v->xq + i * v->xq_row;
        float *dxe = v->dxe + i * v->dxe_row;
        for (int64_t t = 0; t < v->chunks; t++) {
            const int bytes = 2 * t + 1 < groups ? 64 : 32;  /* a chunk cut short: its second group zero */
            if (q4) {
                const int8_t *src = qi + t * 128;
                int8_t *dst = xq + t * 128;
                for (int B = 0; B < bytes; B++) {
                    dst[B] = src[q4_element[B]];
                    dst[64 + B] = src[q4_element[B] + 8];
                }
                for (int B = bytes; B < 64; B++) dst[B] = dst[64 + B] = 0;
            } else {
                const int8_t *src = qi + t * 64;
                int8_t *dst = xq + t * 64;
                for (int B = 0; B < bytes; B++) dst[B] = src[q8_element[B]];
                for (int B = bytes; B < 64; B++) dst[B] = 0;
            }
            for (int lane = 0; lane < 16; lane++) {
                const int64_t g = 2 * t + lane / 8;
                if (q4) {
                    dxe[t * 16 + lane] = g < groups ? di[2 * g + (lane % 4 >= 2)] : 0.0f;
                } else {
                    dxe[t * 16 + lane] = g < groups ? di[g] : 0.0f;
                    const int8_t *l4 = xq + t * 64 + 4 * lane;
                    v->corr[i * v->chunks * 16 + t * 16 + lane] = -128 * (l4[0] + l4[1] + l4[2] + l4[3]);
                }
            }
        }
    }
}

/* One weight row against M rows of prepared activations: the sum over blocks
 * of weight scale * activation scale * integer dot product, plus for q4 the
 * offsets times the activations' block sums (int8: without the row scale,
 * which packed_finish applies). Against the fp32 products this build had
 * before (packed_row), 2 cores of an AMD EPYC with AVX-512, one scratch run
 * taking turns: one row, weights streamed from DRAM, q4 gate/up (3072 x 576)
 * 63.1 -> 45.4 us (29.2 GB/s) and down (576 x 1536) 31.8 -> 22.6 us, q8_0
 * gate/up 78.4 -> 71.9 us; from cache, 1 and 4 rows, q4 1.15-2.0x and q8_0
 * 0.96-1.64x as fast (bench/results/llama-cpp-cpu-*.json for whole decode
 * steps). */
static inline __attribute__((always_inline)) void vnni_row(
        int kind, const VnniRows *v, int64_t k, const int32_t *words, const uint16_t *scales,
        const uint16_t *offsets, int m, float *res) {
    __m512 acc[KILN_MAX_ROWS];
    _Pragma("GCC unroll 8") for (int i = 0; i < m; i++) acc[i] = _mm512_setzero_ps();
    const uint8_t *bytes = (const uint8_t *)words;
    const __mmask64 first_group = 0xffffffffull;  /* a chunk whose second group is past the row's end */
    if (kind == KIND_Q4) {
        const int64_t groups = k / 64;
        const __m512i low = _mm512_set1_epi8(15);
        const __m512i shuffle = _mm512_broadcast_i32x4(_mm_setr_epi8(
            Q4_SOURCE(0), Q4_SOURCE(1), Q4_SOURCE(2), Q4_SOURCE(3), Q4_SOURCE(4), Q4_SOURCE(5), Q4_SOURCE(6),
            Q4_SOURCE(7), Q4_SOURCE(8), Q4_SOURCE(9), Q4_SOURCE(10), Q4_SOURCE(11), Q4_SOURCE(12), Q4_SOURCE(13),
            Q4_SOURCE(14), Q4_SOURCE(15)));
        /* lane d's scale: the chunk's 4 blocks, 2 * (d / 8) + (d % 4 >= 2) */
        const __m512i pick = _mm512_setr_epi32(0, 0, 1, 1, 0, 0, 1, 1, 2, 2, 3, 3, 2, 2, 3, 3);
        /* the offsets against the activations' block sums, 4 blocks a chunk, in
         * a short accumulator of their own: a separate pass over them after the
         * row (offsets_dot) made a 3072 x 576 weight on one core 76 us against
         * 51-58 us this way */
        __m128 acc_o[KILN_MAX_ROWS];
        _Pragma("GCC unroll 8") for (int i = 0; i < m; i++) acc_o[i] = _mm_setzero_ps();
        const int64_t blocks = k / 32;
        for (int64_t t = 0; t < v->chunks; t++) {
            const uint8_t *p = bytes + t * 64;
            prefetch_ahead(p);
            const int whole = 2 * t + 1 < groups;
            const __mmask8 present = whole ? 0xf : 0x3;
            const __m512i raw = whole ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(first_group, p);
            const __m512i w = _mm512_shuffle_epi8(raw, shuffle);
            const __m128 s4 = _mm_cvtph_ps(_mm_maskz_loadu_epi16(present, scales + 4 * t));
            const __m512 dw = _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(s4));
            const __m128 o = _mm_cvtph_ps(_mm_maskz_loadu_epi16(present, offsets + 4 * t));
            const __m512i lo = _mm512_and_si512(w, low), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
            _Pragma("GCC unroll 8") for (int i = 0; i < m; i++) {
                const int8_t *xp = v->xq + i * v->xq_row + t * 128;
                __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xp));
                a = _mm512_dpbusd_epi32(a, hi, _mm512_loadu_si512(xp + 64));
                const __m512 dx = _mm512_loadu_ps(v->dxe + i * v->dxe_row + t * 16);
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(dw, dx), acc[i]);
                acc_o[i] = _mm_fmadd_ps(o, _mm_maskz_loadu_ps(present, v->xsum + i * blocks + 4 * t), acc_o[i]);
            }
        }
        _Pragma("GCC unroll 8") for (int i = 0; i < m; i++) {
            __m128 h = _mm_add_ps(acc_o[i], _mm_movehl_ps(acc_o[i], acc_o[i]));
            h = _mm_add_ss(h, _mm_movehdup_ps(h));
            res[i] = _mm512_reduce_add_ps(acc[i]) + _mm_cvtss_f32(h);
        }
        return;
    } else {
        const int64_t groups = k / 32;
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        const __m512i pick = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
        for (int64_t t = 0; t < v->chunks; t++) {
            const uint8_t *p = bytes + t * 64;
            prefetch_ahead(p);
            const int whole = 2 * t + 1 < groups;
            /* past the row's end the weights read 0, flipped to 128, against activations of 0 */
            const __m512i w = _mm512_xor_si512(whole ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(first_group, p),
                                               flip);
            __m512 dw = _mm512_set1_ps(1.0f);
            if (kind == KIND_Q8_0) {
                const __m128 s2 = _mm_cvtph_ps(_mm_maskz_loadu_epi16(whole ? 0x3 : 0x1, scales + 2 * t));
                dw = _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(s2));
            }
            _Pragma("GCC unroll 8") for (int i = 0; i < m; i++) {
                const __m512i start = _mm512_loadu_si512(v->corr + i * v->chunks * 16 + t * 16);
                const __m512i dot = _mm512_dpbusd_epi32(start, w, _mm512_loadu_si512(v->xq + i * v->xq_row + t * 64));
                const __m512 dx = _mm512_loadu_ps(v->dxe + i * v->dxe_row + t * 16);
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), kind == KIND_Q8_0 ? _mm512_mul_ps(dw, dx) : dx,
                                         acc[i]);
            }
        }
    }
    for (int i = 0; i < m; i++) res[i] = _mm512_reduce_add_ps(acc[i]);
}
#endif

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
        if (KILN_HAS(KIND_F32) && kind == KIND_F32)
            dense_f32((const float *)xa, k, (const float *)w + j * k, m, m, res);
#if KILN_DPBF16
        else if (KILN_HAS(KIND_BF16) && kind == KIND_BF16_DP)
            dense_bf16_dp((const uint16_t *)xa, k, (const uint16_t *)w + j * k, m, res);
#endif
        else if (KILN_HAS(KIND_BF16)) dense_bf16((const float *)xa, k, (const uint16_t *)w + j * k, m, m, res);
        _Pragma("GCC unroll 8") for (int i = 0; i < m; i++)
            store(out, out_bf16, i * out_stride + j, res[i] + bias_at(bias, out_bf16, j));
    }
}

/* Rows [j0, j1) of an fp32 output of more than KILN_MAX_ROWS activation rows
 * (``m``; ``x`` holds them padded with zeros to ``mp``, a multiple of XB): 4
 * weight rows at a time (block_f32), the last 1-3 one at a time by
 * DENSE_ROW, 8 activation rows a call. */
static void rows_f32_block(const float *x, int m, int mp, int64_t k, const float *w, int64_t j0, int64_t j1,
                           const float *bias, float *out, int64_t out_stride) {
    float res[4 * KILN_DENSE_MAX_ROWS];
    int64_t j = j0;
    for (; j + 4 <= j1; j += 4) {
        block_f32(x, k, mp, w + j * k, j + 8 <= j1 ? w + (j + 4) * k : NULL, res);
        for (int r = 0; r < 4; r++) {
            const float b = bias ? bias[j + r] : 0.0f;
            for (int i = 0; i < m; i++) out[i * out_stride + j + r] = res[r * KILN_DENSE_MAX_ROWS + i] + b;
        }
    }
    for (; j < j1; j++)
        for (int i0 = 0; i0 < m; i0 += KILN_MAX_ROWS) {
            const int part = m - i0 < KILN_MAX_ROWS ? m - i0 : KILN_MAX_ROWS;
            dense_f32(x + i0 * k, k, w + j * k, part, part, res);
            for (int i = 0; i < part; i++) out[(i0 + i) * out_stride + j] = res[i] + (bias ? bias[j] : 0.0f);
        }
}

/* ``xa``: the prepared activations (prepare_packed): VnniRows where ``vnni``,
 * else fp32 rows. ``scales``: int8's fp32 row scales, else fp16 block scales
 * (with q4's fp16 ``offsets``), converted in the loops where they are used.
 * Scratch timings against fp32 scales, one row, 2 threads, weights from
 * DRAM, 2 cores of an AMD EPYC: q8_0 6-7.5% faster (6% fewer bytes; the
 * 49152 x 576 LM head too), q4 2-4%; whole decode steps 5% (Q8_0) and 3%
 * (Q4_1) shorter. Widening each row's scales to fp32 in a buffer first was
 * slower at K = 576 (18 blocks a row): q4 6-13%, the q8_0 head up to 5%, as
 * the loop's loads waited on the stores just made. */
static inline __attribute__((always_inline)) void rows_packed(
        int kind, int vnni, const void *xa, const float *xsum, const int m, int64_t k, const int32_t *words,
        const void *scales, const void *offsets, int64_t j0, int64_t j1, const void *bias, void *out,
        int out_bf16, int64_t out_stride) {
    const int64_t blocks = k / 32;
    float res[KILN_MAX_ROWS];
    for (int64_t j = j0; j < j1; j++) {
        const int32_t *wp = words + j * (kind == KIND_Q4 ? k / 8 : k / 4);
        const float *row_scale = kind == KIND_INT8 ? (const float *)scales + j : NULL;
        const uint16_t *sp = kind == KIND_INT8 ? NULL : (const uint16_t *)scales + j * blocks;
        const uint16_t *op = offsets ? (const uint16_t *)offsets + j * blocks : NULL;
#if KILN_VNNI
        if (vnni) {
            if (KILN_HAS(KIND_Q4) && kind == KIND_Q4) vnni_row(KIND_Q4, (const VnniRows *)xa, k, wp, sp, op, m, res);
            else if (KILN_HAS(KIND_Q8_0) && kind == KIND_Q8_0)
                vnni_row(KIND_Q8_0, (const VnniRows *)xa, k, wp, sp, NULL, m, res);
            else if (KILN_HAS(KIND_INT8)) vnni_row(KIND_INT8, (const VnniRows *)xa, k, wp, sp, NULL, m, res);
        } else
#endif
        {
            const float *xf = (const float *)xa;
            if (KILN_HAS(KIND_Q4) && kind == KIND_Q4) packed_row(KIND_Q4, xf, k, wp, sp, m, res);
            else if (KILN_HAS(KIND_Q8_0) && kind == KIND_Q8_0) packed_row(KIND_Q8_0, xf, k, wp, sp, m, res);
            else if (KILN_HAS(KIND_INT8)) packed_row(KIND_INT8, xf, k, wp, sp, m, res);
        }
        for (int i = 0; i < m; i++)
            store(out, out_bf16, i * out_stride + j,
                  packed_finish(kind, vnni, res[i], row_scale, op, xsum + i * (k / 32), k) + bias_at(bias, out_bf16, j));
    }
}

#define SWITCH_M(m, CALL) switch (m) { \
    case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; case 4: CALL(4); break; \
    case 5: CALL(5); break; case 6: CALL(6); break; case 7: CALL(7); break; default: CALL(8); break; }

static void rows(int kind, int vnni, const void *xa, const float *xsum, int m, int64_t k, const void *w,
                 const void *scales, const void *offsets, int64_t j0, int64_t j1, const void *bias, void *out,
                 int out_bf16, int64_t out_stride) {
#define DENSE(M) rows_dense(kind, xa, M, k, w, j0, j1, bias, out, out_bf16, out_stride)
#define PACKED(M) rows_packed(kind, vnni, xa, xsum, M, k, (const int32_t *)w, scales, offsets, j0, j1, \
                              bias, out, out_bf16, out_stride)
    const int dense = kind <= KIND_BF16 || kind == KIND_BF16_DP;
    if (KILN_HAS(KIND_F32) && kind == KIND_F32 && m > KILN_MAX_ROWS)
        rows_f32_block((const float *)xa, m, (m + XB - 1) / XB * XB, k, (const float *)w, j0, j1,
                       (const float *)bias, (float *)out, out_stride);
    else if ((KILN_KINDS & 0x3) && dense) { SWITCH_M(m, DENSE) }
    else if ((KILN_KINDS & 0x1c) && !dense) { SWITCH_M(m, PACKED) }
#undef DENSE
#undef PACKED
}

/* A buffer of ``need`` elements of ``size`` bytes: ``local`` when it fits
 * (``have`` elements), else the heap (freed by the caller when it differs). */
static void *buffer(void *local, int64_t have, int64_t need, size_t size) {
    return need <= have ? local : malloc(size * (size_t)need);
}

/* A share of ``local`` (``*used`` bytes of it taken), or of ``*heap``,
 * aligned to 64 bytes. */
static void *carve(unsigned char *base, size_t *used, size_t bytes) {
    void *p = base + *used;
    *used += (bytes + 63) & ~(size_t)63;
    return p;
}

/* The packed kinds' activations from the fp32 rows ``xbuf``, with their
 * 32-element block sums in ``xsum`` (for q4's offsets). ``round_x``: rounded
 * to int8 per 32 elements (round_blocks), then with VNNI laid out for
 * vnni_row in ``*vr`` (``*vnni`` set), else written back into ``xbuf`` as the
 * rounded fp32 values; otherwise as they are. For packed_row the fp32 rows
 * are then permuted into the words' order (AVX2: int8 and q8_0 only).
 * Returns what the rows take, or NULL when memory could not be allocated;
 * ``*heap`` is for the caller to free. */
static const void *prepare_packed(int kind, int round_x, float *xbuf, int64_t m, int64_t k, float *xsum,
                                  unsigned char *local, size_t local_bytes, void **heap, void *vr, int *vnni) {
    const int64_t blocks = m * (k / 32);
    *vnni = 0;
    size_t need = 0;
    if (round_x) need += ((size_t)(m * k) + 63) / 64 * 64 + ((size_t)blocks * 4 + 63) / 64 * 64;
#if KILN_VNNI
    VnniRows *v = (VnniRows *)vr;
    if (round_x) {
        v->chunks = vnni_chunks(kind, k);
        v->xq_row = v->chunks * (kind == KIND_Q4 ? 128 : 64);
        v->dxe_row = v->chunks * 16;
        need += (size_t)(m * v->xq_row) + (size_t)(m * v->dxe_row) * 4 + (size_t)(m * v->chunks * 16) * 4 + 3 * 64;
    } else {
        need += (size_t)(m * k) * 4 + 64;
    }
#else
    (void)vr;
    if (KILN_AVX512 || kind != KIND_Q4) need += (size_t)(m * k) * 4 + 64;
#endif
    unsigned char *base = local;
    if (need > local_bytes) {
        base = *heap = aligned_alloc(64, (need + 63) / 64 * 64);
        if (!base) return NULL;
    }
    size_t used = 0;
    if (round_x) {
        int8_t *q = carve(base, &used, (size_t)(m * k));
        float *d = carve(base, &used, (size_t)blocks * 4);
        round_blocks(xbuf, blocks, q, d, xsum);
#if KILN_VNNI
        v->xq = carve(base, &used, (size_t)(m * v->xq_row));
        v->dxe = carve(base, &used, (size_t)(m * v->dxe_row) * 4);
        v->corr = carve(base, &used, (size_t)(m * v->chunks * 16) * 4);
        v->xsum = xsum;
        vnni_layout(kind, q, d, m, k, v);
        *vnni = 1;
        return v;
#else
        for (int64_t e = 0; e < m * k; e++) xbuf[e] = (float)q[e] * d[e / 32];
#endif
    } else if (kind == KIND_Q4) {
        for (int64_t b = 0; b < blocks; b++) {
            float s = 0.0f;
            for (int t = 0; t < 32; t++) s += xbuf[b * 32 + t];
            xsum[b] = s;
        }
    }
    if (KILN_AVX512 || kind != KIND_Q4) {  /* AVX2's q4 takes the activations in their own order */
        float *perm = carve(base, &used, (size_t)(m * k) * 4);
        permute_packed(kind, xbuf, perm, m, k);
        return perm;
    }
    return xbuf;
}

/* The most activation rows one call of ``kind`` takes (fp32 out of an fp32
 * kind: KILN_DENSE_MAX_ROWS, rows_f32_block), for kiln to split its calls by. */
int kiln_linear_max_rows(int kind, int out_bf16) {
    return (kind & ~KILN_ROUND_X) == KIND_F32 && !out_bf16 ? KILN_DENSE_MAX_ROWS : KILN_MAX_ROWS;
}

/* out[M, N] = x[M, K] @ W[N, K]^T + bias. Returns 0, -1 for arguments
 * outside the kernel's limits (the caller checks them first), -2 when a
 * buffer could not be allocated. */
int kiln_linear(int kind, const void *x, int x_bf16, int64_t x_stride, int64_t m, const void *w,
                const void *scales, const void *offsets, int64_t n, int64_t k, const void *bias, void *out,
                int out_bf16, int64_t out_stride, int threads) {
    const int round_x = (kind & KILN_ROUND_X) != 0;
    kind &= ~KILN_ROUND_X;
    if (round_x && kind < KIND_INT8) return -1;
    if (m < 1 || m > kiln_linear_max_rows(kind, out_bf16) || k < 1 || k > KILN_MAX_K || n < 1 || kind < KIND_F32 ||
        kind > KIND_Q4)
        return -1;
    if (!KILN_HAS(kind)) return -1;  /* not built into this library */
    if ((kind == KIND_INT8 || kind == KIND_Q8_0) && k % 32) return -1;
    if (kind == KIND_Q4 && (k % 64 || !offsets)) return -1;
    /* The activations as the rows take them: contiguous fp32 rows, bf16 rows
     * for the bf16 dot product, or for the packed kinds as prepare_packed
     * makes them, with their 32-element block sums (``sbuf``). */
    const int64_t mp = m > KILN_MAX_ROWS ? (m + XB - 1) / XB * XB : m;  /* rows_f32_block's padded rows */
    _Alignas(64) float xf[KILN_DENSE_MAX_ROWS * 1024];
    float xs[KILN_MAX_ROWS * 32];
    _Alignas(64) unsigned char scratch[KILN_MAX_ROWS * 4096];
    float *xbuf = buffer(xf, KILN_DENSE_MAX_ROWS * 1024, mp * k, sizeof(float));
    float *sbuf = buffer(xs, KILN_MAX_ROWS * 32, m * (k / 32 + 1), sizeof(float));
    const void *xa = xbuf;
    void *heap = NULL;
#if KILN_VNNI
    VnniRows vr;
#else
    char vr;  /* unused */
#endif
    int rc = -2, vnni = 0;
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
        memset(xbuf + m * k, 0, sizeof(float) * (size_t)((mp - m) * k));
    }
    if (kind >= KIND_INT8 && kind <= KIND_Q4) {
        xa = prepare_packed(kind, round_x, xbuf, m, k, sbuf, scratch, sizeof scratch, &heap, &vr, &vnni);
        if (!xa) goto done;
    }
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
        if (j0 < j1) rows(kind, vnni, xa, sbuf, (int)m, k, w, scales, offsets, j0, j1, bias, out, out_bf16,
                          out_stride);
    }
    rc = 0;
done:
    if (xbuf && xbuf != xf) free(xbuf);
    if (sbuf && sbuf != xs) free(sbuf);
    free(heap);
    (void)vr;
    return rc;
}

/* -------------------------------------------------------------- AMX tiles
 * bf16 linears of many rows (a batched decode step, a prefill) on Intel's AMX
 * tile unit, where the CPU has one (Sapphire Rapids and later), up to
 * kiln.compiler.onednn.AMX_MAX_ROWS; oneDNN takes the others. The linears of
 * a decode step of the 135M shape (30 layers and the LM head, 269 MB of
 * weights read from memory, 2 threads of an Intel Xeon) took 15.2-16.1 ms
 * here against 22.9-23.3 for oneDNN on weights it had reordered at 16 rows,
 * and 22.4-23.9 against 29.9-30.9 at 64 rows (scratch runs, 2026-12-05).
 * From cache the gap is wider (the 960 x 576 QKV weight at 64 rows: 77
 * against 180 us): oneDNN's fixed cost per call is larger than the
 * arithmetic of a small model's layer.
 *
 * A product C[M, N] += A[M, K] B[K, N] runs on tiles of 16 rows of 64 bytes:
 * A's tile is 16 rows by 32 bf16 of K, B's is 16 pairs of K by 16 columns,
 * each pair of bf16 side by side (the layout the tile instruction reads),
 * C's is 16 rows by 16 fp32. Of the 8 tiles, 4 hold C for 32 rows by 32
 * columns, 2 the A and 2 the B tiles of one step of K: each tile loaded feeds
 * two products.
 *
 * The weight is laid out once (kiln_amx_pack) as the B tiles in the order the
 * loop reads them: for each pair of 16-column blocks (the last block alone
 * when their count is odd), for each step of 32 along K, the pair's two tiles
 * one after the other: tile[kk][j][p] = W[16 b + j][32 s + 2 kk + p]. Each
 * thread takes a contiguous share of the pairs and so reads one stream of
 * weights; the rows of the activations repeat per pair, from cache.
 *
 * A 2x2 block's C tiles are stored to one of two buffers, and rounded into
 * out a few rows at each step of K of the next block (amx_rows) instead of
 * at once: the store waits for the block's last product, and rows rounded
 * right after it kept the core from issuing the next block's loads and
 * products while the tile unit drained. A row's two column blocks go out as
 * one 64-byte store. Weights cycled through 1.2 GB, 2 threads of an Intel
 * Xeon, two scratch runs each, us a call against the store-then-round form:
 * at 64 rows, the LM head (49152 x 576) 3409-3577 against 3809-3993, the
 * gate/up weight (3072 x 576) 238-251 against 270-276, QKV (960 x 576) 75-87
 * against 88-90, the narrow o_proj and down_proj equal; at 16 rows the LM
 * head 2401 against 2512; at 512 rows gate/up 1027 against 1098. The same
 * bits. A 64-request bf16 decode step of the 135M shape: 41.3-43.6 against
 * 42.8-44.8 ms, the same tokens (scratch A/B, two rounds taking turns). */
#if KILN_AVX512 && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    (KILN_KINDS & 3) /* KIND_F32 or KIND_BF16 (an enum, which #if cannot read): fp32's greedy screen uses it */
#define KILN_AMX 1
#include <unistd.h>
#include <sys/syscall.h>

#define KILN_ARCH_REQ_XCOMP_PERM 0x1023 /* arch_prctl: ask for a state component */
#define KILN_XFEATURE_XTILEDATA 18      /* the tiles' data */
/* How far ahead of the tiles being multiplied to ask for the weights: one
 * step of K of a pair. 4 to 32 KB ahead, into L1 or L2, and the next pair's
 * tiles asked for into L2 while multiplying the current ones, did no better
 * (a step's linears of the 135M shape read from memory, 2 threads).
 *
 * Past 32 rows a pair's tiles are multiplied in more than one pass over its
 * row blocks, the first reading them from memory and the others from cache;
 * during those passes nothing was being read, and the next pair's first pass
 * then waited on memory. There the next pair's lines are asked for into L2,
 * spread over the current pair's passes (amx_ask_next). Weights read from
 * memory (a 600 MB read between calls), 2 threads of an Intel Xeon, rounds
 * taking turns (scratch, 2026-12-07): the LM head (49152 x 576) at 64 rows
 * 2.91 -> 2.34 ms, at 48 rows 2.56 -> 2.21; a bf16 step's 120 linears of the
 * 135M shape at 64 rows 9.66 -> 8.62 ms, at 48 rows 9.19 -> 8.41. Asked for
 * in a single pass too (32 rows or fewer), the same step's linears read from
 * the last-level cache took 4.13 -> 4.38 ms at 16 rows, so one pass keeps
 * the ask of its own tiles alone. */
#define KILN_AMX_AHEAD 2048
/* Row blocks of 16 taken at once: each thread's pairs run over 256 rows
 * before the next 256, whose activations then stay in L2 (2 MB a core). */
#define KILN_AMX_CHUNK 16

/* The share of the next pair's ``lines`` (its tiles, from ``next``) that step
 * ``s`` of pass ``pass`` asks for into L2, of ``passes`` passes of ``steps``
 * steps each: all of them by the last step of the last pass. */
static inline void amx_ask_next(const char *next, int64_t lines, int64_t pass, int64_t passes, int64_t s,
                                int64_t steps) {
    const int64_t i = pass * steps + s, total = passes * steps;
    for (int64_t l = i * lines / total; l < (i + 1) * lines / total; l++) _mm_prefetch(next + 64 * l, _MM_HINT_T1);
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

static int amx_granted = -1;

/* 1 when this process may use the tiles: Linux hands their state out per
 * process, on request. The first call asks; later ones return its answer. */
int kiln_amx(void) {
    if (amx_granted < 0)
        amx_granted = syscall(SYS_arch_prctl, KILN_ARCH_REQ_XCOMP_PERM, KILN_XFEATURE_XTILEDATA) == 0;
    return amx_granted;
}

/* The B tiles of w[N, K] bf16 into wp (N * K elements), in the order above.
 * Returns 0, or -1 unless N is a multiple of 16 and K of 32. */
int kiln_amx_pack(const uint16_t *w, int64_t n, int64_t k, uint16_t *wp, int threads) {
    if (n < 16 || n % 16 || k < 32 || k % 32) return -1;
    const int64_t blocks = n / 16, steps = k / 32;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t pair = b / 2, width = pair * 2 + 1 < blocks ? 2 : 1;
        for (int64_t s = 0; s < steps; s++) {
            uint32_t *tile = (uint32_t *)(wp + (pair * 2 * steps + s * width + (b & 1)) * 512);
            for (int kk = 0; kk < 16; kk++)
                for (int j = 0; j < 16; j++)
                    memcpy(tile + kk * 16 + j, w + (b * 16 + j) * k + s * 32 + kk * 2, sizeof(uint32_t));
        }
    }
    return 0;
}

/* A 2x2 block of C whose tiles were stored (kiln_amx_linear's cbs), waiting
 * to be rounded into out: its first row and column, whether its second row
 * block and second column block are there, whether there is one at all. */
typedef struct {
    int64_t row0, col0;
    int rows2, cols2, live;
} amx_block;

/* Rows [lo, hi) of a stored block (row r: row r % 16 of row block r / 16),
 * plus bias, rounded to bf16 into out; rows from m on are padding and are
 * dropped. A row's two column blocks go out as one 64-byte store. */
static inline __attribute__((always_inline)) void amx_rows(float (*cb)[256], const amx_block *blk, int lo, int hi,
                                                           int64_t m, const uint16_t *bias, uint16_t *out,
                                                           int64_t out_stride) {
    for (int r = lo; r < hi; r++) {
        const int t = r >> 4, i = r & 15;
        const int64_t row = blk->row0 + r;
        if ((t && !blk->rows2) || row >= m) continue;
        uint16_t *o = out + row * out_stride + blk->col0;
        const __m512 c0 = _mm512_add_ps(_mm512_load_ps(cb[2 * t] + 16 * i),
                                        bias ? load_bf16(bias + blk->col0) : _mm512_setzero_ps());
        if (blk->cols2) {
            const __m512 c1 = _mm512_add_ps(_mm512_load_ps(cb[2 * t + 1] + 16 * i),
                                            bias ? load_bf16(bias + blk->col0 + 16) : _mm512_setzero_ps());
            _mm512_storeu_si512((void *)o, (__m512i)_mm512_cvtne2ps_pbh(c1, c0));
        } else {
            _mm256_storeu_si256((__m256i *)o, (__m256i)_mm512_cvtneps_pbh(c0));
        }
    }
}

/* out[M, N] = x[M, K] @ W[N, K]^T + bias, all bf16, the products summed in
 * fp32; wp is W laid out by kiln_amx_pack. Returns 0, -1 for arguments
 * outside the kernel's limits, -2 when a buffer could not be allocated, -3
 * when the process may not use the tiles (kiln_amx). */
int kiln_amx_linear(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, const uint16_t *wp, int64_t n,
                    const uint16_t *bias, uint16_t *out, int64_t out_stride, int threads) {
    if (m < 1 || n < 16 || n % 16 || k < 32 || k % 32 || x_stride < k || out_stride < n) return -1;
    if (kiln_amx() != 1) return -3;
    /* The rows of a last, partial block of 16, padded with zeros: a tile
     * loads 16 rows, and those past x's end may not be there to read. */
    const int64_t full = m / 16, blocks_m = (m + 15) / 16, blocks_n = n / 16, steps = k / 32;
    uint16_t *tail = NULL;
    if (full < blocks_m) {
        tail = aligned_alloc(64, (size_t)(16 * k * sizeof(uint16_t) + 63) / 64 * 64);
        if (!tail) return -2;
        memset(tail, 0, 16 * k * sizeof(uint16_t));
        for (int64_t i = full * 16; i < m; i++)
            memcpy(tail + (i - full * 16) * k, x + i * x_stride, k * sizeof(uint16_t));
    }
    const int64_t pairs = (blocks_n + 1) / 2;
#pragma omp parallel num_threads(threads)
    {
        amx_config config;
        memset(&config, 0, sizeof config);
        config.palette = 1;
        for (int t = 0; t < 8; t++) {
            config.colsb[t] = 64;
            config.rows[t] = 16;
        }
        _tile_loadconfig(&config);
        _Alignas(64) float cbs[2][4][256];  /* the block being stored, and the one before it */
        amx_block prev = {0, 0, 0, 0, 0};
        int cur = 0;
        /* rows of prev rounded a step of K: all 32 by the block's last step */
        const int per_step = (int)((32 + steps - 1) / steps);
        for (int64_t c0 = 0; c0 < blocks_m; c0 += KILN_AMX_CHUNK) {
            const int64_t c1 = c0 + KILN_AMX_CHUNK < blocks_m ? c0 + KILN_AMX_CHUNK : blocks_m;
            const int64_t passes = (c1 - c0 + 1) / 2;  /* over each pair's row blocks, two at a time */
#pragma omp for schedule(static) nowait
            for (int64_t p = 0; p < pairs; p++) {
                const int cols2 = 2 * p + 1 < blocks_n, width = cols2 ? 2 : 1;
                const uint16_t *w = wp + p * 2 * steps * 512;
                /* the next pair's cache lines (16 a tile), asked for during this pair's passes when there are
                   several; the pair after the last one is the other thread's or none (0 lines) */
                const int64_t next_lines =
                    passes > 1 && p + 1 < pairs ? steps * (2 * p + 3 < blocks_n ? 2 : 1) * 16 : 0;
                for (int64_t bm = c0; bm < c1; bm += 2) {
                    const int rows2 = bm + 1 < blocks_m;
                    const uint16_t *a0 = bm < full ? x + bm * 16 * x_stride : tail;
                    const uint16_t *a1 = bm + 1 < full ? x + (bm + 1) * 16 * x_stride : tail;
                    const int64_t s0 = (bm < full ? x_stride : k) * 2, s1 = (bm + 1 < full ? x_stride : k) * 2;
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    for (int64_t s = 0; s < steps; s++) {
                        const int r0 = (int)s * per_step;
                        if (prev.live && r0 < 32)
                            amx_rows(cbs[1 - cur], &prev, r0, r0 + per_step < 32 ? r0 + per_step : 32, m, bias, out,
                                     out_stride);
                        const uint16_t *b = w + s * width * 512;
                        if (bm == c0)  /* the first pass over the pair reads it from memory */
                            for (int l = 0; l < width * 16; l++)
                                _mm_prefetch((const char *)b + KILN_AMX_AHEAD + 64 * l, _MM_HINT_T0);
                        if (next_lines)
                            amx_ask_next((const char *)(w + 2 * steps * 512), next_lines, (bm - c0) / 2, passes, s,
                                         steps);
                        _tile_loadd(4, a0 + 32 * s, s0);
                        _tile_loadd(6, b, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        if (cols2) {
                            _tile_loadd(7, b + 512, 64);
                            _tile_dpbf16ps(1, 4, 7);
                        }
                        if (rows2) {
                            _tile_loadd(5, a1 + 32 * s, s1);
                            _tile_dpbf16ps(2, 5, 6);
                            if (cols2) _tile_dpbf16ps(3, 5, 7);
                        }
                    }
                    _tile_stored(0, cbs[cur][0], 64);
                    if (cols2) _tile_stored(1, cbs[cur][1], 64);
                    if (rows2) {
                        _tile_stored(2, cbs[cur][2], 64);
                        if (cols2) _tile_stored(3, cbs[cur][3], 64);
                    }
                    prev = (amx_block){bm * 16, p * 32, rows2, cols2, 1};
                    cur = 1 - cur;
                }
            }
            if (prev.live) amx_rows(cbs[1 - cur], &prev, 0, 32, m, bias, out, out_stride);
            prev.live = 0;
        }
        _tile_release();
    }
    free(tail);
    return 0;
}
#else
#define KILN_AMX 0
int kiln_amx(void) { return 0; }
int kiln_amx_pack(const uint16_t *w, int64_t n, int64_t k, uint16_t *wp, int threads) {
    (void)w, (void)n, (void)k, (void)wp, (void)threads;
    return -1;
}
int kiln_amx_linear(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, const uint16_t *wp, int64_t n,
                    const uint16_t *bias, uint16_t *out, int64_t out_stride, int threads) {
    (void)x, (void)x_stride, (void)m, (void)k, (void)wp, (void)n, (void)bias, (void)out, (void)out_stride,
        (void)threads;
    return -3;
}
#endif

/* ------------------------------------------------------------------ fp32 panels
 * fp32 linears of many rows (a batched decode step, a prefill) as outer
 * products on weights laid out once as panels of 48 columns: each step of K
 * loads 3 vectors of one panel and multiplies them by 8 activation rows,
 * each value broadcast, into 24 accumulators (8 rows by 48 columns) kept in
 * registers, which nothing reduces across lanes. Each thread takes a
 * contiguous share of the panels, so reads one stream of weights, and asks
 * for the next panel's lines into L2 a few each step of K while it computes
 * the current one from cache: the weights stream from memory while the
 * arithmetic runs, where oneDNN's product on its reordered weights did one
 * and then the other. Every output is one chain of fused multiply-adds over
 * K in order, so a row gets the same bits whatever it is batched with.
 *
 * The linears of a decode step of the 135M shape (30 layers, 425 MB of
 * weights read from memory, 2 threads of an Intel Xeon), ms against oneDNN
 * on its reordered weights, two scratch rounds taking turns (2026-12-07):
 * 16 rows 22.6-23.0 against 31.5-31.9, 64 rows 48.7-50.0 against 67.9-71.4,
 * 512 rows 347 against 352-367; the LM head (49152 x 576) at 64 rows 11.7
 * against 14.7 ms. Without the ask for the next panel the two were level.
 * Activation rows are read where they are, 8 row pointers a block (the last
 * row repeated past M): copying them into a block layout first was 4-8%
 * slower. Blocking K, so that 8 rows of K = 1536 stay in L1, did no better. */
#if KILN_AVX512 && (KILN_KINDS & 1) /* KIND_F32 */
#define KILN_PANELS 1
#define PANEL_VECTORS 3
#define PANEL_COLS (16 * PANEL_VECTORS)
#define PANEL_ROWS 8
#define PANEL_CHUNK 256 /* activation rows whose panels' products run before the next rows' (in L2) */

int kiln_panels(void) { return 1; }

/* The floats kiln_panels_pack writes for w[N, K]: N rounded up to whole panels. */
int64_t kiln_panels_size(int64_t n, int64_t k) { return (n + PANEL_COLS - 1) / PANEL_COLS * PANEL_COLS * k; }

/* w[N, K] fp32 as panels: wp[p][t][j] = w[48 p + j][t], zero past N. */
int kiln_panels_pack(const float *w, int64_t n, int64_t k, float *wp, int threads) {
    if (n < 1 || k < 1) return -1;
    const int64_t panels = (n + PANEL_COLS - 1) / PANEL_COLS;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        float *dst = wp + p * k * PANEL_COLS;
        const float *src = w + p * PANEL_COLS * k;
        const int cols = n - p * PANEL_COLS < PANEL_COLS ? (int)(n - p * PANEL_COLS) : PANEL_COLS;
        for (int64_t t = 0; t < k; t++) {  /* the 48 rows' lines stay in L1 over 16 steps of t */
            for (int j = 0; j < cols; j++) dst[t * PANEL_COLS + j] = src[j * k + t];
            for (int j = cols; j < PANEL_COLS; j++) dst[t * PANEL_COLS + j] = 0.0f;
        }
    }
    return 0;
}

/* out rows [0, rows) by columns [0, cols) of one panel = the rows at ``a``
 * times the panel ``b``, plus bias; asks for ``lines`` cache lines from
 * ``ahead`` into L2 evenly over the steps of K (a line each time ``lines``
 * more steps' worth of credit reaches K). Asked for in a burst instead (one
 * line a step until done, the rest of K without), each thread's asks waited
 * on the line fill buffers: spread evenly, the 3072 x 576 product from
 * memory took 532-686 us against 606-913 at 64 rows and 221-250 against
 * 239-281 at 16, 960 x 576 178-198 against 196-222 at 64 (scratch, rounds
 * taking turns, 2026-12-07). */
static inline __attribute__((always_inline)) void panel_block(
        const float *const *a, const float *b, int64_t k, float *out, int64_t out_stride, int rows, int cols,
        const float *bias, const char *ahead, int64_t lines) {
    __m512 acc[PANEL_ROWS][PANEL_VECTORS];
    _Pragma("GCC unroll 8") for (int i = 0; i < PANEL_ROWS; i++)
        _Pragma("GCC unroll 3") for (int v = 0; v < PANEL_VECTORS; v++) acc[i][v] = _mm512_setzero_ps();
    int64_t credit = 0;
    for (int64_t t = 0; t < k; t++) {
        for (credit += lines; credit >= k; credit -= k) {
            _mm_prefetch(ahead, _MM_HINT_T1);
            ahead += 64;
        }
        const float *bt = b + t * PANEL_COLS;
        const __m512 b0 = _mm512_loadu_ps(bt), b1 = _mm512_loadu_ps(bt + 16), b2 = _mm512_loadu_ps(bt + 32);
        _Pragma("GCC unroll 8") for (int i = 0; i < PANEL_ROWS; i++) {
            const __m512 av = _mm512_set1_ps(a[i][t]);
            acc[i][0] = _mm512_fmadd_ps(av, b0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(av, b1, acc[i][1]);
            acc[i][2] = _mm512_fmadd_ps(av, b2, acc[i][2]);
        }
    }
    for (int i = 0; i < rows; i++)
        for (int v = 0; v < PANEL_VECTORS && 16 * v < cols; v++) {
            const int valid = cols - 16 * v;
            const __mmask16 mask = valid >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << valid) - 1);
            __m512 r = acc[i][v];
            if (bias) r = _mm512_add_ps(r, _mm512_maskz_loadu_ps(mask, bias + 16 * v));
            _mm512_mask_storeu_ps(out + i * out_stride + 16 * v, mask, r);
        }
}

/* The lines a thread asks for during its panel ``p`` of [p0, p1): its next
 * panel; after its last, its first again where more rows follow (``again``),
 * else the first panel this thread takes of the linear the caller makes next
 * (``next_wp``, N ``next_n`` by K ``next_k``, or NULL). */
static const char *panel_ahead(const float *wp, int64_t k, int64_t p, int64_t p0, int64_t p1, int again,
                               const float *next_wp, int64_t next_n, int64_t next_k, int id, int nt,
                               int64_t *lines) {
    *lines = k * PANEL_COLS / 16;
    if (p + 1 < p1) return (const char *)(wp + (p + 1) * k * PANEL_COLS);
    if (again) return (const char *)(wp + p0 * k * PANEL_COLS);
    if (!next_wp) return NULL;
    const int64_t panels = (next_n + PANEL_COLS - 1) / PANEL_COLS, q0 = panels * id / nt;
    if (q0 >= panels * (id + 1) / nt) return NULL;
    *lines = next_k * PANEL_COLS / 16;
    return (const char *)(next_wp + q0 * next_k * PANEL_COLS);
}

/* out[M, N] = x[M, K] @ W[N, K]^T + bias in fp32, wp being W's panels
 * (kiln_panels_pack). ``next_wp`` (or NULL): the panels of the linear the
 * caller makes next (N ``next_n`` by K ``next_k``), whose first lines each
 * thread asks for during its last panel, so that the next call's first
 * panel does not start cold; a hint, which costs only bandwidth when wrong.
 * A decode step's 120 linears of the 135M shape from memory (scratch,
 * 2026-12-07, rounds taking turns): 16 rows 16.5 against 17.2-17.5 ms, 64
 * rows 39.0-40.9 against 40.8-42.3. Returns 0, or -1 for arguments outside
 * the kernel's limits. */
int kiln_panels_linear(const float *x, int64_t x_stride, int64_t m, int64_t k, const float *wp, int64_t n,
                       const float *bias, float *out, int64_t out_stride, int threads, const float *next_wp,
                       int64_t next_n, int64_t next_k) {
    if (m < 1 || n < 1 || k < 1 || x_stride < k || out_stride < n || (next_wp && (next_n < 1 || next_k < 1)))
        return -1;
    const int64_t blocks = (m + PANEL_ROWS - 1) / PANEL_ROWS, panels = (n + PANEL_COLS - 1) / PANEL_COLS;
#pragma omp parallel num_threads(threads)
    {
#ifdef _OPENMP
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
#else
        const int nt = 1, id = 0;
#endif
        const int64_t p0 = panels * id / nt, p1 = panels * (id + 1) / nt;
        for (int64_t c0 = 0; c0 < blocks; c0 += PANEL_CHUNK / PANEL_ROWS) {
            const int64_t c1 = c0 + PANEL_CHUNK / PANEL_ROWS < blocks ? c0 + PANEL_CHUNK / PANEL_ROWS : blocks;
            for (int64_t p = p0; p < p1; p++) {
                const float *panel = wp + p * k * PANEL_COLS;
                int64_t ahead_lines;
                const char *next = panel_ahead(wp, k, p, p0, p1, c1 < blocks, next_wp, next_n, next_k, id, nt,
                                               &ahead_lines);
                /* the lines ahead, asked for in shares over this panel's blocks */
                const int64_t share = (ahead_lines + (c1 - c0) - 1) / (c1 - c0);
                const int cols = n - p * PANEL_COLS < PANEL_COLS ? (int)(n - p * PANEL_COLS) : PANEL_COLS;
                for (int64_t blk = c0; blk < c1; blk++) {
                    const int64_t first = (blk - c0) * share;
                    const int64_t lines = next && first < ahead_lines
                                              ? (ahead_lines - first < share ? ahead_lines - first : share) : 0;
                    const int rows = m - blk * PANEL_ROWS < PANEL_ROWS ? (int)(m - blk * PANEL_ROWS) : PANEL_ROWS;
                    const float *a[PANEL_ROWS];
                    for (int i = 0; i < PANEL_ROWS; i++)  /* rows past M repeat the last; their sums are dropped */
                        a[i] = x + (blk * PANEL_ROWS + (i < rows ? i : rows - 1)) * x_stride;
                    const char *ahead = lines ? next + first * 64 : (const char *)panel;
                    panel_block(a, panel, k, out + blk * PANEL_ROWS * out_stride + p * PANEL_COLS, out_stride, rows,
                                cols, bias ? bias + p * PANEL_COLS : NULL, ahead, lines);
                }
            }
        }
    }
    return 0;
}
#else
#define KILN_PANELS 0
int kiln_panels(void) { return 0; }
/* (kiln_panels_size and kiln_panels_pack are only declared where kiln_panels says 1) */
int kiln_panels_linear(const float *x, int64_t x_stride, int64_t m, int64_t k, const float *wp, int64_t n,
                       const float *bias, float *out, int64_t out_stride, int threads, const float *next_wp,
                       int64_t next_n, int64_t next_k) {
    (void)x, (void)x_stride, (void)m, (void)k, (void)wp, (void)n, (void)bias, (void)out, (void)out_stride,
        (void)threads, (void)next_wp, (void)next_n, (void)next_k;
    return -1;
}
#endif

/* ------------------------------------------------------------------ argmax
 * Each row's index of its largest value, as torch's max(dim=-1) picks it: the
 * first of equal values, and the first NaN where a row has one. The sampler
 * takes a greedy step's tokens this way: torch's max over the last dim took
 * 63-93 us for one 49152-wide row here and 460-500 us for four (fp32 and
 * bf16, 2 threads), two passes over the row in L2 a few. */
#if KILN_AVX512
static inline unsigned vmask_eq(vfloat a, vfloat b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
static inline unsigned vmask_nan(vfloat a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
static inline unsigned vmask_ge(vfloat a, vfloat b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
static inline float vhmax(vfloat v) { return _mm512_reduce_max_ps(v); }
#else
static inline unsigned vmask_eq(vfloat a, vfloat b) { return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)); }
static inline unsigned vmask_nan(vfloat a) { return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)); }
static inline unsigned vmask_ge(vfloat a, vfloat b) {
    return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GE_OQ));
}
static inline float vhmax(vfloat v) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}
#endif

#define ARGMAX_ROW(NAME, T, LOADV, TOF)                                                            \
static int64_t NAME(const T *x, int64_t n) {                                                       \
    vfloat m0 = vset1(-INFINITY), m1 = m0;                                                         \
    unsigned nan = 0;                                                                              \
    int64_t i = 0;                                                                                 \
    for (; i + 2 * VW <= n; i += 2 * VW) {                                                         \
        const vfloat a = LOADV(x + i), b = LOADV(x + i + VW);                                      \
        nan |= vmask_nan(a) | vmask_nan(b);                                                        \
        m0 = vmax(m0, a);                                                                          \
        m1 = vmax(m1, b);                                                                          \
    }                                                                                              \
    float best = vhmax(vmax(m0, m1));                                                              \
    for (; i < n; i++) {                                                                           \
        const float v = TOF(x[i]);                                                                 \
        if (v != v) nan = 1;                                                                       \
        else if (v > best) best = v;                                                               \
    }                                                                                              \
    if (nan)                                                                                       \
        for (i = 0; i < n; i++)                                                                    \
            if (TOF(x[i]) != TOF(x[i])) return i;                                                  \
    const vfloat target = vset1(best);                                                             \
    for (i = 0; i + VW <= n; i += VW) {                                                            \
        const unsigned k = vmask_eq(LOADV(x + i), target);                                         \
        if (k) return i + __builtin_ctz(k);                                                        \
    }                                                                                              \
    for (; i < n; i++)                                                                             \
        if (TOF(x[i]) == best) return i;                                                           \
    return 0;                                                                                      \
}

ARGMAX_ROW(argmax_f32, float, vload, f32_id)
ARGMAX_ROW(argmax_bf16, uint16_t, load_bf16, bf16_to_f32)

/* ``out[r]``: the argmax of row r of ``x`` (``rows`` rows of ``n`` values,
 * ``stride`` elements apart; fp32, or bf16 where ``x_bf16``). Returns 0, -1
 * for sizes outside the kernel's. */
int kiln_argmax(const void *x, int x_bf16, int64_t rows, int64_t n, int64_t stride, int64_t *out, int threads) {
    if (rows < 1 || n < 1 || stride < n) return -1;
#pragma omp parallel for num_threads(threads) if (rows > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        out[r] = x_bf16 ? argmax_bf16((const uint16_t *)x + r * stride, n) : argmax_f32((const float *)x + r * stride, n);
    return 0;
}

/* ------------------------------------------------------- greedy screen
 * The greedy tokens of an fp32 LM head without its fp32 product: the head is
 * first computed in bf16 on the AMX tiles (x and W rounded to bf16, the
 * products summed in fp32, the sums rounded to bf16: ``s``), which reads half
 * the bytes and multiplies 16 times faster; then only the columns whose fp32
 * logit could still be the largest are computed in fp32, in exactly the
 * order of the kernel that computes the whole head at this batch, so the
 * token is the argmax of the logits that kernel would have made, bit for bit.
 *
 * Why it is exact: |s_j - f_j| <= e_j for every column j, f_j being the fp32
 * logit and
 *     e_j = (2^-7 + 2^-16 + 2 K 2^-24) |x| |W_j| + 2^-8 |s_j|   (+1% and a
 * denormal term): rounding x and W to bf16 moves each product by at most
 * 2^-7 + 2^-16 of |x_t W_jt|, each chain of K fp32 sums by K 2^-24 of
 * sum_t |x_t W_jt| (<= |x| |W_j|, Cauchy-Schwarz; ``wnorm`` holds |W_j|
 * rounded up), and rounding the sum to bf16 by 2^-8 of it. With
 * lo = max_j (s_j - e_j), every column with s_j + e_j < lo has f_j < lo <=
 * the f of the column that reached lo, so it cannot be the argmax nor tie it;
 * the others (the real model: a median of 2 of 49152, at most 32 over 230
 * greedy steps, scratch) are computed exactly, and the first largest wins, as
 * argmax_rows picks. A row with a value that is not finite, or large enough
 * that a sum could overflow, is computed whole. */
static float exact_logit(int order, const float *x, const float *w, int64_t k) {
    if (order == 0) {  /* the panels' chain (panel_block): fused multiply-adds over K in order, from zero */
        float acc = 0.0f;
        for (int64_t t = 0; t < k; t++) acc = fmaf(x[t], w[t], acc);
        return acc;
    }
    float res[KILN_MAX_ROWS];  /* dense_f32 as a call of ``order`` rows sums each row (rows_dense) */
    dense_f32(x, k, w, 1, order, res);
    return res[0] + 0.0f;
}

static int64_t screen_row(const float *x, int64_t k, const float *w, int64_t n, const uint16_t *s,
                          const float *wnorm, float wnorm_max, int order) {
    double sq = 0.0;
    for (int64_t t = 0; t < k; t++) sq += (double)x[t] * x[t];
    const double bound = (0x1p-7 + 0x1p-16 + 2.0 * (double)k * 0x1p-24) * 1.01 * sqrt(sq) * 1.01;
    int whole = !(bound * wnorm_max < 0x1p100);  /* not finite, or near fp32's range */
    const float a = (float)bound, c = 0x1p-8f * 1.02f, tiny = (float)k * 0x1p-100f;
    float lo = -INFINITY;
    if (!whole) {
        vfloat m0 = vset1(-INFINITY), big = vzero();
        int64_t j = 0;
        for (; j + VW <= n; j += VW) {
            const vfloat sj = load_bf16(s + j), mag = vmax(sj, vsub(vzero(), sj));
            const vfloat e = vfmadd(vset1(a), vload(wnorm + j), vfmadd(vset1(c), mag, vset1(tiny)));
            m0 = vmax(m0, vsub(sj, e));
            big = vmax(big, mag);
            if (vmask_nan(sj)) whole = 1;
        }
        lo = vhmax(m0);
        float top = vhmax(big);
        for (; j < n; j++) {
            const float sj = bf16_to_f32(s[j]), e = a * wnorm[j] + c * fabsf(sj) + tiny;
            if (sj != sj) whole = 1;
            if (sj - e > lo) lo = sj - e;
            if (fabsf(sj) > top) top = fabsf(sj);
        }
        if (!(top < 0x1p100f)) whole = 1;
    }
    int64_t best = -1;
    float best_v = 0.0f;
    if (whole) {  /* every column, as argmax_rows: the first NaN, else the first largest */
        for (int64_t j = 0; j < n; j++) {
            const float v = exact_logit(order, x, w + j * k, k);
            if (v != v) return j;
            if (best < 0 || v > best_v) best = j, best_v = v;
        }
        return best;
    }
    int64_t j = 0;
    for (; j + VW <= n; j += VW) {
        const vfloat sj = load_bf16(s + j), mag = vmax(sj, vsub(vzero(), sj));
        const vfloat hi = vadd(sj, vfmadd(vset1(a), vload(wnorm + j), vfmadd(vset1(c), mag, vset1(tiny))));
        unsigned cand = vmask_ge(hi, vset1(lo));
        while (cand) {
            const int64_t col = j + __builtin_ctz(cand);
            cand &= cand - 1;
            const float v = exact_logit(order, x, w + col * k, k);
            if (best < 0 || v > best_v) best = col, best_v = v;
        }
    }
    for (; j < n; j++) {
        const float sj = bf16_to_f32(s[j]);
        if (sj + (a * wnorm[j] + c * fabsf(sj) + tiny) >= lo) {
            const float v = exact_logit(order, x, w + j * k, k);
            if (best < 0 || v > best_v) best = j, best_v = v;
        }
    }
    return best;
}

/* out[r]: the argmax of row r of x[M, K] @ W[N, K]^T in fp32, its sums
 * ordered as the kernel that computes the product orders them: the panels
 * (``panels``), else the dense rows of a call of M rows (M at most
 * KILN_MAX_ROWS); from ``s`` [M, N] (bf16, row stride ``s_stride``), the same
 * product in bf16 (see above), and wnorm[j] >= |W_j|. Returns 0, or -1 for
 * arguments outside the kernel's limits. */
int kiln_greedy_screen(const float *x, int64_t x_stride, int64_t m, int64_t k, const float *w, int64_t n,
                       const uint16_t *s, int64_t s_stride, const float *wnorm, int panels, int64_t *out,
                       int threads) {
    if (!KILN_HAS(KIND_F32) || m < 1 || k < 1 || n < 1 || x_stride < k || s_stride < n ||
        (!panels && m > KILN_MAX_ROWS))
        return -1;
    float top = 0.0f;  /* the largest |W_j|, NaN if one is */
    for (int64_t j = 0; j < n; j++) top = wnorm[j] > top || wnorm[j] != wnorm[j] ? wnorm[j] : top;
    const int order = panels ? 0 : (int)m;
#pragma omp parallel for num_threads(threads) if (m > 1) schedule(dynamic)
    for (int64_t r = 0; r < m; r++)
        out[r] = screen_row(x + r * x_stride, k, w, n, s + r * s_stride, wnorm, top, order);
    return 0;
}

/* ------------------------------------------------------------ SiLU times up
 * The activation of a gated MLP between its two linears: out = silu(gate) *
 * up, where each row of ``x`` is the merged gate/up product, gate in its
 * first ``inter`` values and up in the next. Inductor's kernel for it runs
 * Sleef's exponential and a true division: 52 us a layer of 64 rows of the
 * 135M shape in bf16, about 1.5 ms of a 39 ms decode step of 64 requests
 * (2 threads of an Intel Xeon, perf, 2026-12-06); this loop's figures are
 * in kiln/compiler/activation.py.
 *
 * silu(g) = g / (1 + exp(-g)). exp(x) is p(f) 2^n (x = n ln2 + f, |f| <=
 * ln2 / 2, p of degree 7), its argument held within [-80, 80], where 2^n
 * and 1 + exp(x) stay normal numbers: below a gate of -80 the result is
 * g * 1.8e-35 instead of smaller still, and a gate of -inf gives -inf where
 * torch gives NaN. A NaN gate gives NaN (it is a factor of the result).
 * With AVX-512 the division is the reciprocal estimate (14 bits) refined by
 * one Newton step, which leaves the activation within about 2 ulp of the
 * exact silu in fp32, against Inductor's 1.5 (scratch check over [-79, 40]);
 * AVX2's estimate has 12 bits, so that build divides. Products in fp32,
 * rounded once to bf16 at the end, as in Inductor's kernel.
 * Both builds take these steps in vectors, of 16 or of 8. */
#define KILN_SILU_CHUNK 512       /* elements of a row one task takes (a multiple of VW) */
#define KILN_SILU_PARALLEL 8192   /* fewer elements than this run on one thread */
/* p(f), exp(f) for |f| <= ln2 / 2 (Cephes' expf polynomial). */
static inline vfloat exp_poly(vfloat f) {
    vfloat p = vset1(1.9875691500e-4f);
    p = vfmadd(p, f, vset1(1.3981999507e-3f));
    p = vfmadd(p, f, vset1(8.3334519073e-3f));
    p = vfmadd(p, f, vset1(4.1665795894e-2f));
    p = vfmadd(p, f, vset1(1.6666665459e-1f));
    p = vfmadd(p, f, vset1(5.0000001201e-1f));
    return vfmadd(vmul(p, f), f, vadd(f, vset1(1.0f)));
}
/* -g held within [-80, 80] as n ln2 + f (n an integer, in *n); returns f. */
static inline vfloat exp_split(vfloat g, vfloat *n) {
    const vfloat x = vmin(vmax(vsub(vzero(), g), vset1(-80.0f)), vset1(80.0f));
    *n = vround(vmul(x, vset1(1.44269504088896341f)));
    return vfnmadd(*n, vset1(-2.12194440e-4f), vfnmadd(*n, vset1(0.693359375f), x));
}
#if KILN_AVX512
static inline vfloat silu_times(vfloat g, vfloat u) {
    vfloat n;
    const vfloat f = exp_split(g, &n);
    const __m512 d = _mm512_add_ps(_mm512_scalef_ps(exp_poly(f), n), _mm512_set1_ps(1.0f));
    __m512 r = _mm512_rcp14_ps(d);
    r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f)));
    return _mm512_mul_ps(_mm512_mul_ps(g, r), u);
}
static inline void store_bf16(uint16_t *p, vfloat v) {
#if KILN_DPBF16
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v));
#else  /* round to nearest even, as f32_to_bf16 */
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(up, 16)));
#endif
}
#else
static inline vfloat silu_times(vfloat g, vfloat u) {
    vfloat n;
    const vfloat f = exp_split(g, &n);
    const __m256 e = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(exp_poly(f)),  /* p(f) 2^n */
                                                          _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23)));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(e, _mm256_set1_ps(1.0f))), u);
}
static inline void store_bf16(uint16_t *p, vfloat v) {  /* round to nearest even, as f32_to_bf16 */
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i up = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(up), _mm256_extracti128_si256(up, 1)));
}
#endif

/* Columns [c0, c1) of one row, gate at g and up at u; a tail shorter than a
 * vector goes through a zero-padded copy, so that every value takes the
 * vector steps. */
#define SILU_SPAN(NAME, T, LOADV, STOREV)                                                        \
static void NAME(const T *g, const T *u, T *o, int64_t c0, int64_t c1) {                        \
    int64_t c = c0;                                                                              \
    for (; c + VW <= c1; c += VW) STOREV(o + c, silu_times(LOADV(g + c), LOADV(u + c)));         \
    if (c < c1) {                                                                                \
        T gt[VW] = {0}, ut[VW] = {0}, ot[VW];                                                    \
        memcpy(gt, g + c, (size_t)(c1 - c) * sizeof(T));                                         \
        memcpy(ut, u + c, (size_t)(c1 - c) * sizeof(T));                                         \
        STOREV(ot, silu_times(LOADV(gt), LOADV(ut)));                                            \
        memcpy(o + c, ot, (size_t)(c1 - c) * sizeof(T));                                         \
    }                                                                                            \
}

SILU_SPAN(silu_span_f32, float, vload, vstore)
SILU_SPAN(silu_span_bf16, uint16_t, load_bf16, store_bf16)

/* out[r, i] = silu(x[r, i]) * x[r, inter + i] for ``rows`` rows of fp32, or
 * of bf16 where ``bf16`` (x and out alike); row r of x at x + r * x_stride,
 * of out at out + r * out_stride (elements). Returns 0, -1 for sizes outside
 * the kernel's. */
int kiln_silu_mul(const void *x, int64_t x_stride, int64_t rows, int64_t inter, void *out, int64_t out_stride,
                  int bf16, int threads) {
    if (rows < 0 || inter < 1 || x_stride < 2 * inter || out_stride < inter) return -1;
    const int64_t per_row = (inter + KILN_SILU_CHUNK - 1) / KILN_SILU_CHUNK, tasks = rows * per_row;
#pragma omp parallel for num_threads(threads) if (rows * inter >= KILN_SILU_PARALLEL) schedule(static)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t r = t / per_row, c0 = t % per_row * KILN_SILU_CHUNK;
        const int64_t c1 = c0 + KILN_SILU_CHUNK < inter ? c0 + KILN_SILU_CHUNK : inter;
        if (bf16) {
            const uint16_t *g = (const uint16_t *)x + r * x_stride;
            silu_span_bf16(g, g + inter, (uint16_t *)out + r * out_stride, c0, c1);
        } else {
            const float *g = (const float *)x + r * x_stride;
            silu_span_f32(g, g + inter, (float *)out + r * out_stride, c0, c1);
        }
    }
    return 0;
}

/* The kinds this library takes (KILN_KINDS), for kiln to check before calling. */
int kiln_linear_kinds(void) { return KILN_KINDS; }

/* Whether the packed kinds multiply bytes by bytes (AVX512-VNNI), for kiln's reports. */
int kiln_linear_vnni(void) { return KILN_VNNI; }

/* Whether the compiler targeted AMX's tiles (-march=native on a CPU that has
 * them), whatever kinds this library holds: bit 0 the tiles with their bf16
 * and int8 products, bit 1 also their fp16 products. What Inductor's AMX
 * probe builds tests for (kiln.compiler.toolchain's trusted_prediction). */
int kiln_linear_amx_target(void) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
#if defined(__AMX_FP16__)
    return 3;
#else
    return 1;
#endif
#else
    return 0;
#endif
}

/* The instruction set this library was built for, for kiln's reports. */
const char *kiln_linear_isa(void) {
    return KILN_DPBF16 ? "avx512-bf16" : KILN_AVX512 ? "avx512" : "avx2";
}

/* ------------------------------------------------------------------ replay
 * The calls of a CPU call graph (kiln.graphs.cpu) made from C: one ctypes
 * call a step, where a Python loop made each of a decode step's 271 calls
 * (Inductor's kernels, this file's linears, the decode-attention kernel) and
 * each call turned its tensors back into addresses.
 *
 * Every argument is an integer (an address, a size, a flag), and every
 * function is called through one prototype of KILN_REPLAY_ARGS integers. On
 * x86-64 (System V), the only target this file builds for, the first six
 * integer arguments travel in registers and the rest on the caller's stack,
 * which the caller clears: a function with fewer parameters reads its own and
 * leaves the others. kiln.graphs.cpu replays from Python a graph with any
 * other argument (a float) or with more arguments than this takes. */
#if !defined(__x86_64__)
#error "kiln_replay calls through the x86-64 System V convention"
#endif
#define KILN_REPLAY_ARGS 64
typedef struct {
    const void *fn;
    const int64_t *args; /* its arguments, followed by at least KILN_REPLAY_ARGS more readable integers */
    int64_t check;       /* 1: the call returns an int, which must equal ``expected`` */
    int64_t expected;
} kiln_replay_call;

#define I8 int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t
typedef int (*kiln_replay_fn)(I8, I8, I8, I8, I8, I8, I8, I8);  /* KILN_REPLAY_ARGS integers */
#undef I8

/* Makes the ``n`` calls in order. Returns -1 when each returned what it
 * should, else the index of the first that did not, with what it returned in
 * ``*got`` (the calls after it are not made). Each call passes
 * KILN_REPLAY_ARGS integers from its ``args``: its own, then what follows
 * them (the next call's, or the padding after the last), which it ignores. */
int64_t kiln_replay(const kiln_replay_call *calls, int64_t n, int64_t *got) {
    for (int64_t i = 0; i < n; i++) {
        const int64_t *a = calls[i].args;
#define A8(j) a[j], a[j + 1], a[j + 2], a[j + 3], a[j + 4], a[j + 5], a[j + 6], a[j + 7]
        const int r = ((kiln_replay_fn)calls[i].fn)(A8(0), A8(8), A8(16), A8(24), A8(32), A8(40), A8(48), A8(56));
#undef A8
        if (calls[i].check && r != calls[i].expected) {
            *got = r;
            return i;
        }
    }
    return -1;
}

/* The most arguments a replayed call may have, for kiln to check before. */
int kiln_replay_args(void) { return KILN_REPLAY_ARGS; }

#ifdef KILN_PYTHON
/* The same entry point as a Python extension module (built with -DKILN_PYTHON
 * where Python's headers are installed), called with tensors instead of
 * addresses: a ctypes call with 15 converted arguments took 4 us here, this
 * one well under 1, and a decode step of the 135M shape makes 121 of them.
 * Tensors reach their data through torch's helper for Inductor's own CPU
 * kernels, whose address the loader passes in the environment
 * (_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR), as Inductor does. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static void *(*tensor_data)(PyObject *);

static const void *data_or_null(PyObject *t) { return t == Py_None ? NULL : tensor_data(t); }

/* 0 when ``name`` got ``want`` arguments, else -1 with Python's error set. */
static int arity(const char *name, Py_ssize_t got, Py_ssize_t want) {
    if (got == want) return 0;
    PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, got);
    return -1;
}

/* The integers at positions ``at[0..n)`` of ``a`` into ``v``: 0, else -1 with
 * Python's error set. */
static int ints_at(PyObject *const *a, const int *at, int n, int64_t *v) {
    for (int i = 0; i < n; i++) {
        v[i] = PyLong_AsLongLong(a[at[i]]);
        if (v[i] == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

/* linear(kind, x, x_bf16, x_stride, m, w, scales, offsets, n, k, bias, out, out_bf16, out_stride, threads)
 * -> kiln_linear's return code; tensors or None where kiln_linear takes NULL. */
static PyObject *py_linear(PyObject *self, PyObject *const *a, Py_ssize_t n_args) {
    (void)self;
    int64_t v[9];
    const int at[9] = {0, 2, 3, 4, 8, 9, 12, 13, 14};
    if (arity("linear", n_args, 15) || ints_at(a, at, 9, v)) return NULL;
    int rc = kiln_linear((int)v[0], tensor_data(a[1]), (int)v[1], v[2], v[3], tensor_data(a[5]),
                         data_or_null(a[6]), data_or_null(a[7]), v[4], v[5], data_or_null(a[10]),
                         tensor_data(a[11]), (int)v[6], v[7], (int)v[8]);
    return PyLong_FromLong(rc);
}

/* amx_linear(x, x_stride, m, k, wp, n, bias, out, out_stride, threads) -> kiln_amx_linear's
 * return code; bias a tensor or None. */
static PyObject *py_amx_linear(PyObject *self, PyObject *const *a, Py_ssize_t n_args) {
    (void)self;
    int64_t v[6];
    const int at[6] = {1, 2, 3, 5, 8, 9};
    if (arity("amx_linear", n_args, 10) || ints_at(a, at, 6, v)) return NULL;
    int rc = kiln_amx_linear(tensor_data(a[0]), v[0], v[1], v[2], tensor_data(a[4]), v[3], data_or_null(a[6]),
                             tensor_data(a[7]), v[4], (int)v[5]);
    return PyLong_FromLong(rc);
}

/* panels_linear(x, x_stride, m, k, wp, n, bias, out, out_stride, threads, next_wp, next_n, next_k) ->
 * kiln_panels_linear's return code; bias and next_wp a tensor or None. */
static PyObject *py_panels_linear(PyObject *self, PyObject *const *a, Py_ssize_t n_args) {
    (void)self;
    int64_t v[8];
    const int at[8] = {1, 2, 3, 5, 8, 9, 11, 12};
    if (arity("panels_linear", n_args, 13) || ints_at(a, at, 8, v)) return NULL;
    int rc = kiln_panels_linear(tensor_data(a[0]), v[0], v[1], v[2], tensor_data(a[4]), v[3], data_or_null(a[6]),
                                tensor_data(a[7]), v[4], (int)v[5], data_or_null(a[10]), v[6], v[7]);
    return PyLong_FromLong(rc);
}

/* silu_mul(x, x_stride, rows, inter, out, out_stride, bf16, threads) -> kiln_silu_mul's return code. */
static PyObject *py_silu_mul(PyObject *self, PyObject *const *a, Py_ssize_t n_args) {
    (void)self;
    int64_t v[6];
    const int at[6] = {1, 2, 3, 5, 6, 7};
    if (arity("silu_mul", n_args, 8) || ints_at(a, at, 6, v)) return NULL;
    int rc = kiln_silu_mul(tensor_data(a[0]), v[0], v[1], v[2], tensor_data(a[4]), v[3], (int)v[4], (int)v[5]);
    return PyLong_FromLong(rc);
}

/* argmax(x, x_bf16, rows, n, stride, threads) -> [index of row 0, ...], or None
 * where kiln_argmax refuses the sizes. */
static PyObject *py_argmax(PyObject *self, PyObject *const *a, Py_ssize_t n_args) {
    (void)self;
    int64_t v[5];
    const int at[5] = {1, 2, 3, 4, 5};
    if (arity("argmax", n_args, 6) || ints_at(a, at, 5, v)) return NULL;
    int64_t local[64];
    int64_t *out = v[1] <= 64 ? local : malloc(sizeof(int64_t) * (v[1] > 0 ? v[1] : 1));
    if (!out) return PyErr_NoMemory();
    PyObject *result = NULL;
    if (kiln_argmax(tensor_data(a[0]), (int)v[0], v[1], v[2], v[3], out, (int)v[4]) != 0) {
        result = Py_None;
        Py_INCREF(result);
    } else if ((result = PyList_New(v[1])) != NULL) {
        for (int64_t r = 0; r < v[1]; r++) {
            PyObject *item = PyLong_FromLongLong(out[r]);
            if (!item) {
                Py_CLEAR(result);
                break;
            }
            PyList_SET_ITEM(result, r, item);
        }
    }
    if (out != local) free(out);
    return result;
}

static PyMethodDef py_methods[] = {
    {"linear", (PyCFunction)(void (*)(void))py_linear, METH_FASTCALL, "kiln_linear with tensor arguments"},
    {"amx_linear", (PyCFunction)(void (*)(void))py_amx_linear, METH_FASTCALL,
     "kiln_amx_linear with tensor arguments"},
    {"panels_linear", (PyCFunction)(void (*)(void))py_panels_linear, METH_FASTCALL,
     "kiln_panels_linear with tensor arguments"},
    {"argmax", (PyCFunction)(void (*)(void))py_argmax, METH_FASTCALL, "kiln_argmax with a tensor, as a list"},
    {"silu_mul", (PyCFunction)(void (*)(void))py_silu_mul, METH_FASTCALL, "kiln_silu_mul with tensor arguments"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef py_module = {PyModuleDef_HEAD_INIT, "kiln_linear", NULL, -1, py_methods};

PyMODINIT_FUNC PyInit_kiln_linear(void) {
    const char *addr = getenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR");
    char *end = NULL;
    unsigned long long p = addr ? strtoull(addr, &end, 10) : 0;
    if (!p || end == addr) {
        PyErr_SetString(PyExc_RuntimeError, "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR must name torch's helper");
        return NULL;
    }
    tensor_data = (void *(*)(PyObject *))(uintptr_t)p;
    return PyModule_Create(&py_module);
}
#endif
