/* The certified step of gpt2edge's sparse head in one native call (gpt2edge/runtime/sparse_head/native.py).

   The same arithmetic as the body graph's fused nodes (gpt2edge/sparse/fused.py), without ONNX Runtime's
   ~1 us per node for ~47 small nodes: per row, from the hidden state h (C,),
     1. h_eff, the activation the head's kernel multiplies (exact.py): at level 4, h per block to int8
        (scale max|h_b| / 127, times its reciprocal, rounded half to even), else h itself;
     2. the bound's terms: Q^T h_eff, ||h_eff - Q Q^T h_eff||, h_eff . mu, ||h_eff|| (the float allowance);
     3. the group bounds, the m best groups, their members' upper bounds, the K best of those (the candidates);
     4. the candidates' logits: integer block dots times the scales (level 4), or float dots in double;
     5. the bar: the least selected member bound, or the least selected group's bound when higher, plus
        h_eff . mu and the allowance: every row left out scores below it;
     6. (`extend`) when the bar stops the best candidate: more rows read, within budgets, and a tighter bar.
   Then g2e_rows: the runtime's check of the certificate and the returned rows.
   Plain C99 with no allocation: the caller passes the scratch. Hot loops are cloned per instruction set
   (GCC/Clang target_clones), so one build runs on any x86-64 and uses AVX-512 or AVX2 where the CPU has it. */

#include "certify_kernels.h"

/* what step 6 reads of steps 1-5 */
typedef struct {
    const float *he;
    const int32_t *qa, *qsum;
    const float *sa, *x, *gb;
    const int32_t *gsel;
    const float *mub;
    const int32_t *msel;
    double hmu, slack;
} step_state;

static size_t align8(size_t n) { return (n + 7) & ~(size_t)7; }

/* Step 6's scratch, in bytes. */
static size_t extend_bytes(const g2e_tables *t) {
    const size_t XR = t->extra_rows, XG = t->extra_groups, n = XR + t->K;
    return align8(t->G) + align8((size_t)t->m * t->S) + align8(4 * XG) + align8(4 * XG * t->S) + 8 * n + 8 * n +
           4 * n + 4 * n + 4 * n + 64;
}

/* Step 6: every row whose upper bound reaches best - TIE (the k-th best for top-k) gets its exact logit: the
   members of the selected groups not yet read, and those of the groups left out whose group bound reaches it,
   unless there are more than the budgets allow. Then the output is the K best of all the rows read, and the
   bar the largest upper bound of any row not read, or the largest logit read but left out: both below
   best - TIE when it worked. Leaves the outputs as they are when the best already clears the bar (or the bar
   is NaN), or a budget is exceeded. Returns the rows it read. */
static int extend(const g2e_tables *t, const step_state *st, int k, int64_t *ids, double *logits, double *bar,
                  uint8_t *work) {
    const int G = t->G, S = t->S, m = t->m, K = t->K, r = t->r, XR = t->extra_rows, XG = t->extra_groups;
    uint8_t *gmask = work, *cmask = gmask + align8(G);
    int32_t *xg = (int32_t *)(cmask + align8((size_t)m * S));
    float *xmub = (float *)((uint8_t *)xg + align8(4 * (size_t)XG));
    int64_t *xid = (int64_t *)((uint8_t *)xmub + align8(4 * (size_t)XG * S));
    double *xlog = (double *)(xid + XR + K);
    int32_t *sel = (int32_t *)(xlog + XR + K);
    float *vals = (float *)(sel + XR + K), *copy = vals + XR + K;
    /* the k-th best candidate's logit (k = 1: the best): the one that must clear the bar */
    double kth = logits[0];
    if (k <= 1) {
        for (int i = 1; i < K; i++) kth = logits[i] > kth ? logits[i] : kth;
    } else {
        for (int i = 0; i < K; i++) vals[i] = (float)logits[i];
        select_top(vals, sel, copy, K, k);  /* float order: only where to stop reading; the bar stays exact */
        kth = logits[sel[0]];
        for (int i = 1; i < k; i++) kth = logits[sel[i]] < kth ? logits[sel[i]] : kth;
    }
    if (!(kth - t->tie <= *bar)) return 0;
    const double thr = kth - t->tie - st->hmu - st->slack;  /* relative bounds below this cannot reach it */
    memset(gmask, 0, G);
    memset(cmask, 0, (size_t)m * S);
    for (int i = 0; i < m; i++) gmask[st->gsel[i]] = 1;
    for (int i = 0; i < K; i++) cmask[st->msel[i]] = 1;
    int nxg = 0, nx = 0;
    double rest = -INFINITY;  /* the largest relative bound of a row not read */
    for (int g = 0; g < G; g++) {
        if (gmask[g]) continue;
        if ((double)st->gb[g] >= thr) {
            if (nxg == XG) return 0;
            xg[nxg++] = g;
        } else if (st->gb[g] > rest) {
            rest = st->gb[g];
        }
    }
    const int64_t block = (int64_t)(r + 1) * S;
    for (int j = 0; j < nxg; j++) axpy_rows(st->x, t->rowt + (int64_t)xg[j] * block, r + 1, S, xmub + (int64_t)j * S);
    for (int p = 0; p < m * S; p++) {
        if (cmask[p]) continue;
        if ((double)st->mub[p] >= thr) {
            if (nx == XR) return 0;
            xid[nx++] = t->members[(int64_t)st->gsel[p / S] * S + p % S];
        } else if (st->mub[p] > rest) {
            rest = st->mub[p];
        }
    }
    for (int j = 0; j < nxg; j++)
        for (int q = 0; q < S; q++) {
            const float v = xmub[(int64_t)j * S + q];
            if ((double)v >= thr) {
                if (nx == XR) return 0;
                xid[nx++] = t->members[(int64_t)xg[j] * S + q];
            } else if (v > rest) {
                rest = v;
            }
        }
    exact_rows(t, xid, nx, xlog, st->he, st->qa, st->qsum, st->sa);
    /* the K best of the candidates and the rows just read; the others raise the bar */
    const int n = nx + K;
    memcpy(xid + nx, ids, sizeof(int64_t) * K);
    memcpy(xlog + nx, logits, sizeof(double) * K);
    for (int i = 0; i < n; i++) vals[i] = (float)xlog[i];
    select_top(vals, sel, copy, n, K);
    double left = -INFINITY;
    for (int i = 0; i < K; i++) vals[sel[i]] = NAN;  /* marks the kept */
    for (int i = 0; i < n; i++)
        if (vals[i] == vals[i] && xlog[i] > left) left = xlog[i];
    for (int i = 0; i < K; i++) {
        ids[i] = xid[sel[i]];
        logits[i] = xlog[sel[i]];
    }
    /* a logit read but left out bounds its row only up to the summation order of another implementation of the
       same arithmetic (exact.py's numpy sums: ~1e-16 relative): a margin far inside TIE */
    if (left > -INFINITY) left += 1e-9 * (1.0 + fabs(left));
    const double unread = rest + st->hmu + st->slack;
    *bar = unread > left ? unread : left;
    return nx;
}

/* The interface's version and the tables' size: native.py refuses a library built from other sources (a stale
   build left in place) rather than read its struct wrongly. Bump G2E_ABI with any change of an exported
   signature or of g2e_tables. */
#define G2E_ABI 1
int64_t g2e_abi(void) { return (int64_t)G2E_ABI * 1000000 + (int64_t)sizeof(g2e_tables); }

/* The scratch a call needs, in floats (the caller allocates it once). */
int64_t g2e_scratch_floats(const g2e_tables *t) {
    const int64_t C = t->C, pad = (int64_t)t->kb * t->bs, padded = C > pad ? C : pad, ms = (int64_t)t->m * t->S;
    /* he, qa (padded); sa, qsum (kb); hq, x (r + 1); hqg (rg); xg (rg + 2); gb (G); mub (m S); proj (C);
       gsel (G); msel (m S); tmp (max(G, m S)) */
    return 2 * padded + 2 * t->kb + 2 * (t->r + 1) + 2 * t->rg + 2 + 2 * t->G + 2 * ms + C +
           (t->G > ms ? t->G : ms) + 16 + (int64_t)(extend_bytes(t) / sizeof(float)) + 2;
}

/* One row: h (C,) -> ids (K,), logits (K,), bar (1,). Returns the exact rows it computed. */
HOT static int certify_row(const g2e_tables *t, const float *h, int k, int64_t *ids, double *logits, double *bar,
                           float *work) {
    const int C = t->C, r = t->r, rg = t->rg, G = t->G, S = t->S, m = t->m, K = t->K;
    const int padded = t->kb * t->bs > C ? t->kb * t->bs : C;
    float *he = work, *sa = he + padded;
    int32_t *qa = (int32_t *)(sa + t->kb), *qsum = qa + padded;
    float *hq = (float *)(qsum + t->kb), *x = hq + r + 1, *hqg = x + r + 1, *xg = hqg + rg;
    float *gb = xg + rg + 2, *mub = gb + G, *proj = mub + (int64_t)m * S;
    int32_t *gsel = (int32_t *)(proj + C), *msel = gsel + G;
    float *tmp = (float *)(msel + (int64_t)m * S);

    /* a non-finite activation (a diverged model): nothing to certify; no int8 conversion of inf or NaN either */
    int finite = 1;
    for (int c = 0; c < C; c++) finite &= isfinite(h[c]) != 0;
    if (!finite) {
        for (int i = 0; i < K; i++) {
            ids[i] = 0;
            logits[i] = 0.0;
        }
        *bar = NAN;
        return 0;
    }

    /* 1. h_eff */
    if (t->kind == 2) {
        for (int b = 0; b < t->kb; b++) {
            const int start = b * t->bs, end = start + t->bs < C ? start + t->bs : C;
            float mx = 0.0f;
            for (int c = start; c < end; c++) mx = fabsf(h[c]) > mx ? fabsf(h[c]) : mx;
            const float s = mx / 127.0f;
            const float inv = s != 0.0f ? 1.0f / s : 0.0f;
            int32_t qs = 0;
            for (int c = start; c < end; c++) {
                const float qf = rintf(h[c] * inv);  /* round half to even, as ONNX Round and numpy's rint */
                qa[c] = (int32_t)qf;
                he[c] = qf * s;
                qs += qa[c];
            }
            sa[b] = s;
            qsum[b] = qs;
        }
    } else {
        memcpy(he, h, sizeof(float) * C);
    }

    /* 2. the bound's terms */
    axpy_rows(he, t->q, C, r, hq);  /* Q^T h: h (C,) times Q (C, r) */
    const double perp = perp_norm(he, t->qt, hq, C, r, proj);  /* the build scaled eps up for its rounding */
    double hmu = 0.0, hn = 0.0;
    for (int c = 0; c < C; c++) {
        hmu += (double)he[c] * t->mu[c];
        hn += (double)he[c] * he[c];
    }
    const double slack = sqrt(hn) * t->slack_coef;
    double perpg = perp, nq = 0.0;
    if (rg == r) {
        memcpy(hqg, hq, sizeof(float) * r);
    } else {
        axpy_rows(he, t->qg, C, rg, hqg);
        perpg = perp_norm(he, t->qgt, hqg, C, rg, proj);
    }
    for (int j = 0; j < rg; j++) nq += (double)hqg[j] * hqg[j];
    memcpy(xg, hqg, sizeof(float) * rg);
    xg[rg] = (float)perpg;
    xg[rg + 1] = (float)sqrt(nq);

    /* 3. groups, then their members */
    axpy_rows(xg, t->gtab, rg + 2, G, gb);
    select_top(gb, gsel, tmp, G, m);
    float gbar = -3e38f;
    if (m < G) {
        gbar = gb[gsel[0]];
        for (int i = 1; i < m; i++) gbar = gb[gsel[i]] < gbar ? gb[gsel[i]] : gbar;
    }
    memcpy(x, hq, sizeof(float) * r);
    x[r] = (float)perp;
    const int64_t block = (int64_t)(r + 1) * S;  /* floats per group */
    for (int i = 0; i < m; i++) {
        if (i + 2 < m) prefetch_span(t->rowt + (int64_t)gsel[i + 2] * block, block * sizeof(float));
        axpy_rows(x, t->rowt + (int64_t)gsel[i] * block, r + 1, S, mub + (int64_t)i * S);
    }
    const int n = m * S;
    select_top(mub, msel, tmp, n, K);
    float worst = mub[msel[0]];
    for (int i = 1; i < K; i++) worst = mub[msel[i]] < worst ? mub[msel[i]] : worst;
    if (n == K) worst = -3e38f;  /* every member is a candidate: only the groups left out bound the rest */
    *bar = (double)(worst > gbar ? worst : gbar) + hmu + slack;

    /* 4. the candidates' logits */
    for (int i = 0; i < K; i++) {
        const int32_t pos = msel[i];
        ids[i] = t->members[(int64_t)gsel[pos / S] * S + pos % S];
    }
    exact_rows(t, ids, K, logits, he, qa, qsum, sa);

    /* 6. the bar stops the best candidate: read more rows, within budgets, rather than leave the step to the
       full head (~0.3 ms): usually a few hundred rows more (~10-30 us) */
    if (t->extra_rows <= 0) return K;
    const step_state st = {he, qa, qsum, sa, x, gb, gsel, mub, msel, hmu, slack};
    const uintptr_t end = (uintptr_t)(tmp + (G > m * S ? G : m * S));
    return K + extend(t, &st, k, ids, logits, bar, (uint8_t *)((end + 7) & ~(uintptr_t)7));  /* 8-byte aligned */
}

/* B rows: h (B, C) -> ids (B, K), logits (B, K), bar (B, 1), and the exact rows each computed: read (B,). k: how
   many of the best the caller needs apart from the rest (1: greedy; top-k sampling: k <= K - 1). */
int g2e_certify(const g2e_tables *t, const float *h, int32_t B, int32_t k, int64_t *ids, double *logits, double *bar,
                int32_t *read, float *work) {
    if (k < 1 || k >= t->K) k = 1;
    for (int b = 0; b < B; b++)
        read[b] = certify_row(t, h + (int64_t)b * t->C, k, ids + (int64_t)b * t->K, logits + (int64_t)b * t->K,
                              bar + b, work);
    return 0;
}

static int cmp_i64(const void *a, const void *b) {
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* After g2e_certify, the runtime's check and rows (fused.py's FusedReader.certified and row, in one call): row b
   is certified (ok[b] = 1) when its k best candidates are k distinct rows whose least logit beats the bar and the
   (k+1)-th candidate by more than tie; then rows[b] (V,) gets -inf but at the candidates, their logits shifted so
   the best is 0 (only the ids written last time, last[b], are reset; last_ok[b] = 0: the whole row). Uncertified
   rows are left to the caller (the full head). scratch: 2 K floats and K ints. */
int g2e_rows(int32_t B, int32_t K, int64_t V, int32_t k, double tie, const int64_t *ids, const double *logits,
             const double *bar, int8_t *ok, float *rows, int64_t *last, int8_t *last_ok, float *scratch) {
    float *vals = scratch, *copy = scratch + K;
    int32_t *sel = (int32_t *)(scratch + 2 * K);
    for (int b = 0; b < B; b++) {
        const int64_t *id = ids + (int64_t)b * K;
        const double *ex = logits + (int64_t)b * K;
        const double br = bar[b];
        int good = 0;
        if (br == br && k >= 1 && k < K) {
            if (k == 1) {
                int j = 0;
                for (int i = 1; i < K; i++) j = ex[i] > ex[j] ? i : j;
                double second = -INFINITY;
                for (int i = 0; i < K; i++)
                    if (i != j && ex[i] > second) second = ex[i];
                good = ex[j] - tie > br && ex[j] - tie > second;
            } else {
                for (int i = 0; i < K; i++) vals[i] = (float)ex[i];
                select_top(vals, sel, copy, K, k);  /* float order; the rule below is on the doubles */
                double kth = INFINITY, next = -INFINITY;
                for (int i = 0; i < k; i++) {
                    kth = ex[sel[i]] < kth ? ex[sel[i]] : kth;
                    vals[sel[i]] = NAN;
                }
                for (int i = 0; i < K; i++)
                    if (vals[i] == vals[i] && ex[i] > next) next = ex[i];
                int distinct = k <= 256;  /* MAX_TOP_K is 100 */
                int64_t keep[256];
                if (distinct) {
                    for (int i = 0; i < k; i++) keep[i] = id[sel[i]];
                    qsort(keep, k, sizeof(int64_t), cmp_i64);
                    for (int i = 1; i < k; i++) distinct &= keep[i] != keep[i - 1];
                }
                good = distinct && kth - tie > br && kth - tie > next;
            }
        }
        ok[b] = (int8_t)good;
        if (!good) continue;
        float *out = rows + (int64_t)b * V;
        int64_t *prev = last + (int64_t)b * K;
        if (last_ok[b]) {
            for (int i = 0; i < K; i++) out[prev[i]] = -INFINITY;
        } else {
            for (int64_t v = 0; v < V; v++) out[v] = -INFINITY;
        }
        double mx = ex[0];
        for (int i = 1; i < K; i++) mx = ex[i] > mx ? ex[i] : mx;
        for (int i = 0; i < K; i++) out[id[i]] = (float)(ex[i] - mx);
        memcpy(prev, id, sizeof(int64_t) * K);
        last_ok[b] = 1;
    }
    return 0;
}
