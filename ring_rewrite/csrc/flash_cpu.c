/* Block attention on CPU, float32: forward (out, lse) and backward (dq, dk, dv).
 *
 * FlashAttention-2 (Dao 2023, Algorithms 1 and 2) with products of its own: S = scale q k^T, a
 * running max and sum per query row (forward), P = exp(S - lse), dV += P^T dO, dP = dO V^T,
 * dS = P (dP - rowsum(dO O)), dQ += scale dS K, dK += scale dS^T Q (backward). Every product is
 * one register tile at a time (`tile`: MR rows by QV vectors, a row's factor broadcast, the other
 * operand's row loaded), laid out so that each operand is read where it already lies or from a
 * copy made once for many products: no BLAS call packs a P tile or a key tile again for each
 * query tile (Note [The CPU block kernel] in cpu_kernel.py says what that cost).
 *   - Forward, a task per (batch, head, query tile of TQ rows): the tile's q transposed and scaled
 *     once; per key tile S^T (keys x queries) from k's rows, so that each query's max, sum and
 *     rescaling run across vector lanes; out^T += V^T P^T from v's rows. A causal tile stops at
 *     its last row's diagonal.
 *   - Backward, a task per (batch, kv head), which owns its dK and dV, key tile by key tile (K and
 *     V transposed, K in rows, once a key tile), every query tile that sees it (q scaled and dO in
 *     rows, once a pair): S and dP (queries x keys), P and dS in place, then dV, dK into the key
 *     tile's own sums and dQ into dq. Tasks that would leave threads idle (fewer left than threads:
 *     one head of one segment, as the local branches' head chunks often run) are shared by every
 *     thread, each taking a slice of the query tiles that see a key tile and summing the key
 *     tile's dK, dV with the others after it.
 * Sums over many terms are taken a register tile at a time and then added to what the rows hold:
 * a key seen by L queries adds L / TQ partial sums to its dK row, not L terms one by one (whose
 * rounding error grows with L; BLAS's blocked sums are as exact as these).
 * Threads are OpenMP's (torch's runtime: the same libgomp; `threads` of them). Vector width and
 * tile shape follow the target (-march=native): 16 lanes and 6 x 4 vectors with AVX-512, 8 lanes
 * and 6 x 2 with AVX, 4 lanes otherwise (6 x 4 with NEON's 32 registers, 6 x 2 with SSE's 16);
 * -DRR_QV and -DRR_TK select other tiles (below).
 *
 * Tensors: q (B, Hq, L, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv), dout and out (B, Hq, L, Dv),
 * lse (B, Hq, L), each with unit stride in its last dim; GQA by head groups (query head h reads
 * kv head h / (Hq / Hkv)). Each tensor comes with a layout `st` (elements): batch b, head h,
 * row i at b / nseg * st[0] + b % nseg * st[1] + st[3 + h] + i * st[2]. A plain tensor has
 * nseg = 1 and st[3 + h] = h times its head stride; a dilated branch's rows read in place have
 * the segments as batches and each head's lattice offset in st[3 + h]. The forward writes out
 * and lse, or with `merge` merges its rows into what they hold (a row of lse -inf holds
 * nothing): the out and lse of attention over both key sets, as merge.py's merge_partials. The
 * backward writes dq, dk, dv, or with `accumulate` adds to them (no two kv heads' rows may then
 * be the same). Causal is top-left: row i sees keys 0..i. A backward row whose lse is infinite
 * (nothing to attend) contributes nothing.
 * A NaN or inf reaches what the rows that see it reach, as in the float64 reference, and nothing
 * else (Note [Non-finite values] in cpu_kernel.py): a row with a NaN or +inf score is NaN, lse
 * too (a merge keeps it NaN); backward, such a row's P is NaN on every key it sees. A product
 * never multiplies a NaN or inf by the 0 of a pair that is not seen: forward P V skips the
 * value rows past the diagonal that hold one, backward dS K the key rows, and dS^T Q takes the
 * q of a NaN row as 0 (its dS is NaN wherever it sees a key). Each is checked per tile. A key
 * that an inf makes score -inf in a row it is seen by has P = 0 there exactly, so that dS K takes
 * 0 * inf, NaN, as the function does.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Lanes a vector (VL) and vectors a register tile's row (QV): as many accumulators (MR QV) as
 * the target's vector registers leave room for. */
#if defined(__AVX512F__)
#define VL 16
#define TARGET_QV 4
#elif defined(__AVX__)
#define VL 8
#define TARGET_QV 2
#elif defined(__ARM_NEON)
#define VL 4
#define TARGET_QV 4
#else
#define VL 4
#define TARGET_QV 2
#endif
/* Rows a register tile (MR); query rows a query tile (TQ, the forward's S^T: its lanes); keys a
 * key tile (TK). A build may select other vectors a tile row (-DRR_QV=1, 2 or 4) and keys a key
 * tile (-DRR_TK, a multiple of VL): cpu_kernel.py's VARIANTS, timed against each other and
 * aten's kernel where a block first runs (Note [Choosing the CPU block kernel] in cpu_choice.py). */
#ifdef RR_QV
#define QV RR_QV
#else
#define QV TARGET_QV
#endif
#ifdef RR_TK
#define TK RR_TK
#else
#define TK 256
#endif
#if QV != 1 && QV != 2 && QV != 4
#error "RR_QV must be 1, 2 or 4 (product() has column blocks of 4, 3, 2 and 1 vectors)"
#endif
#if TK < VL || TK % VL
#error "RR_TK must be a multiple of the vector's lanes"
#endif
enum { MR = 6, TQ = VL * QV };
typedef float vf __attribute__((vector_size(VL * sizeof(float))));

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

/* One register tile: C[i, 0 : nv VL] (ldc apart; `add`: added to) = sum over k < kk of
 * A(i, k) B[k, 0 : nv VL] for rows i < rows, where A(i, k) = a[i * ai + k * ak] (any strides:
 * broadcast) and B's rows are ldb apart (loaded; aligned to VL floats). */
static inline __attribute__((always_inline)) void tile(const int rows, const int nv, int64_t kk,
                                                        const float *a, int64_t ai, int64_t ak,
                                                        const float *b, int64_t ldb, float *c,
                                                        int64_t ldc, int add) {
    vf acc[MR][QV];
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < nv; j++) acc[i][j] = (vf){};
    for (int64_t k = 0; k < kk; k++) {
        vf row[QV];
        for (int j = 0; j < nv; j++) row[j] = *(const vf *)(b + k * ldb + j * VL);
        for (int i = 0; i < rows; i++) {
            const vf s = (vf){} + a[i * ai + k * ak];
            for (int j = 0; j < nv; j++) acc[i][j] += s * row[j];
        }
    }
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < nv; j++) {
            vf *to = (vf *)(c + i * ldc + j * VL);
            *to = add ? *to + acc[i][j] : acc[i][j];
        }
}

/* The rows of one column block of nv vectors: whole register tiles, then the rows left. */
#define TILES(nv)                                                                                  \
    do {                                                                                           \
        int64_t i = 0;                                                                             \
        for (; i + MR <= m; i += MR) tile(MR, nv, kk, a + i * ai, ai, ak, b, ldb, c + i * ldc, ldc, add); \
        switch (m - i) {                                                                           \
        case 5: tile(5, nv, kk, a + i * ai, ai, ak, b, ldb, c + i * ldc, ldc, add); break;         \
        case 4: tile(4, nv, kk, a + i * ai, ai, ak, b, ldb, c + i * ldc, ldc, add); break;         \
        case 3: tile(3, nv, kk, a + i * ai, ai, ak, b, ldb, c + i * ldc, ldc, add); break;         \
        case 2: tile(2, nv, kk, a + i * ai, ai, ak, b, ldb, c + i * ldc, ldc, add); break;         \
        case 1: tile(1, nv, kk, a + i * ai, ai, ak, b, ldb, c + i * ldc, ldc, add); break;         \
        }                                                                                          \
    } while (0)

/* C (m x n, ldc; `add`: added to) = A B: A (m x kk) at a[i * ai + k * ak], B (kk x n) in rows
 * ldb apart; n, ldb, ldc and B's and C's addresses multiples of VL floats. */
static void product(int64_t m, int64_t n, int64_t kk, const float *a, int64_t ai, int64_t ak,
                    const float *b, int64_t ldb, float *c, int64_t ldc, int add) {
    for (int64_t j = 0; j < n; j += QV * VL, b += QV * VL, c += QV * VL) {
        const int64_t nv = (n - j) / VL < QV ? (n - j) / VL : QV;
        if (nv == QV) TILES(QV);
#if QV == 4
        else if (nv == 3) TILES(3);
        else if (nv == 2) TILES(2);
#endif
        else TILES(1);
    }
}
#undef TILES

/* Element offset of batch b, head h, row i of a tensor of layout st (as in the header). */
static inline int64_t at(const int64_t *st, int64_t nseg, int64_t b, int64_t h, int64_t i) {
    return b / nseg * st[0] + b % nseg * st[1] + st[3 + h] + i * st[2];
}

/* The number of keys of tile [n, n + kb) that query row `row` sees (0 to kb). */
static inline int64_t seen(int causal, int64_t row, int64_t n, int64_t kb) {
    if (!causal) return kb;
    int64_t lim = row - n + 1;
    return lim < 0 ? 0 : (lim > kb ? kb : lim);
}

static inline int64_t pad(int64_t n) { return (n + VL - 1) / VL * VL; }

/* Whether the first `cols` values of `rows` rows (`ld` apart) are all finite. */
static int all_finite(const float *x, int64_t ld, int64_t rows, int64_t cols) {
    int ok = 1;
    for (int64_t i = 0; i < rows; i++)
#pragma omp simd reduction(&& : ok)
        for (int64_t j = 0; j < cols; j++) ok = ok && isfinite(x[i * ld + j]);
    return ok;
}

static void *scratch(int64_t floats) {
    return aligned_alloc(VL * sizeof(float), sizeof(float) * pad(floats));
}

void rr_flash_forward(const float *q, const int64_t *qs, const float *k, const int64_t *ks,
                      const float *v, const int64_t *vs, float *out, const int64_t *os, float *lse,
                      const int64_t *ls, int64_t B, int64_t Hq, int64_t Hkv, int64_t L, int64_t S,
                      int64_t D, int64_t Dv, int64_t nseg, float scale, int causal, int merge,
                      int threads) {
    const int64_t tiles = (L + TQ - 1) / TQ, group = Hq / Hkv;
#pragma omp parallel num_threads(threads)
    {
        /* S^T and P^T (keys x queries), q^T scaled, out^T, each query's max and sum. */
        float *st = scratch(TK * TQ + D * TQ + Dv * TQ + 2 * TQ);
        float *qt = st + TK * TQ, *acc = qt + D * TQ, *mx = acc + Dv * TQ, *sum = mx + TQ;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < B * Hq * tiles; task++) {
            const int64_t b = task / (Hq * tiles), h = task / tiles % Hq, m = task % tiles * TQ;
            const int64_t tq = L - m < TQ ? L - m : TQ, hk = h / group;
            const float *qh = q + at(qs, nseg, b, h, m);
            const float *kh = k + at(ks, nseg, b, hk, 0), *vh = v + at(vs, nseg, b, hk, 0);
            const int64_t bound = causal ? (m + tq < S ? m + tq : S) : S;
            for (int64_t d = 0; d < D; d++)
                for (int64_t r = 0; r < TQ; r++) qt[d * TQ + r] = r < tq ? scale * qh[r * qs[2] + d] : 0.0f;
            for (int64_t r = 0; r < TQ; r++) mx[r] = -INFINITY, sum[r] = 0.0f;
            memset(acc, 0, sizeof(float) * Dv * TQ);
            for (int64_t n = 0; n < bound; n += TK) {
                const int64_t kb = bound - n < TK ? bound - n : TK;
                /* Keys past the diagonal of some row of the tile: key n + c, row m + r sees it
                 * iff n + c <= m + r. */
                const int64_t cut = causal ? (m - n + 1 > 0 ? m - n + 1 : 0) : kb;
                product(kb, TQ, D, kh + n * ks[2], ks[2], 1, qt, TQ, st, TQ, 0); /* S^T = K (scale q)^T */
                for (int64_t c = cut; c < kb; c++)
                    for (int64_t r = 0; r < n + c - m && r < TQ; r++) st[c * TQ + r] = -INFINITY;
                float hi[TQ], tot[TQ];
                for (int64_t r = 0; r < TQ; r++) hi[r] = mx[r], tot[r] = 0.0f;
                for (int64_t c = 0; c < kb; c++)
#pragma omp simd
                    for (int64_t r = 0; r < TQ; r++) hi[r] = st[c * TQ + r] > hi[r] ? st[c * TQ + r] : hi[r];
                /* A row whose scores are all -inf so far (an inf in k times q's sign) holds nothing:
                 * shifted by 0, not by -inf (-inf - -inf is NaN), its lse stays -inf. */
                float shift[TQ];
                for (int64_t r = 0; r < TQ; r++) shift[r] = hi[r] == -INFINITY ? 0.0f : hi[r];
                for (int64_t c = 0; c < kb; c++)
#pragma omp simd
                    for (int64_t r = 0; r < TQ; r++) {
                        const float e = exp_neg(st[c * TQ + r] - shift[r]);
                        st[c * TQ + r] = e;
                        tot[r] += e;
                    }
                for (int64_t c = cut; c < kb; c++)
                    for (int64_t r = 0; r < n + c - m && r < TQ; r++) st[c * TQ + r] = 0.0f;
                float shrink[TQ];
#pragma omp simd
                for (int64_t r = 0; r < TQ; r++) {
                    shrink[r] = exp_neg(mx[r] - shift[r]); /* mx = -inf: about 1e-38 of nothing */
                    sum[r] = sum[r] * shrink[r] + tot[r];
                    mx[r] = hi[r];
                }
                if (n > 0)
                    for (int64_t d = 0; d < Dv; d++)
#pragma omp simd
                        for (int64_t r = 0; r < TQ; r++) acc[d * TQ + r] *= shrink[r];
                /* out^T += V^T P^T. A key past some row's diagonal has P = 0 there, and 0 times a
                 * NaN or inf in its value row would reach that row, which does not see the key:
                 * such keys (rare: checked, not assumed) add only to the rows that see them. */
                const int64_t clean = cut < kb && !all_finite(vh + (n + cut) * vs[2], vs[2], kb - cut, Dv) ? cut : kb;
                product(Dv, TQ, clean, vh + n * vs[2], 1, vs[2], st, TQ, acc, TQ, 1);
                for (int64_t c = clean; c < kb; c++) {
                    const float *vr = vh + (n + c) * vs[2];
                    for (int64_t d = 0; d < Dv; d++)
#pragma omp simd
                        for (int64_t r = n + c - m > 0 ? n + c - m : 0; r < TQ; r++)
                            acc[d * TQ + r] += vr[d] * st[c * TQ + r];
                }
            }
            for (int64_t r = 0; r < tq; r++) {
                float *o = out + at(os, nseg, b, h, m + r), *l = lse + at(ls, nseg, b, h, m + r);
                /* sum = 0, or mx = -inf: nothing seen, or only -inf scores (lse -inf, out 0). sum
                 * NaN: a NaN or +inf score, so the row is NaN, lse too (not -inf: a merge, a
                 * backward would read it as holding nothing). */
                const float got = sum[r] > 0.0f ? mx[r] + logf(sum[r]) : sum[r] == 0.0f ? -INFINITY : NAN;
                const float inv = got > -INFINITY ? 1.0f / sum[r] : got == -INFINITY ? 0.0f : NAN;
                if (!merge || *l == -INFINITY) {
                    for (int64_t c = 0; c < Dv; c++) o[c] = acc[c * TQ + r] * inv;
                    *l = got;
                } else if (got > -INFINITY || isnan(got)) {
                    /* Into what earlier branches left here: the softmax over both key sets (a NaN
                     * on either side makes the row NaN). */
                    const float top = *l > got ? *l : got;
                    const float wo = expf(*l - top), wa = expf(got - top), total = wo + wa;
                    const float keep = wo / total, add = inv * wa / total;
                    for (int64_t c = 0; c < Dv; c++) o[c] = keep * o[c] + add * acc[c * TQ + r];
                    *l = top + logf(total);
                }
            }
        }
        free(st);
    }
}

/* The backward's operands (strides in elements, as in the header). */
struct grads {
    const float *dout, *q, *k, *v, *out, *lse;
    const int64_t *dos, *qs, *ks, *vs, *os, *ls, *dqs, *dks, *dvs;
    float *dq, *dk, *dv;
    int64_t B, Hq, Hkv, L, S, D, Dv, nseg;
    float scale;
    int causal, accumulate;
};

/* Per thread: a key tile's K and V transposed (D x TK, Dv x TK; keys past the tile zero), K in
 * rows (D padded to VL; a row holding a NaN or inf zero, its index in `bad`), its dK and dV sums;
 * a query tile's P and dP, then dS (TQ x TK), its q scaled and its dO in rows (zero past the tile
 * and where a row is dead; q zero where its lse is NaN), its dQ / scale; each query row's
 * rowsum(dO O) and lse, every row of a kv head's group. */
struct scratch {
    float *p, *dp, *kt, *vt, *kr, *dkt, *dvt, *qr, *dor, *dqr, *dsum, *lrow;
    int64_t bad[TK], nbad;
};

static void scratch_alloc(struct scratch *w, const struct grads *a) {
    const int64_t D = a->D, Dv = a->Dv, Dp = pad(D), Dvp = pad(Dv), rows = pad(a->Hq / a->Hkv * a->L);
    w->p = scratch(2 * TQ * TK + (D + Dv) * TK + TK * (2 * Dp + Dvp) + TQ * (2 * Dp + Dvp) + 2 * rows);
    w->dp = w->p + TQ * TK, w->kt = w->dp + TQ * TK, w->vt = w->kt + D * TK, w->kr = w->vt + Dv * TK;
    w->dkt = w->kr + TK * Dp, w->dvt = w->dkt + TK * Dp, w->qr = w->dvt + TK * Dvp;
    w->dor = w->qr + TQ * Dp, w->dqr = w->dor + TQ * Dvp, w->dsum = w->dqr + TQ * Dp;
    w->lrow = w->dsum + rows;
}

/* rowsum(dO O) and lse of every query row of kv head hk's group: row g * L + i of its g-th head. */
static void head_stats(const struct grads *a, struct scratch *w, int64_t b, int64_t hk) {
    const int64_t group = a->Hq / a->Hkv;
    for (int64_t g = 0; g < group; g++) {
        const int64_t h = hk * group + g;
        const float *dot = a->dout + at(a->dos, a->nseg, b, h, 0), *ot = a->out + at(a->os, a->nseg, b, h, 0);
        const float *lt = a->lse + at(a->ls, a->nseg, b, h, 0);
        for (int64_t r = 0; r < a->L; r++) {
            float s = 0.0f;
            for (int64_t c = 0; c < a->Dv; c++) s += dot[r * a->dos[2] + c] * ot[r * a->os[2] + c];
            w->dsum[g * a->L + r] = s;
            w->lrow[g * a->L + r] = lt[r * a->ls[2]];
        }
    }
}

/* Keys [n, n + kb) of kv head hk into w: K and V transposed, K in rows; their dK, dV sums zero. */
static void key_tile(const struct grads *a, struct scratch *w, int64_t b, int64_t hk, int64_t n, int64_t kb) {
    const int64_t D = a->D, Dv = a->Dv, Dp = pad(D), Dvp = pad(Dv);
    const float *kh = a->k + at(a->ks, a->nseg, b, hk, n), *vh = a->v + at(a->vs, a->nseg, b, hk, n);
    for (int64_t c = 0; c < TK; c++) {
        for (int64_t d = 0; d < D; d++) w->kt[d * TK + c] = c < kb ? kh[c * a->ks[2] + d] : 0.0f;
        for (int64_t d = 0; d < Dv; d++) w->vt[d * TK + c] = c < kb ? vh[c * a->vs[2] + d] : 0.0f;
    }
    for (int64_t c = 0; c < kb; c++) {
        memcpy(w->kr + c * Dp, kh + c * a->ks[2], sizeof(float) * D);
        memset(w->kr + c * Dp + D, 0, sizeof(float) * (Dp - D));
    }
    /* dQ = dS K: a key's dS is 0 where a row does not see it (past the diagonal, or a dead row),
     * and 0 times its NaN or inf would reach that row. Such keys (rare: checked, not assumed)
     * leave K's rows and add to the rows that see them only (`pair`). */
    w->nbad = 0;
    if (!all_finite(w->kr, Dp, kb, D))
        for (int64_t c = 0; c < kb; c++)
            if (!all_finite(w->kr + c * Dp, Dp, 1, D)) {
                w->bad[w->nbad++] = c;
                memset(w->kr + c * Dp, 0, sizeof(float) * D);
            }
    memset(w->dkt, 0, sizeof(float) * kb * Dp);
    memset(w->dvt, 0, sizeof(float) * kb * Dvp);
}

/* Query rows [m, m + tq) of head h (the g-th of its group) against w's key tile [n, n + kb):
 * their share of dK and dV added to w's sums, their dQ written (`add`: added) to dq. */
static void pair(const struct grads *a, struct scratch *w, int64_t b, int64_t h, int64_t g, int64_t m,
                 int64_t n, int64_t kb, int add) {
    const int64_t D = a->D, Dv = a->Dv, Dp = pad(D), Dvp = pad(Dv), kbp = pad(kb);
    const int64_t tq = a->L - m < TQ ? a->L - m : TQ;
    const float *qh = a->q + at(a->qs, a->nseg, b, h, m), *doh = a->dout + at(a->dos, a->nseg, b, h, m);
    const float *lrow = w->lrow + g * a->L + m, *dsum = w->dsum + g * a->L + m;
    float *p = w->p, *dp = w->dp, *qr = w->qr, *dor = w->dor;
    int64_t lims[TQ]; /* keys of the tile each row sees */
    int64_t gone[TK]; /* a row's keys of `bad` that score -inf */
    for (int64_t r = 0; r < TQ; r++) { /* rows past the tile or dead: zero, as are the pads */
        const int live = r < tq && !isinf(lrow[r]);
        /* A row whose lse is NaN (a NaN or inf in its q, or in a key it sees) has P = NaN on every
         * key it sees, whatever q holds: q zero, so that dK = dS^T Q does not take q's NaN or
         * inf (times dS = 0) to keys past the diagonal. */
        const int64_t nq = live && !isnan(lrow[r]) ? D : 0, nd = live ? Dv : 0;
        for (int64_t d = 0; d < nq; d++) qr[r * Dp + d] = a->scale * qh[r * a->qs[2] + d];
        if (live) memcpy(dor + r * Dvp, doh + r * a->dos[2], sizeof(float) * Dv);
        memset(qr + r * Dp + nq, 0, sizeof(float) * (Dp - nq));
        memset(dor + r * Dvp + nd, 0, sizeof(float) * (Dvp - nd));
    }
    product(TQ, kbp, D, qr, Dp, 1, w->kt, TK, p, TK, 0);    /* S = (scale Q) K^T */
    product(TQ, kbp, Dv, dor, Dvp, 1, w->vt, TK, dp, TK, 0); /* dP = dO V^T */
    for (int64_t r = 0; r < TQ; r++) {
        float *pr = p + r * TK, *dr = dp + r * TK;
        const int64_t lim = r >= tq || isinf(lrow[r]) ? 0 : seen(a->causal, m + r, n, kb);
        const float l = lim ? lrow[r] : 0.0f, ds = lim ? dsum[r] : 0.0f;
        lims[r] = lim;
        /* A key holding an inf scores -inf where q's signs make it so, and drops out of the row:
         * P = 0 there exactly (exp_neg gives about 1e-38), so that dQ = dS K takes 0 * inf, NaN,
         * in the key's inf channels, as the function does. Finite keys score no -inf. */
        int64_t ngone = 0;
        for (int64_t j = 0; j < w->nbad; j++)
            if (w->bad[j] < lim && pr[w->bad[j]] == -INFINITY) gone[ngone++] = w->bad[j];
#pragma omp simd
        for (int64_t c = 0; c < lim; c++) {
            const float e = exp_neg(pr[c] - l);
            pr[c] = e;
            dr[c] = e * (dr[c] - ds);
        }
        for (int64_t j = 0; j < ngone; j++) pr[gone[j]] = 0.0f, dr[gone[j]] = 0.0f;
        for (int64_t c = lim; c < kbp; c++) pr[c] = 0.0f, dr[c] = 0.0f;
    }
    product(kb, Dvp, TQ, p, 1, TK, dor, Dvp, w->dvt, Dvp, 1); /* dV += P^T dO */
    product(kb, Dp, TQ, dp, 1, TK, qr, Dp, w->dkt, Dp, 1);    /* dK += dS^T (scale Q) */
    product(TQ, Dp, kb, dp, TK, 1, w->kr, Dp, w->dqr, Dp, 0); /* dQ / scale = dS K */
    if (w->nbad) { /* keys holding a NaN or inf, to the rows that see them (key_tile) */
        const float *kh = a->k + at(a->ks, a->nseg, b, h / (a->Hq / a->Hkv), n);
        for (int64_t j = 0; j < w->nbad; j++) {
            const int64_t c = w->bad[j];
            for (int64_t r = 0; r < tq; r++)
                if (c < lims[r])
                    for (int64_t d = 0; d < D; d++) w->dqr[r * Dp + d] += dp[r * TK + c] * kh[c * a->ks[2] + d];
        }
    }
    float *dqh = a->dq + at(a->dqs, a->nseg, b, h, m);
    for (int64_t r = 0; r < tq; r++) {
        float *row = dqh + r * a->dqs[2];
        const float *share = w->dqr + r * Dp;
        if (add)
#pragma omp simd
            for (int64_t d = 0; d < D; d++) row[d] += a->scale * share[d];
        else
#pragma omp simd
            for (int64_t d = 0; d < D; d++) row[d] = a->scale * share[d];
    }
}

/* dK and dV of keys [n + lo, n + hi) of kv head hk: the sums of nt threads' scratches (written,
 * or added to). */
static void store_keys(const struct grads *a, const struct scratch *all, int nt, int64_t b, int64_t hk,
                       int64_t n, int64_t lo, int64_t hi) {
    const int64_t Dp = pad(a->D), Dvp = pad(a->Dv);
    float *dkh = a->dk + at(a->dks, a->nseg, b, hk, n), *dvh = a->dv + at(a->dvs, a->nseg, b, hk, n);
    for (int64_t c = lo; c < hi; c++) {
        float *dkr = dkh + c * a->dks[2], *dvr = dvh + c * a->dvs[2];
        if (!a->accumulate) {
            memset(dkr, 0, sizeof(float) * a->D);
            memset(dvr, 0, sizeof(float) * a->Dv);
        }
        for (int u = 0; u < nt; u++) {
            for (int64_t d = 0; d < a->D; d++) dkr[d] += all[u].dkt[c * Dp + d];
            for (int64_t d = 0; d < a->Dv; d++) dvr[d] += all[u].dvt[c * Dvp + d];
        }
    }
}

/* Thread t's slice [lo, hi) of [0, n) cut in nt. */
static void slice(int64_t n, int t, int nt, int64_t *lo, int64_t *hi) {
    *lo = n * t / nt, *hi = n * (t + 1) / nt;
}

/* A (batch, kv head) on nt threads, thread t (nt = 1: a task of one thread's own), key tile by
 * key tile: each thread takes a slice of the query tiles that see the key tile (causal: from the
 * one holding its first key), adds their dK, dV shares to its sums and writes their dQ (at key
 * tile 0, which every query sees) or adds to it; the key tile's dK, dV are then the sum of the
 * threads' sums. Every thread of nt calls it. */
static void head_task(const struct grads *a, struct scratch *w, struct scratch *all, int t, int nt,
                      int64_t task) {
    const int64_t b = task / a->Hkv, hk = task % a->Hkv, group = a->Hq / a->Hkv;
    const int64_t tiles = (a->L + TQ - 1) / TQ;
    head_stats(a, w, b, hk);
    for (int64_t n = 0; n < a->S; n += TK) {
        const int64_t kb = a->S - n < TK ? a->S - n : TK, first = a->causal ? n / TQ : 0;
        int64_t lo = 0, hi = 0;
        key_tile(a, w, b, hk, n, kb);
        if (first < tiles) slice(tiles - first, t, nt, &lo, &hi);
        for (int64_t g = 0; g < group; g++)
            for (int64_t i = first + lo; i < first + hi; i++)
                pair(a, w, b, hk * group + g, g, i * TQ, n, kb, a->accumulate || n > 0);
        if (nt == 1) {
            store_keys(a, w, 1, b, hk, n, 0, kb);
            continue;
        }
#pragma omp barrier
        slice(kb, t, nt, &lo, &hi);
        store_keys(a, all, nt, b, hk, n, lo, hi);
#pragma omp barrier
    }
}

void rr_flash_backward(const float *dout, const int64_t *dos, const float *q, const int64_t *qs,
                       const float *k, const int64_t *ks, const float *v, const int64_t *vs,
                       const float *out, const int64_t *os, const float *lse, const int64_t *ls,
                       float *dq, const int64_t *dqs, float *dk, const int64_t *dks, float *dv,
                       const int64_t *dvs, int64_t B, int64_t Hq, int64_t Hkv, int64_t L, int64_t S,
                       int64_t D, int64_t Dv, int64_t nseg, float scale, int causal, int accumulate,
                       int threads) {
    const struct grads a = {dout, q, k, v, out, lse, dos, qs, ks, vs, os, ls, dqs, dks, dvs,
                            dq, dk, dv, B, Hq, Hkv, L, S, D, Dv, nseg, scale, causal, accumulate};
    struct scratch *all = malloc(sizeof(struct scratch) * threads);
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        struct scratch *w = all + t;
        scratch_alloc(w, &a);
        /* Whole tasks while every thread gets one; the rest shared, key tile by key tile. */
        const int64_t tasks = B * Hkv, whole = tasks / nt * nt;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < whole; task++) head_task(&a, w, w, 0, 1, task);
        for (int64_t task = whole; task < tasks; task++) head_task(&a, w, all, t, nt, task);
#pragma omp barrier
        free(w->p);
    }
    free(all);
}
