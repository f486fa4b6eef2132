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
 * head) backward, which owns its dK and dV, so nothing is shared. Backward tasks that would leave
 * threads idle (fewer left than threads: one head of one segment, as the local branches' head
 * chunks often run) are shared by every thread instead, each query tile's keys cut in slices.
 *
 * Tensors: q (B, Hq, L, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv), dout and out (B, Hq, L, Dv),
 * lse (B, Hq, L), each with unit stride in its last dim; GQA by head groups (query head h reads
 * kv head h / (Hq / Hkv)). Each tensor comes with a layout `st` (elements): batch b, head h,
 * row i at b / nseg * st[0] + b % nseg * st[1] + st[3 + h] + i * st[2]. A plain tensor has
 * nseg = 1 and st[3 + h] = h times its head stride; a dilated branch's rows read in place have
 * the segments as batches and each head's lattice offset in st[3 + h] (a row stride must fit an
 * int). The forward writes out and lse, or with `merge` merges its rows into what they hold (a
 * row of lse -inf holds nothing): the out and lse of attention over both key sets, as
 * merge.py's merge_partials. The backward writes dq, dk, dv, or with `accumulate` adds to them
 * (no two kv heads' rows may then be the same). Causal is top-left:
 * row i sees keys 0..i. A backward row whose lse is infinite (nothing to attend) contributes
 * nothing.
 */
#include <math.h>
#include <omp.h>
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

void rr_flash_forward(const float *q, const int64_t *qs, const float *k, const int64_t *ks,
                      const float *v, const int64_t *vs, float *out, const int64_t *os, float *lse,
                      const int64_t *ls, int64_t B, int64_t Hq, int64_t Hkv, int64_t L, int64_t S,
                      int64_t D, int64_t Dv, int64_t TQ, int64_t nseg, float scale, int causal,
                      int merge, int threads) {
    const int64_t tiles = (L + TQ - 1) / TQ, group = Hq / Hkv;
#pragma omp parallel num_threads(threads)
    {
        float *sc = malloc(sizeof(float) * (TQ * TK + TQ * Dv + 2 * TQ));
        float *acc = sc + TQ * TK, *mx = acc + TQ * Dv, *sum = mx + TQ;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < B * Hq * tiles; task++) {
            const int64_t b = task / (Hq * tiles), h = task / tiles % Hq, m = task % tiles * TQ;
            const int64_t tq = L - m < TQ ? L - m : TQ, hk = h / group;
            const float *qt = q + at(qs, nseg, b, h, m);
            const float *kh = k + at(ks, nseg, b, hk, 0), *vh = v + at(vs, nseg, b, hk, 0);
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
            for (int64_t r = 0; r < tq; r++) {
                float *o = out + at(os, nseg, b, h, m + r), *l = lse + at(ls, nseg, b, h, m + r);
                const float *a = acc + r * Dv, got = sum[r] > 0.0f ? mx[r] + logf(sum[r]) : -INFINITY;
                const float inv = sum[r] > 0.0f ? 1.0f / sum[r] : 0.0f;
                if (!merge || *l == -INFINITY) {
                    for (int64_t c = 0; c < Dv; c++) o[c] = a[c] * inv;
                    *l = got;
                } else if (got > -INFINITY) {
                    /* Into what earlier branches left here: the softmax over both key sets. */
                    const float top = *l > got ? *l : got;
                    const float wo = expf(*l - top), wa = expf(got - top), total = wo + wa;
                    const float keep = wo / total, add = inv * wa / total;
                    for (int64_t c = 0; c < Dv; c++) o[c] = keep * o[c] + add * a[c];
                    *l = top + logf(total);
                }
            }
        }
        free(sc);
    }
}

/* The backward's operands (strides in elements, as in the header). */
struct grads {
    const float *dout, *q, *k, *v, *out, *lse;
    const int64_t *dos, *qs, *ks, *vs, *os, *ls, *dqs, *dks, *dvs;
    float *dq, *dk, *dv;
    int64_t B, Hq, Hkv, L, S, D, Dv, TQ, nseg;
    float scale;
    int causal, accumulate;
};

/* Per thread: P and dP tiles, a tile's rowsum(dO O) and lse, and (shared tasks) its dQ share. */
struct scratch {
    float *p, *dp, *dsum, *lrow, *dq;
};

static void scratch_alloc(struct scratch *w, int64_t TQ, int64_t D) {
    w->p = malloc(sizeof(float) * (2 * TQ * TK + 2 * TQ + TQ * D));
    w->dp = w->p + TQ * TK, w->dsum = w->dp + TQ * TK, w->lrow = w->dsum + TQ, w->dq = w->lrow + TQ;
}

/* The last key (exclusive) that rows [m, m + tq) see. */
static inline int64_t key_bound(const struct grads *a, int64_t m, int64_t tq) {
    return a->causal ? (m + tq < a->S ? m + tq : a->S) : a->S;
}

/* rowsum(dO O) and lse of query rows [m, m + tq) of head h into w. */
static void tile_stats(const struct grads *a, struct scratch *w, int64_t b, int64_t h, int64_t m, int64_t tq) {
    const float *dot = a->dout + at(a->dos, a->nseg, b, h, m);
    const float *ot = a->out + at(a->os, a->nseg, b, h, m);
    const float *lt = a->lse + at(a->ls, a->nseg, b, h, m);
    for (int64_t r = 0; r < tq; r++) {
        float s = 0.0f;
        for (int64_t c = 0; c < a->Dv; c++) s += dot[r * a->dos[2] + c] * ot[r * a->os[2] + c];
        w->dsum[r] = s;
        w->lrow[r] = lt[r * a->ls[2]];
    }
}

/* Query rows [m, m + tq) of head h against keys [k0, k1) (k0 < k1): their share of dK and dV
 * added to the kv head's rows (dkh, dvh: that head's first, in dk's and dv's layouts), their dQ
 * share written (`add`: added) to dqt (ld ldq). Needs tile_stats of the rows in w. */
static void tile_backward(const struct grads *a, struct scratch *w, int64_t b, int64_t h, int64_t m,
                          int64_t tq, int64_t k0, int64_t k1, float *dkh, float *dvh, float *dqt,
                          int64_t ldq, int add) {
    const int64_t hk = h / (a->Hq / a->Hkv), D = a->D, Dv = a->Dv, ldk = a->dks[2], ldv = a->dvs[2];
    const float *kh = a->k + at(a->ks, a->nseg, b, hk, 0), *vh = a->v + at(a->vs, a->nseg, b, hk, 0);
    const float *qt = a->q + at(a->qs, a->nseg, b, h, m);
    const float *dot = a->dout + at(a->dos, a->nseg, b, h, m);
    float *p = w->p, *dp = w->dp;
    for (int64_t n = k0; n < k1; n += TK) {
        const int64_t kb = k1 - n < TK ? k1 - n : TK;
        gemm('T', 'N', kb, tq, D, a->scale, kh + n * a->ks[2], a->ks[2], qt, a->qs[2], 0.0f, p, TK);
        gemm('T', 'N', kb, tq, Dv, 1.0f, vh + n * a->vs[2], a->vs[2], dot, a->dos[2], 0.0f, dp, TK);
        for (int64_t r = 0; r < tq; r++) {
            float *pr = p + r * TK, *dr = dp + r * TK;
            const int64_t lim = isinf(w->lrow[r]) ? 0 : seen(a->causal, m + r, n, kb);
            const float l = w->lrow[r], ds = w->dsum[r];
#pragma omp simd
            for (int64_t c = 0; c < lim; c++) {
                const float e = exp_neg(pr[c] - l);
                pr[c] = e;
                dr[c] = e * (dr[c] - ds);
            }
            for (int64_t c = lim; c < kb; c++) pr[c] = 0.0f, dr[c] = 0.0f;
        }
        gemm('N', 'T', Dv, kb, tq, 1.0f, dot, a->dos[2], p, TK, 1.0f, dvh + n * ldv, ldv);
        gemm('N', 'N', D, tq, kb, a->scale, kh + n * a->ks[2], a->ks[2], dp, TK,
             add || n > k0 ? 1.0f : 0.0f, dqt, ldq);
        gemm('N', 'T', D, kb, tq, a->scale, qt, a->qs[2], dp, TK, 1.0f, dkh + n * ldk, ldk);
    }
}

/* Zeroes rows [lo, hi) of n channels from x on, ld apart. */
static void zero_rows(float *x, int64_t lo, int64_t hi, int64_t n, int64_t ld) {
    for (int64_t r = lo; r < hi; r++) memset(x + r * ld, 0, sizeof(float) * n);
}

/* A (batch, kv head) on one thread: every query head of its group, every tile, its own dK, dV. */
static void own_task(const struct grads *a, struct scratch *w, int64_t task) {
    const int64_t b = task / a->Hkv, hk = task % a->Hkv, group = a->Hq / a->Hkv;
    float *dkh = a->dk + at(a->dks, a->nseg, b, hk, 0), *dvh = a->dv + at(a->dvs, a->nseg, b, hk, 0);
    if (!a->accumulate) {
        zero_rows(dkh, 0, a->S, a->D, a->dks[2]);
        zero_rows(dvh, 0, a->S, a->Dv, a->dvs[2]);
    }
    for (int64_t h = hk * group; h < (hk + 1) * group; h++)
        for (int64_t m = 0; m < a->L; m += a->TQ) {
            const int64_t tq = a->L - m < a->TQ ? a->L - m : a->TQ;
            tile_stats(a, w, b, h, m, tq);
            tile_backward(a, w, b, h, m, tq, 0, key_bound(a, m, tq), dkh, dvh,
                          a->dq + at(a->dqs, a->nseg, b, h, m), a->dqs[2], a->accumulate);
        }
}

/* Thread t's slice [lo, hi) of [0, n) cut in nt, on multiples of `align`. */
static void slice(int64_t n, int t, int nt, int64_t align, int64_t *lo, int64_t *hi) {
    const int64_t units = (n + align - 1) / align;
    const int64_t a = units * t / nt * align, z = units * (t + 1) / nt * align;
    *lo = a < n ? a : n, *hi = z < n ? z : n;
}

/* A (batch, kv head) shared by all nt threads, thread t one of them: each query tile's keys cut
 * in nt slices, each thread adding its slice's dK, dV (the slices of one tile are disjoint) and
 * writing its dQ share, which the threads then sum into the tile's rows. Every thread calls it. */
static void shared_task(const struct grads *a, struct scratch *w, struct scratch *all, int t, int nt,
                        int64_t task, int *wrote) {
    const int64_t b = task / a->Hkv, hk = task % a->Hkv, group = a->Hq / a->Hkv, D = a->D;
    float *dkh = a->dk + at(a->dks, a->nseg, b, hk, 0), *dvh = a->dv + at(a->dvs, a->nseg, b, hk, 0);
    int64_t lo, hi;
    if (!a->accumulate) {
        slice(a->S, t, nt, 1, &lo, &hi);
        zero_rows(dkh, lo, hi, D, a->dks[2]);
        zero_rows(dvh, lo, hi, a->Dv, a->dvs[2]);
    }
#pragma omp barrier
    for (int64_t h = hk * group; h < (hk + 1) * group; h++)
        for (int64_t m = 0; m < a->L; m += a->TQ) {
            const int64_t tq = a->L - m < a->TQ ? a->L - m : a->TQ;
            slice(key_bound(a, m, tq), t, nt, 16, &lo, &hi);
            wrote[t] = lo < hi;
            if (lo < hi) {
                tile_stats(a, w, b, h, m, tq);
                tile_backward(a, w, b, h, m, tq, lo, hi, dkh, dvh, w->dq, D, 0);
            }
#pragma omp barrier
            float *dqt = a->dq + at(a->dqs, a->nseg, b, h, m);
            slice(tq, t, nt, 1, &lo, &hi);
            for (int64_t r = lo; r < hi; r++) {
                float *row = dqt + r * a->dqs[2];
                if (!a->accumulate)
                    for (int64_t c = 0; c < D; c++) row[c] = 0.0f;
                for (int u = 0; u < nt; u++)
                    if (wrote[u])
                        for (int64_t c = 0; c < D; c++) row[c] += all[u].dq[r * D + c];
            }
#pragma omp barrier
        }
}

void rr_flash_backward(const float *dout, const int64_t *dos, const float *q, const int64_t *qs,
                       const float *k, const int64_t *ks, const float *v, const int64_t *vs,
                       const float *out, const int64_t *os, const float *lse, const int64_t *ls,
                       float *dq, const int64_t *dqs, float *dk, const int64_t *dks, float *dv,
                       const int64_t *dvs, int64_t B, int64_t Hq, int64_t Hkv, int64_t L, int64_t S,
                       int64_t D, int64_t Dv, int64_t TQ, int64_t nseg, float scale, int causal,
                       int accumulate, int threads) {
    const struct grads a = {dout, q, k, v, out, lse, dos, qs, ks, vs, os, ls, dqs, dks, dvs,
                            dq, dk, dv, B, Hq, Hkv, L, S, D, Dv, TQ, nseg, scale, causal, accumulate};
    struct scratch *all = malloc(sizeof(struct scratch) * threads);
    int *wrote = malloc(sizeof(int) * threads);
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        struct scratch *w = all + t;
        scratch_alloc(w, TQ, D);
        /* Whole tasks while every thread gets one; the rest shared, tile by tile. */
        const int64_t tasks = B * Hkv, whole = tasks / nt * nt;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < whole; task++) own_task(&a, w, task);
        for (int64_t task = whole; task < tasks; task++) shared_task(&a, w, all, t, nt, task, wrote);
#pragma omp barrier
        free(w->p);
    }
    free(all);
    free(wrote);
}
