/* y[M, N] = x[M, K] . w[N, K]^T for a few rows M (decode batches: 5-16 rows; one row: dotb below), float32.
 *
 * Tiles of 4 weight rows x 4 rows of x: 16 vector accumulators over K, so each weight element is loaded from
 * memory once per 4-row block of x and from L1 for the other blocks (the 4 weight rows, 4 * K floats, stay in L1
 * while every block of x passes), and each x element once per 4 weight rows. The weight rows of the tile two tiles
 * on are prefetched into L2 at the same offset as the rows read now (by the first block of x only): a tile's 4 rows
 * are 4 short streams (1.5-4 KB each) that the hardware prefetcher alone read at ~9 GB/s at 5-8 rows of x (with it
 * x1.2-2 cold, bench/small_gemm.py; x1.0-1.2 at 16 rows, where the FMAs bound it; a 16-sequence decode step of the
 * bench checkpoint x1.13, bench/decode_ops.py). GCC/Clang vector extensions, built with -march=native at first use
 * (AVX-512 16-wide here, AVX2 / NEON elsewhere), no intrinsics. Rows past M or N
 * in a tile: the last weight row repeated (computed, not stored); a block of x has only the rows there are. Each
 * output's K is summed in 16 lanes, then across them (a tile's 16 outputs in one transposing tree, hsum16: x1.04-1.1
 * cold at 16 rows against 16 horizontal sums): another order than the BLAS's (~1e-6 relative). */
#include <stdint.h>
#include <math.h>
#include <string.h>

#define VL 16
typedef float vf __attribute__((vector_size(VL * sizeof(float))));

static inline vf load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof(v));
    return v;
}

/* lane i of the result: the sum of v[i]'s lanes, for 16 vectors (a transposing tree: 15 shuffle pairs and adds
 * instead of 16 horizontal sums) */
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
static inline vf hsum16(const vf v[16]) {
    vf p[8], q[4], r[2];
    for (int i = 0; i < 8; i++)
        p[i] = SHUF(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               SHUF(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        q[i] = SHUF(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               SHUF(p[2 * i], p[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        r[i] = SHUF(q[2 * i], q[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               SHUF(q[2 * i], q[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return SHUF(r[0], r[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           SHUF(r[0], r[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

static inline float hsum(vf v) {
    float s = 0.0f;
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
}

#define KC 256 /* K block: 4 weight rows and 16 rows of x of it (20 KB) stay in L1 across the row blocks */
#define MMAX 16
#define MAXK 16 /* decode_tail: the most picks a token (top_k) */
#define MAXG 64 /* decode_tail: the most expert groups */
#define PF_TILES 2 /* prefetch the weight rows of the tile this many tiles on (into L2: _MM_HINT_T1) */

/* acc[i][j] += x row i . w row j over [k0, k1) for the mr <= 4 rows of one block (mr a constant once inlined);
 * pf: the rows to prefetch at the same offsets, or NULL */
static inline __attribute__((always_inline)) void tile(int mr, vf acc[4][4], const float *const xr[4],
                                                       const float *const wr[4], int64_t k0, int64_t k1,
                                                       const float *const *pf) {
    vf a[4][4];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < 4; j++) a[i][j] = acc[i][j];
    for (int64_t kk = k0; kk < k1; kk += VL) {
        if (pf)
            for (int j = 0; j < 4; j++) __builtin_prefetch(pf[j] + kk, 0, 1);
        vf w0 = load(wr[0] + kk), w1 = load(wr[1] + kk), w2 = load(wr[2] + kk), w3 = load(wr[3] + kk);
        __asm__("" : "+v"(w0), "+v"(w1), "+v"(w2), "+v"(w3)); /* kept in registers: one load each */
        for (int i = 0; i < mr; i++) {
            vf xv = load(xr[i] + kk);
            __asm__("" : "+v"(xv));
            a[i][0] += xv * w0;
            a[i][1] += xv * w1;
            a[i][2] += xv * w2;
            a[i][3] += xv * w3;
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = a[i][j];
}

#define NB 8 /* one-row GEMVs (decode_head, decode_tail, small_gemm at one row): rows a block */

/* y[0..NB) = x . w rows wr[0..NB) over k: one accumulator a row, the NB rows read side by side. No software
 * prefetch: NB concurrent row streams is what the hardware prefetcher reads fastest here (a 8192 x 1024 GEMV cold:
 * 13.6 / 26.9 GB/s on 1 / 2 threads against 11.6 / 23.8 for 4 rows with 4 more prefetched into L2, 12.4 / 26.2
 * for 4 rows alone, 13.2 / 27.7 for 16; the prefetch helped only at K = 384, ~5%). */
static inline void dotb(const float *x, const float *const wr[NB], int64_t k, float y[NB]) {
    vf a[16];
    const int64_t kv = k - k % VL;
    memset(a, 0, sizeof(a));
    for (int64_t kk = 0; kk < kv; kk += VL) {
        const vf xv = load(x + kk);
        for (int j = 0; j < NB; j++) a[j] += load(wr[j] + kk) * xv;
    }
    const vf s = hsum16(a); /* lane j: row j's sum */
    for (int j = 0; j < NB; j++) {
        float t = s[j];
        for (int64_t kk = kv; kk < k; kk++) t += x[kk] * wr[j][kk];
        y[j] = t;
    }
}

/* The rows [i0, i0 + NB) of a one-row GEMV as pointers (clamped to n: rows past it repeat the last, computed, not
 * stored): row(i) = w + (i / g) * sg + (i % g) * sr for groups of g rows */
static inline void rowsb(const float *w, int64_t i0, int64_t n, int64_t g, int64_t sg, int64_t sr, const float *wr[NB]) {
    for (int j = 0; j < NB; j++) {
        const int64_t i = i0 + j < n ? i0 + j : n - 1;
        wr[j] = w + (i / g) * sg + (i % g) * sr;
    }
}

/* y[:n] = w . x for w [n, k] (rows ldw apart): the rows shared by the threads of the enclosing parallel region in
 * static blocks of NB (an orphaned `omp for`: its barrier at the end; on one thread outside a region) */
static void gemv_rows(const float *x, const float *w, int64_t ldw, int64_t n, int64_t k, float *y) {
#pragma omp for schedule(static)
    for (int64_t b = 0; b < (n + NB - 1) / NB; b++) {
        const float *wr[NB];
        float yv[NB];
        rowsb(w, NB * b, n, 1, ldw, 0, wr);
        dotb(x, wr, k, yv);
        for (int64_t j = 0; j < NB && NB * b + j < n; j++) y[NB * b + j] = yv[j];
    }
}

/* x: [M, K] rows ldx apart; w: [N, K] rows ldw apart; y: [M, N] rows ldy apart; M <= MMAX; `threads` OpenMP
 * threads (torch's own pool: the same libgomp) share the weight-row tiles. Returns 0, or -1 when M is out of range
 * (nothing written). */
int small_gemm(const float *x, int64_t ldx, const float *w, int64_t ldw, float *y, int64_t ldy, int64_t m,
               int64_t n, int64_t k, int threads) {
    if (m < 1 || m > MMAX) return -1;
    if (m == 1) { /* one row: NB weight rows side by side (dotb) */
#pragma omp parallel num_threads(threads) if (threads > 1)
        gemv_rows(x, w, ldw, n, k, y);
        return 0;
    }
    const int64_t kv = k - k % VL;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t n0 = 0; n0 < n; n0 += 4) {
        vf acc[MMAX / 4][4][4];
        const float *wr[4], *pf[4];
        for (int j = 0; j < 4; j++) {
            wr[j] = w + (n0 + j < n ? n0 + j : n - 1) * ldw;
            pf[j] = w + (n0 + 4 * PF_TILES + j < n ? n0 + 4 * PF_TILES + j : n - 1) * ldw;
        }
        memset(acc, 0, sizeof(acc));
        for (int64_t k0 = 0; k0 < kv; k0 += KC) {
            const int64_t k1 = k0 + KC < kv ? k0 + KC : kv;
            for (int64_t m0 = 0; m0 < m; m0 += 4) {
                const float *xr[4];
                for (int i = 0; i < 4; i++) xr[i] = x + (m0 + i < m ? m0 + i : m - 1) * ldx;
                switch (m - m0 < 4 ? m - m0 : 4) {
                case 1: tile(1, acc[m0 / 4], xr, wr, k0, k1, m0 ? NULL : pf); break;
                case 2: tile(2, acc[m0 / 4], xr, wr, k0, k1, m0 ? NULL : pf); break;
                case 3: tile(3, acc[m0 / 4], xr, wr, k0, k1, m0 ? NULL : pf); break;
                default: tile(4, acc[m0 / 4], xr, wr, k0, k1, m0 ? NULL : pf); break;
                }
            }
        }
        vf sums;
        for (int64_t i = 0; i < m; i++) {
            const float *xi = x + i * ldx;
            if (i % 4 == 0) sums = hsum16(acc[i / 4][0]); /* the block's 4 x 4 sums, lane (i % 4) * 4 + j */
            for (int j = 0; j < 4 && n0 + j < n; j++) {
                float s = sums[(i % 4) * 4 + j];
                for (int64_t kk = kv; kk < k; kk++) s += xi[kk] * wr[j][kk];
                y[i * ldy + n0 + j] = s;
            }
        }
    }
    return 0;
}

/* The routed experts of a MoE layer for n <= MMAX tokens (a decode batch), one call instead of the per-expert loop's
 * ~8 framework ops an expert: out[t] = sum over token t's picks, in expert-id order, of wts[t, j] * down_e(silu(g) * u)
 * with [g | u] = gate_up_e . x[t] (the grouped path's grouping and order of additions, as index_add_ into zeros;
 * each matmul on small_gemm, whose sums differ from the loop's 1-4 row kernel by float32 rounding). x: [n, h] contiguous; ids, wts: [n, k] (a token's
 * picks distinct); expert e's gate | up rows [2 * inter, h] at gate_up + e * gu_se (rows h apart), its down [h, inter]
 * at down + e * dn_se (rows dn_ld apart); out: [n, h] (written); scratch: n * (2 h + 3 inter) floats. Each matmul
 * runs on `threads` OpenMP threads (small_gemm). Returns 0, or -1 when n or an expert id is out of range (out then
 * undefined). */
int moe_experts(const float *x, int64_t n, int64_t h, const int64_t *ids, const float *wts, int64_t k,
                const float *gate_up, int64_t gu_se, const float *down, int64_t dn_se, int64_t dn_ld, int64_t inter,
                int64_t n_exp, float *out, float *scratch, int threads) {
    if (n < 1 || n > MMAX) return -1;
    for (int64_t i = 0; i < n * k; i++)
        if (ids[i] < 0 || ids[i] >= n_exp) return -1;
    float *xs = scratch, *gu = xs + n * h, *act = gu + n * 2 * inter, *ys = act + n * inter;
    memset(out, 0, (size_t)(n * h) * sizeof(float));
    for (int64_t e = 0; e < n_exp; e++) {
        int64_t tok[MMAX];
        float wt[MMAX];
        int64_t c = 0;
        for (int64_t t = 0; t < n; t++)
            for (int64_t j = 0; j < k; j++)
                if (ids[t * k + j] == e) {
                    tok[c] = t;
                    wt[c++] = wts[t * k + j];
                    break;
                }
        if (c == 0) continue;
        for (int64_t r = 0; r < c; r++) memcpy(xs + r * h, x + tok[r] * h, (size_t)h * sizeof(float));
        small_gemm(xs, h, gate_up + e * gu_se, h, gu, 2 * inter, c, 2 * inter, h, threads);
        for (int64_t r = 0; r < c; r++) {
            const float *g = gu + r * 2 * inter, *u = g + inter;
            float *a = act + r * inter;
            for (int64_t i = 0; i < inter; i++) a[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
        }
        small_gemm(act, inter, down + e * dn_se, dn_ld, ys, h, c, h, inter, threads);
        for (int64_t r = 0; r < c; r++) {
            float *o = out + tok[r] * h;
            const float *y = ys + r * h;
            for (int64_t i = 0; i < h; i++) o[i] += y[i] * wt[r];
        }
    }
    return 0;
}

/* One block of columns [n0, n0 + nvec * VL) of y[m rows] = x . w over k rows of w (m * nvec <= 16 accumulators),
 * each row's block read once, in memory order (mr, nvec constants once inlined). */
static inline __attribute__((always_inline)) void kn_block(int mr, int nvec, const float *xb, int64_t sxm,
                                                           const float *wb, int64_t swk, float *yb, int64_t n,
                                                           int64_t n0, int64_t k) {
    vf a[4][16];
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < nvec; v++) a[i][v] = (vf){0};
    for (int64_t kk = 0; kk < k; kk++) {
        const float *wr = wb + kk * swk + n0;
        for (int v = 0; v < nvec; v++) {
            const vf wv = load(wr + v * VL);
            for (int i = 0; i < mr; i++) a[i][v] += xb[i * sxm + kk] * wv;
        }
    }
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < nvec; v++) memcpy(yb + i * n + n0 + v * VL, &a[i][v], sizeof(vf));
}

/* y[b, m, :] = sum_k x[b, m, k] * w[b, k, :] for a weight whose N dimension is contiguous (the absorbed
 * attention's per-head W_UK [H, nope, r] at decode): each weight row is read once, in memory order, for the m <= 4
 * rows of x; columns in blocks of 16 / m vectors (16 accumulators: one row of x takes 256 columns of a weight row
 * at a time). x: rows sxm apart, batches sxb apart; w: rows swk apart, batches swb apart; y: [B, M, N] contiguous.
 * `threads` OpenMP threads share the batches. Returns 0, or -1 when M is out of range (nothing written). Each
 * output sums over k in k order. */
int bgemv_kn(const float *x, int64_t sxb, int64_t sxm, const float *w, int64_t swb, int64_t swk, float *y,
             int64_t nb, int64_t m, int64_t k, int64_t n, int threads) {
    if (m < 1 || m > 4) return -1;
    const int64_t nvec = 16 / (m == 3 ? 4 : m), nc = nvec * VL; /* 16, 8, 4, 4 vectors */
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * sxb, *wb = w + b * swb;
        float *yb = y + b * m * n;
        int64_t n0 = 0;
        for (; n0 + nc <= n; n0 += nc) switch (m) {
            case 1: kn_block(1, 16, xb, sxm, wb, swk, yb, n, n0, k); break;
            case 2: kn_block(2, 8, xb, sxm, wb, swk, yb, n, n0, k); break;
            case 3: kn_block(3, 4, xb, sxm, wb, swk, yb, n, n0, k); break;
            default: kn_block(4, 4, xb, sxm, wb, swk, yb, n, n0, k); break;
            }
        for (; n0 + VL <= n; n0 += VL) switch (m) { /* whole vectors past the last block */
            case 1: kn_block(1, 1, xb, sxm, wb, swk, yb, n, n0, k); break;
            case 2: kn_block(2, 1, xb, sxm, wb, swk, yb, n, n0, k); break;
            case 3: kn_block(3, 1, xb, sxm, wb, swk, yb, n, n0, k); break;
            default: kn_block(4, 1, xb, sxm, wb, swk, yb, n, n0, k); break;
            }
        for (int64_t c = n0; c < n; c++) /* columns past the last vector */
            for (int i = 0; i < m; i++) {
                float s = 0.0f;
                for (int64_t kk = 0; kk < k; kk++) s += xb[i * sxm + kk] * wb[kk * swk + c];
                yb[i * n + c] = s;
            }
    }
    return 0;
}

#define HB 8  /* heads per block: 8 independent accumulator chains */
#define RC (2 * VL) /* value columns per pass: 8 heads x 2 vectors of accumulators in registers */

/* The absorbed MLA attention of decode tokens over their selected cached rows, read in place from the pool's
 * float32 rows (no gathered copy): per token t and head h, s_j = scale * q[t, h] . row(slots[t, j]) + bias[t, j]
 * over the k selected rows, p = softmax(s) (float32, max subtracted), out[t, h, :] = sum_j p_j * row(...)[:r].
 * q: [T, H, D] contiguous (D = r + rope); rows: D floats each, ldr apart; slots: [T, k] int64 in range (checked
 * by the caller); bias: [T, k] (0 or -inf) or NULL; out: [T, H, r] contiguous; scratch_all: T * H * k floats.
 * Heads run in blocks of 8 (a block past H repeats the last head, computed, not stored); `threads` OpenMP threads
 * share the (token, head block) pairs. Sums run in another order than the BLAS's (~1e-6 relative). Returns 0. */
/* One (token, block of HB heads from h0) of mla_decode: qt [nh, d] the token's query, st / bt its k slots / bias (or
 * NULL), ot [nh, r] its output, scratch nh * k floats */
static void mla_block(const float *qt, int64_t nh, int64_t d, int64_t r, const float *rows, int64_t ldr,
                      const int64_t *st, int64_t k, const float *bt, float scale, float *ot, float *scratch, int64_t h0) {
    const int64_t dv = d - d % VL, rv = r - r % RC;
    const float *qh[HB];
    int64_t hi[HB];
    for (int i = 0; i < HB; i++) {
        hi[i] = h0 + i < nh ? h0 + i : nh - 1;
        qh[i] = qt + hi[i] * d;
    }
    for (int64_t j = 0; j < k; j++) { /* scores: the row read once for the block's heads */
        const float *row = rows + st[j] * ldr;
        vf a[HB];
        memset(a, 0, sizeof(a));
        for (int64_t i = 0; i < dv; i += VL) {
            const vf rw = load(row + i);
            for (int hh = 0; hh < HB; hh++) a[hh] += load(qh[hh] + i) * rw;
        }
        const float b = bt ? bt[j] : 0.0f;
        for (int hh = 0; hh < HB; hh++) {
            float sc = hsum(a[hh]);
            for (int64_t i = dv; i < d; i++) sc += qh[hh][i] * row[i];
            scratch[hi[hh] * k + j] = scale * sc + b;
        }
    }
    for (int hh = 0; hh < HB && h0 + hh < nh; hh++) { /* softmax over the k scores of each head */
        float *p = scratch + (h0 + hh) * k, mx = p[0], sum = 0.0f;
        for (int64_t j = 1; j < k; j++) mx = p[j] > mx ? p[j] : mx;
        for (int64_t j = 0; j < k; j++) {
            p[j] = expf(p[j] - mx);
            sum += p[j];
        }
        const float inv = 1.0f / sum;
        for (int64_t j = 0; j < k; j++) p[j] *= inv;
    }
    for (int64_t c0 = 0; c0 < rv; c0 += RC) { /* values: 8 heads x RC columns in registers over the rows */
        vf a[HB][2];
        memset(a, 0, sizeof(a));
        for (int64_t j = 0; j < k; j++) {
            const float *row = rows + st[j] * ldr + c0;
            const vf r0 = load(row), r1 = load(row + VL);
            for (int hh = 0; hh < HB; hh++) {
                const float pj = scratch[hi[hh] * k + j];
                a[hh][0] += pj * r0;
                a[hh][1] += pj * r1;
            }
        }
        for (int hh = 0; hh < HB && h0 + hh < nh; hh++) memcpy(ot + (h0 + hh) * r + c0, a[hh], sizeof(a[hh]));
    }
    for (int64_t c = rv; c < r; c++) /* columns past the last pass */
        for (int hh = 0; hh < HB && h0 + hh < nh; hh++) {
            float o = 0.0f;
            for (int64_t j = 0; j < k; j++) o += scratch[(h0 + hh) * k + j] * rows[st[j] * ldr + c];
            ot[(h0 + hh) * r + c] = o;
        }
}

int mla_decode(const float *q, int64_t nt, int64_t nh, int64_t d, int64_t r, const float *rows, int64_t ldr,
               const int64_t *slots, int64_t k, const float *bias, float scale, float *out, float *scratch_all,
               int threads) {
    const int64_t nhb = (nh + HB - 1) / HB;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t tb = 0; tb < nt * nhb; tb++) { /* (token, block of heads) pairs: independent */
        const int64_t t = tb / nhb;
        mla_block(q + t * nh * d, nh, d, r, rows, ldr, slots + t * k, k, bias ? bias + t * k : NULL, scale,
                  out + t * nh * r, scratch_all + t * nh * k, (tb % nhb) * HB);
    }
    return 0;
}

/* y = x * (1 / sqrt(mean(x^2) + eps)) * w over n */
static void rms_row(const float *x, const float *w, float eps, int64_t n, float *y) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) y[i] = x[i] * inv * w[i];
}

static inline float silu_mul(float g, float u) { return g / (1.0f + expf(-g)) * u; }

/* The router's choice for one token (moe_fused.route): sigmoid scores, + bias for the choice, group-limited
 * (a group's score: its top-2 choices' sum; the topk_group best groups kept), top_k picks (ties: the lower id),
 * weights = the picked scores (/ their sum + 1e-20 when norm) * scaling. sc: 2 * e floats of scratch. */
static void route1(const float *logits, int64_t e, const float *bias, int64_t top_k, int64_t n_group,
                   int64_t topk_group, int norm, float scaling, int64_t *ids, float *wts, float *sc) {
    float *ch = sc + e;
    for (int64_t i = 0; i < e; i++) {
        sc[i] = 1.0f / (1.0f + expf(-logits[i]));
        ch[i] = sc[i] + bias[i];
    }
    if (topk_group < n_group) {
        const int64_t per = e / n_group;
        float gs[MAXG];
        int keep[MAXG];
        for (int64_t g = 0; g < n_group; g++) {
            float a = -INFINITY, b = -INFINITY;
            for (int64_t i = g * per; i < (g + 1) * per; i++)
                if (ch[i] > a) {
                    b = a;
                    a = ch[i];
                } else if (ch[i] > b)
                    b = ch[i];
            gs[g] = per > 1 ? a + b : a;
            keep[g] = 0;
        }
        for (int64_t p = 0; p < topk_group; p++) {
            int64_t best = -1;
            for (int64_t g = 0; g < n_group; g++)
                if (!keep[g] && (best < 0 || gs[g] > gs[best])) best = g;
            keep[best] = 1;
        }
        for (int64_t i = 0; i < e; i++)
            if (!keep[i / per]) ch[i] = -INFINITY;
    }
    float sum = 0.0f;
    for (int64_t p = 0; p < top_k; p++) {
        int64_t best = -1;
        for (int64_t i = 0; i < e; i++) {
            int taken = 0;
            for (int64_t q = 0; q < p; q++) taken |= ids[q] == i;
            if (!taken && (best < 0 || ch[i] > ch[best])) best = i;
        }
        ids[p] = best;
        wts[p] = sc[best];
        sum += wts[p];
    }
    for (int64_t p = 0; p < top_k; p++) wts[p] = (norm ? wts[p] / (sum + 1e-20f) : wts[p]) * scaling;
}

/* A batch-1 decoder layer's tail after its attention core (decode_one's B) in one call: o = o_lat . W_UV per head,
 * h = stream + W_o . o, xn = rms_norm(h) * norm_w, then the MoE: t = tail . xn (router logits | shared gate |
 * shared up), the router's top_k picks, each picked expert's gate | up . xn, silu(gate) * up, its down, and
 * out = shared_down . (silu * up of the shared) + sum over picks (in pick order) of weight * down_e . act + h;
 * or, n_exp == 0, a dense MLP: gate_up [2I, hidden] and down [hidden, I] (out = down . act + h). Every GEMV row
 * read once, the threads of one parallel region sharing each GEMV's rows in static blocks of NB (8 barriers).
 * o_lat: [nh, r]; W_UV head h's row i at w_uv + h * uv_sh + i * uv_sr (r contiguous), v rows a head (v % NB == 0);
 * w_o: [hid, nh * v] rows ld_o apart; tail: [rr + 2 is, hid] contiguous; bias: [rr]; gate_up: expert e's [2I, hid]
 * at gate_up + e * gu_se; down: expert e's [hid, I] at down + e * dn_se, rows dn_ld apart; shared_down: [hid, is]
 * rows sd_ld apart; out: [hid]; scratch: nh * v + 2 hid + rr + 2 is + top_k * 3 I + is + 2 rr floats. Returns 0,
 * or -1 when a size is out of range (nothing written). */
int decode_tail(const float *o_lat, int64_t nh, int64_t r, const float *w_uv, int64_t uv_sh, int64_t uv_sr,
                int64_t v, const float *w_o, int64_t ld_o, const float *stream, const float *norm_w, float eps,
                int64_t hid, const float *tail, int64_t rr, int64_t is, const float *bias, int64_t top_k,
                int64_t n_group, int64_t topk_group, int norm, float scaling, const float *gate_up, int64_t gu_se,
                int64_t inter, int64_t n_exp, const float *down, int64_t dn_se, int64_t dn_ld,
                const float *shared_down, int64_t sd_ld, float *out, float *scratch, int threads) {
    const int dense = n_exp == 0;
    const int64_t nk = dense ? 1 : top_k, hv = nh * v, nt = rr + 2 * is;
    if (v % NB || (2 * inter) % NB || nk < 1 || nk > MAXK || hid < 1 || r < 1 || inter < 1 ||
        (!dense && (rr < 1 || rr != n_exp || top_k > rr || n_group < 1 || n_group > MAXG || rr % n_group ||
                    topk_group < 1 || topk_group > n_group)))
        return -1;
    float *o = scratch, *h = o + hv, *xn = h + hid, *t = xn + hid, *gu = t + nt, *act = gu + nk * 2 * inter;
    float *sact = act + nk * inter, *rsc = sact + is;
    int64_t ids[MAXK] = {0};
    float wts[MAXK] = {1.0f};
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t b = 0; b < hv / NB; b++) { /* o = o_lat . W_UV per head (a block of NB rows: one head) */
            const float *wr[NB];
            rowsb(w_uv, NB * b, hv, v, uv_sh, uv_sr, wr);
            dotb(o_lat + (NB * b / v) * r, wr, r, o + NB * b);
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < (hid + NB - 1) / NB; b++) { /* h = stream + W_o . o */
            const float *wr[NB];
            float y[NB];
            rowsb(w_o, NB * b, hid, 1, ld_o, 0, wr);
            dotb(o, wr, hv, y);
            for (int64_t j = 0; j < NB && NB * b + j < hid; j++) h[NB * b + j] = y[j] + stream[NB * b + j];
        }
#pragma omp single
        rms_row(h, norm_w, eps, hid, xn);
        if (!dense) {
            gemv_rows(xn, tail, hid, nt, hid, t); /* router logits | shared gate | shared up */
#pragma omp single
            {
                route1(t, rr, bias, top_k, n_group, topk_group, norm, scaling, ids, wts, rsc);
                for (int64_t i = 0; i < is; i++) sact[i] = silu_mul(t[rr + i], t[rr + is + i]);
            }
        }
        const int64_t g2 = 2 * inter;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < nk * g2 / NB; b++) { /* each pick's gate | up (a block of NB rows: one expert) */
            const int64_t j = NB * b / g2;
            const float *wr[NB];
            rowsb(gate_up + ids[j] * gu_se, NB * b - j * g2, g2, 1, hid, 0, wr);
            dotb(xn, wr, hid, gu + NB * b);
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < nk * inter; i++) {
            const int64_t j = i / inter, c = i % inter;
            act[i] = silu_mul(gu[j * g2 + c], gu[j * g2 + inter + c]);
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < (hid + NB - 1) / NB; b++) { /* out = shared + the picks' weighted downs + h */
            const float *wr[NB];
            float y[NB], s[NB] = {0.0f}, routed[NB] = {0.0f};
            for (int64_t j = 0; j < nk; j++) {
                rowsb(down + ids[j] * dn_se, NB * b, hid, 1, dn_ld, 0, wr);
                dotb(act + j * inter, wr, inter, y);
                for (int q = 0; q < NB; q++) routed[q] = j ? routed[q] + y[q] * wts[j] : (dense ? y[q] : y[q] * wts[0]);
            }
            if (!dense) {
                rowsb(shared_down, NB * b, hid, 1, sd_ld, 0, wr);
                dotb(sact, wr, is, s);
            }
            for (int64_t q = 0; q < NB && NB * b + q < hid; q++)
                out[NB * b + q] = (dense ? routed[q] : s[q] + routed[q]) + h[NB * b + q];
        }
    }
    return 0;
}

/* y[:n] = x[:k] . w (k rows of n, rows swk apart, n contiguous), each column summed over k in k order */
static void kn_row(const float *x, const float *w, int64_t swk, float *y, int64_t k, int64_t n) {
    int64_t n0 = 0;
    for (; n0 + 16 * VL <= n; n0 += 16 * VL) kn_block(1, 16, x, 0, w, swk, y, n, n0, k);
    for (; n0 + VL <= n; n0 += VL) kn_block(1, 1, x, 0, w, swk, y, n, n0, k);
    for (int64_t c = n0; c < n; c++) {
        float s = 0.0f;
        for (int64_t kk = 0; kk < k; kk++) s += x[kk] * w[kk * swk + c];
        y[c] = s;
    }
}

/* y[:w] = x[:w] . rot (rot [w, w] row-major: y[j] = sum_i x[i] * rot[i, j]; the rope as its rotation matrix) */
static void rope_row(const float *x, const float *rot, int64_t w, float *y) {
    for (int64_t j = 0; j < w; j++) {
        float s = 0.0f;
        for (int64_t i = 0; i < w; i++) s += x[i] * rot[i * w + j];
        y[j] = s;
    }
}

/* A batch-1 decoder layer's attention up to its core (decode_one's A, W_UK and core) in one call: xa = rms_norm(x)
 * (ln1, eps1); y = w_x . xa over its first q_rank + rank + rope (+ ix_dim for a producer) rows (q_a | kv_a | the
 * index key); q_resid = rms_norm(y[q_a]) (q_norm); the KV row [rms_norm(y[latent]) (kv_norm) | y[k_rot] . rot]
 * written to the pool's row out_slot[0] (kv rows ldk apart); a producer's index key layer_norm(y[key]) (k_w, k_b,
 * k_eps) . ix_rot written to its pool row (ix rows ldi apart; ix NULL: a layer that shares another's); z = w_q .
 * q_resid over its first nh * (nope + rope) rows; per head the query [z[nope] . W_UK | z[rope] . rot] (W_UK head
 * h's row i at w_uk + h * uk_sh + i * uk_sr, rank contiguous); then the absorbed attention over the k pool rows
 * `slots` (mla_decode's, no bias) into o_lat [nh, rank]. w_x rows hid apart, w_q rows q_rank apart; rot [rope,
 * rope], ix_rot [ix_dim, ix_dim]; scratch: ny + q_rank + ix_dim + nh * (nope + 2 rope + rank) + nh * k floats. The
 * threads of one parallel region split each GEMV's rows (blocks of NB), the heads and the head blocks. Slots in
 * range: the caller's. Returns 0. */
int decode_head(const float *x, int64_t hid, const float *ln1, float eps1, const float *w_x, int64_t q_rank,
                int64_t rank, int64_t rope, const float *q_norm, float q_eps, const float *kv_norm, float kv_eps,
                const float *rot, const float *w_q, int64_t nh, int64_t nope, const float *w_uk, int64_t uk_sh,
                int64_t uk_sr, int64_t ix_dim, const float *ix_rot, const float *k_w, const float *k_b, float k_eps,
                float *kv, int64_t ldk, float *ix, int64_t ldi, const int64_t *out_slot, const int64_t *slots,
                int64_t k, float scale, float *o_lat, float *scratch, int threads) {
    const int64_t ny = q_rank + rank + rope + (ix ? ix_dim : 0), qd = nope + rope, nz = nh * qd, d = rank + rope;
    float *y = scratch, *xa = y + ny, *qr = xa + hid, *kt = qr + q_rank, *z = kt + ix_dim, *q = z + nz;
    float *sc = q + nh * d;
    float *kv_row = kv + out_slot[0] * ldk;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp single
        rms_row(x, ln1, eps1, hid, xa);
        gemv_rows(xa, w_x, hid, ny, hid, y); /* q_a | kv_a (| the index key) */
#pragma omp single
        {
            rms_row(y, q_norm, q_eps, q_rank, qr);
            rms_row(y + q_rank, kv_norm, kv_eps, rank, kv_row);
            rope_row(y + q_rank + rank, rot, rope, kv_row + rank);
            if (ix) { /* the index key: LayerNorm (biased variance), then its rope */
                const float *kr = y + q_rank + rank + rope;
                float mean = 0.0f, var = 0.0f;
                for (int64_t i = 0; i < ix_dim; i++) mean += kr[i];
                mean /= (float)ix_dim;
                for (int64_t i = 0; i < ix_dim; i++) var += (kr[i] - mean) * (kr[i] - mean);
                const float inv = 1.0f / sqrtf(var / (float)ix_dim + k_eps);
                for (int64_t i = 0; i < ix_dim; i++) kt[i] = (kr[i] - mean) * inv * k_w[i] + k_b[i];
                rope_row(kt, ix_rot, ix_dim, ix + out_slot[0] * ldi);
            }
        }
        gemv_rows(qr, w_q, q_rank, nz, q_rank, z); /* q_b: each head's nope | rope */
#pragma omp for schedule(static)
        for (int64_t h = 0; h < nh; h++) { /* the query: q_nope . W_UK | the roped part */
            kn_row(z + h * qd, w_uk + h * uk_sh, uk_sr, q + h * d, nope, rank);
            rope_row(z + h * qd + nope, rot, rope, q + h * d + rank);
        }
#pragma omp for schedule(static)
        for (int64_t h0 = 0; h0 < nh; h0 += HB)
            mla_block(q, nh, d, rank, kv, ldk, slots, k, NULL, scale, o_lat, sc, h0);
    }
    return 0;
}
