/* Attention over packed scalar codes, without unpacking them into memory.

   Layout (packing.py): codes of shape (T, H, c) in token-major order; every 8 consecutive codes form one
   little-endian word of 8 * bits bits, code j at bit bits * j, stored in `bits` bytes. With c a multiple
   of 8, row (t, h) starts at byte ((t * H + h) * c / 8) * bits.

   pass_range, scoring: out[h, m, t] += sum_j q[h, m, j] * levels[code(t, h, j)]      q (H, M, c), out (H, M, T)
   pass_range, mixing:  out[h, m, j] += sum_t p[h, m, t] norm[h, t] levels[code(t, h, j)]  p (H, M, T), out (H, M, c)

   Eight codes are decoded at once into eight floats: one variable shift of the broadcast word, and a
   lookup in the levels held in up to four registers (up to 32 levels), or a gather beyond. Tokens are
   split into `threads` contiguous ranges (OpenMP); kv_mix_coded adds the per-thread sums at the end. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>
#include <math.h>

#define TB 4 /* tokens per pass */
#define MB 3 /* query rows per pass over the codes (a KV head's G query heads at one decoding step) */
#define MAX_ROWS 16 /* query rows a head's mix reads (native.MAX_ROWS): more go through the matmul path */

static inline __m256 decode8(const uint8_t *src, const int bits, const __m256 *lv, const float *levels) {
    __m256i idx;
    if (bits <= 4) {
        uint32_t w = 0;  /* byte by byte: a 3-byte memcpy into a 4-byte word stalls store forwarding */
        for (int i = 0; i < bits; i++) w |= (uint32_t)src[i] << (8 * i);
        const __m256i shifts = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(bits));
        idx = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)w), shifts),
                               _mm256_set1_epi32((1 << bits) - 1));
    } else {  /* 8 codes in 40..64 bits: codes 0-3 in the low 32 bits, codes 4-7 in the 32 after bit 4 * bits */
        uint64_t w = 0;
        for (int i = 0; i < bits; i++) w |= (uint64_t)src[i] << (8 * i);
        const uint32_t lo = (uint32_t)w, hi = (uint32_t)(w >> (4 * bits));
        const __m256i shifts = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3), _mm256_set1_epi32(bits));
        idx = _mm256_and_si256(_mm256_srlv_epi32(_mm256_setr_epi32(lo, lo, lo, lo, hi, hi, hi, hi), shifts),
                               _mm256_set1_epi32((1 << bits) - 1));
    }
    if (bits <= 3) return _mm256_permutevar8x32_ps(lv[0], idx);
    if (bits <= 5) {  /* a permute per register of 8 levels (index bits 0-2), blends on index bits 3 and 4 */
        const __m256 bit3 = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28));
        __m256 v = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lv[0], idx), _mm256_permutevar8x32_ps(lv[1], idx), bit3);
        if (bits == 4) return v;
        __m256 u = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lv[2], idx), _mm256_permutevar8x32_ps(lv[3], idx), bit3);
        return _mm256_blendv_ps(v, u, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 27)));
    }
    return _mm256_i32gather_ps(levels, idx, 4);
}

/* up to 32 levels in four registers, zero past the last */
static void load_levels(const float *levels, int bits, __m256 *lv) {
    float pad[32] = {0};
    int n = 1 << bits;
    memcpy(pad, levels, sizeof(float) * (n < 32 ? n : 32));
    for (int i = 0; i < 4; i++) lv[i] = _mm256_loadu_ps(pad + 8 * i);
}

/* the four horizontal sums of a, b, c, d */
static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

/* One channel part of a coded side, as a pass reads it: its codes from the pass's first token, channels per
   row, bytes from row (t, h) to row (t, h + 1) (c / 8 * bits, or more where a row is the first c codes of a
   longer one), levels, and its own queries (H, M, c) when scoring or output block (H, M, c) when mixing. */
typedef struct {
    const uint8_t *data;
    int64_t c, pitch;
    const float *levels, *q;
    float *dst;
} Part;

static const Part NONE = {0};

/* Part a's and (with B > 0) part b's share of one block of four tokens, one head and up to MB query rows. */
static inline __attribute__((always_inline)) void score_part(
        const Part a, const int A, const __m256 *lv, int64_t t, int64_t h, int64_t H, int tb, int64_t m0, int64_t M,
        int mb, __m256 acc[TB][MB]) {
    const uint8_t *rows[TB];
    for (int k = 0; k < TB; k++) rows[k] = a.data + ((t + (k < tb ? k : 0)) * H + h) * a.pitch;
    const float *qh = a.q + (h * M + m0) * a.c;
    for (int64_t g = 0; g < a.c / 8; g++) {
        __m256 qv[MB];
        for (int i = 0; i < MB; i++) qv[i] = i < mb ? _mm256_loadu_ps(qh + i * a.c + 8 * g) : _mm256_setzero_ps();
        for (int k = 0; k < TB; k++) {
            __m256 v = decode8(rows[k] + g * A, A, lv, a.levels);
            for (int i = 0; i < MB; i++) acc[k][i] = _mm256_fmadd_ps(v, qv[i], acc[k][i]);
        }
    }
}

static inline __attribute__((always_inline)) void mix_part(
        const Part a, const int A, const __m256 *lv, int64_t t, int64_t h, int64_t H, int tb, int64_t m0, int64_t M,
        int mb, __m256 w[TB][MB]) {
    const uint8_t *rows[TB];
    for (int k = 0; k < TB; k++) rows[k] = a.data + ((t + (k < tb ? k : 0)) * H + h) * a.pitch;
    float *o = a.dst + (h * M + m0) * a.c;
    for (int64_t g = 0; g < a.c / 8; g++) {
        __m256 acc[MB];
        for (int i = 0; i < MB; i++) acc[i] = i < mb ? _mm256_loadu_ps(o + i * a.c + 8 * g) : _mm256_setzero_ps();
        for (int k = 0; k < TB; k++) {
            __m256 v = decode8(rows[k] + g * A, A, lv, a.levels);
            for (int i = 0; i < MB; i++) acc[i] = _mm256_fmadd_ps(w[k][i], v, acc[i]);
        }
        for (int i = 0; i < mb; i++) _mm256_storeu_ps(o + i * a.c + 8 * g, acc[i]);
    }
}

/* mix_part for more query rows than one pass's registers hold (M > MB): each code is decoded once for all M rows,
   whose sums are read and written through memory (L1) instead of three passes decoding every code again. */
static inline __attribute__((always_inline)) void mix_rows(
        const Part a, const int A, const __m256 *lv, int64_t t, int64_t h, int64_t H, int tb, int64_t M,
        const float w[TB][MAX_ROWS]) {
    const uint8_t *rows[TB];
    for (int k = 0; k < TB; k++) rows[k] = a.data + ((t + (k < tb ? k : 0)) * H + h) * a.pitch;
    float *o = a.dst + h * M * a.c;
    for (int64_t g = 0; g < a.c / 8; g++) {
        __m256 v[TB];
        for (int k = 0; k < TB; k++) v[k] = decode8(rows[k] + g * A, A, lv, a.levels);
        for (int i = 0; i < (int)M; i++) {
            float *oi = o + i * a.c + 8 * g;
            __m256 acc = _mm256_loadu_ps(oi);
            for (int k = 0; k < TB; k++) acc = _mm256_fmadd_ps(_mm256_broadcast_ss(&w[k][i]), v[k], acc);
            _mm256_storeu_ps(oi, acc);
        }
    }
}

/* One pass over tokens [t0, t1) of one or two channel parts (a at A bits, b at B bits; B = 0: none), four tokens
   at a time: the two parts of an outlier split (lo + 1 and lo bits) share the pass's accumulators, sums and
   weights. Scoring (mix = 0): each query vector is loaded once for the four tokens, and their four dot products
   are summed across lanes together (hsum4) into out (H, M, T). Mixing (mix = 1): weights p (H, M, T), row h * M + m
   at p + (h * M + m) * ps (a slice of a joint softmax is read where it lies), times norm (H, T); each output vector
   is loaded and stored once for the four, up to MB rows from registers, more by mix_rows. Fixed trip counts keep
   the accumulators in registers: a missing token rereads row 0 with weight 0, a missing row queries 0. */
static inline __attribute__((always_inline)) void pass_range(
        const Part a, const int A, const Part b, const int B, int64_t t0, int64_t t1, int64_t T, int64_t H,
        const float *p, int64_t ps, const float *norm, int64_t M, float *out, const int mix) {
    __m256 lva[4], lvb[4];
    float wm[TB][MAX_ROWS];  /* mix_rows' weights, token-major */
    load_levels(a.levels, A, lva);
    if (B) load_levels(b.levels, B, lvb);
    for (int64_t t = t0; t < t1; t += TB) {
        const int tb = t1 - t < TB ? (int)(t1 - t) : TB;
        for (int64_t h = 0; h < H; h++) {
            if (mix && M > MB) {
                for (int k = 0; k < TB; k++)
                    for (int64_t i = 0; i < M; i++)
                        wm[k][i] = k < tb ? p[(h * M + i) * ps + t + k] * norm[h * T + t + k] : 0.0f;
                mix_rows(a, A, lva, t, h, H, tb, M, wm);
                if (B) mix_rows(b, B, lvb, t, h, H, tb, M, wm);
                continue;
            }
            for (int64_t m0 = 0; m0 < M; m0 += MB) {
                const int mb = M - m0 < MB ? (int)(M - m0) : MB;
                if (mix) {
                    __m256 w[TB][MB];
                    for (int k = 0; k < TB; k++)
                        for (int i = 0; i < MB; i++)
                            w[k][i] = _mm256_set1_ps(k < tb && i < mb
                                                     ? p[(h * M + m0 + i) * ps + t + k] * norm[h * T + t + k] : 0.0f);
                    mix_part(a, A, lva, t, h, H, tb, m0, M, mb, w);
                    if (B) mix_part(b, B, lvb, t, h, H, tb, m0, M, mb, w);
                    continue;
                }
                __m256 acc[TB][MB];
                for (int k = 0; k < TB; k++)
                    for (int i = 0; i < MB; i++) acc[k][i] = _mm256_setzero_ps();
                score_part(a, A, lva, t, h, H, tb, m0, M, mb, acc);
                if (B) score_part(b, B, lvb, t, h, H, tb, m0, M, mb, acc);
                for (int i = 0; i < mb; i++) {
                    float *o = out + (h * M + m0 + i) * T + t;
                    __m128 sum = hsum4(acc[0][i], acc[1][i], acc[2][i], acc[3][i]);
                    if (tb == TB) {
                        _mm_storeu_ps(o, _mm_add_ps(_mm_loadu_ps(o), sum));
                    } else {
                        float tmp[4];
                        _mm_storeu_ps(tmp, sum);
                        for (int k = 0; k < tb; k++) o[k] += tmp[k];
                    }
                }
            }
        }
    }
}

/* one instance per width, so that every shift, mask and branch on `bits` is a constant */
#define DISPATCH(fn, ...) \
    switch (bits) { \
        case 1: fn(__VA_ARGS__, 1); break; case 2: fn(__VA_ARGS__, 2); break; case 3: fn(__VA_ARGS__, 3); break; \
        case 4: fn(__VA_ARGS__, 4); break; case 5: fn(__VA_ARGS__, 5); break; case 6: fn(__VA_ARGS__, 6); break; \
        case 7: fn(__VA_ARGS__, 7); break; default: fn(__VA_ARGS__, 8); break; \
    }
/* an outlier split's two parts, at bits and bits - 1, in one pass */
#define DISPATCH_SPLIT(fn, ...) \
    switch (bits) { \
        case 2: fn(__VA_ARGS__, 2); break; case 3: fn(__VA_ARGS__, 3); break; case 4: fn(__VA_ARGS__, 4); break; \
        case 5: fn(__VA_ARGS__, 5); break; case 6: fn(__VA_ARGS__, 6); break; case 7: fn(__VA_ARGS__, 7); break; \
        default: fn(__VA_ARGS__, 8); break; \
    }
/* part i of a side as pass r reads it (see kv_score_coded), with its queries Q or output block D */
#define PART(i, B, Q, D) ((Part){data[i] + base * (c[i] / 8 * (B)), c[i], c[i] / 8 * (B), levels[i], Q, D})
#define QP(i) (qp[i] + r * M * c[i])
#define DST(i) (dst[i] + r * M * c[i])
#define SCORE(t0, t1, B) pass_range(PART(i, B, QP(i), NULL), B, NONE, 0, t0, t1, T, heads, NULL, 0, NULL, M, \
                                    out + r * M * T, 0)
#define SCORE2(t0, t1, B) pass_range(PART(0, B, QP(0), NULL), B, PART(1, B - 1, QP(1), NULL), B - 1, t0, t1, T, \
                                     heads, NULL, 0, NULL, M, out + r * M * T, 0)
#define MIX(t0, t1, B) pass_range(PART(i, B, NULL, DST(i)), B, NONE, 0, t0, t1, T, heads, p + r * M * ps, ps, \
                                  norm + base, M, NULL, 1)
#define MIX2(t0, t1, B) pass_range(PART(0, B, NULL, DST(0)), B, PART(1, B - 1, NULL, DST(1)), B - 1, t0, t1, T, \
                                   heads, p + r * M * ps, ps, norm + base, M, NULL, 1)
/* every part of a side over [t0, t1) with ONE per part, or an outlier split (channels at bits + 1 and at bits)
   with TWO in one pass */
#define PARTS(ONE, TWO) \
    if (nparts == 2 && nbits[0] == nbits[1] + 1 && nbits[1] >= 1) { \
        const int bits = nbits[0]; \
        DISPATCH_SPLIT(TWO, t0, t1) \
    } else { \
        for (int i = 0; i < nparts; i++) { \
            const int bits = nbits[i]; \
            DISPATCH(ONE, t0, t1) \
        } \
    }
#define GROUP(t0, t1, B) pass_range((Part){data + (b * g * d / 8) * B, d, d / 8 * B, levels, qg + b * M * d, NULL}, B, \
                                    NONE, 0, t0, t1, T, 1, NULL, 0, NULL, M, out + h * M * T + gi * g, 0)
#define RUN(t0, t1, B) pass_range((Part){data + r * ch / 8 * B, ch, d / 8 * B, levels, NULL, dst}, B, NONE, 0, \
                                  t0, t1, T, H, p, ps, norms + r * H * T, M, NULL, 1)
#define MAX_PARTS 8

/* A coded side of one layer: `nparts` channel parts, part i holding channels idx[i] (H, c[i]) of each head
   (NULL: all d channels, in order) as codes of nbits[i] bits with levels[i]. Both return 0, or -1 where
   memory for their scratch could not be had (out is then not filled).

   kv_score_coded: out[h, m, t] = scale * norm[h, t] * sum_j q[h, m, j] * level(t, h, j) + add[h, t]   (add: NULL, 0)
   kv_mix_coded:   out[h, m, j] = sum_t p[h, m, t] * norm[h, t] * level(t, h, j)
   with q (H, M, d), p (H, M, T) (row h * M + m at p + (h * M + m) * ps), norm (H, T), level(t, h, j) the level of
   channel j's code.

   Runs (seg != NULL): the side is one head of seg[H] tokens (idx (1, c[i]), norm and add (seg[H],)), and query
   head h reads only its own run, tokens seg[h] to seg[h + 1] (composition packs ragged heads one after another
   this way); T is then the longest run: out and p are (H, M, T), a run's scores past its end are -inf and its
   weights there are not read. Each code is decoded once for the M rows of its head, not once per H * M rows. */

static int gather_queries(int nparts, const uint8_t *const *idx, const int64_t *c, int64_t H, int shared, int64_t d,
                          const float *q, int64_t M, float **qp) {
    for (int i = 0; i < nparts; i++) {
        if (!idx[i]) { qp[i] = (float *)q; continue; }
        qp[i] = malloc(sizeof(float) * H * M * c[i]);
        if (!qp[i]) {
            while (i--) if (idx[i]) free(qp[i]);
            return -1;
        }
        for (int64_t h = 0; h < H; h++)
            for (int64_t m = 0; m < M; m++)
                for (int64_t j = 0; j < c[i]; j++)
                    qp[i][(h * M + m) * c[i] + j] = q[(h * M + m) * d + idx[i][(shared ? 0 : h) * c[i] + j]];
    }
    return 0;
}

/* Thread k of `threads`'s share of pass r over a side: its tokens [t0, t1) of the n from token `base` (all H heads'
   tokens [0, T) in one pass, or with runs one pass per head over its run). */
static inline void share(const int64_t *seg, int64_t r, int64_t T, int k, int threads, int64_t *base, int64_t *n,
                         int64_t *t0, int64_t *t1) {
    *base = seg ? seg[r] : 0;
    *n = seg ? seg[r + 1] - *base : T;
    *t0 = *n * k / threads;
    *t1 = *n * (k + 1) / threads;
}

int kv_score_coded(int nparts, const uint8_t *const *data, const uint8_t *const *idx, const float *const *levels,
                   const int64_t *c, const int *nbits, int64_t T, int64_t H, int64_t d, const float *q, int64_t M,
                   const float *norm, float scale, const float *add, const int64_t *seg, float *out,
                   int threads) {
    float *qp[MAX_PARTS];
    if (nparts > MAX_PARTS || gather_queries(nparts, idx, c, H, seg != NULL, d, q, M, qp)) return -1;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int k = 0; k < threads; k++) {
        const int64_t passes = seg ? H : 1, heads = seg ? 1 : H;
        for (int64_t r = 0; r < passes; r++) {
            int64_t base, n, t0, t1;
            share(seg, r, T, k, threads, &base, &n, &t0, &t1);
            PARTS(SCORE, SCORE2)
            for (int64_t h = 0; h < heads; h++)
                for (int64_t m = 0; m < M; m++) {
                    float *o = out + ((r + h) * M + m) * T;
                    const float *nh = norm + h * T + base, *ah = add ? add + h * T + base : NULL;
                    for (int64_t t = t0; t < t1; t++)
                        o[t] = o[t] * scale * nh[t] + (ah ? ah[t] : 0.0f);
                    for (int64_t t = n + (T - n) * k / threads; t < n + (T - n) * (k + 1) / threads; t++)
                        o[t] = -INFINITY;
                }
        }
    }
    for (int i = 0; i < nparts; i++)
        if (idx[i]) free(qp[i]);
    return 0;
}

int kv_mix_coded(int nparts, const uint8_t *const *data, const uint8_t *const *idx, const float *const *levels,
                 const int64_t *c, const int *nbits, int64_t T, int64_t H, int64_t d, const float *p, int64_t ps,
                 int64_t M, const float *norm, const int64_t *seg, float *out, int threads) {
    /* each thread sums its tokens into its own (H, M, c[i]) block per part; the blocks are added into out's
       channels at the end */
    int64_t per = 0, off[MAX_PARTS];
    if (nparts > MAX_PARTS || M > MAX_ROWS) return -1;
    for (int i = 0; i < nparts; i++) { off[i] = per; per += H * M * c[i]; }
    float *buf = calloc((size_t)threads * per, sizeof(float));
    if (!buf) return -1;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int k = 0; k < threads; k++) {
        const int64_t passes = seg ? H : 1, heads = seg ? 1 : H;
        float *dst[MAX_PARTS];
        for (int i = 0; i < nparts; i++) dst[i] = buf + k * per + off[i];
        for (int64_t r = 0; r < passes; r++) {
            int64_t base, n, t0, t1;
            share(seg, r, T, k, threads, &base, &n, &t0, &t1);
            PARTS(MIX, MIX2)
        }
    }
    for (int k = 0; k < threads; k++)
        for (int i = 0; i < nparts; i++) {
            const float *b = buf + k * per + off[i];
            for (int64_t h = 0; h < H; h++)
                for (int64_t m = 0; m < M; m++)
                    for (int64_t j = 0; j < c[i]; j++)
                        out[(h * M + m) * d + (idx[i] ? idx[i][(seg ? 0 : h) * c[i] + j] : j)]
                            += b[(h * M + m) * c[i] + j];
        }
    free(buf);
    return 0;
}

/* KIVI's keys: codes (G, H, g, d), group gi of g tokens with its own per-channel scales, folded by the caller
   into one query per group and head, qg (G, H, M, d):
   out[h, m, gi * g + u] += sum_j qg[gi, h, m, j] * levels[code(gi, h, u, j)]   (out (H, M, T), T = G * g) */
int kv_score_groups(const uint8_t *data, int64_t G, int64_t H, int64_t g, int64_t d, int nbits, const float *levels,
                    const float *qg, int64_t M, float *out, int threads) {
    if (g * d % 8 || d % 8) return -1;
    const int64_t T = G * g;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < G * H; b++) { /* one block of g rows per (group, head), read as one head */
        const int64_t gi = b / H, h = b % H;
        const int bits = nbits;
        DISPATCH(GROUP, 0, g)
    }
    return 0;
}

/* KIVI's values: codes (T, H, d) with a scale and a minimum per token, head and run of ch channels, norms
   and mins (d / ch, H, T):
   out[h, m, j] += sum_t p[h, m, t] * (norms[j / ch, h, t] * levels[code(t, h, j)] + mins[j / ch, h, t])
   (out (H, M, d); p's rows ps apart, as kv_mix_coded's) */
int kv_mix_runs(const uint8_t *data, int64_t T, int64_t H, int64_t d, int64_t ch, int nbits, const float *levels,
                const float *p, int64_t ps, int64_t M, const float *norms, const float *mins, float *out,
                int threads) {
    if (ch % 8 || d % ch || M > MAX_ROWS) return -1;
    const int64_t runs = d / ch, per = H * M * ch + H * M; /* a run's codes' sums, then its minimum's */
    float *buf = calloc((size_t)threads * runs * per, sizeof(float));
    if (!buf) return -1;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int k = 0; k < threads; k++) {
        const int64_t t0 = T * k / threads, t1 = T * (k + 1) / threads;
        const int bits = nbits;
        for (int64_t r = 0; r < runs; r++) {
            float *dst = buf + (k * runs + r) * per;
            DISPATCH(RUN, t0, t1)
            for (int64_t h = 0; h < H; h++)
                for (int64_t m = 0; m < M; m++) {
                    float acc = 0.0f;
                    for (int64_t t = t0; t < t1; t++) acc += p[(h * M + m) * ps + t] * mins[(r * H + h) * T + t];
                    dst[H * M * ch + h * M + m] = acc;
                }
        }
    }
    for (int k = 0; k < threads; k++)
        for (int64_t r = 0; r < runs; r++) {
            const float *b = buf + (k * runs + r) * per;
            for (int64_t h = 0; h < H; h++)
                for (int64_t m = 0; m < M; m++)
                    for (int64_t j = 0; j < ch; j++)
                        out[(h * M + m) * d + r * ch + j] += b[(h * M + m) * ch + j] + b[H * M * ch + h * M + m];
        }
    free(buf);
    return 0;
}

/* kv_score_prerope's tokens at head dim 64 (the bundled models'), all in registers: each key rebuilt from its decoded
   codes (z[g][tl * c[g] + u]), turned by its position's cos / sin row and read by the M query rows into
   out[m * T]. The tables' two halves are equal (Llama-style RoPE), so only the first is read: half the traffic.
   With AVX-512 a key is four registers and KT = 4 keys are rebuilt at once, else one key in eight. */
#ifdef __AVX512F__
#define VW 16
#define KT 4  /* keys rebuilt at once: four FMA chains a register hide each other's latency */
#define V __m512
#define VLOAD _mm512_loadu_ps
#define VSET1 _mm512_set1_ps
#define VMUL _mm512_mul_ps
#define VADD _mm512_add_ps
#define VFMA _mm512_fmadd_ps
#define VFNMA _mm512_fnmadd_ps
static inline float vsum(__m512 s) { return _mm512_reduce_add_ps(s); }
#else
#define VW 8
#define KT 1  /* the key's eight registers already hide the FMA latency; two would spill */
#define V __m256
#define VLOAD _mm256_loadu_ps
#define VSET1 _mm256_set1_ps
#define VMUL _mm256_mul_ps
#define VADD _mm256_add_ps
#define VFMA _mm256_fmadd_ps
#define VFNMA _mm256_fnmadd_ps
static inline float vsum(__m256 s) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    return _mm_cvtss_f32(_mm_hadd_ps(_mm_hadd_ps(h, h), h));
}
#endif
#define NV (64 / VW)

/* A key k (registers) turned by its position's cos / sin row and read by the M query rows into out[m * T] */
static inline __attribute__((always_inline)) void read64(const V *k, const float *ct, const float *st,
        const float *q, int64_t M, float *out, int64_t T) {
    V r[NV];
    for (int i = 0; i < NV / 2; i++) {
        const V cs = VLOAD(ct + VW * i), sn = VLOAD(st + VW * i);
        r[i] = VFNMA(k[i + NV / 2], sn, VMUL(k[i], cs));
        r[i + NV / 2] = VFMA(k[i], sn, VMUL(k[i + NV / 2], cs));
    }
    for (int64_t m = 0; m < M; m++, q += 64) {
        V sm = VMUL(VLOAD(q), r[0]);
        for (int i = 1; i < NV; i++) sm = VFMA(VLOAD(q + VW * i), r[i], sm);
        out[m * T] = vsum(sm);
    }
}

/* KT keys from token tl rebuilt at once (w's rows loaded once for all), then each turned and read */
static inline __attribute__((always_inline)) void prerope64(float *const *z, const int64_t *c, int ngroups,
        int64_t tl, const float *w, const float *mean, const float *ct, const float *st, const float *q, int64_t M,
        float *out, int64_t T) {
    V k[KT][NV];
    for (int j = 0; j < KT; j++)
        for (int i = 0; i < NV; i++) k[j][i] = VLOAD(mean + VW * i);
    for (int g = 0; g < ngroups; g++) {
        const float *zt = z[g] + tl * c[g];
        for (int64_t u = 0; u < c[g]; u++, w += 64)
            for (int i = 0; i < NV; i++) {
                const V wi = VLOAD(w + VW * i);
                for (int j = 0; j < KT; j++) k[j][i] = VFMA(VSET1(zt[j * c[g] + u]), wi, k[j][i]);
            }
    }
    for (int j = 0; j < KT; j++) read64(k[j], ct + 64 * j, st + 64 * j, q, M, out + j, T);
}

/* The same for any even head dim d (up to 256), through memory. */
static inline void prerope_any(float *const *z, const int64_t *c, int ngroups, int64_t tl, const float *w,
        const float *mean, const float *ct, const float *st, const float *q, int64_t M, float *out, int64_t T,
        int64_t d) {
    const int64_t half = d / 2;
    float key[256], turned[256];
    for (int64_t i = 0; i < d; i++) key[i] = mean[i];
    for (int g = 0; g < ngroups; g++)
        for (int64_t u = 0; u < c[g]; u++, w += d) {
            const float za = z[g][tl * c[g] + u];
            for (int64_t i = 0; i < d; i++) key[i] += za * w[i];
        }
    for (int64_t i = 0; i < half; i++) {
        turned[i] = key[i] * ct[i] - key[i + half] * st[i];
        turned[i + half] = key[i + half] * ct[i] + key[i] * st[i];
    }
    for (int64_t m = 0; m < M; m++, q += d) {
        float s = 0.0f;
        #pragma omp simd reduction(+:s)
        for (int64_t i = 0; i < d; i++) s += q[i] * turned[i];
        out[m * T] = s;
    }
}

/* With AMX (Intel's tile matrix unit) 16 tokens of a head are scored as two bf16 tile products. Each product
   splits its float factors into a bf16 high part and a bf16 rest and sums Xh Yh + Xh Yl + Xl Yh (+ Xl Yl), which
   keeps about 16 bits of each product. (1) Keys less their mean, K = Z W: a width group's codes are decoded 64 at
   a time straight to the bf16 parts of their levels (each 8-code word spread to a 64-bit lane, its codes cut out
   to bytes by one multishift, looked up as 16-bit words), and token i's row of a tile is read at i * c of them: a
   chunk of 32 columns runs into the next token's codes, which meet the zero rows of W's padded chunk. (2) Scores,
   S = Kr Q^T: each key plus the mean is turned to its position in registers and split into parts, and the product
   with the head's query rows gives the 16 tokens' scores with no horizontal sums. The operating system must grant
   the tile state first (kv_amx). */
#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#define AMX_BITS 5  /* the widest code decoded 64 at a time: 32 levels' bf16 parts fill one register */
#define AMX_ROWS 16  /* query rows a head's scores tile holds */
#define ZLEN(c) ((16 * (c) + 64 + 31) / 32 * 32)  /* a group's 16 tokens' level parts, padded, on whole cache lines */

/* a calling thread's tile memory, on 64-byte lines, kept for its next call (a fresh mapping each call costs page
   faults) */
static __thread uint16_t *scratch;
static __thread size_t scratch_bytes;

static uint16_t *amx_scratch(size_t bytes) {
    if (bytes > scratch_bytes) {
        free(scratch);
        scratch = aligned_alloc(64, (bytes + 63) / 64 * 64);
        scratch_bytes = scratch ? bytes : 0;
    }
    return scratch;
}

static int amx_granted = -1;

int kv_amx(void) {  /* 1 where the kernel grants this process the AMX tile data (arch_prctl XCOMP_PERM), else 0 */
    if (amx_granted < 0) amx_granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0;
    return amx_granted;
}

int kv_amx_allow(int allow) {  /* allow = 0: the AVX path from now on (tests compare the two); 1: AMX where granted */
    amx_granted = allow ? -1 : 0;
    return kv_amx();
}

typedef struct { uint8_t palette, start, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } TileConfig;

static void amx_configure(void) {  /* 8 tiles of 16 x 64 bytes: 0-3 keys (floats), 4 A, 5 and 7 B, 6 scores */
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) cfg.colsb[i] = 64, cfg.rows[i] = 16;
    _tile_loadconfig(&cfg);
}

/* 16 floats' bf16 high parts (rest = 0) or rests (rest = 1), each in the low half of a 32-bit lane */
static inline __m512i amx_parts(__m512 v, int rest) {
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    if (!rest) return _mm512_cvtepu16_epi32(h);
    const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(v, back)));
}

/* 16 floats' bf16 high parts into hi and their rests into lo, 16 entries each */
static inline void amx_split16(__m512 v, uint16_t *hi, uint16_t *lo) {
    _mm256_storeu_si256((__m256i *)hi, _mm512_cvtepi32_epi16(amx_parts(v, 0)));
    _mm256_storeu_si256((__m256i *)lo, _mm512_cvtepi32_epi16(amx_parts(v, 1)));
}

/* B tiles (16 x 32 bf16, pair-interleaved: tile row kk holds rows 2 kk and 2 kk + 1 of a chunk, column by column)
   of n rows (zero from row `valid` on), in chunks of 32 rows: per chunk the high parts then the rests, each as
   `cols` / 16 column tiles. cols = 64: a group's w (row j at x + 64 j); cols = 16 (transposed): a head's query
   rows as columns (row j is coordinate j of each query, query m at x + 64 m, zero from query `valid` on). */
static void amx_tiles(const float *x, int64_t n, int64_t valid, int transposed, uint16_t *b) {
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(64));
    const __mmask16 queries = (__mmask16)(valid >= 16 ? 0xffff : (1u << valid) - 1);
    for (int64_t k = 0; k < (n + 31) / 32; k++)
        for (int rest = 0; rest < 2; rest++)
            for (int ct = 0; ct < (transposed ? 1 : 4); ct++)
                for (int64_t j = 32 * k; j < 32 * k + 32; j += 2, b += 32) {
                    __m512 even, odd;
                    if (transposed) {
                        even = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), queries, rows, x + j, 4);
                        odd = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), queries, rows, x + j + 1, 4);
                    } else {
                        even = j < valid ? _mm512_loadu_ps(x + j * 64 + 16 * ct) : _mm512_setzero_ps();
                        odd = j + 1 < valid ? _mm512_loadu_ps(x + (j + 1) * 64 + 16 * ct) : _mm512_setzero_ps();
                    }
                    _mm512_store_si512(b, _mm512_or_si512(amx_parts(even, rest),
                                                          _mm512_slli_epi32(amx_parts(odd, rest), 16)));
                }
}

typedef struct { uint8_t perm[64], shift[64], mask[64]; uint16_t hi[32], lo[32]; } AmxCodes;

static void amx_codes(const float *levels, int bits, AmxCodes *a) {
    memset(a, 0, sizeof *a);
    for (int i = 0; i < 64; i++) {
        a->perm[i] = (uint8_t)(i % 8 < bits ? i / 8 * bits + i % 8 : 0);  /* word i / 8's bytes to lane i / 8 */
        a->shift[i] = (uint8_t)(i % 8 * bits);
        a->mask[i] = (uint8_t)((1 << bits) - 1);
    }
    for (int i = 0; bits <= AMX_BITS && i < 1 << bits; i += 16) {  /* the levels' parts, as the tiles' */
        const int n = (1 << bits) - i;
        amx_split16(_mm512_maskz_loadu_ps((__mmask16)(n >= 16 ? 0xffff : (1u << n) - 1), levels + i), a->hi + i,
                    a->lo + i);
    }
}

/* n codes (a multiple of 16, from a word boundary) as the bf16 parts of their levels into zh and zl, 64 at a time;
   up to 63 entries past n are written */
static inline void amx_decode(const uint8_t *src, int bits, int64_t n, const AmxCodes *a, const float *levels,
                              uint16_t *zh, uint16_t *zl) {
    if (bits > AMX_BITS) {  /* more levels than a register holds: eight at a time as floats, split 16 at a time */
        __m256 lv[4];
        load_levels(levels, bits, lv);
        for (int64_t e = 0; e < n; e += 16)
            amx_split16(_mm512_insertf32x8(_mm512_castps256_ps512(decode8(src + e / 8 * bits, bits, lv, levels)),
                                           decode8(src + (e + 8) / 8 * bits, bits, lv, levels), 1), zh + e, zl + e);
        return;
    }
    const __m512i perm = _mm512_loadu_si512(a->perm), shift = _mm512_loadu_si512(a->shift);
    const __m512i mask = _mm512_loadu_si512(a->mask), hi = _mm512_loadu_si512(a->hi), lo = _mm512_loadu_si512(a->lo);
    for (int64_t e = 0; e < n; e += 64, src += 8 * bits) {
        const int64_t words = n - e >= 64 ? 8 : (n - e) / 8;
        const __m512i raw = _mm512_maskz_loadu_epi8(((__mmask64)1 << (words * bits)) - 1, src);
        const __m512i idx = _mm512_and_si512(_mm512_multishift_epi64_epi8(shift, _mm512_permutexvar_epi8(perm, raw)),
                                             mask);
        const __m512i i0 = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(idx));
        const __m512i i1 = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(idx, 1));
        _mm512_storeu_si512(zh + e, _mm512_permutexvar_epi16(i0, hi));
        _mm512_storeu_si512(zh + e + 32, _mm512_permutexvar_epi16(i1, hi));
        _mm512_storeu_si512(zl + e, _mm512_permutexvar_epi16(i0, lo));
        _mm512_storeu_si512(zl + e + 32, _mm512_permutexvar_epi16(i1, lo));
    }
}

/* tile 4 times the four column tiles of B at b, into tiles 0-3 */
#define AMX_COLUMNS(b) do { \
    _tile_loadd(5, (b), 64); _tile_dpbf16ps(0, 4, 5); _tile_loadd(5, (b) + 512, 64); _tile_dpbf16ps(1, 4, 5); \
    _tile_loadd(5, (b) + 1024, 64); _tile_dpbf16ps(2, 4, 5); _tile_loadd(5, (b) + 1536, 64); _tile_dpbf16ps(3, 4, 5); \
} while (0)

/* A rows of 16 tokens (pitch 2 rp: [Zh | Zl]) from each group's decoded level parts (zh[g] / zl[g], token i's at
   i * c[g]) in group order, 32 entries a copy: each copy's tail is overwritten by the next group's, the next
   part's or the next row's, and the last group's (columns r .. rp - 1) meets W's zero rows; a has 32 spare */
static inline void amx_rows(uint16_t *const *zh, uint16_t *const *zl, const int64_t *c, int ng, int64_t rp,
                            uint16_t *a) {
    for (int i = 0; i < 16; i++)
        for (int part = 0; part < 2; part++) {
            uint16_t *row = a + (2 * i + part) * rp;
            for (int g = 0; g < ng; row += c[g], g++) {
                const uint16_t *src = (part ? zl[g] : zh[g]) + i * c[g];
                for (int64_t u = 0; u < c[g]; u += 32) _mm512_storeu_si512(row + u, _mm512_loadu_si512(src + u));
            }
        }
}

/* 16 keys less their mean into k (16 x 64 floats) from their A rows: per chunk of 32 axes, Zh against Wh and Wl,
   Zl against Wh (bt: the head's w as amx_tiles) */
static inline void amx_keys(const uint16_t *a, int64_t rp, const uint16_t *bt, float *k) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kc = 0; kc < rp / 32; kc++) {
        const uint16_t *wh = bt + kc * 4096, *wl = wh + 2048;
        _tile_loadd(4, a + 32 * kc, 4 * rp);
        AMX_COLUMNS(wh);
        AMX_COLUMNS(wl);
        _tile_loadd(4, a + rp + 32 * kc, 4 * rp);
        AMX_COLUMNS(wh);
    }
    _tile_stored(0, k, 256);
    _tile_stored(1, k + 16, 256);
    _tile_stored(2, k + 32, 256);
    _tile_stored(3, k + 48, 256);
}

/* the 16 keys of k (less their mean) turned by their positions' rows (ct, st, row pitch 64) and read by the head's
   M query rows (bq: amx_tiles of q, transposed) into out[m * T + i]; ka (16 x 128 bf16) and s (16 x 16 floats)
   are scratch */
static inline void amx_read(const float *k, const float *mean, const float *ct, const float *st,
                            const uint16_t *bq, int64_t M, float *out, int64_t T, uint16_t *ka, float *s) {
    for (int i = 0; i < 16; i++, k += 64, ct += 64, st += 64) {
        __m512 key[4], r[4];
        for (int j = 0; j < 4; j++) key[j] = _mm512_add_ps(_mm512_loadu_ps(k + 16 * j), _mm512_loadu_ps(mean + 16 * j));
        for (int j = 0; j < 2; j++) {
            const __m512 cs = _mm512_loadu_ps(ct + 16 * j), sn = _mm512_loadu_ps(st + 16 * j);
            r[j] = _mm512_fnmadd_ps(key[j + 2], sn, _mm512_mul_ps(key[j], cs));
            r[j + 2] = _mm512_fmadd_ps(key[j], sn, _mm512_mul_ps(key[j + 2], cs));
        }
        __m512 hi[4], lo[4];  /* the high part truncated (exact in bf16), the rest rounded */
        for (int j = 0; j < 4; j++)
            hi[j] = _mm512_and_ps(r[j], _mm512_castsi512_ps(_mm512_set1_epi32((int)0xffff0000u))),
            lo[j] = _mm512_sub_ps(r[j], hi[j]);
        for (int j = 0; j < 2; j++) {
            _mm512_storeu_si512(ka + 128 * i + 32 * j, (__m512i)_mm512_cvtne2ps_pbh(hi[2 * j + 1], hi[2 * j]));
            _mm512_storeu_si512(ka + 128 * i + 64 + 32 * j, (__m512i)_mm512_cvtne2ps_pbh(lo[2 * j + 1], lo[2 * j]));
        }
    }
    _tile_zero(6);
    for (int kc = 0; kc < 2; kc++) {
        _tile_loadd(5, bq + kc * 1024, 64);
        _tile_loadd(7, bq + kc * 1024 + 512, 64);
        _tile_loadd(4, ka + 32 * kc, 256);
        _tile_dpbf16ps(6, 4, 5);
        _tile_dpbf16ps(6, 4, 7);
        _tile_loadd(4, ka + 64 + 32 * kc, 256);
        _tile_dpbf16ps(6, 4, 5);
        _tile_dpbf16ps(6, 4, 7);
    }
    _tile_stored(6, s, 64);
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(16));
    for (int64_t m = 0; m < M; m++) _mm512_storeu_ps(out + m * T, _mm512_i32gather_ps(rows, s + m, 4));
}
#else
int kv_amx(void) { return 0; }
int kv_amx_allow(int allow) { return 0; }
#endif

/* pca keys coded before RoPE (pca.py), one layer's H heads in one call. Head h holds axes (d, r[h]) and deviations
   (r[h]) in fp16, each axis's width (r[h] bytes) and a mean key (d, fp16); its width groups gs[h] .. gs[h + 1] - 1,
   in increasing width, hold the codes of the axes of that width (in axis order), c[g] a token at nbits[g] bits,
   packed token-major with no row alignment (code u of token t is code t * c[g] + u of the group's store), read
   through levels[g]. Per token the key is rebuilt from w, each group's axes times their deviations stacked in group
   order (built here from the held fp16 tensors, so nothing derived is held between steps):
   k = mean + sum_j z_j w[j], out[h, m, t] = q[h, m] . (k cos[t] + rotate_half(k) sin[t]) (cos, sin (T, d): the
   token's position's rows). Blocks of PB tokens (a multiple of 16) start on whole groups of 8 codes, so each group's
   codes are decoded eight at a time (decode8; the store's padding completes the last) or 64 at a time on the tile
   path; a block's table rows are read once for all heads, and nothing of size T x d is written. */
#define PB 32
#define MAX_HEADS 64

int kv_score_prerope(int H, const int *gs, const uint8_t *const *data, const int64_t *c, const int *nbits,
                     const float *const *levels, const uint16_t *const *axes, const uint16_t *const *dev,
                     const uint8_t *const *widths, const uint16_t *const *mean, const int64_t *r, const float *cosv,
                     const float *sinv, int64_t T, int64_t d, const float *q, int64_t M, float *out, int threads) {
    if (H > MAX_HEADS || d > 256 || d % 2) return -1;
    int64_t wsize = 0, zsize = 0;
    for (int h = 0; h < H; h++) {
        int64_t n = 0;
        for (int g = gs[h]; g < gs[h + 1]; g++) n += c[g];
        if (n != r[h] || r[h] > 256 || gs[h + 1] - gs[h] > MAX_PARTS) return -1;
        wsize += (r[h] + 1) * d;
        if (PB * r[h] + 8 * MAX_PARTS > zsize) zsize = PB * r[h] + 8 * MAX_PARTS;
    }
    const int64_t blocks = (T + PB - 1) / PB;
    float *wbuf = malloc(sizeof(float) * (wsize + threads * zsize));
    if (!wbuf) return -1;
    float *wh[MAX_HEADS], *mh[MAX_HEADS], *zbuf = wbuf + wsize;
    for (int h = 0, off = 0; h < H; off += (int)((r[h] + 1) * d), h++) {  /* mean row, then w's rows */
        mh[h] = wbuf + off;
        wh[h] = mh[h] + d;
        for (int64_t i = 0; i < d; i++) mh[h][i] = _cvtsh_ss(mean[h][i]);
        float *row = wh[h];
        for (int g = gs[h]; g < gs[h + 1]; g++)
            for (int64_t j = 0; j < r[h]; j++) {
                if (widths[h][j] != nbits[g]) continue;
                const float sd = _cvtsh_ss(dev[h][j]);
                for (int64_t i = 0; i < d; i++) row[i] = _cvtsh_ss(axes[h][i * r[h] + j]) * sd;
                row += d;
            }
    }
#ifdef HAVE_AMX
    int amx = d == 64 && M <= AMX_ROWS && kv_amx();
    /* per head: its w's tiles and its queries'; per thread: a head's groups' 16 tokens' level parts and A rows */
    int64_t bsize = 0, lsize = 0, rp[MAX_HEADS];
    for (int h = 0; h < H; h++) {
        int64_t lh = 32 * (rp[h] = (r[h] + 31) / 32 * 32) + 32;
        for (int g = gs[h]; g < gs[h + 1]; g++) lh += 2 * ZLEN(c[g]);
        bsize += rp[h] / 32 * 4096 + 2048;
        if (lh > lsize) lsize = lh;
    }
    uint16_t *bts = amx ? amx_scratch(2 * (bsize + threads * lsize)) : NULL;  /* B tiles: all written below */
    AmxCodes *codes = amx ? malloc(sizeof(AmxCodes) * gs[H]) : NULL;
    if (amx && (!bts || !codes)) return free(codes), free(wbuf), -1;
    if (amx) memset(bts + bsize, 0, 2 * threads * lsize);  /* what a tile row reads past the decoded codes */
    uint16_t *bt[MAX_HEADS], *bq[MAX_HEADS];
    for (int h = 0, off = 0; amx && h < H; off += (int)(rp[h] / 32 * 4096 + 2048), h++) {
        amx_tiles(wh[h], r[h], r[h], 0, bt[h] = bts + off);
        amx_tiles(q + h * M * d, 64, M, 1, bq[h] = bt[h] + rp[h] / 32 * 4096);
        for (int g = gs[h]; g < gs[h + 1]; g++) amx_codes(levels[g], nbits[g], codes + g);
    }
#endif
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int k = 0; k < threads; k++) {
        float *z = zbuf + k * zsize;
#ifdef HAVE_AMX
        float kb[16 * 64] __attribute__((aligned(64))), sb[16 * 16] __attribute__((aligned(64)));
        uint16_t ka[16 * 128] __attribute__((aligned(64))), *lv = amx ? bts + bsize + k * lsize : NULL;
        if (amx) amx_configure();
#endif
        for (int64_t blk = blocks * k / threads; blk < blocks * (k + 1) / threads; blk++) {
            const int64_t t0 = blk * PB, nt = T - t0 < PB ? T - t0 : PB;
            for (int h = 0; h < H; h++) {
                const int ng = gs[h + 1] - gs[h];
                const int64_t *ch = c + gs[h];
                const float *qh = q + h * M * d;
                float *oh = out + h * M * T;
                int64_t tl = 0;
#ifdef HAVE_AMX
                for (; amx && tl + 16 <= nt; tl += 16) {
                    uint16_t *zh[MAX_PARTS], *zl[MAX_PARTS], *a = lv;
                    for (int g = 0, off = (int)(32 * rp[h] + 32); g < ng; off += (int)(2 * ZLEN(ch[g])), g++) {
                        const int G = gs[h] + g;
                        zh[g] = lv + off;
                        zl[g] = zh[g] + ZLEN(ch[g]);
                        amx_decode(data[G] + ((t0 + tl) * ch[g] / 8) * nbits[G], nbits[G], 16 * ch[g], codes + G,
                                   levels[G], zh[g], zl[g]);
                    }
                    amx_rows(zh, zl, ch, ng, rp[h], a);
                    amx_keys(a, rp[h], bt[h], kb);
                    amx_read(kb, mh[h], cosv + (t0 + tl) * d, sinv + (t0 + tl) * d, bq[h], M, oh + t0 + tl, T, ka,
                             sb);
                }
                if (tl == nt) continue;
#endif
                float *zg[MAX_PARTS];
                for (int g = 0, off = 0; g < ng; off += (int)(PB * ch[g] + 8), g++) {
                    const int G = gs[h] + g, b = nbits[G];
                    __m256 lvr[4];
                    load_levels(levels[G], b, lvr);
                    zg[g] = z + off;
                    const uint8_t *src = data[G] + (t0 * ch[g] / 8) * b;
                    for (int64_t e = tl * ch[g]; e < nt * ch[g]; e += 8)  /* the tokens the tiles left */
                        _mm256_storeu_ps(zg[g] + e, decode8(src + e / 8 * b, b, lvr, levels[G]));
                }
                if (d == 64)
                    for (; tl + KT <= nt; tl += KT)
                        prerope64(zg, ch, ng, tl, wh[h], mh[h], cosv + (t0 + tl) * d, sinv + (t0 + tl) * d, qh, M,
                                  oh + t0 + tl, T);
                for (; tl < nt; tl++) {
                    const int64_t t = t0 + tl;
                    prerope_any(zg, ch, ng, tl, wh[h], mh[h], cosv + t * d, sinv + t * d, qh, M, oh + t, T, d);
                }
            }
        }
#ifdef HAVE_AMX
        if (amx) _tile_release();
#endif
    }
#ifdef HAVE_AMX
    free(codes);
#endif
    free(wbuf);
    return 0;
}
