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

/* One pass over tokens [t0, t1) of one or two channel parts (a at A bits, b at B bits; B = 0: none), four tokens
   at a time: the two parts of an outlier split (lo + 1 and lo bits) share the pass's accumulators, sums and
   weights. Scoring (mix = 0): each query vector is loaded once for the four tokens, and their four dot products
   are summed across lanes together (hsum4) into out (H, M, T). Mixing (mix = 1): weights p (H, M, T) times
   norm (H, T); each output vector is loaded and stored once for the four. Fixed trip counts keep the
   accumulators in registers: a missing token rereads row 0 with weight 0, a missing row queries 0. */
static inline __attribute__((always_inline)) void pass_range(
        const Part a, const int A, const Part b, const int B, int64_t t0, int64_t t1, int64_t T, int64_t H,
        const float *p, const float *norm, int64_t M, float *out, const int mix) {
    __m256 lva[4], lvb[4];
    load_levels(a.levels, A, lva);
    if (B) load_levels(b.levels, B, lvb);
    for (int64_t t = t0; t < t1; t += TB) {
        const int tb = t1 - t < TB ? (int)(t1 - t) : TB;
        for (int64_t h = 0; h < H; h++) {
            for (int64_t m0 = 0; m0 < M; m0 += MB) {
                const int mb = M - m0 < MB ? (int)(M - m0) : MB;
                if (mix) {
                    __m256 w[TB][MB];
                    for (int k = 0; k < TB; k++)
                        for (int i = 0; i < MB; i++)
                            w[k][i] = _mm256_set1_ps(k < tb && i < mb
                                                     ? p[(h * M + m0 + i) * T + t + k] * norm[h * T + t + k] : 0.0f);
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
#define SCORE(t0, t1, B) pass_range(PART(i, B, QP(i), NULL), B, NONE, 0, t0, t1, T, heads, NULL, NULL, M, \
                                    out + r * M * T, 0)
#define SCORE2(t0, t1, B) pass_range(PART(0, B, QP(0), NULL), B, PART(1, B - 1, QP(1), NULL), B - 1, t0, t1, T, \
                                     heads, NULL, NULL, M, out + r * M * T, 0)
#define MIX(t0, t1, B) pass_range(PART(i, B, NULL, DST(i)), B, NONE, 0, t0, t1, T, heads, p + r * M * T, \
                                  norm + base, M, NULL, 1)
#define MIX2(t0, t1, B) pass_range(PART(0, B, NULL, DST(0)), B, PART(1, B - 1, NULL, DST(1)), B - 1, t0, t1, T, \
                                   heads, p + r * M * T, norm + base, M, NULL, 1)
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
                                    NONE, 0, t0, t1, T, 1, NULL, NULL, M, out + h * M * T + gi * g, 0)
#define RUN(t0, t1, B) pass_range((Part){data + r * ch / 8 * B, ch, d / 8 * B, levels, NULL, dst}, B, NONE, 0, \
                                  t0, t1, T, H, p, norms + r * H * T, M, NULL, 1)
#define MAX_PARTS 8

/* A coded side of one layer: `nparts` channel parts, part i holding channels idx[i] (H, c[i]) of each head
   (NULL: all d channels, in order) as codes of nbits[i] bits with levels[i]. Both return 0, or -1 where
   memory for their scratch could not be had (out is then not filled).

   kv_score_coded: out[h, m, t] = scale * norm[h, t] * sum_j q[h, m, j] * level(t, h, j) + add[h, t]   (add: NULL, 0)
   kv_mix_coded:   out[h, m, j] = sum_t p[h, m, t] * norm[h, t] * level(t, h, j)
   with q (H, M, d), p (H, M, T), norm (H, T), level(t, h, j) the level of channel j's code.

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
                 const int64_t *c, const int *nbits, int64_t T, int64_t H, int64_t d, const float *p, int64_t M,
                 const float *norm, const int64_t *seg, float *out, int threads) {
    /* each thread sums its tokens into its own (H, M, c[i]) block per part; the blocks are added into out's
       channels at the end */
    int64_t per = 0, off[MAX_PARTS];
    if (nparts > MAX_PARTS) return -1;
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
   (out (H, M, d)) */
int kv_mix_runs(const uint8_t *data, int64_t T, int64_t H, int64_t d, int64_t ch, int nbits, const float *levels,
                const float *p, int64_t M, const float *norms, const float *mins, float *out, int threads) {
    if (ch % 8 || d % ch) return -1;
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
                    for (int64_t t = t0; t < t1; t++) acc += p[(h * M + m) * T + t] * mins[(r * H + h) * T + t];
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

/* With AMX (Intel's tile matrix unit) a block's keys are rebuilt 16 at a time as one bf16 matrix product, the
   weights and the decoded levels each split into a bf16 high part and a bf16 rest so that
   Zh Wh + Zh Wl + Zl Wh keeps about 16 bits of each product (the dropped Zl Wl is 2^-18 of it): A' = [Zh | Zl] (16
   tokens, 2 rp columns, rp = r rounded up to 32, zero beyond r), B' = [Wh; Wl] (2 rp rows, in the tile unit's
   pair-interleaved layout), Zh read against both halves of B', Zl against Wh. The operating system must grant the
   tile state first (kv_amx). */
#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1

static int amx_granted = -1;

int kv_amx(void) {  /* 1 where the kernel grants this process the AMX tile data (arch_prctl XCOMP_PERM), else 0 */
    if (amx_granted < 0) amx_granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0;
    return amx_granted;
}

int kv_amx_allow(int allow) {  /* allow = 0: the AVX path from now on (tests compare the two); 1: AMX where granted */
    amx_granted = allow ? -1 : 0;
    return kv_amx();
}

static inline uint16_t to_bf16(float x) {  /* round to nearest even, as _mm512_cvtneps_pbh */
    uint32_t u;
    memcpy(&u, &x, 4);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

static inline float from_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, 4);
    return x;
}

typedef struct { uint8_t palette, start, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } TileConfig;

static void amx_configure(void) {  /* tiles 0-3: a 16 x 64 float block of keys; 4: A' rows; 5: B' tile */
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 6; i++) cfg.colsb[i] = 64, cfg.rows[i] = 16;
    _tile_loadconfig(&cfg);
}

/* B' of a head's w (r, 64) as (2 rp / 32) x 4 tiles of 16 x 32 bf16: tile (ks, n), row kk holds rows 32 ks + 2 kk
   and + 1 of B' interleaved, columns 16 n .. 16 n + 15. */
static void amx_weights(const float *w, int64_t r, int64_t rp, uint16_t *bt) {
    for (int64_t row = 0; row < 2 * rp; row++) {
        const int64_t part = row / rp, j = row % rp, ks = row / 32, kk = row % 32 / 2, odd = row % 2;
        for (int64_t col = 0; col < 64; col++) {
            uint16_t v = 0;
            if (j < r) {
                const float x = w[j * 64 + col];
                const uint16_t hi = to_bf16(x);
                v = part == 1 ? to_bf16(x - from_bf16(hi)) : hi;
            }
            bt[((ks * 4 + col / 16) * 16 + kk) * 32 + col % 16 * 2 + odd] = v;
        }
    }
}

/* A' rows of tokens tl0 .. tl0 + 15 of a decoded block (zg as in prerope64), row pitch 2 rp; columns r .. rp - 1 of
   each part stay as they were (zero). */
static inline void amx_rows(float *const *zg, const int64_t *c, int ng, int64_t tl0, int64_t rp, uint16_t *a) {
    for (int i = 0; i < 16; i++) {
        uint16_t *row = a + i * 2 * rp;
        int64_t off = 0;
        for (int g = 0; g < ng; off += c[g], g++) {
            const float *src = zg[g] + (tl0 + i) * c[g];
            for (int64_t u = 0; u < c[g]; u += 16) {
                const __mmask16 m = c[g] - u >= 16 ? 0xffff : (__mmask16)((1u << (c[g] - u)) - 1);
                const __m512 v = _mm512_maskz_loadu_ps(m, src + u);
                const __m256i hi = (__m256i)_mm512_cvtneps_pbh(v);
                const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
                const __m256i lo = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(v, back));
                _mm256_mask_storeu_epi16(row + off + u, m, hi);
                _mm256_mask_storeu_epi16(row + rp + off + u, m, lo);
            }
        }
    }
}

/* tile 4 (A' columns) times the four column tiles of B' at b, into tiles 0-3 */
#define AMX_COLUMNS(b) do { \
    _tile_loadd(5, (b), 64); _tile_dpbf16ps(0, 4, 5); _tile_loadd(5, (b) + 512, 64); _tile_dpbf16ps(1, 4, 5); \
    _tile_loadd(5, (b) + 1024, 64); _tile_dpbf16ps(2, 4, 5); _tile_loadd(5, (b) + 1536, 64); _tile_dpbf16ps(3, 4, 5); \
} while (0)

/* 16 keys less their mean (16 x 64 floats into k) */
static inline void amx_keys(const uint16_t *a, int64_t rp, const uint16_t *bt, float *k) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t ks = 0; ks < rp / 32; ks++) {
        const uint16_t *wh = bt + ks * 4 * 512, *wl = bt + (rp / 32 + ks) * 4 * 512;
        _tile_loadd(4, a + ks * 32, 2 * rp * 2);  /* Zh: against Wh and Wl */
        AMX_COLUMNS(wh);
        AMX_COLUMNS(wl);
        _tile_loadd(4, a + rp + ks * 32, 2 * rp * 2);  /* Zl: against Wh */
        AMX_COLUMNS(wh);
    }
    _tile_stored(0, k, 256);
    _tile_stored(1, k + 16, 256);
    _tile_stored(2, k + 32, 256);
    _tile_stored(3, k + 48, 256);
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
   token's position's rows). Blocks of PB tokens (a multiple of 8) start on whole groups of 8 codes, so each group's
   codes are decoded eight at a time (decode8; the store's padding completes the last); a block's table rows are read
   once for all heads, and nothing of size T x d is written. */
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
#ifdef HAVE_AMX
    const int amx = d == 64 && kv_amx();
    int64_t rp[MAX_HEADS], bsize = 0, asize = 0;  /* asize: a thread's A' rows of every head */
    for (int h = 0; h < H; h++) rp[h] = (r[h] + 31) / 32 * 32, bsize += 2 * rp[h] * 64, asize += 16 * 2 * rp[h];
    uint16_t *bts = amx ? malloc(2 * (bsize + threads * asize)) : NULL;
    if (amx && !bts) return free(wbuf), -1;
    if (amx) memset(bts + bsize, 0, 2 * threads * asize);
#endif
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
    uint16_t *bt[MAX_HEADS];
    for (int h = 0, off = 0; amx && h < H; off += (int)(2 * rp[h] * 64), h++)
        amx_weights(wh[h], r[h], rp[h], bt[h] = bts + off);
#endif
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int k = 0; k < threads; k++) {
        float *z = zbuf + k * zsize;
#ifdef HAVE_AMX
        float kb[16 * 64];
        uint16_t *ah[MAX_HEADS];
        for (int h = 0, off = 0; amx && h < H; off += (int)(16 * 2 * rp[h]), h++)
            ah[h] = bts + bsize + k * asize + off;
        if (amx) amx_configure();
#endif
        for (int64_t blk = blocks * k / threads; blk < blocks * (k + 1) / threads; blk++) {
            const int64_t t0 = blk * PB, nt = T - t0 < PB ? T - t0 : PB;
            for (int h = 0; h < H; h++) {
                const int ng = gs[h + 1] - gs[h];
                const int64_t *ch = c + gs[h];
                float *zg[MAX_PARTS];
                for (int g = 0, off = 0; g < ng; off += (int)(PB * ch[g] + 8), g++) {
                    const int G = gs[h] + g, b = nbits[G];
                    __m256 lv[4];
                    load_levels(levels[G], b, lv);
                    zg[g] = z + off;
                    const uint8_t *src = data[G] + (t0 * ch[g] / 8) * b;
                    for (int64_t e = 0; e < nt * ch[g]; e += 8)
                        _mm256_storeu_ps(zg[g] + e, decode8(src + e / 8 * b, b, lv, levels[G]));
                }
                const float *qh = q + h * M * d;
                float *oh = out + h * M * T;
                int64_t tl = 0;
#ifdef HAVE_AMX
                for (; amx && tl + 16 <= nt; tl += 16) {
                    amx_rows(zg, ch, ng, tl, rp[h], ah[h]);
                    amx_keys(ah[h], rp[h], bt[h], kb);
                    for (int i = 0; i < 16; i++) {
                        V key[NV];
                        for (int j = 0; j < NV; j++) key[j] = VADD(VLOAD(kb + 64 * i + VW * j), VLOAD(mh[h] + VW * j));
                        const int64_t t = t0 + tl + i;
                        read64(key, cosv + t * d, sinv + t * d, qh, M, oh + t, T);
                    }
                }
#endif
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
    free(bts);
#endif
    free(wbuf);
    return 0;
}
