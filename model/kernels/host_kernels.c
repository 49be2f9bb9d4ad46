/* Host (CPU) kernels for the decode step's small, operator-bound pieces (model/kernels/host.py builds and
 * loads this file; model/kernels/reference.py and model/formats.py hold the PyTorch code each function
 * reproduces, and tests/test_host_kernels.py compares the two bit for bit).
 *
 * Why C: on the CPU a decode step of a small model is bound by the cost of launching torch operators (a
 * few microseconds each), not by arithmetic; the Sinkhorn loop alone is about 120 operators on a 4 x 4
 * matrix per token. Here each function is one call.
 *
 * Numerics: every function performs the same IEEE fp32 operations in the same order as its PyTorch
 * reference (ATen sums a 4-element row or column left to right on every CPU flavour; checked in the
 * tests), compiled with -ffp-contract=off (no fused multiply-add) and without -ffast-math, for the
 * baseline x86-64 ISA (no -march), so the results do not depend on the CPU the code runs on.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* Sinkhorn normalization of `count` n x n matrices (row-major, contiguous), in place:
 * comb /= rowsum; comb += eps; comb /= (colsum + eps); then iters-1 times: rows (sum + eps), columns
 * (sum + eps). reference._sinkhorn_normalize_ is the same loop in torch. */
void dsv41_sinkhorn_normalize(float *comb, int64_t count, int64_t n, int64_t iters, float eps) {
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

/* formats.fp8_fake_quant_f32 on a contiguous fp32 [rows, cols] (cols a multiple of block): per block of
 * `block` values, scale = 2^ceil(log2(max(amax, floor) * ratio)) read off the bits (formats._ceil_pow2_bits,
 * NaN amax giving -0.0), q = e4m3(clamp(x / scale, -448, 448)), out = q * scale. */
void dsv41_fp8_fake_quant(const float *x, float *out, int64_t numel, int64_t block, float amax_floor,
                          float ratio) {
    for (int64_t g = 0; g < numel; g += block) {
        const float *xb = x + g;
        float amax = 0.0f;
        int nan = 0;
        for (int64_t i = 0; i < block; i++) {
            float a = fabsf(xb[i]);
            if (a != a) nan = 1;
            else if (a > amax) amax = a;
        }
        float m;
        if (nan) m = u2f(0x7FC00000u);
        else m = amax < amax_floor ? amax_floor : amax;
        m = m * ratio;
        uint32_t bits = (f2u(m) + 0x7FFFFFu) & 0xFF800000u;
        float scale = u2f(bits);
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
    uint32_t u = f2u(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float load(const void *p, int64_t i, int bf16) {
    return bf16 ? u2f((uint32_t)((const uint16_t *)p)[i] << 16) : ((const float *)p)[i];
}

static inline void store(void *p, int64_t i, float v, int bf16) {
    if (bf16) ((uint16_t *)p)[i] = to_bf16(v);
    else ((float *)p)[i] = v;
}

/* reference._collapse: out[t, :] = sum_j pre[t, j] x[t, j, :], the products first, then the sum in the
 * order j = 0, 1, ..., n-1; x [tokens, n, d] and out [tokens, d] in x's dtype (bf16 or fp32), pre fp32. */
void dsv41_mhc_collapse(const void *x, const float *pre, void *out, int64_t tokens, int64_t n, int64_t d,
                        int x_bf16) {
    for (int64_t t = 0; t < tokens; t++) {
        const float *p = pre + t * n;
        for (int64_t c = 0; c < d; c++) {
            const int64_t base = t * n * d + c;
            float s = p[0] * load(x, base, x_bf16);
            for (int64_t j = 1; j < n; j++) s = s + p[j] * load(x, base + j * d, x_bf16);
            store(out, t * d + c, s, x_bf16);
        }
    }
}

/* reference.expand (its few-token form; the same sums as the other): out[t, k, :] = post[t, k] y[t, :] +
 * sum_j comb[t, j, k] r[t, j, :] (the sum over j in order, then added to the post term), in y's dtype;
 * r [tokens, n, d] in its own dtype, post [tokens, n] and comb [tokens, n, n] fp32. */
void dsv41_mhc_expand(const void *y, const void *r, const float *post, const float *comb, void *out,
                      int64_t tokens, int64_t n, int64_t d, int y_bf16, int r_bf16) {
    for (int64_t t = 0; t < tokens; t++) {
        const float *cm = comb + t * n * n;
        for (int64_t k = 0; k < n; k++) {
            const float pk = post[t * n + k];
            for (int64_t c = 0; c < d; c++) {
                float m = cm[k] * load(r, t * n * d + c, r_bf16);
                for (int64_t j = 1; j < n; j++) m = m + cm[j * n + k] * load(r, t * n * d + j * d + c, r_bf16);
                store(out, (t * n + k) * d + c, pk * load(y, t * d + c, y_bf16) + m, y_bf16);
            }
        }
    }
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
typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
/* the same vectors at any float's address (unaligned loads and stores, no aliasing assumption) */
typedef float f32x16u __attribute__((vector_size(64), aligned(4), may_alias));
typedef float f32x8u __attribute__((vector_size(32), aligned(4), may_alias));
typedef float f32x4u __attribute__((vector_size(16), aligned(4), may_alias));

#define HEAD_KERNEL(NAME, TARGET, VT, VU, VW, RB, CB)                                                            \
TARGET void NAME##_strided(const float *x, int64_t R, int64_t K, int64_t ldx, const float *wt, int64_t V,        \
                           float *out, int64_t ldo) {                                                            \
    const int64_t vb = (VW) * (CB), full = V / vb * vb;                                                          \
    for (int64_t v0 = 0; v0 < full; v0 += vb) {                                                                  \
        int64_t r = 0;                                                                                           \
        for (; r + (RB) <= R; r += (RB)) { /* RB rows: each weight vector loaded once for RB rows */             \
            VT a[RB][CB], w[CB];                                                                                 \
            for (int c = 0; c < (CB); c++) w[c] = *(const VU *)(wt + v0 + (VW) * c);                             \
            for (int i = 0; i < (RB); i++)                                                                       \
                for (int c = 0; c < (CB); c++) a[i][c] = x[(r + i) * ldx] * w[c];                                \
            for (int64_t k = 1; k < K; k++) {                                                                    \
                for (int c = 0; c < (CB); c++) w[c] = *(const VU *)(wt + k * V + v0 + (VW) * c);                 \
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
                for (int c = 0; c < (CB); c++) a[c] = a[c] + xk * *(const VU *)(wt + k * V + v0 + (VW) * c);     \
            }                                                                                                    \
            for (int c = 0; c < (CB); c++) *(VU *)(out + r * ldo + v0 + (VW) * c) = a[c];                        \
        }                                                                                                        \
    }                                                                                                            \
    for (int64_t r = 0; r < R; r++) { /* the last, partial block of columns */                                   \
        float *o = out + r * ldo;                                                                                \
        for (int64_t j = full; j < V; j++) o[j] = x[r * ldx] * wt[j];                                            \
        for (int64_t k = 1; k < K; k++)                                                                          \
            for (int64_t j = full; j < V; j++) o[j] = o[j] + x[r * ldx + k] * wt[k * V + j];                     \
    }                                                                                                            \
}                                                                                                                \
TARGET void NAME(const float *x, int64_t R, int64_t K, const float *wt, int64_t V, float *out) {                 \
    NAME##_strided(x, R, K, K, wt, V, out, V);                                                                   \
}

#define HEAD_OPT __attribute__((optimize("O3")))
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

/* out[r, n] = sum_k x[r, k] wt[k, n] in the head's fixed order, for any GEMM of the decode step (the model's
 * linear layers, the MoE gate, the mHC projection, the grouped wo_a): rows x[r * ldx ..] (K contiguous floats
 * each), outputs out[r * ldo ..] (N contiguous floats each), so a group's columns of a wider tensor are read
 * and written in place. */
void dsv41_fixed_order_matmul(const float *x, int64_t R, int64_t K, int64_t ldx, const float *wt, int64_t N,
                              float *out, int64_t ldo) {
    static int isa = -1;
    if (isa < 0) isa = dsv41_head_isa();
#if defined(__x86_64__) && defined(__GNUC__)
    if (isa == 2) { dsv41_head_logits_avx512_strided(x, R, K, ldx, wt, N, out, ldo); return; }
    if (isa == 1) { dsv41_head_logits_avx2_strided(x, R, K, ldx, wt, N, out, ldo); return; }
#endif
    dsv41_head_logits_base_strided(x, R, K, ldx, wt, N, out, ldo);
}


/* A quantized linear layer's whole host path in one call (Linear.forward on the CPU: layers.py): x [R, K]
 * (bf16 or fp32, contiguous) widened to fp32, quantized to the FP8 activation grid per block of `block`
 * (dsv41_fp8_fake_quant), times wt [K, N] in the fixed order (dsv41_fixed_order_matmul), into out [R, N]
 * (bf16, rounded to nearest even, or fp32): the same bits as those steps taken apart, without the
 * intermediate tensors (two dtype conversions and three allocations a layer). With wt_b (not NULL) the same
 * quantized x also goes through wt_b [K, Nb] into out_b (a SwiGLU's w1 and w3: layers.linear_pair).
 * Returns 0, or -1 when the scratch memory cannot be had (nothing is written then). */
int dsv41_fp8_linear(const void *x, int x_bf16, int64_t R, int64_t K, int64_t block, float amax_floor,
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
    for (int64_t i = 0; i < R * K; i++) xq[i] = load(x, i, x_bf16);
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
