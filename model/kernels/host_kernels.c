/* Host (CPU) kernels for the decode step's small, operator-bound pieces (model/kernels/host.py builds and
 * loads this file; model/kernels/reference.py and model/formats.py hold the PyTorch code each function
 * reproduces, and tests/test_host_kernels.py compares the two bit for bit).
 *
 * Why C: on the CPU a decode step of a small model is bound by the cost of launching torch operators (a
 * few microseconds each), not by arithmetic; the Sinkhorn loop alone is about 120 operators on a 4 x 4
 * matrix per token. Here each function is one call.
 *
 * Numerics: every function performs the same IEEE fp32 operations in the same order as its PyTorch
 * reference (ATen sums a 4-element row or column left to right on every CPU flavour, and longer rows in the
 * order `aten_row_sum` writes out; checked in the tests), compiled with -ffp-contract=off (no fused
 * multiply-add) and without -ffast-math, for the baseline x86-64 ISA (no -march), so the results do not depend
 * on the CPU the code runs on. expf and log1pf are the C library's, as in ATen's scalar loop.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

/* the loops that should vectorize (-O2 vectorizes only the cheapest) */
#define HEAD_OPT __attribute__((optimize("O3")))

/* GCC's generic vectors, used by every ISA version (the target attribute decides the instructions) */
typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
/* the same vectors at any float's address (unaligned loads and stores, no aliasing assumption) */
typedef float f32x16u __attribute__((vector_size(64), aligned(4), may_alias));
typedef float f32x8u __attribute__((vector_size(32), aligned(4), may_alias));
typedef float f32x4u __attribute__((vector_size(16), aligned(4), may_alias));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef int32_t i32x4 __attribute__((vector_size(16)));
/* bf16 bits at any uint16's address, and 32-bit lanes to widen them into */
typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(2), may_alias));
typedef uint16_t u16x8 __attribute__((vector_size(16), aligned(2), may_alias));
typedef uint16_t u16x4 __attribute__((vector_size(8), aligned(2), may_alias));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x4 __attribute__((vector_size(16)));

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* Sinkhorn normalization of `count` n x n matrices (row-major, contiguous), in place:
 * comb /= rowsum; comb += eps; comb /= (colsum + eps); then iters-1 times: rows (sum + eps), columns
 * (sum + eps). reference._sinkhorn_normalize_ is the same loop in torch. One matrix at a time; for n = 4,
 * dsv41_sinkhorn_normalize (below) runs groups of matrices in vector lanes first. */
static void sinkhorn_scalar(float *comb, int64_t count, int64_t n, int64_t iters, float eps) {
    for (int64_t m = 0; m < count; m++) {
        float *c = comb + m * n * n;
        for (int64_t i = 0; i < n; i++) {  /* the softmax's division, then + eps */
            float s = c[i * n];
            for (int64_t j = 1; j < n; j++) s += c[i * n + j];
            for (int64_t j = 0; j < n; j++) c[i * n + j] = c[i * n + j] / s + eps;
        }
        for (int64_t it = 0; it < iters; it++) {
            if (it > 0) {
                for (int64_t i = 0; i < n; i++) {
                    float s = c[i * n];
                    for (int64_t j = 1; j < n; j++) s += c[i * n + j];
                    s += eps;
                    for (int64_t j = 0; j < n; j++) c[i * n + j] /= s;
                }
            }
            for (int64_t j = 0; j < n; j++) {
                float s = c[j];
                for (int64_t i = 1; i < n; i++) s += c[i * n + j];
                s += eps;
                for (int64_t i = 0; i < n; i++) c[i * n + j] /= s;
            }
        }
    }
}

/* fp32 -> the nearest float8_e4m3fn value (round to nearest, ties to even), for |v| <= 448 or NaN, as
 * torch's cast to float8_e4m3fn and back gives it (a NaN comes back as 0x7FF00000 with its sign). */
static inline float round_e4m3(float v) {
    if (v != v) return copysignf(u2f(0x7FF00000u), v);
    float a = fabsf(v);
    float r;
    if (a < 0x1p-6f) {                 /* subnormal E4M3: multiples of 2^-9 */
        r = rintf(a * 512.0f) * 0x1p-9f;  /* exact scalings; rintf rounds half to even */
    } else {                           /* normal: keep 3 mantissa bits, ties to even */
        uint32_t b = f2u(a);
        b += 0x7FFFFu + ((b >> 20) & 1u);
        r = u2f(b & 0xFFF00000u);
    }
    return copysignf(r, v);
}

/* A block's power-of-two scale as formats.py computes it (ue8m0_scale, _ceil_pow2_bits): the bits of
 * 2^ceil(log2(max(amax, floor) * ratio)), read off the product's bits (the exponent, plus one when any mantissa bit is
 * set); a NaN amax skips the floor and gives -0.0, as torch's clamp and integer add give it. amax is never negative. */
static inline uint32_t ue8m0_bits(float amax, float amax_floor, float ratio) {
    if (amax == amax && amax < amax_floor) amax = amax_floor;
    return (f2u(amax * ratio) + 0x7FFFFFu) & 0xFF800000u;
}

/* The FP8 activation grid on 4 floats at a time, in GCC's generic vectors (one SSE2 register at the baseline ISA):
 * round_e4m3 and the clamp with the branches as masks. Comparisons run on the magnitudes' bits as signed integers (a
 * magnitude's bits order as its value, below 2^31); the subnormal grid's rint is (y + 2^23) - 2^23, exact and ties to
 * even for 0 <= y < 2^22 (here y = |q| 512 < 8). Only for blocks without a NaN (those take the scalar loop). */
static inline i32x4 q_select(i32x4 mask, i32x4 a, i32x4 b) { return (a & mask) | (b & ~mask); }

static inline f32x4 q_e4m3_lanes(f32x4 q) {  /* round_e4m3(clamp(q, -448, 448)) for q without NaN */
    const i32x4 u = (i32x4)q, sign = u & (int32_t)0x80000000u, fp448 = u - u + 0x43E00000;
    i32x4 au = u & 0x7FFFFFFF;
    au = q_select(au > fp448, fp448, au);  /* |q| > 448 (inf too): 448 */
    const f32x4 sub = (((f32x4)au * 512.0f + 0x1p23f) - 0x1p23f) * 0x1p-9f;
    const i32x4 norm = (au + 0x7FFFF + ((au >> 20) & 1)) & (int32_t)0xFFF00000u;
    return (f32x4)(q_select(au < 0x3C800000, (i32x4)sub, norm) | sign);  /* below 2^-6: subnormals */
}

/* formats.fp8_fake_quant_f32 on a contiguous fp32 [rows, cols] (cols a multiple of block): per block of
 * `block` values, scale = 2^ceil(log2(max(amax, floor) * ratio)) read off the bits (formats._ceil_pow2_bits,
 * NaN amax giving -0.0), q = e4m3(clamp(x / scale, -448, 448)), out = q * scale. A block of a multiple of 4 values
 * without a NaN or an inf takes the vector form, with x / scale as x times 1 / scale (scale a power of two whose reciprocal
 * fp32 holds exactly, so the same correctly rounded quotient); other blocks the scalar loop. The same values:
 * 1.4-1.8x faster than the scalar loop alone on a decode step's and a prefill's rows (benchmarks/results/cpu-fp8-quant). */
void dsv41_fp8_fake_quant(const float *x, float *out, int64_t numel, int64_t block, float amax_floor,
                          float ratio) {
    for (int64_t g = 0; g < numel; g += block) {
        const float *xb = x + g;
        float amax = 0.0f;
        int nan = 0;
        if (block % 4 == 0) {  /* the largest magnitude's bits, NaNs (bits above inf's) noted apart */
            i32x4 top = {0}, any_nan = {0};
            for (int64_t i = 0; i < block; i += 4) {
                const i32x4 a = (i32x4)*(const f32x4u *)(xb + i) & 0x7FFFFFFF, is_nan = a > 0x7F800000;
                const i32x4 m = a & ~is_nan;
                any_nan |= is_nan;
                top = q_select(m > top, m, top);
            }
            int32_t t = 0;
            for (int j = 0; j < 4; j++) {
                t = top[j] > t ? top[j] : t;
                nan |= any_nan[j] != 0;
            }
            amax = u2f((uint32_t)t);
        } else {
            for (int64_t i = 0; i < block; i++) {
                float a = fabsf(xb[i]);
                if (a != a) nan = 1;
                else if (a > amax) amax = a;
            }
        }
        const float scale = u2f(ue8m0_bits(nan ? u2f(0x7FC00000u) : amax, amax_floor, ratio));
        if (!nan && f2u(scale) < 0x7F800000u && block % 4 == 0) {  /* no NaN, no inf (then q would hold NaNs) */
            const float inv = 1.0f / scale;
            for (int64_t i = 0; i < block; i += 4)
                *(f32x4u *)(out + g + i) = q_e4m3_lanes(*(const f32x4u *)(xb + i) * inv) * scale;
            continue;
        }
        for (int64_t i = 0; i < block; i++) {
            float q = xb[i] / scale;
            if (q == q) q = q < -448.0f ? -448.0f : (q > 448.0f ? 448.0f : q);
            out[g + i] = round_e4m3(q) * scale;
        }
    }
}

/* ---------------------------------------------------------------- bf16 and the mHC mixes */

/* fp32 -> bf16 bits, round to nearest even (c10::BFloat16's rounding; a NaN gives a quiet NaN, whose
 * payload torch itself writes differently on its vector and scalar paths). */
static inline uint16_t to_bf16(float f) {
    const uint32_t u = f2u(f);
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? (uint16_t)((u >> 16) | 0x40u)  /* a select, not a branch: vectorizes */
                                           : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* v rounded to bf16 (nearest even) and widened back; a NaN stays a NaN */
static inline float bf16_round(float v) {
    const uint32_t u = f2u(v);
    const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? v : u2f(r);
}

static inline float load(const void *p, int64_t i, int bf16) {
    return bf16 ? u2f((uint32_t)((const uint16_t *)p)[i] << 16) : ((const float *)p)[i];
}

static inline void store(void *p, int64_t i, float v, int bf16) {
    if (bf16) ((uint16_t *)p)[i] = to_bf16(v);
    else ((float *)p)[i] = v;
}

/* x (bf16 or fp32, n values) as fp32 into out: one loop per input dtype, so each vectorizes */
static void widen(const void *x, int bf16, int64_t n, float *out) {
    if (bf16)
        for (int64_t i = 0; i < n; i++) out[i] = u2f((uint32_t)((const uint16_t *)x)[i] << 16);
    else
        memcpy(out, x, (size_t)n * sizeof(float));
}

/* The mHC mixes below run their sums with lanes over the channels c, in chunks of MHC_CHUNK: each channel's sum
 * still runs j = 0, 1, ..., n-1 (the lanes never meet), and the dtypes are constants of each loop (one call per dtype pair), so
 * the loops vectorize; written with j innermost and the dtype tested per value they ran one channel at a time. */
#define MHC_CHUNK 64

/* reference._collapse: out[t, :] = sum_j pre[t, j] x[t, j, :], the products first, then the sum in the
 * order j = 0, 1, ..., n-1; x [tokens, n, d] and out [tokens, d] in x's dtype (bf16 or fp32), pre fp32. */
static inline __attribute__((always_inline)) void mhc_collapse_body(const void *x, const float *pre, void *out,
                                                                    int64_t tokens, int64_t n, int64_t d,
                                                                    const int x_bf16) {
    float s[MHC_CHUNK];
    for (int64_t t = 0; t < tokens; t++) {
        const float *p = pre + t * n;
        for (int64_t c0 = 0; c0 < d; c0 += MHC_CHUNK) {
            const int64_t w = d - c0 < MHC_CHUNK ? d - c0 : MHC_CHUNK, base = t * n * d + c0;
            for (int64_t c = 0; c < w; c++) s[c] = p[0] * load(x, base + c, x_bf16);
            for (int64_t j = 1; j < n; j++)
                for (int64_t c = 0; c < w; c++) s[c] = s[c] + p[j] * load(x, base + j * d + c, x_bf16);
            for (int64_t c = 0; c < w; c++) store(out, t * d + c0 + c, s[c], x_bf16);
        }
    }
}

HEAD_OPT void dsv41_mhc_collapse(const void *x, const float *pre, void *out, int64_t tokens, int64_t n, int64_t d,
                                 int x_bf16) {
    if (x_bf16) mhc_collapse_body(x, pre, out, tokens, n, d, 1);
    else mhc_collapse_body(x, pre, out, tokens, n, d, 0);
}

/* reference.expand (its few-token form; the same sums as the other): out[t, k, :] = post[t, k] y[t, :] +
 * sum_j comb[t, j, k] r[t, j, :] (the sum over j in order, then added to the post term), in y's dtype;
 * r [tokens, n, d] in its own dtype, post [tokens, n] and comb [tokens, n, n] fp32. */
static inline __attribute__((always_inline)) void mhc_expand_body(const void *y, const void *r, const float *post,
                                                                   const float *comb, void *out, int64_t tokens,
                                                                   int64_t n, int64_t d, const int y_bf16,
                                                                   const int r_bf16) {
    float m[MHC_CHUNK];
    for (int64_t t = 0; t < tokens; t++) {
        const float *cm = comb + t * n * n;
        for (int64_t k = 0; k < n; k++) {
            const float pk = post[t * n + k];
            for (int64_t c0 = 0; c0 < d; c0 += MHC_CHUNK) {
                const int64_t w = d - c0 < MHC_CHUNK ? d - c0 : MHC_CHUNK, rb = t * n * d + c0;
                for (int64_t c = 0; c < w; c++) m[c] = cm[k] * load(r, rb + c, r_bf16);
                for (int64_t j = 1; j < n; j++)
                    for (int64_t c = 0; c < w; c++) m[c] = m[c] + cm[j * n + k] * load(r, rb + j * d + c, r_bf16);
                for (int64_t c = 0; c < w; c++)
                    store(out, (t * n + k) * d + c0 + c, pk * load(y, t * d + c0 + c, y_bf16) + m[c], y_bf16);
            }
        }
    }
}

HEAD_OPT void dsv41_mhc_expand(const void *y, const void *r, const float *post, const float *comb, void *out,
                               int64_t tokens, int64_t n, int64_t d, int y_bf16, int r_bf16) {
    if (y_bf16 && r_bf16) mhc_expand_body(y, r, post, comb, out, tokens, n, d, 1, 1);
    else if (y_bf16) mhc_expand_body(y, r, post, comb, out, tokens, n, d, 1, 0);
    else if (r_bf16) mhc_expand_body(y, r, post, comb, out, tokens, n, d, 0, 1);
    else mhc_expand_body(y, r, post, comb, out, tokens, n, d, 0, 0);
}

/* ---------------------------------------------------------------- rotary embedding of the last channels */

/* layers.rope_tail: x [B, T, H, D] (H = 1 for [B, T, D]) contiguous, bf16 or fp32; the last r channels
 * rotated pairwise by freqs (complex64 as float pairs, [T, r/2], or [B, T, r/2] when per_row), the conjugate
 * when inverse; the rest copied. The complex product as ATen forms it: (ac - bd, ad + bc). */
void dsv41_rope_tail(const void *x, void *out, const float *freqs, int64_t B, int64_t T, int64_t H, int64_t D,
                     int64_t r, int per_row, int inverse, int bf16) {
    const int64_t half = r / 2;
    for (int64_t b = 0; b < B; b++) {
        for (int64_t t = 0; t < T; t++) {
            const float *f = freqs + ((per_row ? b * T : 0) + t) * half * 2;
            for (int64_t h = 0; h < H; h++) {
                const int64_t row = ((b * T + t) * H + h) * D;
                if (bf16) memcpy((uint16_t *)out + row, (const uint16_t *)x + row, (size_t)(D - r) * 2);
                else memcpy((float *)out + row, (const float *)x + row, (size_t)(D - r) * 4);
                for (int64_t i = 0; i < half; i++) {
                    const int64_t at = row + D - r + 2 * i;
                    const float a = load(x, at, bf16), bb = load(x, at + 1, bf16);
                    const float c = f[2 * i], dd = inverse ? -f[2 * i + 1] : f[2 * i + 1];
                    store(out, at, a * c - bb * dd, bf16);
                    store(out, at + 1, a * dd + bb * c, bf16);
                }
            }
        }
    }
}

/* ---------------------------------------------------------------- the output head */

/* Head logits: out[r, v] = sum_k x[r, k] w[v, k] in fp32, with the weight stored transposed, wt [K, V] (k-major,
 * so one k walks V contiguously; the head's bf16 weight widened exactly). Each output is summed in the order
 * k = 0, 1, ..., K-1, starting from the first product: ((x0 w0 + x1 w1) + x2 w2) + ... (reference.head_logits
 * is the same loop in torch). So a row's logits do not depend on how many rows are computed with it (batch
 * invariance without padding rows), nor on the CPU: the lanes of a vector never meet, so the AVX-512, AVX2
 * and baseline versions below give the same bits (no fused multiply-add: -ffp-contract=off); they differ only
 * in their register tiles (RB rows x CB vectors of accumulators, sized to the ISA's register file).
 * dsv41_fixed_order_matmul (below) picks the widest one the CPU runs; each is exported for the tests. */

#define HEAD_KERNEL(NAME, TARGET, VT, VU, VW, RB, CB)                                                            \
TARGET void NAME##_strided(const float *x, int64_t R, int64_t K, int64_t ldx, const float *wt, int64_t V,        \
                           float *out, int64_t ldo, int64_t ldw) {                                               \
    const int64_t vb = (VW) * (CB), full = V / vb * vb;                                                          \
    for (int64_t v0 = 0; v0 < full; v0 += vb) {                                                                  \
        int64_t r = 0;                                                                                           \
        for (; r + (RB) <= R; r += (RB)) { /* RB rows: each weight vector loaded once for RB rows */             \
            VT a[RB][CB], w[CB];                                                                                 \
            for (int c = 0; c < (CB); c++) w[c] = *(const VU *)(wt + v0 + (VW) * c);                             \
            for (int i = 0; i < (RB); i++)                                                                       \
                for (int c = 0; c < (CB); c++) a[i][c] = x[(r + i) * ldx] * w[c];                                \
            for (int64_t k = 1; k < K; k++) {                                                                    \
                for (int c = 0; c < (CB); c++) w[c] = *(const VU *)(wt + k * ldw + v0 + (VW) * c);               \
                for (int i = 0; i < (RB); i++) {                                                                 \
                    const float xk = x[(r + i) * ldx + k];                                                       \
                    for (int c = 0; c < (CB); c++) a[i][c] = a[i][c] + xk * w[c];                                \
                }                                                                                                \
            }                                                                                                    \
            for (int i = 0; i < (RB); i++)                                                                       \
                for (int c = 0; c < (CB); c++) *(VU *)(out + (r + i) * ldo + v0 + (VW) * c) = a[i][c];           \
        }                                                                                                        \
        for (; r < R; r++) { /* the rows left, one at a time (one sequence's decode step is one row) */          \
            VT a[CB];                                                                                            \
            for (int c = 0; c < (CB); c++) a[c] = x[r * ldx] * *(const VU *)(wt + v0 + (VW) * c);                \
            for (int64_t k = 1; k < K; k++) {                                                                    \
                const float xk = x[r * ldx + k];                                                                 \
                for (int c = 0; c < (CB); c++) a[c] = a[c] + xk * *(const VU *)(wt + k * ldw + v0 + (VW) * c);   \
            }                                                                                                    \
            for (int c = 0; c < (CB); c++) *(VU *)(out + r * ldo + v0 + (VW) * c) = a[c];                        \
        }                                                                                                        \
    }                                                                                                            \
    /* whole vectors past the last block (a narrow GEMM: the mHC projection's 24 outputs, the router's 8, a wo_a   \
     * group's 32 were all left to the loop below), RB rows at a time */                                          \
    const int64_t fullv = V / (VW) * (VW);                                                                       \
    for (int64_t v0 = full; v0 < fullv; v0 += (VW)) {                                                            \
        int64_t r = 0;                                                                                           \
        for (; r + (RB) <= R; r += (RB)) {                                                                       \
            VT a[RB], w = *(const VU *)(wt + v0);                                                                \
            for (int i = 0; i < (RB); i++) a[i] = x[(r + i) * ldx] * w;                                          \
            for (int64_t k = 1; k < K; k++) {                                                                    \
                w = *(const VU *)(wt + k * ldw + v0);                                                            \
                for (int i = 0; i < (RB); i++) a[i] = a[i] + x[(r + i) * ldx + k] * w;                           \
            }                                                                                                    \
            for (int i = 0; i < (RB); i++) *(VU *)(out + (r + i) * ldo + v0) = a[i];                             \
        }                                                                                                        \
        for (; r < R; r++) {                                                                                     \
            VT a = x[r * ldx] * *(const VU *)(wt + v0);                                                          \
            for (int64_t k = 1; k < K; k++) a = a + x[r * ldx + k] * *(const VU *)(wt + k * ldw + v0);           \
            *(VU *)(out + r * ldo + v0) = a;                                                                     \
        }                                                                                                        \
    }                                                                                                            \
    const int64_t tail = V - fullv;                                                                              \
    for (int64_t r = 0; tail && r < R; r++) { /* the last columns, fewer than a vector, summed in registers */     \
        float acc[VW];                                                                                           \
        for (int64_t j = 0; j < tail; j++) acc[j] = x[r * ldx] * wt[fullv + j];                                  \
        for (int64_t k = 1; k < K; k++) {                                                                        \
            const float xk = x[r * ldx + k];                                                                     \
            for (int64_t j = 0; j < tail; j++) acc[j] = acc[j] + xk * wt[k * ldw + fullv + j];                   \
        }                                                                                                        \
        for (int64_t j = 0; j < tail; j++) out[r * ldo + fullv + j] = acc[j];                                    \
    }                                                                                                            \
}                                                                                                                \
TARGET void NAME(const float *x, int64_t R, int64_t K, const float *wt, int64_t V, float *out) {                 \
    NAME##_strided(x, R, K, K, wt, V, out, V, V);                                                                \
}

HEAD_KERNEL(dsv41_head_logits_base, HEAD_OPT, f32x4, f32x4u, 4, 2, 4)
#if defined(__x86_64__) && defined(__GNUC__)
HEAD_KERNEL(dsv41_head_logits_avx2, HEAD_OPT __attribute__((target("avx2"))), f32x8, f32x8u, 8, 3, 4)
HEAD_KERNEL(dsv41_head_logits_avx512, HEAD_OPT __attribute__((target("avx512f"))), f32x16, f32x16u, 16, 4, 4)
#endif

/* 2: AVX-512, 1: AVX2, 0: the baseline (what dsv41_fixed_order_matmul runs; host.head_isa() reports it). */
int dsv41_head_isa(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (__builtin_cpu_supports("avx512f")) return 2;
    if (__builtin_cpu_supports("avx2")) return 1;
#endif
    return 0;
}

/* The head for a few rows from its bf16 weight in column blocks: wtb [ceil(V / HEAD_VB)][K][HEAD_VB] (block b holds
 * columns b * HEAD_VB .. + HEAD_VB - 1 of the transposed weight, zeros past V), so one row's pass reads each block's
 * weights as one contiguous stream of half the fp32 weight's bytes (a decode step of one sequence is one row, bound
 * by reading the vocabulary-sized matrix). Each output is summed as dsv41_head_logits sums it, k = 0, 1, ..., K-1
 * from the first product; a bf16 weight widens to fp32 exactly, so these are its bits. */
#define HEAD_VB 64

/* RB rows x HEAD_VB columns of outputs from one block's weights at rows x + r * K, CP vectors of columns at a time
 * (RB x CP accumulators held in registers: AVX2's 16 vector registers hold 4 rows x 2 vectors, not a row x the
 * block's 8 for more than one row, so it takes a block in four parts); each weight vector read once for the RB rows;
 * WIDEN(p) the bf16 weight vector at p as fp32 bits */
#define HEAD_BF16_TILE(VT, VU, WIDEN, VW, RB, CP)                                                                    \
    do {                                                                                                         \
        for (int c0 = 0; c0 < NV; c0 += (CP)) {                                                                  \
            VT a[RB][CP];                                                                                        \
            for (int c = 0; c < (CP); c++) {                                                                     \
                const VT wc = (VT)WIDEN(w + (VW) * (c0 + c));                                                        \
                for (int i = 0; i < (RB); i++) a[i][c] = x[(r + i) * K] * wc;                                    \
            }                                                                                                    \
            for (int64_t k = 1; k < K; k++)                                                                      \
                for (int c = 0; c < (CP); c++) {                                                                 \
                    const VT wc = (VT)WIDEN(w + k * HEAD_VB + (VW) * (c0 + c));                                      \
                    for (int i = 0; i < (RB); i++) a[i][c] = a[i][c] + x[(r + i) * K + k] * wc;                  \
                }                                                                                                \
            const int64_t lo = (int64_t)(VW) * c0, part = width - lo < (VW) * (CP) ? width - lo : (VW) * (CP);   \
            if (part > 0) /* a constant trip count below: the accumulators stay in registers */                  \
            for (int i = 0; i < (RB); i++) {                                                                     \
                float *o = out + (r + i) * V + b * HEAD_VB + lo;                                                 \
                if (part == (VW) * (CP)) {                                                                       \
                    for (int c = 0; c < (CP); c++) *(VU *)(o + (VW) * c) = a[i][c];                              \
                } else {                                                                                         \
                    float tail[(VW) * (CP)];                                                                     \
                    for (int c = 0; c < (CP); c++) *(VU *)(tail + (VW) * c) = a[i][c];                           \
                    memcpy(o, tail, (size_t)part * sizeof(float));                                               \
                }                                                                                                \
            }                                                                                                    \
        }                                                                                                        \
    } while (0)

#define HEAD_BF16_KERNEL(NAME, TARGET, VT, VU, WIDEN, VW, RB, CP)                                                    \
TARGET void NAME##_range(const float *x, int64_t R, int64_t K, const uint16_t *wtb, int64_t V, float *out,      \
                         int64_t b0, int64_t b1) { /* column blocks b0 .. b1 - 1 */                               \
    enum { NV = HEAD_VB / (VW) };                                                                                \
    for (int64_t b = b0; b < b1; b++) {                                                                          \
        const uint16_t *w = wtb + b * K * HEAD_VB;                                                               \
        const int64_t width = (b + 1) * HEAD_VB <= V ? HEAD_VB : V - b * HEAD_VB;                                \
        int64_t r = 0;                                                                                           \
        for (; r + (RB) <= R; r += (RB)) HEAD_BF16_TILE(VT, VU, WIDEN, VW, RB, CP);                                  \
        if ((RB) > 3 && R - r == 3) { HEAD_BF16_TILE(VT, VU, WIDEN, VW, 3, CP); r += 3; } /* the rows left, */       \
        if ((RB) > 2 && R - r == 2) { HEAD_BF16_TILE(VT, VU, WIDEN, VW, 2, CP); r += 2; } /* as one tile    */       \
        for (; r < R; r++) HEAD_BF16_TILE(VT, VU, WIDEN, VW, 1, NV);                      /* when they fit  */       \
    }                                                                                                            \
}                                                                                                                \
TARGET void NAME(const float *x, int64_t R, int64_t K, const uint16_t *wtb, int64_t V, float *out) {             \
    NAME##_range(x, R, K, wtb, V, out, 0, (V + HEAD_VB - 1) / HEAD_VB);                                          \
}

/* A bf16 weight vector at p widened to fp32 (its bits shifted up 16). AVX2's in intrinsics: GCC widens a generic u16x8
 * in five instructions, vpmovzxwd + vpslld are two. */
#define WIDEN_BASE(p) (__builtin_convertvector(*(const u16x4 *)(p), u32x4) << 16)
#define WIDEN_AVX2(p) _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16)
#define WIDEN_AVX512(p) (__builtin_convertvector(*(const u16x16 *)(p), u32x16) << 16)

/* tiles of RB rows x CP vectors: the baseline 3 x 4 (SSE's 16 registers), AVX2 4 x 2 (its 16), AVX-512 4 x 4 (its 32) */
HEAD_BF16_KERNEL(dsv41_head_bf16_base, HEAD_OPT, f32x4, f32x4u, WIDEN_BASE, 4, 3, 4)
#if defined(__x86_64__) && defined(__GNUC__)
HEAD_BF16_KERNEL(dsv41_head_bf16_avx2, HEAD_OPT __attribute__((target("avx2"))), f32x8, f32x8u, WIDEN_AVX2, 8, 4, 2)
HEAD_BF16_KERNEL(dsv41_head_bf16_avx512, HEAD_OPT __attribute__((target("avx512f"))), f32x16, f32x16u, WIDEN_AVX512,
                 16, 4, 4)
#endif

/* Run the widest version of a kernel the CPU has: BASE##_avx512, BASE##_avx2 or BASE##_base (SUFFIX: a name's
 * tail after the ISA, e.g. _strided), all of the same bits; the ISA asked once per function. */
#if defined(__x86_64__) && defined(__GNUC__)
#define ISA_DISPATCH(BASE, SUFFIX, ARGS)                                                                     \
    static int isa = -1;                                                                                     \
    if (isa < 0) isa = dsv41_head_isa();                                                                     \
    if (isa == 2) { BASE##_avx512##SUFFIX ARGS; return; }                                                    \
    if (isa == 1) { BASE##_avx2##SUFFIX ARGS; return; }                                                      \
    BASE##_base##SUFFIX ARGS;
#else
#define ISA_DISPATCH(BASE, SUFFIX, ARGS) BASE##_base##SUFFIX ARGS;
#endif

/* Sinkhorn of 4 x 4 matrices (V4.1's n), VW matrices at a time, one per vector lane: the same operations in the
 * same order as sinkhorn_scalar for each (lanes never meet; IEEE division either way), where one matrix at a
 * time waited on a chain of scalar divisions (20 iterations x 32 a matrix). Returns the matrices done (a multiple
 * of VW); the rest are left to sinkhorn_scalar. */
#define SINKHORN4_KERNEL(NAME, TARGET, VT, VW)                                                                   \
TARGET static int64_t NAME(float *comb, int64_t count, int64_t iters, float eps) {                               \
    int64_t m0 = 0;                                                                                              \
    for (; m0 + (VW) <= count; m0 += (VW)) {                                                                     \
        VT c[16], s;                                                                                             \
        for (int e = 0; e < 16; e++)                                                                             \
            for (int l = 0; l < (VW); l++) c[e][l] = comb[(m0 + l) * 16 + e];                                    \
        for (int i = 0; i < 4; i++) {  /* the softmax's division, then + eps */                                  \
            s = c[i * 4]; s += c[i * 4 + 1]; s += c[i * 4 + 2]; s += c[i * 4 + 3];                               \
            for (int j = 0; j < 4; j++) c[i * 4 + j] = c[i * 4 + j] / s + eps;                                   \
        }                                                                                                        \
        for (int64_t it = 0; it < iters; it++) {                                                                 \
            if (it > 0)                                                                                          \
                for (int i = 0; i < 4; i++) {                                                                    \
                    s = c[i * 4]; s += c[i * 4 + 1]; s += c[i * 4 + 2]; s += c[i * 4 + 3]; s += eps;             \
                    for (int j = 0; j < 4; j++) c[i * 4 + j] /= s;                                               \
                }                                                                                                \
            for (int j = 0; j < 4; j++) {                                                                        \
                s = c[j]; s += c[4 + j]; s += c[8 + j]; s += c[12 + j]; s += eps;                                \
                for (int i = 0; i < 4; i++) c[i * 4 + j] /= s;                                                   \
            }                                                                                                    \
        }                                                                                                        \
        for (int e = 0; e < 16; e++)                                                                             \
            for (int l = 0; l < (VW); l++) comb[(m0 + l) * 16 + e] = c[e][l];                                    \
    }                                                                                                            \
    return m0;                                                                                                   \
}
SINKHORN4_KERNEL(sinkhorn4_base, HEAD_OPT, f32x4, 4)
#if defined(__x86_64__) && defined(__GNUC__)
SINKHORN4_KERNEL(sinkhorn4_avx2, HEAD_OPT __attribute__((target("avx2"))), f32x8, 8)
SINKHORN4_KERNEL(sinkhorn4_avx512, HEAD_OPT __attribute__((target("avx512f"))), f32x16, 16)
#endif

/* version: 2 AVX-512, 1 AVX2, 0 the baseline, -1 the widest this CPU runs; every version the same bits */
void dsv41_sinkhorn_normalize_version(int version, float *comb, int64_t count, int64_t n, int64_t iters, float eps) {
    int64_t done = 0;
    if (n == 4) {
#if defined(__x86_64__) && defined(__GNUC__)
        static int isa = -1;
        if (isa < 0) isa = dsv41_head_isa();
        if (version < 0 || version > isa) version = isa;
        done = version == 2 ? sinkhorn4_avx512(comb, count, iters, eps)
               : version == 1 ? sinkhorn4_avx2(comb, count, iters, eps) : sinkhorn4_base(comb, count, iters, eps);
#else
        done = sinkhorn4_base(comb, count, iters, eps);
#endif
    }
    sinkhorn_scalar(comb + done * n * n, count - done, n, iters, eps);
}

void dsv41_sinkhorn_normalize(float *comb, int64_t count, int64_t n, int64_t iters, float eps) {
    dsv41_sinkhorn_normalize_version(-1, comb, count, n, iters, eps);
}

/* out[r, n] = sum_k x[r, k] wt[k, n] in the head's fixed order, for any GEMM of the decode step (the model's
 * linear layers, the MoE gate, the mHC projection, the grouped wo_a): rows x[r * ldx ..] (K contiguous floats
 * each), outputs out[r * ldo ..] (N contiguous floats each), so a group's columns of a wider tensor are read
 * and written in place. */
void dsv41_fixed_order_matmul(const float *x, int64_t R, int64_t K, int64_t ldx, const float *wt, int64_t N,
                              float *out, int64_t ldo) {
    ISA_DISPATCH(dsv41_head_logits, _strided, (x, R, K, ldx, wt, N, out, ldo, N))
}


/* dsv41_head_bf16_* at the widest ISA the CPU runs (host.head_logits_bf16) */
void dsv41_head_bf16(const float *x, int64_t R, int64_t K, const uint16_t *wtb, int64_t V, float *out) {
    ISA_DISPATCH(dsv41_head_bf16, , (x, R, K, wtb, V, out))
}

static void head_bf16_range(const float *x, int64_t R, int64_t K, const uint16_t *wtb, int64_t V, float *out,
                            int64_t b0, int64_t b1) {
    ISA_DISPATCH(dsv41_head_bf16, _range, (x, R, K, wtb, V, out, b0, b1))
}

/* The head on two threads, this one and one started for the call: each computes its own columns, each column
 * summed as on one thread, so the same bits (a column's sum never depends on which columns are beside it). The
 * engine asks for it where a core would otherwise idle (host.helper_core: a decode step while the scheduler's
 * prefill thread has no prompt). Without a thread (pthread_create fails) the whole runs here. */
typedef struct {
    const float *x; int64_t R, K; const void *w; int64_t V; float *out; int64_t lo, hi; int bf16;
} head_part;

/* columns lo .. hi - 1 of the fp32 head: the weight's rows stay V apart */
static void head_columns(const float *x, int64_t R, int64_t K, const float *wt, int64_t V, float *out, int64_t lo,
                         int64_t hi) {
    ISA_DISPATCH(dsv41_head_logits, _strided, (x, R, K, K, wt + lo, hi - lo, out + lo, V, V))
}

static void head_part_run(const head_part *p) {
    if (p->bf16) head_bf16_range(p->x, p->R, p->K, (const uint16_t *)p->w, p->V, p->out, p->lo, p->hi);
    else head_columns(p->x, p->R, p->K, (const float *)p->w, p->V, p->out, p->lo, p->hi);
}

static void *head_part_thread(void *arg) { head_part_run((const head_part *)arg); return NULL; }

static void head_two_threads(head_part first, int64_t split, int64_t end) {
    head_part second = first;
    first.hi = second.lo = split;
    second.hi = end;
    pthread_t helper;
    if (pthread_create(&helper, NULL, head_part_thread, &second) != 0) {
        first.hi = end;
        head_part_run(&first);
        return;
    }
    head_part_run(&first);
    pthread_join(helper, NULL);
}

/* dsv41_head_bf16 with its column blocks split between two threads (the first thread takes the first half) */
void dsv41_head_bf16_two(const float *x, int64_t R, int64_t K, const uint16_t *wtb, int64_t V, float *out) {
    const int64_t blocks = (V + HEAD_VB - 1) / HEAD_VB;
    head_part p = {x, R, K, wtb, V, out, 0, 0, 1};
    head_two_threads(p, blocks / 2, blocks);
}

/* dsv41_head_logits (the fp32 head, x [R, K] and out [R, V] contiguous) split between two threads at a multiple of
 * 64 columns (whole register tiles on either side) */
void dsv41_head_logits_two(const float *x, int64_t R, int64_t K, const float *wt, int64_t V, float *out) {
    head_part p = {x, R, K, wt, V, out, 0, 0, 0};
    head_two_threads(p, V / 2 / 64 * 64, V);
}


/* A quantized linear layer's whole host path in one call (Linear.forward on the CPU: layers.py): x [R, K]
 * (bf16 or fp32, contiguous) widened to fp32, quantized to the FP8 activation grid per block of `block`
 * (dsv41_fp8_fake_quant), times wt [K, N] in the fixed order (dsv41_fixed_order_matmul), into out [R, N]
 * (bf16, rounded to nearest even, or fp32): the same bits as those steps taken apart, without the
 * intermediate tensors (two dtype conversions and three allocations a layer). With wt_b (not NULL) the same
 * quantized x also goes through wt_b [K, Nb] into out_b (a SwiGLU's w1 and w3: layers.linear_pair).
 * Returns 0, or -1 when the scratch memory cannot be had (nothing is written then). */
HEAD_OPT int dsv41_fp8_linear(const void *x, int x_bf16, int64_t R, int64_t K, int64_t block, float amax_floor,
                     float ratio, const float *wt, int64_t N, void *out, const float *wt_b, int64_t Nb,
                     void *out_b, int out_bf16) {
    int64_t widest = wt_b && Nb > N ? Nb : N;
    float *xq = malloc((size_t)(R * K) * sizeof(float));
    float *y = out_bf16 ? malloc((size_t)(R * widest) * sizeof(float)) : NULL;
    if (!xq || (out_bf16 && !y)) {
        free(xq);
        free(y);
        return -1;
    }
    if (x_bf16)  /* one loop per input dtype: each vectorizes */
        for (int64_t i = 0; i < R * K; i++) xq[i] = u2f((uint32_t)((const uint16_t *)x)[i] << 16);
    else
        memcpy(xq, x, (size_t)(R * K) * sizeof(float));
    dsv41_fp8_fake_quant(xq, xq, R * K, block, amax_floor, ratio);  /* in place: each value read, then written */
    for (int pass = 0; pass < (wt_b ? 2 : 1); pass++) {
        const float *w = pass ? wt_b : wt;
        int64_t n = pass ? Nb : N;
        void *o = pass ? out_b : out;
        dsv41_fixed_order_matmul(xq, R, K, K, w, n, out_bf16 ? y : (float *)o, n);
        if (out_bf16)
            for (int64_t i = 0; i < R * n; i++) ((uint16_t *)o)[i] = to_bf16(y[i]);
    }
    free(y);
    free(xq);
    return 0;
}


/* ---------------------------------------------------------------- scoring a block of head logits */

/* ln p(target), the log-sum-exp and the argmax of each row of fp32 logits [R, V] (row r at logits + r * ld):
 * what `dsv41 bpb` and the log-likelihoods need of the head, in three passes over a row that stays in cache,
 * where torch took a log-sum-exp, a gather and an argmax over the whole block. reference.score_logits is the
 * same arithmetic in torch, and these are its bits on every CPU:
 *   m     the row's maximum, the logit at its first index (argmax; a NaN, when there is one, is the maximum
 *         at its first index and makes the log-probabilities NaN, as torch's argmax and logsumexp have it)
 *   e_j   exp(l_j - m) by exp_poly: 0 below -87, else 2^n p(r) with n = round(d log2 e), r = d - n ln2 in two
 *         parts, p the degree-7 Taylor polynomial (Horner); only fp32 multiplies and adds, so no libm whose
 *         version or vector width could change a bit
 *   sum   16 fp32 partial sums (element j into lane j mod 16, in order), restarted every 1024 elements and
 *         added into 16 fp64 sums, then the 16 halved in a fixed tree: the same order whatever the vector width
 *   lse   (float)(m + log(sum)) in fp64, log by its atanh series (log_series); logprob = l_t - lse in fp32.
 * The AVX-512, AVX2 and baseline versions differ only in how many lanes one instruction holds. */
#define SCORE_LANES 16
#define SCORE_CHUNK 1024
#define EXP_FLOOR (-87.0f)

/* ln(x) for a finite x >= 1 (a sum whose largest term is exactly 1): x = f 2^e with f in [sqrt(1/2), sqrt(2)),
 * ln f = 2 atanh(s) = 2 (s + s^3/3 + s^5/5 + ...), s = (f - 1) / (f + 1), |s| < 0.172: 14 terms reach 2^-53. */
static double log_series(double x) {
    int e;
    double f = frexp(x, &e) * 2.0;  /* [1, 2), exact */
    e -= 1;
    if (f > 1.4142135623730951) { f = f * 0.5; e += 1; }
    const double s = (f - 1.0) / (f + 1.0), s2 = s * s;
    double term = s, acc = 0.0;
    for (int k = 0; k < 14; k++) { acc = acc + term / (double)(2 * k + 1); term = term * s2; }
    return (double)e * 0.6931471805599453 + 2.0 * acc;
}

#define SCORE_KERNEL(NAME, TARGET, VT, VU, IT, VW)                                                              \
TARGET static VT NAME##_exp(VT d) {                                                                             \
    const VT t = d * 1.44269504088896341f + 12582912.0f; /* + 1.5 * 2^23: n rounded to nearest, in the low bits */\
    const VT n = t - 12582912.0f;                                                                               \
    const VT r = (d - n * 0.693145751953125f) - n * 1.428606765330187e-06f;                                    \
    VT p = r * 1.98412698e-04f + 1.38888889e-03f;                                                               \
    p = p * r + 8.33333333e-03f;                                                                                \
    p = p * r + 4.16666667e-02f;                                                                                \
    p = p * r + 1.66666667e-01f;                                                                                \
    p = p * r + 0.5f;                                                                                           \
    p = p * r + 1.0f;                                                                                           \
    p = p * r + 1.0f;                                                                                           \
    const IT keep = d >= EXP_FLOOR;            /* -1 where the term counts, 0 where it is flushed to 0 */      \
    const IT biased = (__builtin_convertvector(n, IT) + 127) & keep; /* 1..127 where kept: 2^n's exponent */     \
    const IT bits = biased << 23;                                                                               \
    return (VT)(((IT)(p * (VT)bits)) & keep);                                                                   \
}                                                                                                               \
/* the row's maximum (NaN aside) and the first index of it, or of the first NaN when there is one */            \
TARGET static int64_t NAME##_argmax(const float *l, int64_t V, int *has_nan_out, int *nonfinite_out) {           \
    enum { NV = SCORE_LANES / (VW) };                                                                           \
    const int64_t full = V / SCORE_LANES * SCORE_LANES;                                                         \
    VT mx[NV], amx[NV]; /* the maximum, and the largest magnitude (an inf, either sign, makes it inf) */         \
    IT nan[NV];                                                                                                 \
    const IT magnitude = (IT){0} + 0x7FFFFFFF;                                                                  \
    for (int c = 0; c < NV; c++) { mx[c] = (VT){0} - __builtin_inff(); amx[c] = (VT){0}; nan[c] = (IT){0}; }     \
    for (int64_t j = 0; j < full; j += SCORE_LANES)                                                             \
        for (int c = 0; c < NV; c++) {                                                                          \
            const VT v = *(const VU *)(l + j + (VW) * c), a = (VT)((IT)v & magnitude);                           \
            const IT gt = v > mx[c], agt = a > amx[c];                                                          \
            mx[c] = (VT)(((IT)v & gt) | ((IT)mx[c] & ~gt));                                                     \
            amx[c] = (VT)(((IT)a & agt) | ((IT)amx[c] & ~agt));                                                 \
            nan[c] |= (v != v);                                                                                 \
        }                                                                                                       \
    float m = -__builtin_inff(), am = 0.0f;                                                                     \
    int has_nan = 0;                                                                                            \
    for (int c = 0; c < NV; c++)                                                                                \
        for (int i = 0; i < (VW); i++) {                                                                        \
            if (mx[c][i] > m) m = mx[c][i];                                                                     \
            if (amx[c][i] > am) am = amx[c][i];                                                                 \
            has_nan |= nan[c][i] != 0;                                                                          \
        }                                                                                                       \
    for (int64_t j = full; j < V; j++) {                                                                        \
        if (l[j] > m) m = l[j];                                                                                 \
        if (fabsf(l[j]) > am) am = fabsf(l[j]);                                                                 \
        has_nan |= l[j] != l[j];                                                                                \
    }                                                                                                           \
    int64_t at = 0;                                                                                             \
    if (has_nan) { while (l[at] == l[at]) at++; }                                                               \
    else { while (at < V - 1 && !(l[at] == m)) at++; }                                                          \
    *has_nan_out = has_nan;                                                                                     \
    *nonfinite_out = has_nan || am == __builtin_inff();                                                         \
    return at;                                                                                                  \
}                                                                                                               \
/* the argmax of each row; with nonfinite (not NULL), *nonfinite = the rows holding a NaN or an inf: the engine's   \
 * greedy pick and its check of the logits (engine.check_finite) in one read */                                 \
TARGET void NAME##_argmax_rows(const float *logits, int64_t R, int64_t V, int64_t ld, int64_t *argmax,           \
                               int64_t *nonfinite) {                                                            \
    int has_nan, bad;                                                                                           \
    int64_t rows_bad = 0;                                                                                       \
    for (int64_t r = 0; r < R; r++) {                                                                           \
        argmax[r] = NAME##_argmax(logits + r * ld, V, &has_nan, &bad);                                          \
        rows_bad += bad;                                                                                        \
    }                                                                                                           \
    if (nonfinite) *nonfinite = rows_bad;                                                                       \
}                                                                                                               \
TARGET void NAME(const float *logits, int64_t R, int64_t V, int64_t ld, const int64_t *targets, float *logprob, \
                 float *lse, int64_t *argmax) {                                                                 \
    enum { NV = SCORE_LANES / (VW) };                                                                           \
    for (int64_t r = 0; r < R; r++) {                                                                          \
        const float *l = logits + r * ld;                                                                       \
        const int64_t full = V / SCORE_LANES * SCORE_LANES;                                                     \
        int has_nan;                                                                                            \
        int bad;                                                                                                \
        const int64_t at = NAME##_argmax(l, V, &has_nan, &bad);                                                 \
        const float m = l[at];                                                                                  \
        argmax[r] = at;                                                                                         \
        /* a NaN, or an infinite maximum: lse is m, as torch's logsumexp gives it */                              \
        const int special = has_nan || __builtin_isinf(m);                                                      \
        double total = 1.0;                                                                                     \
        if (!special) {                                                                                         \
            /* pass 2: the 16 lanes' sums of exp(l - m), fp32 within a chunk, fp64 across chunks */              \
            double dsum[SCORE_LANES] = {0};                                                                     \
            const VT mv = (VT){0} + m;                                                                          \
            for (int64_t j0 = 0; j0 < V; j0 += SCORE_CHUNK) {                                                   \
                const int64_t j1 = j0 + SCORE_CHUNK < V ? j0 + SCORE_CHUNK : V;                                 \
                const int64_t jv = j1 < full ? j1 : full;                                                       \
                VT acc[NV];                                                                                     \
                for (int c = 0; c < NV; c++) acc[c] = (VT){0};                                                  \
                for (int64_t j = j0; j < jv; j += SCORE_LANES)                                                  \
                    for (int c = 0; c < NV; c++)                                                                \
                        acc[c] = acc[c] + NAME##_exp(*(const VU *)(l + j + (VW) * c) - mv);                     \
                float lanes[SCORE_LANES];                                                                       \
                for (int c = 0; c < NV; c++) *(VU *)(lanes + (VW) * c) = acc[c];                                \
                for (int64_t j = jv > j0 ? jv : j0; j < j1; j++) { /* the row's last, partial group of 16 */    \
                    VT one = (VT){0} + (l[j] - m);                                                              \
                    lanes[j % SCORE_LANES] = lanes[j % SCORE_LANES] + NAME##_exp(one)[0];                       \
                }                                                                                               \
                for (int i = 0; i < SCORE_LANES; i++) dsum[i] = dsum[i] + (double)lanes[i];                     \
            }                                                                                                   \
            for (int w = SCORE_LANES / 2; w >= 1; w /= 2)                                                       \
                for (int i = 0; i < w; i++) dsum[i] = dsum[i] + dsum[i + w];                                    \
            total = dsum[0];                                                                                    \
        }                                                                                                       \
        const float s = special ? m : (float)((double)m + log_series(total));                                  \
        lse[r] = s;                                                                                             \
        logprob[r] = l[targets[r]] - s;                                                                         \
    }                                                                                                           \
}

SCORE_KERNEL(dsv41_score_logits_base, HEAD_OPT, f32x4, f32x4u, i32x4, 4)
#if defined(__x86_64__) && defined(__GNUC__)
SCORE_KERNEL(dsv41_score_logits_avx2, HEAD_OPT __attribute__((target("avx2"))), f32x8, f32x8u, i32x8, 8)
SCORE_KERNEL(dsv41_score_logits_avx512, HEAD_OPT __attribute__((target("avx512f"))), f32x16, f32x16u, i32x16, 16)
#endif

void dsv41_score_logits(const float *logits, int64_t R, int64_t V, int64_t ld, const int64_t *targets,
                        float *logprob, float *lse, int64_t *argmax) {
    ISA_DISPATCH(dsv41_score_logits, , (logits, R, V, ld, targets, logprob, lse, argmax))
}

/* argmax[r] of each row of fp32 logits [R, V] (row r at logits + r * ld): torch.argmax's answer (the first index of
 * the maximum; of the first NaN when there is one), for greedy decoding on the CPU in one vector pass a row. */
void dsv41_argmax_rows(const float *logits, int64_t R, int64_t V, int64_t ld, int64_t *argmax, int64_t *nonfinite) {
    ISA_DISPATCH(dsv41_score_logits, _argmax_rows, (logits, R, V, ld, argmax, nonfinite))
}

/* dsv41_fp8_linear over consecutive groups of x's rows, each with its own weights (the routed experts of a MoE
 * layer, their rows sorted by expert: MoE.routed's host path): group g's counts[g] rows times wts[g] (and
 * wts_b[g] when wts_b is not NULL), written at the same rows of out (out_b). The rows of each group get exactly
 * the bits of one dsv41_fp8_linear call on them. Returns 0, or -1 when scratch memory cannot be had. */
int dsv41_fp8_linear_grouped(const void *x, int x_bf16, int64_t K, int64_t block, float amax_floor, float ratio,
                             int64_t G, const int64_t *counts, const float *const *wts, int64_t N, void *out,
                             const float *const *wts_b, int64_t Nb, void *out_b, int out_bf16) {
    const size_t in_size = x_bf16 ? 2 : 4, out_size = out_bf16 ? 2 : 4;
    int64_t row = 0;
    for (int64_t g = 0; g < G; g++) {
        const int64_t R = counts[g];
        if (R > 0 && dsv41_fp8_linear((const char *)x + (size_t)(row * K) * in_size, x_bf16, R, K, block,
                                      amax_floor, ratio, wts[g], N, (char *)out + (size_t)(row * N) * out_size,
                                      wts_b ? wts_b[g] : NULL, Nb,
                                      wts_b ? (char *)out_b + (size_t)(row * Nb) * out_size : NULL, out_bf16))
            return -1;
        row += R;
    }
    return 0;
}


/* ---------------------------------------------------------------- the KV cache's formats, packed and unpacked */
/* formats.py's packers and unpackers, one call per tensor where torch took a dozen operators or more (the decode
 * step packs a window row, the compressor's entries and the indexer's keys and queries in every layer): the same
 * roundings (nearest-even, saturation, the scale rules, the amax floors and their NaN behaviour), so the same
 * bytes and values (tests/test_host_kernels.py, every bf16 value and the edge cases). */

/* torch's float -> float8_e4m3fn cast of a value whose magnitude is at most 448 or NaN: the byte of its nearest
 * E4M3 value (round_e4m3), sign in bit 7, NaN as 0x7F with its sign. */
static inline uint8_t e4m3_code(float v) {
    const uint8_t sign = (f2u(v) >> 24) & 0x80u;
    if (v != v) return sign | 0x7Fu;
    const float r = fabsf(round_e4m3(v));
    if (r < 0x1p-6f) return sign | (uint8_t)(r * 512.0f);  /* subnormal: r = m 2^-9, m in 0..7 (exact) */
    const uint32_t b = f2u(r);
    return sign | (uint8_t)((((b >> 23) - 120u) << 3) | ((b >> 20) & 7u));
}

/* float8_e4m3fn byte -> fp32, as torch's cast (NaN: 0x7FF00000 with the sign, as round_e4m3 has it) */
static inline float e4m3_value(uint8_t c) {
    const uint32_t sign = (uint32_t)(c & 0x80u) << 24;
    const uint32_t e = (c >> 3) & 0xFu, m = c & 7u;
    if (e == 0xFu && m == 7u) return u2f(sign | 0x7FF00000u);
    if (e == 0) return u2f(sign | f2u((float)m * 0x1p-9f));
    return u2f(sign | ((e + 120u) << 23) | (m << 20));
}

/* UE8M0 byte -> fp32 (formats._e8m0_table): 2^-127 for 0, NaN for 255 */
static inline float e8m0_value(uint8_t b) {
    return b == 0 ? u2f(0x00400000u) : (b == 255 ? u2f(0x7FC00000u) : u2f((uint32_t)b << 23));
}

/* the E2M1 code of v (formats.e2m1_encode): magnitudes above each boundary counted (NaN above none), the sign bit
 * copied into bit 3; below[7] are formats._E2M1_BELOW_BOUNDARIES */
static inline uint8_t e2m1_code(float v, const float *below) {
    const float a = fabsf(v);
    uint8_t c = 0;
    for (int i = 0; i < 7; i++) c += a > below[i];
    return c | (uint8_t)((f2u(v) >> 28) & 8u);
}

static const float E2M1_VALUES[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                      -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* a block's amax, NaN when any element is NaN (torch's amax and inf-norm propagate it) */
static inline float block_amax(const void *x, int64_t at, int64_t block, int bf16) {
    float amax = 0.0f;
    for (int64_t i = 0; i < block; i++) {
        const float a = fabsf(load(x, at + i, bf16));
        if (a != a) return a;
        if (a > amax) amax = a;
    }
    return amax;
}

/* formats.pack_fp8_ue8m0: x (bf16 or fp32) -> E4M3 bytes [numel] and UE8M0 bytes [numel / block], the scale
 * dsv41_fp8_fake_quant's */
void dsv41_pack_fp8_ue8m0(const void *x, int x_bf16, int64_t numel, int64_t block, float amax_floor, float ratio,
                          uint8_t *codes, uint8_t *scales) {
    for (int64_t g = 0; g < numel; g += block) {
        const uint32_t bits = ue8m0_bits(block_amax(x, g, block, x_bf16), amax_floor, ratio);
        const float scale = u2f(bits);
        for (int64_t i = 0; i < block; i++) {
            float q = load(x, g + i, x_bf16) / scale;
            if (q == q) q = q < -448.0f ? -448.0f : (q > 448.0f ? 448.0f : q);
            codes[g + i] = e4m3_code(q);
        }
        scales[g / block] = (uint8_t)(bits >> 23);
    }
}

/* formats._quantize_mxfp4 and what follows it: per block, scale = 2^ceil(log2(max(amax, floor) * ratio)) off the
 * sign-cleared bits (formats.ue8m0_scale), codes = e2m1(x / scale). fake: out = e2m1 value * scale in x's dtype
 * (formats.mxfp4_fake_quant); else the codes packed in pairs (low nibble first) and the UE8M0 bytes
 * (formats.pack_mxfp4). */
void dsv41_mxfp4(const void *x, int x_bf16, int64_t numel, int64_t block, float amax_floor, float ratio,
                 const float *below, int fake, void *out, uint8_t *packed, uint8_t *scales) {
    for (int64_t g = 0; g < numel; g += block) {
        /* (formats.ue8m0_scale clears the product's sign first: block_amax is never negative, NaN included) */
        const uint32_t bits = ue8m0_bits(block_amax(x, g, block, x_bf16), amax_floor, ratio);
        const float scale = u2f(bits);
        for (int64_t i = 0; i < block; i++) {
            const uint8_t c = e2m1_code(load(x, g + i, x_bf16) / scale, below);
            if (fake) store(out, g + i, E2M1_VALUES[c] * scale, x_bf16);
            else if (i & 1) packed[(g + i) / 2] |= (uint8_t)(c << 4);
            else packed[(g + i) / 2] = c;
        }
        if (!fake) scales[g / block] = (uint8_t)(bits >> 23);
    }
}

/* formats.pack_fp4_e4m3: per block of 16, scale = e4m3(max(amax, floor) / 6) (a true division, then nearest-even
 * with the cast's saturation at 448), codes = e2m1(x / scale) packed in pairs, the scale's E4M3 byte */
void dsv41_pack_fp4_e4m3(const void *x, int x_bf16, int64_t numel, int64_t block, float amax_floor,
                         const float *below, uint8_t *packed, uint8_t *scales) {
    for (int64_t g = 0; g < numel; g += block) {
        float m = block_amax(x, g, block, x_bf16);
        if (m == m && m < amax_floor) m = amax_floor;
        float s = m / 6.0f;
        if (s == s) s = s > 448.0f ? 448.0f : s;
        const uint8_t sc = e4m3_code(s);
        const float scale = e4m3_value(sc);
        for (int64_t i = 0; i < block; i++) {
            const uint8_t c = e2m1_code(load(x, g + i, x_bf16) / scale, below);
            if (i & 1) packed[(g + i) / 2] |= (uint8_t)(c << 4);
            else packed[(g + i) / 2] = c;
        }
        scales[g / block] = sc;
    }
}

/* e4m3_value of every byte, filled on first use (a race fills it twice with the same values) */
static float E4M3_TABLE[256];
static volatile int e4m3_table_ready = 0;

static void e4m3_table_fill(void) {
    if (e4m3_table_ready) return;
    for (int c = 0; c < 256; c++) E4M3_TABLE[c] = e4m3_value((uint8_t)c);
    e4m3_table_ready = 1;
}

/* The unpackers, to fp32 [numel]: fmt 0 formats.unpack_fp8_ue8m0 (E4M3 bytes, UE8M0 per block), 1
 * formats.unpack_fp4_e4m3 (E2M1 pairs, E4M3 per block), 2 formats.unpack_mxfp4 (E2M1 pairs, UE8M0 per block):
 * each value times its block's scale, one fp32 product (block even; the E4M3 values by table). */
void dsv41_unpack(const uint8_t *codes, const uint8_t *scales, int64_t numel, int64_t block, int fmt, float *out) {
    e4m3_table_fill();
    for (int64_t g = 0; g < numel; g += block) {
        const uint8_t sb = scales[g / block];
        const float scale = fmt == 1 ? E4M3_TABLE[sb] : e8m0_value(sb);
        if (fmt == 0) {
            for (int64_t i = g; i < g + block; i++) out[i] = E4M3_TABLE[codes[i]] * scale;
        } else {
            for (int64_t i = g; i < g + block; i += 2) {
                const uint8_t pair = codes[i / 2];
                out[i] = E2M1_VALUES[pair & 0xFu] * scale;
                out[i + 1] = E2M1_VALUES[pair >> 4] * scale;
            }
        }
    }
}


/* ---------------------------------------------------------------- RMSNorm: ATen's sum, in its order */
/* torch's sum of a contiguous fp32 row (ATen's cpu/SumKernel.cpp, cascade_sum over an inner dimension), written
 * out: vectors of SUM_LANES floats summed by `row_sum` (four accumulators, ILP_ROWS apart, each a cascade of
 * levels), any elements past the last whole vector added to 0 one by one, then the lanes added in order; a row
 * shorter than one vector is `row_sum` over single floats, added to 0. The sum kernel runs 8-lane vectors at
 * every CPU capability torch 2.13 dispatches on x86-64 (the AVX-512 build included), so this is its order on every
 * x86-64 CPU (tests/test_host_kernels.py compares the bits at every row length up to 300 and beyond, at each
 * capability CI runs). A row's sum is never split between threads below 32768 elements (ATen's grain). */
#define SUM_LANES 8
#define ILP_ROWS 4
#define SUM_LEVELS 4

static int64_t ceil_log2(int64_t x) {
    if (x <= 2) return 1;
    int64_t b = 0;
    for (uint64_t v = (uint64_t)(x - 1); v; v >>= 1) b++;
    return b;
}

/* ATen's multi_row_sum for ILP_ROWS accumulators of L lanes: unit i, accumulator k reads the L floats at
 * x + (i * ILP_ROWS + k) * L; `size` units; the cascade folds level j-1 into level j every level_step units. */
static void multi_row_sum(const float *x, int64_t L, int64_t size, float out[ILP_ROWS][SUM_LANES]) {
    const int64_t level_power = ceil_log2(size) / SUM_LEVELS > 4 ? ceil_log2(size) / SUM_LEVELS : 4;
    const int64_t level_step = (int64_t)1 << level_power, level_mask = level_step - 1;
    float acc[SUM_LEVELS][ILP_ROWS][SUM_LANES];
    memset(acc, 0, sizeof(acc));
    int64_t i = 0;
    for (; i + level_step <= size;) {
        for (int64_t j = 0; j < level_step; ++j, ++i)
            for (int k = 0; k < ILP_ROWS; k++)
                for (int64_t l = 0; l < L; l++) acc[0][k][l] = acc[0][k][l] + x[(i * ILP_ROWS + k) * L + l];
        for (int j = 1; j < SUM_LEVELS; ++j) {
            for (int k = 0; k < ILP_ROWS; k++)
                for (int64_t l = 0; l < L; l++) {
                    acc[j][k][l] = acc[j][k][l] + acc[j - 1][k][l];
                    acc[j - 1][k][l] = 0.0f;
                }
            if ((i & (level_mask << (j * level_power))) != 0) break;
        }
    }
    for (; i < size; ++i)
        for (int k = 0; k < ILP_ROWS; k++)
            for (int64_t l = 0; l < L; l++) acc[0][k][l] = acc[0][k][l] + x[(i * ILP_ROWS + k) * L + l];
    for (int j = 1; j < SUM_LEVELS; ++j)
        for (int k = 0; k < ILP_ROWS; k++)
            for (int64_t l = 0; l < L; l++) acc[0][k][l] = acc[0][k][l] + acc[j][k][l];
    memcpy(out, acc[0], sizeof(float) * ILP_ROWS * SUM_LANES);
}

/* ATen's row_sum over `size` units of L lanes at x: the lanes of the result in lane[0..L) */
static void row_sum(const float *x, int64_t L, int64_t size, float lane[SUM_LANES]) {
    float ps[ILP_ROWS][SUM_LANES];
    const int64_t size_ilp = size / ILP_ROWS;
    multi_row_sum(x, L, size_ilp, ps);
    for (int64_t i = size_ilp * ILP_ROWS; i < size; ++i)
        for (int64_t l = 0; l < L; l++) ps[0][l] = ps[0][l] + x[i * L + l];
    for (int k = 1; k < ILP_ROWS; k++)
        for (int64_t l = 0; l < L; l++) ps[0][l] = ps[0][l] + ps[k][l];
    memcpy(lane, ps[0], sizeof(float) * SUM_LANES);
}

static float aten_row_sum(const float *x, int64_t n) {
    float lane[SUM_LANES];
    float total = 0.0f;
    if (n < SUM_LANES) {
        row_sum(x, 1, n, lane);
        return total + lane[0];
    }
    const int64_t vecs = n / SUM_LANES;
    row_sum(x, SUM_LANES, vecs, lane);
    for (int64_t k = vecs * SUM_LANES; k < n; k++) total = total + x[k];
    for (int l = 0; l < SUM_LANES; l++) total = total + lane[l];
    return total;
}

/* 1 / sqrt(mean(x^2) + eps) of each of `rows` contiguous rows of n values (bf16 or fp32), as
 * torch.rsqrt(x.float().square().mean(-1) + eps) gives it: the squares rounded to fp32, ATen's sum, divided by n,
 * eps added, then 1 / sqrt (ATen's rsqrt: a correctly rounded root, then a division). Returns -1 when the scratch
 * memory cannot be had. */
int dsv41_rms_rstd(const void *x, int x_bf16, int64_t rows, int64_t n, float eps, float *rstd) {
    float *sq = malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    if (!sq) return -1;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < n; i++) {
            const float v = load(x, r * n + i, x_bf16);
            sq[i] = v * v;
        }
        rstd[r] = 1.0f / sqrtf(aten_row_sum(sq, n) / (float)n + eps);
    }
    free(sq);
    return 0;
}

/* reference.rms_norm: out = (w * (x * rstd)) in x's dtype (bf16 or fp32), w [n] bf16 or fp32, rstd as
 * dsv41_rms_rstd's. Returns -1 when the scratch memory cannot be had (nothing written). */
int dsv41_rms_norm(const void *x, int x_bf16, const void *w, int w_bf16, int64_t rows, int64_t n, float eps,
                   void *out) {
    float *rstd = malloc((size_t)(rows > 0 ? rows : 1) * sizeof(float));
    if (!rstd || dsv41_rms_rstd(x, x_bf16, rows, n, eps, rstd)) {
        free(rstd);
        return -1;
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < n; i++)
            store(out, r * n + i, load(w, i, w_bf16) * (load(x, r * n + i, x_bf16) * rstd[r]), x_bf16);
    free(rstd);
    return 0;
}


/* ---------------------------------------------------------------- a decode step's attention inputs */
/* Attention.query and Attention.window_latent of a decode step in one call (host.attention_inputs), each piece the
 * dsv41_ function its own call runs, with the same operands, order and dtypes (x's, bf16 or fp32), so the same bits:
 *   qr = RMSNorm_q(FP8(x) Wq_a)                 [R, q_lora]      dsv41_fp8_linear (the pair with Wkv: x quantized
 *   kv = RoPE(RMSNorm_kv(FP8(x) Wkv))           [R, D]           once), dsv41_rms_norm, dsv41_rope_tail
 *   q  = RoPE(FP8(qr) Wq_b)                     [R, H, D]
 * RoPE rotates the last r channels of each head at row b's own frequencies (freqs [R, r/2] complex64, per_row),
 * or at one shared row (per_row 0). Returns 0, or -1 when scratch memory cannot be had. */
int dsv41_attention_inputs(const void *x, int bf16, int64_t R, int64_t dim, int64_t block, float amax_floor,
                           float ratio, const float *wq_a, int64_t q_lora, const void *q_norm, int q_norm_bf16,
                           float q_eps, const float *wq_b, int64_t H, int64_t D, const float *wkv,
                           const void *kv_norm, int kv_norm_bf16, float kv_eps, const float *freqs, int64_t r,
                           int per_row, void *qr, void *q, void *kv) {
    const size_t width = bf16 ? 2 : 4;
    char *scratch = malloc((size_t)R * (size_t)(q_lora + D + H * D) * width);
    if (!scratch) return -1;
    char *qr_raw = scratch, *kv_raw = qr_raw + (size_t)(R * q_lora) * width, *q_raw = kv_raw + (size_t)(R * D) * width;
    int status = dsv41_fp8_linear(x, bf16, R, dim, block, amax_floor, ratio, wq_a, q_lora, qr_raw, wkv, D, kv_raw,
                                  bf16);
    if (!status) status = dsv41_rms_norm(qr_raw, bf16, q_norm, q_norm_bf16, R, q_lora, q_eps, qr);
    if (!status) status = dsv41_rms_norm(kv_raw, bf16, kv_norm, kv_norm_bf16, R, D, kv_eps, kv_raw);
    if (!status) status = dsv41_fp8_linear(qr, bf16, R, q_lora, block, amax_floor, ratio, wq_b, H * D, q_raw, NULL,
                                           0, NULL, bf16);
    if (!status) {
        dsv41_rope_tail(kv_raw, kv, freqs, R, 1, 1, D, r, per_row, 0, bf16);
        dsv41_rope_tail(q_raw, q, freqs, R, 1, H, D, r, per_row, 0, bf16);
    }
    free(scratch);
    return status;
}


/* Attention.output of a decode step in one call (host.attention_output), the same pieces as its calls:
 *   o' = RoPE^-1(o)                 [R, H, D] in o's dtype            dsv41_rope_tail (inverse)
 *   u  = o' W_{o,a} per group       [R, G, N'] fp32, then o's dtype   dsv41_fixed_order_matmul per group over
 *                                                                    o' widened, G groups of H D / G channels
 *   y  = FP8(u) W_{o,b}             [R, dim] in o's dtype             dsv41_fp8_linear
 * wt_groups [G, H D / G, N'] fp32 (host.transposed(W_{o,a}, G)). Returns 0, or -1 when scratch memory cannot
 * be had. */
int dsv41_attention_output(const void *o, int bf16, int64_t R, int64_t H, int64_t D, const float *freqs, int64_t r,
                           int per_row, int64_t G, const float *wt_groups, int64_t Ng, int64_t block,
                           float amax_floor, float ratio, const float *wo_b, int64_t dim, void *out) {
    const int64_t HD = H * D, Dg = HD / G;
    const size_t width = bf16 ? 2 : 4;
    char *scratch = malloc((size_t)R * ((size_t)HD * (width + 4) + (size_t)(G * Ng) * (4 + width)));
    if (!scratch) return -1;
    char *rotated = scratch;
    float *wide = (float *)(rotated + (size_t)(R * HD) * width), *u = wide + R * HD;
    char *u_cast = (char *)(u + R * G * Ng);
    dsv41_rope_tail(o, rotated, freqs, R, 1, H, D, r, per_row, 1, bf16);
    widen(rotated, bf16, R * HD, wide);
    for (int64_t g = 0; g < G; g++)
        dsv41_fixed_order_matmul(wide + g * Dg, R, Dg, HD, wt_groups + g * Dg * Ng, Ng, u + g * Ng, G * Ng);
    for (int64_t i = 0; i < R * G * Ng; i++) store(u_cast, i, u[i], bf16);
    int status = dsv41_fp8_linear(u_cast, bf16, R, G * Ng, block, amax_floor, ratio, wo_b, dim, out, NULL, 0, NULL,
                                  bf16);
    free(scratch);
    return status;
}


/* ---------------------------------------------------------------- the indexer's choice in a decode step */
/* Indexer.select of a decode step (batch_invariant) from the packed MXFP4 keys, in one call (host.indexer_decode),
 * where reference.weighted_relu_scores takes its exact path: bf16 scores and an index head dim of one MXFP4 block,
 * so every q . k is exact in fp32 in any order (reference.mxfp4_products_exact), and at most 4 index heads, whose
 * bf16 head sum ATen takes in fp32 from 0, left to right, rounded once (tested):
 *   s_n = bf16( sum_h bf16( relu(bf16(q_h . k_n)) w_h ) )      q [B, H, Dk] (bf16/fp32), w [B, H] bf16
 *   s_n = -inf where n >= visible[b], or where the candidate pool (bool [B, N] at pool + b pool_ld) leaves n out
 *   top = the k largest s_n, equal ones to the lower n (a stable descending sort's first k), as ascending ids, each
 *         >= visible[b] replaced by -1, then -1 up to `width`
 * Key n of row b: codes + (b apart + n) Dk / 2, scales + (b apart + n) Dk / 32 (a row-range view of the cache);
 * Dk is one MXFP4 block (32), whose one scale multiplies each head's sum.
 * Returns 0, 1 when a score is NaN (torch's sort puts NaN first; the caller takes the torch path), -1 when scratch
 * memory cannot be had. */
int dsv41_indexer_decode(const void *q, int q_bf16, const uint16_t *w, const uint8_t *codes, const uint8_t *scales,
                         int64_t apart, int64_t B, int64_t H, int64_t Dk, int64_t N, const int64_t *visible,
                         const uint8_t *pool, int64_t pool_ld, int64_t k, int64_t width, float *score, int64_t *top) {
    const int64_t K = k < N ? k : N;
    float *kf = malloc((size_t)(Dk + H * Dk) * sizeof(float));
    uint8_t *picked = malloc((size_t)(N > 0 ? N : 1));
    int64_t *best = malloc((size_t)(K > 0 ? K : 1) * sizeof(int64_t));
    if (!kf || !picked || !best) {
        free(kf);
        free(picked);
        free(best);
        return -1;
    }
    float *qf = kf + Dk;
    int status = 0;
    for (int64_t b = 0; b < B && !status; b++) {
        float *s = score + b * N;
        for (int64_t i = 0; i < H * Dk; i++) qf[i] = load(q, b * H * Dk + i, q_bf16);
        for (int64_t n = 0; n < N; n++) {
            const uint8_t *c = codes + (b * apart + n) * (Dk / 2);
            const float scale = e8m0_value(scales[(b * apart + n) * (Dk / 32)]);
            for (int64_t d = 0; d < Dk; d += 2) {  /* the E2M1 values; the key's block scale joins the sum below */
                kf[d] = E2M1_VALUES[c[d / 2] & 0xFu];
                kf[d + 1] = E2M1_VALUES[c[d / 2] >> 4];
            }
            float acc = 0.0f;
            for (int64_t h = 0; h < H; h++) {
                /* eight partial sums, then their lanes, then the power-of-two scale: every partial sum of these
                 * products is exact (one MXFP4 block: the caller's condition), so any order gives the bmm's value */
                f32x8 p = {0};
                int64_t d = 0;
                for (; d + 8 <= Dk; d += 8) p += *(const f32x8u *)(kf + d) * *(const f32x8u *)(qf + h * Dk + d);
                const f32x4 half = (f32x4){p[0], p[1], p[2], p[3]} + (f32x4){p[4], p[5], p[6], p[7]};
                float dot = (half[0] + half[2]) + (half[1] + half[3]);
                for (; d < Dk; d++) dot = dot + kf[d] * qf[h * Dk + d];
                float r = bf16_round(dot * scale);
                r = r < 0.0f ? 0.0f : r;  /* relu_ on bf16: -0.0 and NaN stay */
                acc = acc + bf16_round(r * u2f((uint32_t)w[b * H + h] << 16));
            }
            float v = bf16_round(acc);
            if (n >= visible[b] || (pool && !pool[b * pool_ld + n])) v = -INFINITY;
            if (v != v) status = 1;
            s[n] = v;
        }
        /* the K best, best first by (score descending, id ascending): ids come in ascending order, so an equal
         * score never displaces one already kept */
        int64_t count = 0;
        for (int64_t n = 0; n < N; n++) {
            const float v = s[n];
            if (count == K && !(v > s[best[K - 1]])) continue;
            int64_t j = count < K ? count++ : K - 1;
            for (; j > 0 && v > s[best[j - 1]]; j--) best[j] = best[j - 1];
            best[j] = n;
        }
        memset(picked, 0, (size_t)N);
        for (int64_t j = 0; j < count; j++) picked[best[j]] = 1;
        int64_t *t = top + b * width, j = 0;
        for (int64_t n = 0; n < N; n++)
            if (picked[n]) t[j++] = n < visible[b] ? n : -1;
        for (; j < width; j++) t[j] = -1;
    }
    free(kf);
    free(picked);
    free(best);
    return status;
}


/* ---------------------------------------------------------------- Engram's gate in a decode step */
/* model/engram.py Engram.forward after its wkv product, in the decode step (reference.row_invariant: the sigmoid by
 * ATen's scalar formula), as two calls around torch's sqrt (host.engram_mix), each operation the torch code's:
 *   dsv41_engram_dot   d = (sum_i (h_i (q_i k_i)) key_i) rstd(h) rstd(key) dim^-1/2    per token and stream; the
 *                      sum in ATen's order (aten_row_sum), rstd as dsv41_rms_rstd; a = max(|d|, floor)
 *   (torch)            a = sqrt(a)
 *   dsv41_engram_mix   out = h + sigmoid(copysign(a, d)) value, cast to x's dtype
 * x [R, hc, dim] (bf16/fp32), kv [R, (hc + 1) dim] (the hc keys, then the value), q_weight and k_weight [hc, dim].
 * Returns 0, or -1 when scratch memory cannot be had. */
int dsv41_engram_dot(const void *x, int x_bf16, const void *kv, int kv_bf16, int64_t R, int64_t hc, int64_t dim,
                     const void *qw, int qw_bf16, const void *kw, int kw_bf16, float eps, float scale, float floor,
                     float *dot, float *a) {
    float *scratch = malloc((size_t)(dim + 2 * hc + hc * dim) * sizeof(float));
    if (!scratch) return -1;
    float *prod = scratch, *rstd_h = prod + dim, *rstd_k = rstd_h + hc, *w = rstd_k + hc;
    for (int64_t i = 0; i < hc * dim; i++) w[i] = load(qw, i, qw_bf16) * load(kw, i, kw_bf16);  /* every token's */
    const int64_t kv_row = (hc + 1) * dim, kv_bytes = kv_bf16 ? 2 : 4;
    int status = 0;
    for (int64_t r = 0; r < R && !status; r++) {
        const char *key = (const char *)kv + r * kv_row * kv_bytes;
        status = dsv41_rms_rstd((const char *)x + r * hc * dim * (x_bf16 ? 2 : 4), x_bf16, hc, dim, eps, rstd_h)
                 || dsv41_rms_rstd(key, kv_bf16, hc, dim, eps, rstd_k);
        for (int64_t c = 0; c < hc && !status; c++) {
            for (int64_t i = 0; i < dim; i++)
                prod[i] = load(x, (r * hc + c) * dim + i, x_bf16) * w[c * dim + i] * load(key, c * dim + i, kv_bf16);
            const float d = aten_row_sum(prod, dim) * (rstd_h[c] * rstd_k[c]) * scale;
            const float m = fabsf(d);
            dot[r * hc + c] = d;
            a[r * hc + c] = m < floor ? floor : m;  /* clamp_min: a NaN stays NaN */
        }
    }
    free(scratch);
    return status ? -1 : 0;
}

void dsv41_engram_mix(const void *x, int x_bf16, const void *kv, int kv_bf16, int64_t R, int64_t hc, int64_t dim,
                      const float *dot, const float *root, void *out) {
    const int64_t kv_row = (hc + 1) * dim;
    for (int64_t r = 0; r < R; r++)
        for (int64_t c = 0; c < hc; c++) {
            const float g = 1.0f / (1.0f + expf(-copysignf(root[r * hc + c], dot[r * hc + c])));
            for (int64_t i = 0; i < dim; i++) {
                const int64_t at = (r * hc + c) * dim + i;
                store(out, at, load(x, at, x_bf16) + g * load(kv, r * kv_row + hc * dim + i, kv_bf16), x_bf16);
            }
        }
}


/* ---------------------------------------------------------------- ATen's scalar sigmoid and softplus */
/* torch.sigmoid and F.softplus (beta 1, threshold 20) of fp32 values as ATen's scalar loop computes them
 * (aten/src/ATen/native/cpu: 1 / (1 + exp(-a)); a > 20 ? a : log1p(exp(a))), which `reference.per_row` makes
 * every element take inside the engine's decode step: std::exp and std::log1p there are the C library's expf and
 * log1pf, which these call too, so the bits are the same on any CPU and libm (tests/test_host_kernels.py compares
 * a million values spread over every fp32 exponent at each capability CI runs). */
void dsv41_sigmoid_scalar(const float *x, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = 1.0f / (1.0f + expf(-x[i]));
}

void dsv41_softplus_scalar(const float *x, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float a = x[i];
        out[i] = a > 20.0f ? a : log1pf(expf(a));
    }
}


/* ---------------------------------------------------------------- the MoE router, its GEMM and its choice */
/* reference.gate_route inside the engine's decode step (reference.row_invariant, E not whole vector chunks: the
 * softplus by ATen's scalar formula, reference.per_row), in two calls around torch's sqrt (host.gate_route), where
 * torch took a dozen operators. torch 2.13's fp32 sqrt on the CPU is not the correctly rounded one (about one value
 * in six differs from sqrtf by an ulp, the same at every capability), so it stays torch's:
 *   dsv41_gate_softplus   u = softplus(x W_g^T / temp)      the GEMM in the fixed order (dsv41_fixed_order_matmul
 *                                                          over the widened x), the division only where temp != 1
 *   (torch)               s = sqrt(u)
 *   dsv41_route_pick      I = Top-k(s + b), descending     b [E], or a row of [N, E] (bias_ld E)
 *                         w = s_I / (sum s_I + 1e-20) * scale   the sum left to right (k <= 4: ATen's order for
 *                                                          so short a row), the division only where norm and k > 1
 * torch.topk orders equal values by its own selection algorithm, which this does not copy: a row where one of its
 * k largest biased scores is held twice, or with a NaN, is not answered here. */
int dsv41_gate_softplus(const void *x, int x_bf16, int64_t N, int64_t K, const float *wt, int64_t E, int temp_on,
                        float temp, float *out) {
    float *xf = malloc((size_t)(N * K) * sizeof(float));
    if (!xf) return -1;
    widen(x, x_bf16, N * K, xf);
    dsv41_fixed_order_matmul(xf, N, K, K, wt, E, out, E);
    for (int64_t i = 0; i < N * E; i++) {
        const float a = temp_on ? out[i] / temp : out[i];
        out[i] = a > 20.0f ? a : log1pf(expf(a));  /* dsv41_softplus_scalar's formula */
    }
    free(xf);
    return 0;
}

/* Returns 0, or 1 + the first row it did not answer (the caller takes the torch reference for the whole call). */
int dsv41_route_pick(const float *s, int64_t N, int64_t E, const float *bias, int64_t bias_ld, int64_t k, int norm,
                     float scale, float *weights, int64_t *indices) {
    float biased[256];
    if (E > 256 || k > 4) return 1;
    for (int64_t r = 0; r < N; r++) {
        const float *sr = s + r * E, *b = bias + r * bias_ld;
        int nan = 0;
        for (int64_t e = 0; e < E; e++) {
            biased[e] = sr[e] + b[e];
            nan |= biased[e] != biased[e];
        }
        if (nan) return (int)(r + 1);
        /* k passes of the row maximum; with the k largest distinct and above the rest, torch.topk's answer */
        int64_t picked[4];
        for (int64_t j = 0; j < k; j++) {
            int64_t best = -1, held = 0;
            for (int64_t e = 0; e < E; e++) {
                int used = 0;
                for (int64_t i = 0; i < j; i++) used |= picked[i] == e;
                if (!used && (best < 0 || biased[e] > biased[best])) best = e;
            }
            for (int64_t e = 0; e < E; e++) held += biased[e] == biased[best];
            if (held > 1) return (int)(r + 1);
            picked[j] = best;
        }
        float sum = 0.0f;
        for (int64_t i = 0; i < k; i++) sum = i ? sum + sr[picked[i]] : sr[picked[i]];
        for (int64_t i = 0; i < k; i++) {
            float w = sr[picked[i]];
            if (norm && k > 1) w = w / (sum + 1e-20f);
            weights[r * k + i] = w * scale;
            indices[r * k + i] = picked[i];
        }
    }
    return 0;
}


/* ---------------------------------------------------------------- sparse attention, every sum in a fixed order */
/* reference.sparse_attention_fixed_order over packed rows (reference.sparse_attention_packed's operands): for each
 * query token (b, t) the index list [window_idx ; main_idx] in blocks of ATTN_BLOCK, REF's online softmax per head
 * with its bf16 probabilities before P.V and the sink at the end, each sum in one fixed order (the dot products over
 * d = 0..D-1, the block's probabilities and P.V over j = 0..k-1, each from 0.0f) and exp by exp_fixed, so a token's
 * output depends on nothing but its own operands, on any CPU. Each block's rows are gathered (decoded from their
 * bytes: FP8 E4M3 x UE8M0 per 32 in the window, unless its fp32 values are given; E2M1 x E4M3 per 16 in the main
 * store, the unpackers' values) once for all heads (K = V, one latent row shared by the query heads). Returns 0, or -1
 * without the scratch memory (nothing is written then). */
#define ATTN_BLOCK 64
#define ATTN_SINK_MAX 88.0f
#define ATTN_HB 4  /* heads per register tile */
/* the scratch floats besides the rows: keys_t, the block's rows, q, acc, P.V [H][D], logits and bf16 probabilities
 * [H][ATTN_BLOCK], the running max, denominators and rescales [H] */
#define ATTN_FIXED(H, D) (2 * ATTN_BLOCK * (D) + 3 * (H) * (D) + 2 * (H) * ATTN_BLOCK + 3 * (H))

/* reference.exp_fixed: SCORE_KERNEL's exp (exp_poly) for one value; 0 below EXP_FLOOR and for NaN, finite up to 88 */
static inline float exp_fixed(float d_in) {
    const int keep = d_in >= EXP_FLOOR;  /* no branch: a loop of these vectorizes */
    const float d = keep ? d_in : 0.0f;
    const float t = d * 1.44269504088896341f + 12582912.0f;
    const float n = t - 12582912.0f;
    const float r = (d - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
    float p = r * 1.98412698e-04f + 1.38888889e-03f;
    p = p * r + 8.33333333e-03f;
    p = p * r + 4.16666667e-02f;
    p = p * r + 1.66666667e-01f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const float v = p * u2f((uint32_t)((int32_t)n + 127) << 23);
    return keep ? v : 0.0f;
}

/* the unpackers' values of `rows` consecutive rows of a store: FP8 E4M3 bytes with UE8M0 per 32 (window) or E2M1
 * pairs with E4M3 per 16 (main) */
static void attn_decode_rows(float *out, const uint8_t *codes, const uint8_t *scales, int64_t rows, int64_t D,
                             int fp4) {
    dsv41_unpack(codes, scales, rows * D, fp4 ? 16 : 32, fp4 ? 1 : 0, out);
}

/* base when the k indices' valid ones are base + j (a run of consecutive rows, -1 elsewhere) and columns base ..
 * base + k - 1 lie in a transposed window of W_rows rows after ATTN_BLOCK zero columns; else INT64_MIN */
static inline int64_t window_run(const int64_t *idx, int64_t k, int64_t W_rows) {
    int64_t base = INT64_MIN;
    for (int64_t j = 0; j < k; j++) {
        if (idx[j] < 0) continue;
        if (base == INT64_MIN) base = idx[j] - j;
        else if (idx[j] != base + j) return INT64_MIN;
    }
    return base != INT64_MIN && base >= -ATTN_BLOCK && base + k <= W_rows ? base : INT64_MIN;
}

/* Register tiles of the block's products, lanes of VW floats (VT), two vectors a tile, ATTN_HB heads (or one):
 * - logits of heads h0 .. h0 + HB - 1 for keys j0 .. j0 + 2 VW - 1 (columns of kt, row stride ld): lg[h][j] =
 *   ((0 + q[h][0] kt[0][j]) + q[h][1] kt[1][j]) + ..., d in order, as a scalar loop sums them (the lanes are keys and
 *   never meet). One load of a key vector serves HB heads, where a loop over one head at a time loaded and stored its
 *   logits at every d (a prefill's largest cost in this kernel);
 * - P.V of heads h0 .. for outputs d0 .. d0 + 2 VW - 1: pv[h][d] = ((0 + pb[h][0] row_0[d]) + pb[h][1] row_1[d]) + ...,
 *   j in order (lanes over d); one load of a row vector serves HB heads (K = V: the heads share the latent rows).
 * HB is a constant after inlining. The baseline ISA's tiles are 4-float vectors (8-float ones there split into
 * pairs the compiler spilled: 5x slower than the scalar loops), AVX2's and AVX-512's 8-float ones.
 * Both are ATTN_TILE: acc[i][c] = ((0 + SCALAR(i, 0) VEC(0)[c]) + SCALAR(i, 1) VEC(1)[c]) + ... over t = 0 .. N-1 in
 * order, for i < HB heads and c < 2 vectors, stored at OUT(i) and OUT(i) + VW (VEC, SCALAR and OUT: expressions of the
 * loop variables t and i). */
#define ATTN_TILE(VT, VU, VW, HB, N, VEC, SCALAR, OUT)                                                           \
    do {                                                                                                         \
        VT a[ATTN_HB][2];                                                                                        \
        for (int i = 0; i < (HB); i++) a[i][0] = a[i][1] = (VT){0};                                              \
        for (int64_t t = 0; t < (N); t++) {                                                                      \
            const float *v = (VEC);                                                                              \
            const VT v0 = *(const VU *)v, v1 = *(const VU *)(v + (VW));                                          \
            for (int i = 0; i < (HB); i++) {                                                                     \
                const float s = (SCALAR);                                                                        \
                a[i][0] = a[i][0] + s * v0;                                                                      \
                a[i][1] = a[i][1] + s * v1;                                                                      \
            }                                                                                                    \
        }                                                                                                        \
        for (int i = 0; i < (HB); i++) {                                                                         \
            *(VU *)(OUT) = a[i][0];                                                                              \
            *(VU *)((OUT) + (VW)) = a[i][1];                                                                     \
        }                                                                                                        \
    } while (0)
#define ATTN_TILES(SUF, VT, VU, VW)                                                                              \
static inline __attribute__((always_inline)) void attn_logits_tile##SUF(                                         \
        const float *qf, int64_t D, const float *kt, int64_t ld, int64_t j0, int64_t h0, float *lg, const int HB) { \
    ATTN_TILE(VT, VU, VW, HB, D, kt + t * ld + j0, qf[(h0 + i) * D + t], lg + (h0 + i) * ATTN_BLOCK + j0);        \
}                                                                                                                \
static inline __attribute__((always_inline)) void attn_pv_tile##SUF(                                             \
        const float *pbh, const float *const *src, int64_t k, int64_t D, int64_t d0, int64_t h0, float *pv,      \
        const int HB) {                                                                                          \
    ATTN_TILE(VT, VU, VW, HB, k, src[t] + d0, pbh[(h0 + i) * ATTN_BLOCK + t], pv + (h0 + i) * D + d0);            \
}
ATTN_TILES(4, f32x4, f32x4u, 4)
ATTN_TILES(8, f32x8, f32x8u, 8)

/* Every head's tiles of one product over columns 0 .. END - 1, a tile's columns at a time (16 with 8-float vectors,
 * WIDE; else 8): ATTN_HB heads at a time, then the heads left one at a time. TILE##8 and TILE##4 take (ARGS..., c0,
 * h0, OUT, HB); WIDE is a constant after inlining. */
#define ATTN_TILE_CALL(TILE, WIDE, HB, OUT, c0, h0, ...)                                                          \
    do {                                                                                                         \
        if (WIDE) TILE##8(__VA_ARGS__, c0, h0, OUT, HB);                                                         \
        else TILE##4(__VA_ARGS__, c0, h0, OUT, HB);                                                              \
    } while (0)
#define ATTN_EACH_TILE(TILE, H, END, WIDE, OUT, ...)                                                              \
    do {                                                                                                         \
        const int64_t step_ = (WIDE) ? 16 : 8;                                                                   \
        int64_t h0_ = 0;                                                                                         \
        for (; h0_ + ATTN_HB <= (H); h0_ += ATTN_HB)                                                             \
            for (int64_t c0_ = 0; c0_ < (END); c0_ += step_)                                                     \
                ATTN_TILE_CALL(TILE, WIDE, ATTN_HB, OUT, c0_, h0_, __VA_ARGS__);                                 \
        for (; h0_ < (H); h0_++)                                                                                 \
            for (int64_t c0_ = 0; c0_ < (END); c0_ += step_)                                                     \
                ATTN_TILE_CALL(TILE, WIDE, 1, OUT, c0_, h0_, __VA_ARGS__);                                       \
    } while (0)

/* Every head's logits of a block of k keys into lg [H][ATTN_BLOCK]: ATTN_EACH_TILE, then the keys past the last whole
 * tile one by one; the same sums in the same order everywhere. */
static inline __attribute__((always_inline)) void attn_block_logits(const float *qf, int64_t H, int64_t D,
                                                                     const float *kt, int64_t ld, int64_t k,
                                                                     float *lg, const int wide) {
    const int64_t kt_end = wide ? k / 16 * 16 : k / 8 * 8;
    ATTN_EACH_TILE(attn_logits_tile, H, kt_end, wide, lg, qf, D, kt, ld);
    for (int64_t h = 0; h < H; h++)
        for (int64_t j = kt_end; j < k; j++) {
            float s = 0.0f;
            for (int64_t d = 0; d < D; d++) s = s + qf[h * D + d] * kt[d * ld + j];
            lg[h * ATTN_BLOCK + j] = s;
        }
}

/* Every head's P.V of a block into pv [H][D] (D a multiple of 32, so of a tile's 16 or 8 outputs). */
static inline __attribute__((always_inline)) void attn_block_pv(const float *pbh, const float *const *src, int64_t k,
                                                                 int64_t H, int64_t D, float *pv, const int wide) {
    ATTN_EACH_TILE(attn_pv_tile, H, D, wide, pv, pbh, src, k, D);
}

/* The body over every query token. A store's rows are read as fp32 values: the window's given (win_values), or
 * else, and the main store's, decoded from their bytes; for several tokens a sequence (a prefill) each store's
 * W_rows / N_rows rows are decoded once per sequence into `decoded` (the tokens share most of them), for one
 * token only the rows it selects. W and N: the rows between one sequence's first row and the next's. */
static inline __attribute__((always_inline)) void sparse_attention_body(
        const void *q, int q_bf16, int64_t B, int64_t T, int64_t H, int64_t D,
        const float *win_values, const uint8_t *win_codes, const uint8_t *win_scales, int64_t W, int64_t W_rows,
        const int64_t *win_idx, int64_t Kw, const uint8_t *main_codes, const uint8_t *main_scales, int64_t N,
        int64_t N_rows, const int64_t *main_idx, int64_t Km, const float *sink, float scale, void *out,
        float *scratch, float *decoded, float *win_t, const int wide) {
    float *rows = scratch, *keys_t = rows + ATTN_BLOCK * D, *qf = keys_t + ATTN_BLOCK * D, *acc = qf + H * D;
    float *pv = acc + H * D, *lg = pv + H * D, *pbh = lg + H * ATTN_BLOCK, *run_max = pbh + H * ATTN_BLOCK;
    float *denom = run_max + H, *resc = denom + H;  /* ATTN_FIXED(H, D) floats in all */
    float p[ATTN_BLOCK];
    const float *src[ATTN_BLOCK];
    int valid[ATTN_BLOCK];
    const int64_t K = Kw + Km;
    const float *window_b = NULL, *main_b = NULL;  /* sequence b's rows as values, where they are */
    const int64_t ldw = W_rows + ATTN_BLOCK;  /* win_t's row: ATTN_BLOCK zero columns, then the W_rows rows' values */
    for (int64_t bt = 0; bt < B * T; bt++) {
        const int64_t b = bt / T;
        if (bt % T == 0) {
            window_b = win_values ? win_values + b * W * D : NULL;
            main_b = NULL;
            if (decoded) {
                float *next = decoded;
                if (!win_values) {
                    attn_decode_rows(next, win_codes + b * W * D, win_scales + b * W * (D / 32), W_rows, D, 0);
                    window_b = next;
                    next += W_rows * D;
                }
                if (Km) {
                    attn_decode_rows(next, main_codes + b * N * (D / 2), main_scales + b * N * (D / 16), N_rows, D, 1);
                    main_b = next;
                }
            }
            if (win_t && window_b)  /* the window's values transposed, once a sequence (see the block loop) */
                for (int64_t d = 0; d < D; d++) {
                    float *col = win_t + d * ldw;
                    memset(col, 0, ATTN_BLOCK * sizeof(float));
                    for (int64_t r = 0; r < W_rows; r++) col[ATTN_BLOCK + r] = window_b[r * D + d];
                }
        }
        for (int64_t i = 0; i < H * D; i++) { qf[i] = load(q, bt * H * D + i, q_bf16); acc[i] = 0.0f; }
        for (int64_t h = 0; h < H; h++) { run_max[h] = -1e30f; denom[h] = 0.0f; }
        for (int64_t start = 0; start < K; start += ATTN_BLOCK) {
            const int64_t k = K - start < ATTN_BLOCK ? K - start : ATTN_BLOCK;
            /* A prefill's window block: its valid indices run base + j (the causal window, window_indices), so its
             * keys, transposed, are columns base .. base + k - 1 of win_t, read in place (the zero columns before
             * row 0 stand in for the -1 entries, whose logits become -inf below whatever they read); otherwise
             * they are gathered into keys_t. Both hold the same values, so the same bits. */
            const int64_t base = win_t && window_b && start + k <= Kw
                                 ? window_run(win_idx + bt * Kw + start, k, W_rows) : INT64_MIN;
            const float *kt = base == INT64_MIN ? keys_t : win_t + ATTN_BLOCK + base;
            const int64_t ld = base == INT64_MIN ? ATTN_BLOCK : ldw;
            for (int64_t j = 0; j < k; j++) {
                const int64_t at = start + j, window = at < Kw;
                const int64_t idx = window ? win_idx[bt * Kw + at] : main_idx[bt * Km + at - Kw];
                float *row = rows + j * D;  /* where a row is decoded; rows held as values are read in place */
                valid[j] = idx >= 0;
                src[j] = row;
                if (!valid[j]) memset(row, 0, (size_t)D * sizeof(float));
                else if (window && window_b) src[j] = window_b + idx * D;
                else if (window) attn_decode_rows(row, win_codes + (b * W + idx) * D,
                                                  win_scales + (b * W + idx) * (D / 32), 1, D, 0);
                else if (main_b) src[j] = main_b + idx * D;
                else attn_decode_rows(row, main_codes + (b * N + idx) * (D / 2), main_scales + (b * N + idx) * (D / 16),
                                      1, D, 1);
                if (kt == keys_t)
                    for (int64_t d = 0; d < D; d++) keys_t[d * ATTN_BLOCK + j] = src[j][d];
            }
            attn_block_logits(qf, H, D, kt, ld, k, lg, wide);
            for (int64_t h = 0; h < H; h++) {
                float *logit = lg + h * ATTN_BLOCK, *pb = pbh + h * ATTN_BLOCK;
                float block_max = -__builtin_inff();
                for (int64_t j = 0; j < k; j++) {
                    logit[j] = valid[j] ? logit[j] * scale : -__builtin_inff();
                    if (logit[j] != logit[j] || logit[j] > block_max) block_max = logit[j];  /* NaN stays */
                }
                const float old = run_max[h];
                const float new_max = old != old ? old : (block_max != block_max || block_max > old ? block_max : old);
                resc[h] = exp_fixed(old - new_max);
                for (int64_t j = 0; j < k; j++) p[j] = exp_fixed(logit[j] - new_max);
                for (int64_t j = 0; j < k; j++) pb[j] = bf16_round(p[j]);
                float psum = 0.0f;
                for (int64_t j = 0; j < k; j++) psum = psum + p[j];
                denom[h] = denom[h] * resc[h] + psum;
                run_max[h] = new_max;
            }
            attn_block_pv(pbh, src, k, H, D, pv, wide);
            for (int64_t h = 0; h < H; h++) {
                float *ah = acc + h * D;
                const float *ph = pv + h * D;
                for (int64_t d = 0; d < D; d++) ah[d] = ah[d] * resc[h] + ph[d];
            }
        }
        for (int64_t h = 0; h < H; h++) {
            float gap = sink[h] - run_max[h];
            if (gap > ATTN_SINK_MAX) gap = ATTN_SINK_MAX;
            const float total = denom[h] + exp_fixed(gap);
            for (int64_t d = 0; d < D; d++) store(out, (bt * H + h) * D + d, acc[h * D + d] / total, q_bf16);
        }
    }
}

#define ATTN_ARGS(T_)                                                                                            \
    const void *q, int q_bf16, int64_t B, int64_t T_, int64_t H, int64_t D, const float *win_values,              \
    const uint8_t *win_codes, const uint8_t *win_scales, int64_t W, int64_t W_rows, const int64_t *win_idx,      \
    int64_t Kw, const uint8_t *main_codes, const uint8_t *main_scales, int64_t N, int64_t N_rows,                \
    const int64_t *main_idx, int64_t Km, const float *sink, float scale, void *out
#define ATTN_CALL q, q_bf16, B, T, H, D, win_values, win_codes, win_scales, W, W_rows, win_idx, Kw, main_codes,     \
    main_scales, N, N_rows, main_idx, Km, sink, scale, out
#define ATTN_KERNEL(NAME, TARGET, WIDE)                                                                           \
TARGET static void NAME(ATTN_ARGS(T), float *scratch, float *decoded, float *win_t) {                            \
    sparse_attention_body(ATTN_CALL, scratch, decoded, win_t, WIDE);                                             \
}
ATTN_KERNEL(dsv41_sparse_attention_base, HEAD_OPT, 0)
#if defined(__x86_64__) && defined(__GNUC__)
ATTN_KERNEL(dsv41_sparse_attention_avx2, HEAD_OPT __attribute__((target("avx2"))), 1)
ATTN_KERNEL(dsv41_sparse_attention_avx512, HEAD_OPT __attribute__((target("avx512f"))), 1)
#endif

/* version: 2 AVX-512, 1 AVX2, 0 the baseline, -1 the widest this CPU runs (dsv41_head_isa); every version the same
 * bits (tests/test_host_kernels.py runs each one the CPU has) */
int dsv41_sparse_attention_version(int version, ATTN_ARGS(T)) {
    const int64_t decoded_size = T > 1 ? (win_values ? 0 : W_rows * D) + (Km ? N_rows * D : 0) : 0;
    const int64_t win_t_size = T > 1 ? (W_rows + ATTN_BLOCK) * D : 0;  /* a prefill's window, transposed */
    const int64_t fixed = ATTN_FIXED(H, D);
    float *scratch = malloc(sizeof(float) * (size_t)(fixed + decoded_size + win_t_size));
    if (!scratch) return -1;
    float *decoded = decoded_size ? scratch + fixed : NULL;
    float *win_t = win_t_size ? scratch + fixed + decoded_size : NULL;
#if defined(__x86_64__) && defined(__GNUC__)
    static int isa = -1;
    if (isa < 0) isa = dsv41_head_isa();
    if (version < 0 || version > isa) version = isa;
    if (version == 2) dsv41_sparse_attention_avx512(ATTN_CALL, scratch, decoded, win_t);
    else if (version == 1) dsv41_sparse_attention_avx2(ATTN_CALL, scratch, decoded, win_t);
    else
#endif
    dsv41_sparse_attention_base(ATTN_CALL, scratch, decoded, win_t);
    free(scratch);
    return 0;
}

int dsv41_sparse_attention(ATTN_ARGS(T)) { return dsv41_sparse_attention_version(-1, ATTN_CALL); }


/* ---------------------------------------------------------------- one mHC step */
/* reference.mhc_step_fixed_order (model/kernels/mhc.py's host step in the decode step's row-invariant mode) up to
 * the softmax's exp: with y (not NULL) the residual update x_new = dsv41_mhc_expand(y, x, post_in, comb_in), else
 * x_new is x (nothing written); collapsed = dsv41_mhc_collapse(x_new, pre_prev); then the coefficients of x_new: its
 * fp32 values' RMS statistic (dsv41_rms_rstd), the projection by fn_t [n d, (n+2) n] in the fixed order, times the
 * statistic, the affine map per mix (z = mix * scale_mix + base), pre = sigmoid + hc_eps and post = 2 sigmoid
 * (ATen's scalar formula, as dsv41_sigmoid_scalar), and comb = z - its row's max, whose exp the caller takes
 * (torch's, MKL's or Sleef's vector code: no C function here has its bits) before dsv41_sinkhorn_normalize. x, y,
 * x_new and collapsed in one dtype (bf16 or fp32); the rest fp32. Returns 0, or -1 without the scratch memory. */
int dsv41_mhc_step(const void *x, const void *y, const float *post_in, const float *comb_in, const float *pre_prev,
                   int bf16, int64_t R, int64_t n, int64_t d, const float *fn_t, const float *scale_mix,
                   const float *base, float hc_eps, float norm_eps, void *x_new, void *collapsed, float *pre,
                   float *post, float *comb) {
    const int64_t nd = n * d, M = (n + 2) * n;
    float *flat = malloc(sizeof(float) * (size_t)(R * nd + R * M + R));
    if (!flat) return -1;
    float *mix = flat + R * nd, *rstd = mix + R * M;
    const void *xs = x;
    if (y) {
        dsv41_mhc_expand(y, x, post_in, comb_in, x_new, R, n, d, bf16, bf16);
        xs = x_new;
    }
    dsv41_mhc_collapse(xs, pre_prev, collapsed, R, n, d, bf16);
    for (int64_t i = 0; i < R * nd; i++) flat[i] = load(xs, i, bf16);
    if (dsv41_rms_rstd(flat, 0, R, nd, norm_eps, rstd)) {
        free(flat);
        return -1;
    }
    dsv41_fixed_order_matmul(flat, R, nd, nd, fn_t, M, mix, M);
    for (int64_t r = 0; r < R; r++) {
        float *z = mix + r * M;
        for (int64_t m = 0; m < M; m++) z[m] = z[m] * rstd[r] * scale_mix[m] + base[m];
        for (int64_t j = 0; j < n; j++) {
            pre[r * n + j] = 1.0f / (1.0f + expf(-z[j])) + hc_eps;
            post[r * n + j] = 1.0f / (1.0f + expf(-z[n + j])) * 2.0f;
        }
        for (int64_t i = 0; i < n; i++) {
            const float *zi = z + 2 * n + i * n;
            float top = zi[0];
            for (int64_t j = 1; j < n; j++)
                if (top == top && (zi[j] != zi[j] || zi[j] > top)) top = zi[j];  /* torch.amax: NaN wins */
            for (int64_t j = 0; j < n; j++) comb[(r * n + i) * n + j] = zi[j] - top;
        }
    }
    free(flat);
    return 0;
}


/* ---------------------------------------------------------------- a MoE layer's decode step, in two calls */
/* MoE.every_row's host path (model/moe.py: `_routed_host` for the routed experts, Expert.forward for the shared
 * one) as two calls around the one operator whose bits stay torch's, silu (ATen's vector code, Sleef's exp):
 *
 * dsv41_moe_up: the (token, slot) assignments a = t k + j of the first n tokens sorted by expert (a stable counting
 * sort: `_routed_host`'s argsort), into order [n k]; each expert's tokens through its w1 and w3 (dsv41_fp8_linear on
 * the gathered rows: each row's FP8 activation and fixed-order sums, outputs rounded to x's dtype), then the shared
 * expert's w1 and w3 on all R tokens, each output widened to fp32 and clamped as Expert._hidden and
 * reference.swiglu clamp (up to [-limit, limit], gate to at most limit; none for limit <= 0): gate and up
 * [n k + R, N] fp32, the routed rows first (by expert), then the shared rows. w1[e], w3[e]: expert e's transposed
 * fp32 weights [K, N] (NULL for an expert no token chose). Returns 0, -1 without the scratch memory, -2 for an
 * expert index outside 0..E-1 or without weights (nothing read out of bounds). */
static int moe_gather_linear(const void *x, int x_bf16, int64_t K, int64_t block, float amax_floor, float ratio,
                             const int64_t *rows, int64_t count, const float *wa, int64_t Na, const float *wb,
                             int64_t Nb, void *out_a, void *out_b) {
    const size_t size = x_bf16 ? 2 : 4;
    char *xg = malloc((size_t)(count * K) * size);
    if (!xg) return -1;
    for (int64_t i = 0; i < count; i++)
        memcpy(xg + (size_t)(i * K) * size, (const char *)x + (size_t)(rows[i] * K) * size, (size_t)K * size);
    const int rc = dsv41_fp8_linear(xg, x_bf16, count, K, block, amax_floor, ratio, wa, Na, out_a, wb, Nb, out_b,
                                    x_bf16);
    free(xg);
    return rc;
}

/* -2 where an assignment's expert is outside 0..E-1 or has no weights in w, else 0 */
static int moe_check(const int64_t *indices, int64_t assignments, int64_t E, const float *const *w) {
    for (int64_t a = 0; a < assignments; a++)
        if (indices[a] < 0 || indices[a] >= E || !w[indices[a]]) return -2;
    return 0;
}

/* counts[e] of the assignments' experts and order: the assignments by expert, each expert's in their order
 * (indices checked by moe_check); -1 without scratch memory */
static int moe_sort(const int64_t *indices, int64_t assignments, int64_t E, int64_t *counts, int64_t *order) {
    int64_t *next = malloc(sizeof(int64_t) * (size_t)(E > 0 ? E : 1));
    if (!next) return -1;
    for (int64_t e = 0; e < E; e++) counts[e] = 0;
    for (int64_t a = 0; a < assignments; a++) counts[indices[a]]++;
    int64_t start = 0;
    for (int64_t e = 0; e < E; e++) { next[e] = start; start += counts[e]; }
    for (int64_t a = 0; a < assignments; a++) order[next[indices[a]]++] = a;
    free(next);
    return 0;
}

int dsv41_moe_up(const void *x, int x_bf16, int64_t R, int64_t n, int64_t k, int64_t K, int64_t block,
                 float amax_floor, float ratio, const int64_t *indices, int64_t E, const float *const *w1,
                 const float *const *w3, const float *shared_w1, const float *shared_w3, int64_t N, float limit,
                 float *gate, float *up, int64_t *order) {
    const int64_t nk = n * k, M = nk + R;
    const size_t size = x_bf16 ? 2 : 4;
    int64_t *counts = malloc(sizeof(int64_t) * (size_t)(E + M));
    char *g_raw = malloc((size_t)(M * N) * size), *u_raw = malloc((size_t)(M * N) * size);
    if (!counts || !g_raw || !u_raw) {
        free(counts); free(g_raw); free(u_raw);
        return -1;
    }
    int64_t *rows = counts + E;
    int rc = moe_check(indices, nk, E, w1);
    if (!rc) rc = moe_check(indices, nk, E, w3);
    if (!rc) rc = moe_sort(indices, nk, E, counts, order);
    for (int64_t i = 0; i < nk; i++) rows[i] = order[i] / k;
    for (int64_t t = 0; t < R; t++) rows[nk + t] = t;
    int64_t row = 0;
    for (int64_t e = 0; e < E && !rc; e++) {
        if (!counts[e]) continue;
        rc = moe_gather_linear(x, x_bf16, K, block, amax_floor, ratio, rows + row, counts[e], w1[e], N, w3[e], N,
                               g_raw + (size_t)(row * N) * size, u_raw + (size_t)(row * N) * size);
        row += counts[e];
    }
    if (!rc && R)
        rc = moe_gather_linear(x, x_bf16, K, block, amax_floor, ratio, rows + nk, R, shared_w1, N, shared_w3, N,
                               g_raw + (size_t)(nk * N) * size, u_raw + (size_t)(nk * N) * size);
    if (!rc)
        for (int64_t i = 0; i < M * N; i++) {
            float g = load(g_raw, i, x_bf16), u = load(u_raw, i, x_bf16);
            if (limit > 0) {
                u = u < -limit ? -limit : (u > limit ? limit : u);
                g = g > limit ? limit : g;
            }
            gate[i] = g;
            up[i] = u;
        }
    free(counts); free(g_raw); free(u_raw);
    return rc == -2 ? -2 : (rc ? -1 : 0);
}

/* dsv41_moe_down: h = silu(gate) * up in fp32 (silu_gate: torch's silu of dsv41_moe_up's gate), times the routing
 * weight on the routed rows (weights [n k] at the sorted assignment: Expert._hidden), rounded to x's dtype; each
 * expert's rows through its w2 and the shared rows through shared_w2 (dsv41_fp8_linear, outputs in x's dtype and
 * widened); then per token 0 + its routed outputs in ascending expert order (`_routed_host`'s sum; tokens n.. have
 * none), + its shared output, rounded to x's dtype: out [R, D]. Returns 0, -1 without the scratch memory, -2 as
 * dsv41_moe_up's. */
int dsv41_moe_down(const float *silu_gate, const float *up, int64_t R, int64_t n, int64_t k, int64_t N,
                   int64_t block, float amax_floor, float ratio, const int64_t *indices, const int64_t *order,
                   const float *weights, int64_t E, const float *const *w2, const float *shared_w2, int64_t D,
                   int x_bf16, void *out) {
    const int64_t nk = n * k, M = nk + R;
    const size_t size = x_bf16 ? 2 : 4;
    int64_t *counts = malloc(sizeof(int64_t) * (size_t)(E > 0 ? E : 1));
    char *h = malloc((size_t)(M * N) * size), *o_raw = malloc((size_t)(M * D) * size);
    float *y = malloc(sizeof(float) * (size_t)(R * D));
    if (!counts || !h || !o_raw || !y) {
        free(counts); free(h); free(o_raw); free(y);
        return -1;
    }
    for (int64_t e = 0; e < E; e++) counts[e] = 0;
    for (int64_t a = 0; a < nk; a++) {
        if (indices[a] < 0 || indices[a] >= E || !w2[indices[a]] || order[a] < 0 || order[a] >= nk) {
            free(counts); free(h); free(o_raw); free(y);
            return -2;
        }
        counts[indices[a]]++;
    }
    for (int64_t i = 0; i < M; i++) {
        const float w = i < nk ? weights[order[i]] : 0.0f;
        for (int64_t c = 0; c < N; c++) {
            float v = silu_gate[i * N + c] * up[i * N + c];
            if (i < nk) v = w * v;
            store(h, i * N + c, v, x_bf16);
        }
    }
    int rc = 0;
    int64_t row = 0;
    for (int64_t e = 0; e < E && !rc; e++) {
        if (!counts[e]) continue;
        rc = dsv41_fp8_linear(h + (size_t)(row * N) * size, x_bf16, counts[e], N, block, amax_floor, ratio, w2[e], D,
                              o_raw + (size_t)(row * D) * size, NULL, 0, NULL, x_bf16);
        row += counts[e];
    }
    if (!rc && R)
        rc = dsv41_fp8_linear(h + (size_t)(nk * N) * size, x_bf16, R, N, block, amax_floor, ratio, shared_w2, D,
                              o_raw + (size_t)(nk * D) * size, NULL, 0, NULL, x_bf16);
    if (!rc) {
        for (int64_t i = 0; i < R * D; i++) y[i] = 0.0f;
        for (int64_t i = 0; i < nk; i++) {  /* by expert: each token's outputs arrive in ascending expert order */
            float *yt = y + (order[i] / k) * D;
            for (int64_t c = 0; c < D; c++) yt[c] = yt[c] + load(o_raw, i * D + c, x_bf16);
        }
        for (int64_t t = 0; t < R; t++)
            for (int64_t c = 0; c < D; c++)
                store(out, t * D + c, y[t * D + c] + load(o_raw, (nk + t) * D + c, x_bf16), x_bf16);
    }
    free(counts); free(h); free(o_raw); free(y);
    return rc ? -1 : 0;
}


/* ---------------------------------------------------------------- the batch cache's per-row writes */
/* dst[r, slots[r]] = src[r] for r < R: dst [S, W, row_bytes] (S >= R sequences of W rows), src [R, row_bytes]
 * contiguous; BatchCache's writes of a decode step (a window row into its ring slot, a group projection into its
 * slot, a compressed entry at its index), where torch took an advanced-indexing put and a select a tensor.
 * Returns 0, or -1 (nothing written) where a slot is outside 0..W-1. */
int dsv41_put_rows(void *dst, int64_t W, int64_t row_bytes, const int64_t *slots, const void *src, int64_t R) {
    for (int64_t r = 0; r < R; r++)
        if (slots[r] < 0 || slots[r] >= W) return -1;
    for (int64_t r = 0; r < R; r++)
        memcpy((char *)dst + (size_t)((r * W + slots[r]) * row_bytes), (const char *)src + (size_t)(r * row_bytes),
               (size_t)row_bytes);
    return 0;
}
