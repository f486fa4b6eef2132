/* Block attention on CPU, float32: forward (out, lse) and backward (dq, dk, dv).
 *
 * What aten's CPU flash kernel does, with two differences that matter to a dilated site, whose
 * every block is a causal square of a few thousand rows (Note [The CPU block kernel] in
 * cpu_kernel.py):
 *   - a causal query tile stops at its last row's diagonal: its last key tile is cut there,
 *     where aten's runs to the end of a 512-key tile (a quarter more pairs than the useful ones
 *     on a 2048-row block);
 *   - query tiles are short (TQ rows, the caller's choice: a 32nd of the block), so what a
 *     tile computes past the diagonal is small.
 * Scores, softmax statistics and the gradients' pieces are the textbook ones (FlashAttention-2,
 * Dao 2023, Algorithms 1 and 2): per query tile, over key tiles, S = scale q k^T, a running
 * max and sum (forward), P = exp(S - lse), dV += P^T dO, dP = dO V^T, dS = P (dP - rowsum(dO O)),
 * dQ += scale dS K, dK += scale dS^T Q (backward). The products are one sgemm each (MKL's, whose
 * address the caller passes: torch's own BLAS). Threads are OpenMP's (torch's runtime: the same
 * libgomp; `threads` of them), one task a (batch, head, query tile) forward and a (batch, kv
 * head) backward, which owns its dK and dV, so nothing is shared.
 *
 * Tensors: q (B, Hq, L, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv), dout and out (B, Hq, L, Dv),
 * lse (B, Hq, L), each with unit stride in its last dim and any other strides (elements; a
 * row stride must fit an int); GQA by head groups (query head h reads kv head h / (Hq / Hkv)).
 * out, dq, dk, dv are written contiguous. Causal is top-left: row i sees keys 0..i.
 * A backward row whose lse is +inf (nothing to attend) contributes nothing.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef void (*sgemm_fn)(const char *, const char *, const int *, const int *, const int *,
                         const float *, const float *, const int *, const float *, const int *,
                         const float *, float *, const int *);

static sgemm_fn sgemm_ptr;

void rr_set_sgemm(void *fn) { sgemm_ptr = (sgemm_fn)fn; }

enum { TK = 256 }; /* keys a tile: 256 and 512 tie; query tile rows TQ are the caller's */

/* Column-major sgemm on row-major buffers: C (m x n) = alpha op(A) op(B) + beta C, where
 * "row-major X with leading dim ld" is "column-major X^T". */
static inline void gemm(char ta, char tb, int m, int n, int k, float alpha, const float *a,
                        int lda, const float *b, int ldb, float beta, float *c, int ldc) {
    sgemm_ptr(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
}

/* exp(x) for x <= 0, to about 2 ulp: 2^n e^f with |f| <= ln2/2, e^f by its Taylor series to
 * f^7 (error < 2e-8 relative). Inputs below -87 give about 1e-38 (callers zero masked entries
 * themselves). Written branch-free so that the loops calling it vectorize. */
static inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    float t = x * 1.44269504088896341f;
    float n = __builtin_floorf(t + 0.5f);
    float f = x - n * 0.693145751953125f;
    f = f - n * 1.428606765330187e-06f;
    float p = 1.0f / 5040.0f;
    p = p * f + 1.0f / 720.0f;
    p = p * f + 1.0f / 120.0f;
    p = p * f + 1.0f / 24.0f;
    p = p * f + 1.0f / 6.0f;
    p = p * f + 0.5f;
    p = p * f + 1.0f;
    p = p * f + 1.0f;
    union { float f; int32_t i; } s;
    s.i = ((int32_t)n + 127) << 23;
    return p * s.f;
}

/* The number of keys of tile [n, n + kb) that query row `row` sees (0 to kb). */
static inline int64_t seen(int causal, int64_t row, int64_t n, int64_t kb) {
    if (!causal) return kb;
    int64_t lim = row - n + 1;
    return lim < 0 ? 0 : (lim > kb ? kb : lim);
}

void rr_flash_forward(const float *q, const int64_t *qs, const float *k, const int64_t *ks,
                      const float *v, const int64_t *vs, float *out, float *lse, int64_t B,
                      int64_t Hq, int64_t Hkv, int64_t L, int64_t S, int64_t D, int64_t Dv,
                      int64_t TQ, float scale, int causal, int threads) {
    const int64_t tiles = (L + TQ - 1) / TQ, group = Hq / Hkv;
#pragma omp parallel num_threads(threads)
    {
        float *sc = malloc(sizeof(float) * (TQ * TK + TQ * Dv + 2 * TQ));
        float *acc = sc + TQ * TK, *mx = acc + TQ * Dv, *sum = mx + TQ;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < B * Hq * tiles; task++) {
            const int64_t b = task / (Hq * tiles), h = task / tiles % Hq, m = task % tiles * TQ;
            const int64_t tq = L - m < TQ ? L - m : TQ, hk = h / group;
            const float *qt = q + b * qs[0] + h * qs[1] + m * qs[2];
            const float *kh = k + b * ks[0] + hk * ks[1], *vh = v + b * vs[0] + hk * vs[1];
            const int64_t bound = causal ? (m + tq < S ? m + tq : S) : S;
            for (int64_t r = 0; r < tq; r++) mx[r] = -INFINITY, sum[r] = 0.0f;
            for (int64_t n = 0; n < bound; n += TK) {
                const int64_t kb = bound - n < TK ? bound - n : TK;
                gemm('T', 'N', kb, tq, D, scale, kh + n * ks[2], ks[2], qt, qs[2], 0.0f, sc, TK);
                for (int64_t r = 0; r < tq; r++) {
                    float *row = sc + r * TK;
                    const int64_t lim = seen(causal, m + r, n, kb);
                    float hi = mx[r];
#pragma omp simd reduction(max : hi)
                    for (int64_t c = 0; c < lim; c++) hi = row[c] > hi ? row[c] : hi;
                    float s = 0.0f;
#pragma omp simd reduction(+ : s)
                    for (int64_t c = 0; c < lim; c++) {
                        row[c] = exp_neg(row[c] - hi);
                        s += row[c];
                    }
                    for (int64_t c = lim; c < kb; c++) row[c] = 0.0f;
                    if (lim == 0) continue;
                    const float shrink = mx[r] == -INFINITY ? 0.0f : exp_neg(mx[r] - hi);
                    sum[r] = sum[r] * shrink + s;
                    mx[r] = hi;
                    if (n > 0)
                        for (int64_t c = 0; c < Dv; c++) acc[r * Dv + c] *= shrink;
                }
                gemm('N', 'N', Dv, tq, kb, 1.0f, vh + n * vs[2], vs[2], sc, TK, n ? 1.0f : 0.0f,
                     acc, Dv);
            }
            float *o = out + ((b * Hq + h) * L + m) * Dv, *l = lse + (b * Hq + h) * L + m;
            for (int64_t r = 0; r < tq; r++) {
                const float inv = sum[r] > 0.0f ? 1.0f / sum[r] : 0.0f;
                for (int64_t c = 0; c < Dv; c++) o[r * Dv + c] = acc[r * Dv + c] * inv;
                l[r] = sum[r] > 0.0f ? mx[r] + logf(sum[r]) : -INFINITY;
            }
        }
        free(sc);
    }
}

void rr_flash_backward(const float *dout, const int64_t *dos, const float *q, const int64_t *qs,
                       const float *k, const int64_t *ks, const float *v, const int64_t *vs,
                       const float *out, const int64_t *os, const float *lse, const int64_t *ls,
                       float *dq, float *dk, float *dv, int64_t B, int64_t Hq, int64_t Hkv,
                       int64_t L, int64_t S, int64_t D, int64_t Dv, int64_t TQ, float scale, int causal,
                       int threads) {
    const int64_t group = Hq / Hkv;
#pragma omp parallel num_threads(threads)
    {
        float *p = malloc(sizeof(float) * (2 * TQ * TK + 2 * TQ));
        float *dp = p + TQ * TK, *dsum = dp + TQ * TK, *lrow = dsum + TQ;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < B * Hkv; task++) {
            const int64_t b = task / Hkv, hk = task % Hkv;
            const float *kh = k + b * ks[0] + hk * ks[1], *vh = v + b * vs[0] + hk * vs[1];
            float *dkh = dk + task * S * D, *dvh = dv + task * S * Dv;
            memset(dkh, 0, sizeof(float) * S * D);
            memset(dvh, 0, sizeof(float) * S * Dv);
            for (int64_t h = hk * group; h < (hk + 1) * group; h++) {
                for (int64_t m = 0; m < L; m += TQ) {
                    const int64_t tq = L - m < TQ ? L - m : TQ;
                    const float *qt = q + b * qs[0] + h * qs[1] + m * qs[2];
                    const float *dot = dout + b * dos[0] + h * dos[1] + m * dos[2];
                    const float *ot = out + b * os[0] + h * os[1] + m * os[2];
                    const float *lt = lse + b * ls[0] + h * ls[1] + m * ls[2];
                    float *dqt = dq + ((b * Hq + h) * L + m) * D;
                    for (int64_t r = 0; r < tq; r++) {
                        float s = 0.0f;
                        for (int64_t c = 0; c < Dv; c++) s += dot[r * dos[2] + c] * ot[r * os[2] + c];
                        dsum[r] = s;
                        lrow[r] = lt[r * ls[2]];
                    }
                    const int64_t bound = causal ? (m + tq < S ? m + tq : S) : S;
                    for (int64_t n = 0; n < bound; n += TK) {
                        const int64_t kb = bound - n < TK ? bound - n : TK;
                        gemm('T', 'N', kb, tq, D, scale, kh + n * ks[2], ks[2], qt, qs[2], 0.0f, p, TK);
                        gemm('T', 'N', kb, tq, Dv, 1.0f, vh + n * vs[2], vs[2], dot, dos[2], 0.0f, dp, TK);
                        for (int64_t r = 0; r < tq; r++) {
                            float *pr = p + r * TK, *dr = dp + r * TK;
                            const int64_t lim = lrow[r] == INFINITY ? 0 : seen(causal, m + r, n, kb);
                            const float l = lrow[r], ds = dsum[r];
#pragma omp simd
                            for (int64_t c = 0; c < lim; c++) {
                                const float e = exp_neg(pr[c] - l);
                                pr[c] = e;
                                dr[c] = e * (dr[c] - ds);
                            }
                            for (int64_t c = lim; c < kb; c++) pr[c] = 0.0f, dr[c] = 0.0f;
                        }
                        gemm('N', 'T', Dv, kb, tq, 1.0f, dot, dos[2], p, TK, 1.0f, dvh + n * Dv, Dv);
                        gemm('N', 'N', D, tq, kb, scale, kh + n * ks[2], ks[2], dp, TK, n ? 1.0f : 0.0f,
                             dqt, D);
                        gemm('N', 'T', D, kb, tq, scale, qt, qs[2], dp, TK, 1.0f, dkh + n * D, D);
                    }
                }
            }
        }
        free(p);
    }
}
