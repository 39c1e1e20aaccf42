/*
 * One whole decoder layer for a few decoding sequences, in one call.
 *
 * Decoding one to eight sequences of a small model spends more time dispatching ~15 small
 * torch ops per layer from Python than computing them. This composes the kernels of the
 * other files (GGUF matmuls, fused norm / rotary / SiLU, paged decode attention) in the same
 * order and with the same rounding points as the torch path of models/llama.py, so its
 * output is the same up to float summation order:
 *
 *   residual += x (or residual = x at the first layer);  h = rmsnorm(residual) * w1
 *   qkv = h Wqkv;  rotate q, k;  k, v -> cache slots;  a = attention(q, paged K/V)
 *   residual += a Wo;  h = rmsnorm(residual) * w2;  x = (silu(h Wg) * (h Wu)) Wd
 *
 * x, residual: [M, hidden] in the model dtype (dtype 0 = float32, 1 = bfloat16); x is
 * overwritten with the layer's MLP output (not yet added to residual, like the torch path).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct {
    int kind; /* 0 = Q4_1, 1 = Q8_0, 2 = dense (qs: [n, k] in the activations' dtype) */
    const void *qs;
    const float *d;
    const float *mn;
    int n, k;
    /* NULL, or the same values dense (bf16 [n, k]): one pass per MAX_ROWS rows then skips the
     * dequantizing, with bit-identical results (gguf_gemm.c sums both kinds in the same order) */
    const void *dense;
} qweight;

typedef struct {
    qweight qkv, o, gate_up, down;
    const void *norm1, *norm2;
    void *k_cache, *v_cache;
    int hidden, heads, kv_heads, head_dim, inter, block_size;
    float eps, scale; /* RMSNorm epsilon; attention scale (head_dim ** -0.5) */
} decoder_layer;

void q4_1_gemm(const void *x_in, int M, int K, const uint8_t *qs, const float *d, const float *mn,
               void *y, int N, float *scratch, int dtype);
void q8_0_gemm(const void *x_in, int M, int K, const int8_t *qs, const float *d, void *y, int N, float *scratch,
               int dtype);
void dense_gemm(const void *x_in, int M, int K, const void *w, void *y, int N, float *scratch, int dtype);
int max_rows(void);
void rms_norm(const void *x, void *residual, const void *w, void *out, int M, int N, float eps, int dtype);
void rotary_qk(void *q, int64_t q_stride, int q_heads, void *k, int64_t k_stride, int k_heads, int T, int D,
               const void *cos, const void *sin, int dtype);
void silu_mul(const void *gu, void *out, int M, int I, int dtype);
int paged_decode_attention(const void *q, void *out, const void *k_cache, const void *v_cache,
                           const int64_t *block_tables, int max_blocks, const int64_t *context_lens,
                           int B, int H, int KVH, int D, int block_size, float scale, int dtype,
                           int64_t skip, float *lse);

static void qgemm(const qweight *w, const void *x, int M, void *y, float *scratch, int dtype) {
    if (w->dense && M > max_rows())
        dense_gemm(x, M, w->k, w->dense, y, w->n, scratch, dtype);
    else if (w->kind == 0)
        q4_1_gemm(x, M, w->k, (const uint8_t *)w->qs, w->d, w->mn, y, w->n, scratch, dtype);
    else if (w->kind == 1)
        q8_0_gemm(x, M, w->k, (const int8_t *)w->qs, w->d, y, w->n, scratch, dtype);
    else
        dense_gemm(x, M, w->k, w->qs, y, w->n, scratch, dtype);
}

/* work: M * (2 * hidden + qkv + 2 * q_size + 3 * inter) elements of the model dtype;
 * scratch: M * (max(hidden, inter) * 33 / 32 + 1) + 16 floats */
int decode_layer(const decoder_layer *L, void *x, void *residual, int first, int M,
                 const void *cos, const void *sin, const int64_t *slots,
                 const int64_t *block_tables, int max_blocks, const int64_t *context_lens,
                 void *work, float *scratch, int dtype) {
    const int es = dtype == 1 ? 2 : 4;
    const int q_size = L->heads * L->head_dim, kv_size = L->kv_heads * L->head_dim;
    const int qkv_n = q_size + 2 * kv_size;
    if (L->qkv.n != qkv_n || L->gate_up.n != 2 * L->inter) return -1;
    char *h = (char *)work;                                   /* [M, hidden] */
    char *qkv = h + (int64_t)M * L->hidden * es;               /* [M, qkv_n] */
    char *q = qkv + (int64_t)M * qkv_n * es;                   /* [M, q_size] contiguous */
    char *attn = q + (int64_t)M * q_size * es;                 /* [M, q_size] */
    char *o = attn + (int64_t)M * q_size * es;                 /* [M, hidden] */
    char *gu = o + (int64_t)M * L->hidden * es;                /* [M, 2 * inter] */
    char *act = gu + (int64_t)M * 2 * L->inter * es;           /* [M, inter] */

    if (first) {
        memcpy(residual, x, (size_t)M * L->hidden * es);
        rms_norm(x, NULL, L->norm1, h, M, L->hidden, L->eps, dtype);
    } else {
        rms_norm(x, residual, L->norm1, h, M, L->hidden, L->eps, dtype);
    }
    qgemm(&L->qkv, h, M, qkv, scratch, dtype);
    rotary_qk(qkv, qkv_n, L->heads, qkv + (int64_t)q_size * es, qkv_n, L->kv_heads, M, L->head_dim, cos, sin, dtype);
    for (int m = 0; m < M; m++) {
        const char *row = qkv + (int64_t)m * qkv_n * es;
        memcpy(q + (int64_t)m * q_size * es, row, (size_t)q_size * es);
        memcpy((char *)L->k_cache + slots[m] * kv_size * es, row + (int64_t)q_size * es, (size_t)kv_size * es);
        memcpy((char *)L->v_cache + slots[m] * kv_size * es, row + (int64_t)(q_size + kv_size) * es,
               (size_t)kv_size * es);
    }
    int rc = paged_decode_attention(q, attn, L->k_cache, L->v_cache, block_tables, max_blocks, context_lens, M,
                                    L->heads, L->kv_heads, L->head_dim, L->block_size, L->scale, dtype, 0, NULL);
    if (rc != 0) return rc;
    qgemm(&L->o, attn, M, o, scratch, dtype);
    rms_norm(o, residual, L->norm2, h, M, L->hidden, L->eps, dtype);
    qgemm(&L->gate_up, h, M, gu, scratch, dtype);
    silu_mul(gu, act, M, L->inter, dtype);
    qgemm(&L->down, act, M, x, scratch, dtype);
    return 0;
}

/* The whole decoder stack of a decoding step in one call: the embedding rows of `ids` (embed: [vocab, hidden]
 * in the model dtype), the rotary rows of `positions` from the cos / sin tables ([max_pos, rot_dim], gathered
 * into cos_buf / sin_buf, [M, rot_dim] each), then every layer in turn. One call instead of one per layer
 * plus the torch ops around them: at one row the Python between the kernels cost ~0.4 ms per token, ~10%
 * of a token's time. The values are the same bytes the torch ops would give (row copies).
 * With n_out > 0 it also finishes what the model's final norm does for the rows out_rows ([n_out] indices
 * into the M rows): each row's x + residual, RMS-normed with final_norm ([hidden], model dtype), into out
 * [n_out, hidden] (x and residual are left as the last layer left them). The same kernel on the same values
 * as the torch path's gather and RMSNorm, which between model steps, with every cache line of the host's
 * Python evicted by the weights, cost ~0.4 ms a step for one row. Returns 0, or a layer's error code with
 * its index in *failed (-3 with *failed = -1: a row of out_rows outside [0, M)). */
int decode_layers(const decoder_layer *layers, int n_layers, const int64_t *ids, const void *embed,
                  const int64_t *positions, const void *cos_table, const void *sin_table, int rot_dim,
                  void *cos_buf, void *sin_buf, void *x, void *residual, int M, const int64_t *slots,
                  const int64_t *block_tables, int max_blocks, const int64_t *context_lens, void *work,
                  float *scratch, int dtype, int *failed, const void *final_norm, float final_eps,
                  const int64_t *out_rows, int n_out, void *out) {
    const int es = dtype == 1 ? 2 : 4;
    const size_t row = (size_t)layers[0].hidden * es, rot = (size_t)rot_dim * es;
    for (int m = 0; m < M; m++) {
        memcpy((char *)x + m * row, (const char *)embed + ids[m] * row, row);
        memcpy((char *)cos_buf + m * rot, (const char *)cos_table + positions[m] * rot, rot);
        memcpy((char *)sin_buf + m * rot, (const char *)sin_table + positions[m] * rot, rot);
    }
    for (int i = 0; i < n_layers; i++) {
        int rc = decode_layer(&layers[i], x, residual, i == 0, M, cos_buf, sin_buf, slots, block_tables,
                              max_blocks, context_lens, work, scratch, dtype);
        if (rc != 0) {
            *failed = i;
            return rc;
        }
    }
    if (n_out > 0) {
        char *xs = (char *)work, *rs = xs + (size_t)n_out * row;  /* the rows' copies: work is free again */
        for (int r = 0; r < n_out; r++) {
            if (out_rows[r] < 0 || out_rows[r] >= M) {
                *failed = -1;
                return -3;
            }
            memcpy(xs + r * row, (const char *)x + out_rows[r] * row, row);
            memcpy(rs + r * row, (const char *)residual + out_rows[r] * row, row);
        }
        rms_norm(xs, rs, final_norm, out, n_out, layers[0].hidden, final_eps, dtype);
    }
    return 0;
}

void argmax_rows(const void *x, int M, int N, int64_t *out, int dtype);

/* One greedy step of M rows: decode_layers with every row's final norm (into `hidden`), the LM head through
 * qgemm into `logits` and each row's argmax into out[0..M): the kernels and values of one engine step per
 * token, shared by decode_steps and spec_decode_steps so that a verified row is the same bits as a plain
 * decode's. Returns decode_layers' code. */
static int greedy_step(const decoder_layer *layers, int n_layers, const int64_t *ids, const void *embed,
                       const int64_t *positions, const void *cos_table, const void *sin_table, int rot_dim,
                       void *cos_buf, void *sin_buf, void *x, void *residual, int M, const int64_t *slots,
                       const int64_t *block_tables, int max_blocks, const int64_t *context_lens, void *work,
                       float *scratch, int dtype, int *failed, const void *final_norm, float final_eps,
                       const int64_t *rows, void *hidden, const qweight *head, void *logits, int64_t *out) {
    const int rc = decode_layers(layers, n_layers, ids, embed, positions, cos_table, sin_table, rot_dim, cos_buf,
                                 sin_buf, x, residual, M, slots, block_tables, max_blocks, context_lens, work,
                                 scratch, dtype, failed, final_norm, final_eps, rows, M, hidden);
    if (rc != 0) return rc;
    qgemm(head, hidden, M, logits, scratch, dtype);
    argmax_rows(logits, M, head->n, out, dtype);
    return 0;
}

/* Greedy decoding of the M rows, up to n_steps tokens each, in one call. A step is decode_layers with every
 * row's final norm (into `hidden` [M, hidden]), the LM head `head` through qgemm (for M <= MAX_ROWS the block
 * kernel, as the torch path's Linear takes) into `logits` [M, vocab] of the model dtype, and each row's argmax
 * (argmax_rows, the greedy sampler's kernel): the same kernels on the same values as one engine step per
 * token. Row m's token of step j is tokens[j * M + m] and the next step's input; positions, context_lens and
 * slots (all [M], changed in place) advance one token, a position p's slot being
 * block_tables[m][p / block_size] * block_size + p % block_size (the caller has allocated the blocks of
 * every position up to the last step's). It stops early after a step in which a row produced one of
 * stop_ids ([n_stop]). Between model steps the host's Python runs cold (the weights evict its caches every
 * step) and cost ~0.9 ms per single-stream token, ~12% of it; here it is paid once per call.
 * Returns the steps done (>= 1), decode_layers' error code (*failed: the layer), or -4 when a row's block
 * table (max_blocks wide) ends before a step's position. */
int decode_steps(const decoder_layer *layers, int n_layers, const int64_t *ids, const void *embed,
                 int64_t *positions, const void *cos_table, const void *sin_table, int rot_dim, void *cos_buf,
                 void *sin_buf, void *x, void *residual, int M, int64_t *slots, const int64_t *block_tables,
                 int max_blocks, int64_t *context_lens, void *work, float *scratch, int dtype, int *failed,
                 const void *final_norm, float final_eps, int64_t *rows, void *hidden, const qweight *head,
                 void *logits, int n_steps, const int64_t *stop_ids, int n_stop, int64_t *tokens) {
    const int bs = layers[0].block_size;
    for (int m = 0; m < M; m++) rows[m] = m;
    for (int j = 0; j < n_steps; j++) {
        if (j > 0) {
            for (int m = 0; m < M; m++) {
                const int64_t p = ++positions[m];
                if (p / bs >= max_blocks) return -4;  /* a table that does not reach this step */
                context_lens[m]++;
                slots[m] = block_tables[(int64_t)m * max_blocks + p / bs] * bs + p % bs;
            }
        }
        int64_t *out = tokens + (int64_t)j * M;
        const int rc = greedy_step(layers, n_layers, j == 0 ? ids : tokens + (int64_t)(j - 1) * M, embed, positions,
                                   cos_table, sin_table, rot_dim, cos_buf, sin_buf, x, residual, M, slots,
                                   block_tables, max_blocks, context_lens, work, scratch, dtype, failed, final_norm,
                                   final_eps, rows, hidden, head, logits, out);
        if (rc != 0) return rc;
        for (int m = 0; m < M; m++)
            for (int s = 0; s < n_stop; s++)
                if (out[m] == stop_ids[s]) return j + 1;
    }
    return n_steps;
}


/* Prompt-lookup n-gram search over hist[0..n), the Python proposer's `find_match` (engine/spec/ngram.py):
 * within the last `lookback` tokens, for m from max_n down to min_n, the most recent earlier occurrence of
 * the last m tokens that ends before the last token; returns m and the index of what followed it in
 * *start (0: no match). */
int ngram_lookup(const int64_t *hist, int64_t n, int min_n, int max_n, int64_t lookback, int64_t *start) {
    const int64_t lo = n > lookback ? n - lookback : 0, end = n - 1;
    if (n - lo <= min_n) return 0;
    const int top = (int64_t)max_n < end - lo ? max_n : (int)(end - lo);
    for (int m = top; m >= min_n; m--) {
        const int64_t *suffix = hist + n - m;
        for (int64_t s = end - m; s >= lo; s--) {
            if (hist[s + m - 1] != suffix[m - 1] || memcmp(hist + s, suffix, (size_t)m * sizeof(int64_t)) != 0)
                continue;
            *start = s + m;
            return m;
        }
    }
    return 0;
}

/* Greedy decoding of S requests with prompt-lookup speculation, several steps in one call: each step looks
 * up an n-gram draft in each active request's tokens (ngram_lookup) and verifies the requests' last tokens
 * and drafts as decode rows of one pass (greedy_step, as decode_steps); a request keeps its drafts up to the first that is not its row's
 * argmax and appends them and the next argmax. Request s drafts k = k_by_match[s * (max_n + 1) + m] tokens
 * after a match of m tokens (0 for none), capped so the call appends at most max_new[s] tokens to it; a
 * step has at most max_rows rows: one per active request, the rest shared among the drafts, longer matches
 * first (ties: in request order). Request s's tokens are hist[hist_off[s] ..], n_hist[s] of them, with room
 * for max_new[s] more; position[s] is its last token's (its KV is computed here; advanced in place); its
 * rows are written to the KV slots of its block table, the first n_blocks[s] entries of row s of `tables`
 * (max_blocks wide, allocated for positions up to position + max_new - 1): a rejected draft's KV lies past
 * the kept tokens and is overwritten later, as after a verification step of the engine. A request is active until it has
 * appended max_new[s] tokens or a token of stop_ids (appended, nothing after it); the call stops after
 * n_steps steps or when none is active. Per step j, stats[(j * S + s) * 3 ..] gets request s's (match,
 * drafts, kept) (drafts -1: not in the step), rows[j] the step's rows and seconds[j] its wall time;
 * appended[s] the tokens appended to s. Buffers are decode_steps', sized for max_rows rows. Returns the
 * steps done (>= 1); decode_layers' error code (*failed: the layer); -4 when a request's table does not
 * reach a row's position; -5 on bad arguments. */
int spec_decode_steps(const decoder_layer *layers, int n_layers, const void *embed, const void *cos_table,
                      const void *sin_table, int rot_dim, void *cos_buf, void *sin_buf, void *x, void *residual,
                      void *work, float *scratch, int dtype, int *failed, const void *final_norm, float final_eps,
                      void *hidden, const qweight *head, void *logits, int S, int64_t *hist, const int64_t *hist_off,
                      const int64_t *n_hist, int64_t *position, const int64_t *tables, const int64_t *n_blocks,
                      int max_blocks, int n_steps,
                      const int *max_new, const int *k_by_match, int min_n, int max_n, int64_t lookback,
                      const int64_t *stop_ids, int n_stop, int *stats, int *rows, double *seconds, int *appended) {
    enum { ROWS = 64 };
    const int bs = layers[0].block_size, limit = max_rows() < ROWS ? max_rows() : ROWS;
    if (S < 1 || S > limit || min_n < 1 || max_n < min_n) return -5;
    for (int s = 0; s < S; s++)
        if (n_hist[s] < 1 || max_new[s] < 1 || n_blocks[s] > max_blocks) return -5;
    int64_t ids[ROWS], pos[ROWS], slots[ROWS], lens[ROWS], idx[ROWS], top[ROWS], from[ROWS];
    int match[ROWS], k[ROWS], first[ROWS], order[ROWS], done[ROWS], owner[ROWS];
    int64_t *row_tables = malloc(sizeof(int64_t) * ROWS * (size_t)max_blocks);
    if (!row_tables) return -5;
    for (int r = 0; r < limit; r++) idx[r] = r, owner[r] = -1;
    for (int s = 0; s < S; s++) appended[s] = 0, done[s] = 0;
    int j = 0, rc = 0;
    for (; j < n_steps; j++) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        int active = 0;
        for (int s = 0; s < S; s++) {
            k[s] = -1;
            if (done[s] || appended[s] >= max_new[s]) continue;
            const int64_t n = n_hist[s] + appended[s];
            const int64_t *h = hist + hist_off[s];
            from[s] = 0;
            match[s] = ngram_lookup(h, n, min_n, max_n, lookback, &from[s]);
            int want = match[s] ? k_by_match[s * (max_n + 1) + match[s]] : 0;
            if (want > max_new[s] - appended[s] - 1) want = max_new[s] - appended[s] - 1;
            if (match[s] && want > n - from[s]) want = (int)(n - from[s]);
            k[s] = want < 0 ? 0 : want;
            order[active++] = s;
        }
        if (!active) break;
        /* the rows past one per request go to the drafts of the longest matches first */
        for (int a = 1; a < active; a++)
            for (int b = a; b > 0 && match[order[b]] > match[order[b - 1]]; b--) {
                const int t = order[b];
                order[b] = order[b - 1], order[b - 1] = t;
            }
        int spare = limit - active;
        for (int a = 0; a < active; a++) {
            const int s = order[a];
            if (k[s] > spare) k[s] = spare;
            spare -= k[s];
        }
        int M = 0;
        for (int s = 0; s < S; s++) {
            if (k[s] < 0) continue;
            const int64_t *h = hist + hist_off[s];
            const int64_t n = n_hist[s] + appended[s];
            first[s] = M;
            for (int r = 0; r <= k[s]; r++, M++) {
                ids[M] = r ? h[from[s] + r - 1] : h[n - 1];
                pos[M] = position[s] + r;
                if (pos[M] / bs >= n_blocks[s]) {
                    rc = -4;
                    goto out;
                }
                lens[M] = pos[M] + 1;
                slots[M] = tables[(int64_t)s * max_blocks + pos[M] / bs] * bs + pos[M] % bs;
                if (owner[M] != s) {  /* the tables do not change during the call: a row's copy stays its */
                    memcpy(row_tables + (int64_t)M * max_blocks, tables + (int64_t)s * max_blocks,
                           sizeof(int64_t) * (size_t)max_blocks);
                    owner[M] = s;
                }
            }
        }
        rc = greedy_step(layers, n_layers, ids, embed, pos, cos_table, sin_table, rot_dim, cos_buf, sin_buf, x,
                         residual, M, slots, row_tables, max_blocks, lens, work, scratch, dtype, failed, final_norm,
                         final_eps, idx, hidden, head, logits, top);
        if (rc != 0) goto out;
        for (int s = 0; s < S; s++) {
            int *st = stats + ((int64_t)j * S + s) * 3;
            st[0] = 0, st[1] = k[s], st[2] = 0;
            if (k[s] < 0) continue;
            const int64_t *t = top + first[s], *d = ids + first[s] + 1;
            int kept = 0;
            while (kept < k[s] && d[kept] == t[kept]) kept++;
            int64_t *h = hist + hist_off[s] + n_hist[s];
            for (int r = 0; r <= kept && !done[s]; r++) {
                h[appended[s]++] = t[r];  /* the kept drafts are their rows' argmaxes; then the next token */
                for (int q = 0; q < n_stop; q++)
                    if (t[r] == stop_ids[q]) done[s] = 1;
            }
            position[s] += kept + 1;
            st[0] = match[s], st[2] = kept;
        }
        rows[j] = M;
        clock_gettime(CLOCK_MONOTONIC, &t1);
        seconds[j] = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    }
    rc = j;
out:
    free(row_tables);
    return rc;
}
