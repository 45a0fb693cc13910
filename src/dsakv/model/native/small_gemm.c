/* y[M, N] = x[M, K] . w[N, K]^T for a few rows M (decode batches: 5-16 rows), float32, one thread.
 *
 * Tiles of 4 weight rows x 4 rows of x: 16 vector accumulators over K, so each weight element is loaded from
 * memory once per 4-row block of x and from L1 for the other blocks (the 4 weight rows, 4 * K floats, stay in L1
 * while every block of x passes), and each x element once per 4 weight rows. GCC/Clang vector extensions, built
 * with -march=native at first use (AVX-512 16-wide here, AVX2 / NEON elsewhere), no intrinsics. Rows past M or N
 * in a tile: the last weight row repeated (computed, not stored); a block of x has only the rows there are. Each
 * output's K is summed in 16 lanes, then across them: another order than the BLAS's (~1e-6 relative). */
#include <stdint.h>
#include <string.h>

#define VL 16
typedef float vf __attribute__((vector_size(VL * sizeof(float))));

static inline vf load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof(v));
    return v;
}

static inline float hsum(vf v) {
    float s = 0.0f;
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
}

#define KC 256 /* K block: 4 weight rows and 16 rows of x of it (20 KB) stay in L1 across the row blocks */
#define MMAX 16

/* acc[i][j] += x row i . w row j over [k0, k1) for the mr <= 4 rows of one block (mr a constant once inlined) */
static inline __attribute__((always_inline)) void tile(int mr, vf acc[4][4], const float *const xr[4],
                                                       const float *const wr[4], int64_t k0, int64_t k1) {
    vf a[4][4];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < 4; j++) a[i][j] = acc[i][j];
    for (int64_t kk = k0; kk < k1; kk += VL) {
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

/* x: [M, K] rows ldx apart; w: [N, K] rows ldw apart; y: [M, N] rows ldy apart; M <= MMAX. Returns 0, or -1 when
 * M is out of range (nothing written). */
int small_gemm(const float *x, int64_t ldx, const float *w, int64_t ldw, float *y, int64_t ldy, int64_t m,
               int64_t n, int64_t k) {
    if (m < 1 || m > MMAX) return -1;
    const int64_t kv = k - k % VL;
    vf acc[MMAX / 4][4][4];
    for (int64_t n0 = 0; n0 < n; n0 += 4) {
        const float *wr[4];
        for (int j = 0; j < 4; j++) wr[j] = w + (n0 + j < n ? n0 + j : n - 1) * ldw;
        memset(acc, 0, sizeof(acc));
        for (int64_t k0 = 0; k0 < kv; k0 += KC) {
            const int64_t k1 = k0 + KC < kv ? k0 + KC : kv;
            for (int64_t m0 = 0; m0 < m; m0 += 4) {
                const float *xr[4];
                for (int i = 0; i < 4; i++) xr[i] = x + (m0 + i < m ? m0 + i : m - 1) * ldx;
                switch (m - m0 < 4 ? m - m0 : 4) {
                case 1: tile(1, acc[m0 / 4], xr, wr, k0, k1); break;
                case 2: tile(2, acc[m0 / 4], xr, wr, k0, k1); break;
                case 3: tile(3, acc[m0 / 4], xr, wr, k0, k1); break;
                default: tile(4, acc[m0 / 4], xr, wr, k0, k1); break;
                }
            }
        }
        for (int64_t i = 0; i < m; i++) {
            const float *xi = x + i * ldx;
            for (int j = 0; j < 4 && n0 + j < n; j++) {
                float s = hsum(acc[i / 4][i % 4][j]);
                for (int64_t kk = kv; kk < k; kk++) s += xi[kk] * wr[j][kk];
                y[i * ldy + n0 + j] = s;
            }
        }
    }
    return 0;
}
