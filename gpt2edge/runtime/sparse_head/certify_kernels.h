/* The kernels of gpt2edge's native certified step (_certify.c includes this, once): the tables' layout, the
   vectorised sums, the selection of the k largest and the exact logits of a set of rows. */

#ifndef GPT2EDGE_CERTIFY_KERNELS_H
#define GPT2EDGE_CERTIFY_KERNELS_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__APPLE__)
#define HOT __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define HOT
#endif

typedef struct {
    int32_t C, r, rg, G, S, m, K, V;
    int32_t kind;       /* 0: fp32 weight rows; 1: codes, float activations; 2: codes, int8 activations (level 4) */
    int32_t bs, kb;     /* the codes' block size and blocks per row */
    float slack_coef;   /* the float allowance per unit of ||h_eff|| (slack_scale + eps_par) */
    float tie;          /* logits closer than this are undecided (exact.py's TIE) */
    int32_t extra_rows, extra_groups;  /* step 5's budgets (0: off) */
    const float *q;     /* (C, r) */
    const float *qg;    /* (C, rg): the group bound's directions (== q when rg == r) */
    const float *qt;    /* (r, C): Q^T */
    const float *qgt;   /* (rg, C) */
    const float *mu;    /* (C,) */
    const float *gtab;  /* (rg + 2, G): [c_g; eps_g; rad_g] */
    const int32_t *members; /* (G, S) row ids */
    const float *rowt;  /* (G, r + 1, S): each group's members' [a_i; eps_i], transposed */
    const float *weight;    /* (V, C) fp32 rows (kind 0) */
    const uint8_t *codes;   /* (V, C) one code per byte (kinds 1, 2) */
    const uint8_t *zps;     /* (V, kb) */
    const float *scales;    /* (V, kb) */
} g2e_tables;

/* x (n,) times a (n, cols) row-major -> out (cols,), in float: out[c] = sum_j x[j] a[j][c]; 64 columns at a
   time in local sums (registers), not re-read and re-written from memory for each j */
HOT static void axpy_rows(const float *restrict x, const float *restrict a, int n, int cols, float *restrict out) {
    int c0 = 0;
    for (; c0 + 64 <= cols; c0 += 64) {
        float acc[64] = {0};
        for (int j = 0; j < n; j++) {
            const float xj = x[j];
            const float *restrict aj = a + (int64_t)j * cols + c0;
            for (int c = 0; c < 64; c++) acc[c] += xj * aj[c];
        }
        memcpy(out + c0, acc, sizeof acc);
    }
    for (int c = c0; c < cols; c++) out[c] = 0.0f;
    for (int j = 0; j < n; j++) {
        const float xj = x[j];
        const float *restrict aj = a + (int64_t)j * cols;
        for (int c = c0; c < cols; c++) out[c] += xj * aj[c];
    }
}

/* ask for every cache line of [p, p + bytes) (a hint: no fault, no effect on results) */
static inline void prefetch_span(const void *p, int64_t bytes) {
    const char *c = (const char *)p;
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o);
    __builtin_prefetch(c + bytes - 1);
}

/* ||h - Q (Q^T h)|| with hq = Q^T h: the projection as r axpys over C (qt is Q^T, (r, C)), the norm in double */
static double perp_norm(const float *h, const float *qt, const float *hq, int C, int r, float *proj) {
    axpy_rows(hq, qt, r, C, proj);
    double s = 0.0;
    for (int c = 0; c < C; c++) {
        const double d = (double)(h[c] - proj[c]);
        s += d * d;
    }
    return sqrt(s);
}

/* The k largest of v (n,): their positions in idx[0..k) (any order). The k-th largest by quickselect on a copy
   of the values (w, n floats: contiguous, no indirection), then one branchless pass for the values above it and
   the ties as needed (~4 us for 4,096 values; quickselect on positions took ~4x that). */
static void select_top(const float *v, int32_t *idx, float *w, int n, int k) {
    memcpy(w, v, sizeof(float) * n);
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        const float a = w[lo], b = w[lo + (hi - lo) / 2], c = w[hi];
        const float p = a < b ? (b < c ? b : (a < c ? c : a)) : (a < c ? a : (b < c ? c : b));
        int i = lo, j = hi;
        while (i <= j) {  /* descending: larger values to the left */
            while (w[i] > p) i++;
            while (w[j] < p) j--;
            if (i <= j) {
                const float t = w[i];
                w[i++] = w[j];
                w[j--] = t;
            }
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else break;
    }
    const float kth = w[k - 1];
    int taken = 0;
    for (int i = 0; i < n; i++) {  /* at most k - 1 values are above the k-th largest */
        idx[taken] = i;
        taken += v[i] > kth;
    }
    for (int i = 0; i < n && taken < k; i++)
        if (v[i] == kth) idx[taken++] = i;
    while (taken < k) idx[taken++] = 0;  /* NaN values: a repeated row, never certified (the bar is NaN too) */
}

/* the integer dot of one row's codes with the int8 activation, per block, times the scales (level 4): exact
   integers (|dot| <= 256 x 255 x 127 < 2^31), so any summation order gives exact.py's value */
HOT static double logit_int8(const g2e_tables *t, const uint8_t *codes, const uint8_t *zp, const float *sc,
                             const int32_t *qa, const int32_t *qsum, const float *sa) {
    double out = 0.0;
    for (int b = 0; b < t->kb; b++) {
        const int start = b * t->bs, end = start + t->bs < t->C ? start + t->bs : t->C;
        int32_t d = 0;
        for (int c = start; c < end; c++) d += (int32_t)codes[c] * qa[c];
        d -= (int32_t)zp[b] * qsum[b];
        out += (double)d * (double)(sc[b] * sa[b]);  /* the scales' product in float, as exact.py */
    }
    return out;
}

/* sum_c w(c) h[c] in double with 8 running sums (a single sum is one long dependency chain: ~4x slower) */
#define LANES 8
#define DOT_LANES(expr)                                                         \
    double lane[LANES] = {0};                                                   \
    int c = 0;                                                                  \
    for (; c + LANES <= C; c += LANES)                                          \
        for (int j = 0; j < LANES; j++) lane[j] += (double)(expr(c + j)) * (double)h[c + j]; \
    double out = 0.0;                                                           \
    for (; c < C; c++) out += (double)(expr(c)) * (double)h[c];                 \
    for (int j = 0; j < LANES; j++) out += lane[j];                             \
    return out;

/* a row's codes dequantized and times h, in double (kind 1: accuracy level 0/1) */
HOT static double logit_dequant(const uint8_t *codes, const uint8_t *zp, const float *sc, const float *h, int C,
                                int bs) {
#define DEQ(i) (((float)codes[i] - (float)zp[(i) / bs]) * sc[(i) / bs])
    DOT_LANES(DEQ)
#undef DEQ
}

HOT static double logit_f32(const float *w, const float *h, int C) {
#define W(i) w[i]
    DOT_LANES(W)
#undef W
}

/* The exact logits of rows ids[0..n) for the prepared activation. Rows are scattered over the table: every line
   is asked for first (the misses overlap), then read. */
static void exact_rows(const g2e_tables *t, const int64_t *ids, int n, double *out, const float *he,
                       const int32_t *qa, const int32_t *qsum, const float *sa) {
    const int C = t->C;
    const int64_t row_bytes = t->kind == 0 ? (int64_t)C * (int64_t)sizeof(float) : (int64_t)C;
    const uint8_t *rows = t->kind == 0 ? (const uint8_t *)t->weight : t->codes;
    for (int i = 0; i < n; i++) {
        prefetch_span(rows + ids[i] * row_bytes, row_bytes);
        if (t->kind != 0) {
            __builtin_prefetch(t->zps + ids[i] * t->kb);
            __builtin_prefetch(t->scales + ids[i] * t->kb);
        }
    }
    for (int i = 0; i < n; i++) {
        const int64_t row = ids[i];
        if (t->kind == 0) {
            out[i] = logit_f32(t->weight + row * C, he, C);
        } else {
            const uint8_t *cd = t->codes + row * C, *zp = t->zps + row * t->kb;
            const float *sc = t->scales + row * t->kb;
            out[i] = t->kind == 2 ? logit_int8(t, cd, zp, sc, qa, qsum, sa) : logit_dequant(cd, zp, sc, he, C, t->bs);
        }
    }
}

#endif
