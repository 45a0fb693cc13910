/* llama.cpp greedy decode of several sequences from token ids, timed: bench/llama_cpp.py's token check and its
   prefill / decode figures measured the way bench/engine.py measures dsakv (llama-cli takes text only, and
   llama-bench refuses an f32 K/V cache).

   llama-greedy MODEL.gguf THREADS N_NEW ID,ID,...[;ID,ID,...]
     -> one line per sequence: its N_NEW greedy token ids, space separated; then
        "time PREFILL_WALL PREFILL_CPU DECODE_WALL DECODE_CPU" (seconds; CPU = process CPU time, all threads)

   Prefill is one llama_decode of every prompt; each decode step is one llama_decode of one token per
   sequence. fp32 K/V cache, flash attention off (the settings under which llama.cpp's tokens equal
   transformers'). Built by bench/llama_cpp.py against the llama.cpp build's headers and libllama. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "llama.h"

static void quiet(enum ggml_log_level level, const char *text, void *user) {
    (void)user;
    if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

static double clock_s(clockid_t id) {
    struct timespec ts;
    clock_gettime(id, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int argmax(const float *logits, int n_vocab) {
    int best = 0;
    for (int v = 1; v < n_vocab; v++)
        if (logits[v] > logits[best]) best = v;
    return best;
}

static void add(struct llama_batch *b, llama_token id, llama_pos pos, llama_seq_id seq, int logits) {
    int i = b->n_tokens++;
    b->token[i] = id;
    b->pos[i] = pos;
    b->n_seq_id[i] = 1;
    b->seq_id[i][0] = seq;
    b->logits[i] = (int8_t)logits;
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s MODEL.gguf THREADS N_NEW ID,ID,...[;ID,ID,...]\n", argv[0]);
        return 2;
    }
    int threads = atoi(argv[2]), n_new = atoi(argv[3]);
    int n_seq = 1, total = 0, longest = 0;
    for (const char *c = argv[4]; *c; c++) n_seq += *c == ';';
    int *lens = calloc((size_t)n_seq, sizeof(int));
    llama_token *prompt = malloc(sizeof(llama_token) * (strlen(argv[4]) / 2 + 2));
    llama_token *out = malloc(sizeof(llama_token) * (size_t)(n_seq * (n_new > 0 ? n_new : 1)));
    int s = 0;
    for (char *c = argv[4]; *c;) {  /* ids separated by ',', sequences by ';' */
        prompt[total++] = (llama_token)strtol(c, &c, 10);
        lens[s]++;
        if (*c == ';') s++;
        if (*c) c++;
    }
    for (s = 0; s < n_seq; s++) longest = lens[s] > longest ? lens[s] : longest;
    llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model *model = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (!model) {
        fprintf(stderr, "cannot load %s\n", argv[1]);
        return 1;
    }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_seq_max = (uint32_t)n_seq;
    cp.n_ctx = (uint32_t)(n_seq * (longest + n_new + 16));
    cp.n_batch = cp.n_ubatch = (uint32_t)(total > 512 ? total : 512);
    cp.n_threads = cp.n_threads_batch = threads;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.type_k = GGML_TYPE_F32;
    cp.type_v = GGML_TYPE_F32;
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "cannot make a context for %d sequences\n", n_seq);
        return 1;
    }
    int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    struct llama_batch batch = llama_batch_init(total > n_seq ? total : n_seq, 0, 1);
    int *last = calloc((size_t)n_seq, sizeof(int)); /* batch row of each sequence's logits */
    int k = 0;
    for (s = 0; s < n_seq; s++)
        for (int p = 0; p < lens[s]; p++, k++) {
            if (p == lens[s] - 1) last[s] = batch.n_tokens;
            add(&batch, prompt[k], p, s, p == lens[s] - 1);
        }
    double w0 = clock_s(CLOCK_MONOTONIC), c0 = clock_s(CLOCK_PROCESS_CPUTIME_ID);
    double pw = 0, pc = 0;
    for (int step = 0; step <= n_new; step++) {
        if (llama_decode(ctx, batch) != 0) {
            fprintf(stderr, "llama_decode failed at step %d\n", step);
            return 1;
        }
        if (step == n_new) break; /* the last step's logits are not needed: decode timed over n_new steps */
        for (s = 0; s < n_seq; s++) out[s * n_new + step] = argmax(llama_get_logits_ith(ctx, last[s]), n_vocab);
        if (step == 0) { /* prefill done: time decode from here */
            double w1 = clock_s(CLOCK_MONOTONIC), c1 = clock_s(CLOCK_PROCESS_CPUTIME_ID);
            pw = w1 - w0, pc = c1 - c0, w0 = w1, c0 = c1;
        }
        batch.n_tokens = 0;
        for (s = 0; s < n_seq; s++) {
            last[s] = batch.n_tokens;
            add(&batch, out[s * n_new + step], lens[s] + step, s, 1);
        }
    }
    double dw = clock_s(CLOCK_MONOTONIC) - w0, dc = clock_s(CLOCK_PROCESS_CPUTIME_ID) - c0;
    for (s = 0; s < n_seq; s++) {
        for (int j = 0; j < n_new; j++) printf(j ? " %d" : "%d", out[s * n_new + j]);
        printf("\n");
    }
    printf("time %.6f %.6f %.6f %.6f\n", pw, pc, dw, dc);
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    free(prompt), free(out), free(lens), free(last);
    return 0;
}
