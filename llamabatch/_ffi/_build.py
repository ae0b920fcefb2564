"""cffi builder for ``llamabatch._ffi._llama`` (API mode, out of line).

Used by ``setup.py`` through ``cffi_modules``-style ``build(build)``: compiles the
hand-written ``_cdefs.h`` against the vendored ``llama.h`` so that the C compiler checks
every declared struct field and signature, and links to the vendored ``libllama``.
"""

from __future__ import annotations

from pathlib import Path

import cffi

HERE = Path(__file__).resolve().parent
MODULE_NAME = "llamabatch._ffi._llama"
MTMD_MODULE_NAME = "llamabatch._ffi._mtmd"

# The installed extension lives in <site-packages>/llamabatch/_ffi/; the runtime copy of
# llama-cpp-python sits beside llamabatch in the same site-packages. An rpath into the
# build environment would break: pip deletes its isolated build env after the build.
RUNTIME_RPATH = "$ORIGIN/../../llama_cpp/lib"


# Compiled as C++ (``source_extension=".cpp"``): only C++ can catch the exceptions llama.cpp
# throws through its C API (a grammar's "Unexpected empty grammar stack"), which otherwise
# reach std::terminate and end the process.
C_SOURCE = """
#include "llama.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <list>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

/* llama.cpp internals (pinned version), to count a grammar's parse stacks: the grammar
 * sampler's context (llama-sampler.cpp), and the accessor llama-grammar.cpp exports. */
struct llama_grammar;
struct llamabatch_grammar_element {
    int type;
    uint32_t value;
};
typedef struct llamabatch_grammar_element llama_grammar_element;
std::vector<std::vector<const llama_grammar_element *>> & llama_grammar_get_stacks(
        struct llama_grammar * grammar);
void llama_grammar_accept(struct llama_grammar * grammar, uint32_t chr);
struct llamabatch_sampler_grammar {
    const struct llama_vocab * vocab;
    std::string grammar_str;
    std::string grammar_root;
    struct llama_grammar * grammar;
};

/* The head of llama.cpp's struct llama_grammar (llama-grammar.h, pinned version): what a pass
 * over the vocabulary depends on, the rules, the parse stacks (pointers into the rules), the
 * partial UTF-8 sequence, and whether a lazy grammar still waits for its trigger. */
struct llamabatch_grammar_head {
    const struct llama_vocab * vocab;
    const std::vector<std::vector<llama_grammar_element>> rules;
    std::vector<std::vector<const llama_grammar_element *>> stacks;
    struct {
        uint32_t value;
        int n_remain;
    } partial_utf8;
    bool lazy;
    bool awaiting_trigger;
};

static size_t llamabatch_grammar_stacks(struct llama_sampler * chain) {
    const int32_t n = llama_sampler_chain_n(chain);
    for (int32_t i = 0; i < n; i++) {
        struct llama_sampler * s = llama_sampler_chain_get(chain, i);
        if (s != NULL && std::strcmp(llama_sampler_name(s), "grammar") == 0) {
            struct llama_grammar * grammar = ((struct llamabatch_sampler_grammar *) s->ctx)->grammar;
            return grammar != NULL ? llama_grammar_get_stacks(grammar).size() : 0;
        }
    }
    return 0;
}

static bool llamabatch_abort_flag_cb(void * data) {
    return data != NULL && *(volatile int *) data != 0;
}

/* llama.cpp's log, filtered before Python: a line under WARN (with its continuations) reaches
 * the Python callback only while llamabatch_log_debug is set (log.sync_level). Every line that
 * reaches Python takes the GIL from inside llama.cpp: a KV copy's debug lines in a decode
 * waited behind the event loop's Python for each of them. */
static void _llamabatch_log_callback(enum ggml_log_level, const char *, void *);
int llamabatch_log_debug = 0;
static thread_local int llamabatch_log_line_level = GGML_LOG_LEVEL_NONE;

static void llamabatch_log_filter(enum ggml_log_level level, const char * text, void * user_data) {
    if (level != GGML_LOG_LEVEL_CONT) {
        llamabatch_log_line_level = level;
    }
    if (llamabatch_log_debug || llamabatch_log_line_level == GGML_LOG_LEVEL_WARN ||
            llamabatch_log_line_level == GGML_LOG_LEVEL_ERROR) {
        _llamabatch_log_callback(level, text, user_data);
    }
}

static void llamabatch_set_error(char * err, size_t err_size, const char * what) {
    if (err != NULL && err_size > 0) {
        std::strncpy(err, what, err_size - 1);
        err[err_size - 1] = '\\0';
    }
}

/* Grammar masks: which tokens a grammar allows is a function of its state alone (its rules,
 * parse stacks and partial UTF-8 sequence), not of the logits; requests sharing a schema pass
 * through the same states, and a pass over the whole vocabulary costs milliseconds. So the
 * passes over the whole vocabulary are kept, one bit per token, keyed by the grammar's identity
 * (a digest of its text, given by the caller) and its state written without addresses: each
 * stack element as (rule, offset). Least recently used first out, within max_bytes. */
struct llamabatch_mask_cache {
    std::mutex lock;
    size_t max_bytes = 0, bytes = 0;
    uint64_t hits = 0, passes = 0;
    struct entry {
        std::vector<uint64_t> bits;
        std::list<const std::string *>::iterator used;
    };
    std::unordered_map<std::string, entry> entries;
    std::list<const std::string *> order;  // keys, the most recently used first
};

static const size_t LLAMABATCH_MASK_ENTRY_OVERHEAD = 128;  // map node, list node, headers

struct llamabatch_mask_cache * llamabatch_mask_cache_new(size_t max_bytes) {
    try {
        auto * cache = new llamabatch_mask_cache();
        cache->max_bytes = max_bytes;
        return cache;
    } catch (...) {
        return NULL;
    }
}

void llamabatch_mask_cache_free(struct llamabatch_mask_cache * cache) {
    delete cache;
}

/* hits, passes, entries, bytes */
void llamabatch_mask_cache_stats(struct llamabatch_mask_cache * cache, uint64_t * out) {
    std::lock_guard<std::mutex> guard(cache->lock);
    out[0] = cache->hits;
    out[1] = cache->passes;
    out[2] = cache->entries.size();
    out[3] = cache->bytes;
}

static void llamabatch_key_put(std::string & key, uint32_t value) {
    key.append((const char *) &value, sizeof value);
}

/* The key of grammar's present state; false when it cannot be written (a stack element outside
 * the grammar's rules: never in the pinned version). */
static bool llamabatch_grammar_state_key(
        const llamabatch_grammar_head & grammar, const char * grammar_id, size_t grammar_id_len,
        std::string & key) {
    /* Each rule's address, sorted: made again only for rules at other addresses (a check in
     * rule order costs far less than the sort, for grammars of thousands of rules). */
    thread_local std::vector<std::pair<uintptr_t, uint32_t>> starts;
    thread_local std::vector<std::pair<uintptr_t, size_t>> made_from;  // (address, size) by rule
    const auto & rules = grammar.rules;
    bool same = made_from.size() == rules.size();
    for (size_t r = 0; same && r < rules.size(); r++) {
        same = made_from[r].first == (uintptr_t) rules[r].data() && made_from[r].second == rules[r].size();
    }
    if (!same) {
        made_from.clear();
        starts.clear();
        for (uint32_t r = 0; r < rules.size(); r++) {
            made_from.emplace_back((uintptr_t) rules[r].data(), rules[r].size());
            if (!rules[r].empty()) {
                starts.emplace_back((uintptr_t) rules[r].data(), r);
            }
        }
        std::sort(starts.begin(), starts.end());
    }
    key.assign(grammar_id, grammar_id_len);
    llamabatch_key_put(key, grammar.partial_utf8.value);
    llamabatch_key_put(key, (uint32_t) grammar.partial_utf8.n_remain);
    for (const auto & stack : grammar.stacks) {
        llamabatch_key_put(key, (uint32_t) stack.size());
        for (const llama_grammar_element * element : stack) {
            const uintptr_t at = (uintptr_t) element;
            auto it = std::upper_bound(starts.begin(), starts.end(), std::make_pair(at, UINT32_MAX));
            if (it == starts.begin()) {
                return false;
            }
            --it;
            const size_t offset = (at - it->first) / sizeof(llama_grammar_element);
            if (offset >= grammar.rules[it->second].size()) {
                return false;
            }
            llamabatch_key_put(key, it->second);
            llamabatch_key_put(key, (uint32_t) offset);
        }
    }
    return true;
}

/* One grammar's mask for its present state, found or made. */
struct llamabatch_masking {
    struct llamabatch_mask_cache * cache;
    const char * grammar_id;
    size_t grammar_id_len;
    struct llama_sampler * grammar;  // the chain's grammar stage
    int32_t n_vocab;
    std::string key;  // empty: this state is not kept (a lazy grammar waiting for its trigger)
    std::vector<uint64_t> bits;
    bool looked = false, ready = false;

    const llamabatch_grammar_head * head() const {
        const auto * sampler = (const struct llamabatch_sampler_grammar *) grammar->ctx;
        return (const llamabatch_grammar_head *) sampler->grammar;
    }

    /* The kept mask of this state, if any (a cheap look: no pass). */
    bool find() {
        if (looked) {
            return ready;
        }
        looked = true;
        const llamabatch_grammar_head * g = head();
        key.clear();
        if (g == NULL || g->awaiting_trigger ||
                !llamabatch_grammar_state_key(*g, grammar_id, grammar_id_len, key)) {
            key.clear();
            return false;
        }
        std::lock_guard<std::mutex> guard(cache->lock);
        auto it = cache->entries.find(key);
        if (it == cache->entries.end()) {
            return false;
        }
        cache->hits++;
        cache->order.splice(cache->order.begin(), cache->order, it->second.used);
        bits = it->second.bits;
        ready = true;
        return true;
    }

    /* The mask, from the cache or by one pass of the grammar over the whole vocabulary (with
     * equal logits: the mask must not depend on them), then kept. */
    const uint64_t * get() {
        if (find()) {
            return bits.data();
        }
        thread_local std::vector<llama_token_data> all;
        all.resize(n_vocab);
        for (int32_t t = 0; t < n_vocab; t++) {
            all[t] = llama_token_data{t, 0.0f, 0.0f};
        }
        llama_token_data_array all_p = {all.data(), all.size(), -1, false};
        llama_sampler_apply(grammar, &all_p);
        return keep_allowed(all.data(), all.size(), true);
    }

    /* The mask of the tokens of data[0, n) whose logits are finite (only those with
     * all_finite: the others are refused), kept: data holds the whole vocabulary after the
     * grammar's pass over logits that were all finite before it, so that only the grammar
     * made any of them -inf. */
    const uint64_t * keep_allowed(const llama_token_data * data, size_t n, bool all_finite) {
        bits.assign(((size_t) n_vocab + 63) / 64, 0);
        for (size_t j = 0; j < n; j++) {
            if (!all_finite || std::isfinite(data[j].logit)) {
                bits[data[j].id >> 6] |= (uint64_t) 1 << (data[j].id & 63);
            }
        }
        ready = true;
        if (key.empty()) {  // not kept (nor counted: a lazy grammar's pass while it waits is a no-op)
            return bits.data();
        }
        std::lock_guard<std::mutex> guard(cache->lock);
        cache->passes++;
        const size_t size = key.size() * 2 + bits.size() * sizeof(uint64_t) + LLAMABATCH_MASK_ENTRY_OVERHEAD;
        if (size > cache->max_bytes) {
            return bits.data();
        }
        while (cache->bytes + size > cache->max_bytes && !cache->order.empty()) {
            auto old = cache->entries.find(*cache->order.back());
            cache->bytes -= old->first.size() * 2 + old->second.bits.size() * sizeof(uint64_t) +
                LLAMABATCH_MASK_ENTRY_OVERHEAD;
            cache->order.pop_back();
            cache->entries.erase(old);
        }
        auto placed = cache->entries.emplace(key, llamabatch_mask_cache::entry{bits, {}});
        if (placed.second) {
            cache->order.push_front(&placed.first->first);
            placed.first->second.used = cache->order.begin();
            cache->bytes += size;
        }
        return bits.data();
    }
};

static bool llamabatch_all_finite(const llama_token_data * data, size_t n) {
    for (size_t j = 0; j < n; j++) {
        if (!std::isfinite(data[j].logit)) {
            return false;
        }
    }
    return true;
}

static inline bool llamabatch_mask_allows(const uint64_t * bits, llama_token id) {
    return (bits[id >> 6] >> (id & 63)) & 1;
}

/* The chain applied stage by stage, its grammar stage by the kept mask; without one, the
 * grammar's own pass, kept as the mask when the logits it saw were all finite (else the mask
 * is made apart: a -inf before the grammar, a ban, must not enter it). */
static void llamabatch_chain_masked(
        struct llama_sampler * smpl, int32_t grammar_at, llamabatch_masking & masking,
        llama_token_data_array & cur_p) {
    const int32_t n = llama_sampler_chain_n(smpl);
    for (int32_t i = 0; i < n; i++) {
        if (i != grammar_at) {
            llama_sampler_apply(llama_sampler_chain_get(smpl, i), &cur_p);
            continue;
        }
        if (!masking.find() && cur_p.size == (size_t) masking.n_vocab &&
                llamabatch_all_finite(cur_p.data, cur_p.size)) {
            llama_sampler_apply(llama_sampler_chain_get(smpl, i), &cur_p);
            masking.keep_allowed(cur_p.data, cur_p.size, true);
            continue;
        }
        const uint64_t * bits = masking.get();
        for (size_t j = 0; j < cur_p.size; j++) {
            if (!llamabatch_mask_allows(bits, cur_p.data[j].id)) {
                cur_p.data[j].logit = -INFINITY;
            }
        }
    }
}

/* The grammar stage's index, and how the chain may spare the grammar a pass over the whole
 * vocabulary (mode): 1, the chain ends in greedy selection; 2, top-k comes right after the
 * grammar; 0, neither. -1: no grammar. */
static int32_t llamabatch_grammar_stage(struct llama_sampler * chain, int32_t * mode) {
    const int32_t n = llama_sampler_chain_n(chain);
    for (int32_t i = 0; i < n - 1; i++) {
        if (std::strcmp(llama_sampler_name(llama_sampler_chain_get(chain, i)), "grammar") == 0) {
            if (std::strcmp(llama_sampler_name(llama_sampler_chain_get(chain, n - 1)), "greedy") == 0) {
                *mode = 1;
                return i;
            }
            const char * next = llama_sampler_name(llama_sampler_chain_get(chain, i + 1));
            *mode = std::strcmp(next, "top-k") == 0 ? 2 : 0;
            return i;
        }
    }
    return -1;
}

static bool llamabatch_selected_ok(const llama_token_data_array & cur_p) {
    return cur_p.selected >= 0 && cur_p.selected < (int64_t) cur_p.size &&
        std::isfinite(cur_p.data[cur_p.selected].logit);
}

/* The grammar's check of data[start, end): those it passes move, in order, to data[kept...];
 * returns the new count. */
static size_t llamabatch_grammar_keep(
        struct llama_sampler * smpl, int32_t grammar_at, const uint64_t * bits, llama_token_data * data,
        size_t start, size_t end, size_t kept, bool sorted) {
    if (bits == NULL) {
        llama_token_data_array part = {data + start, end - start, -1, sorted};
        llama_sampler_apply(llama_sampler_chain_get(smpl, grammar_at), &part);
    }
    for (size_t j = start; j < end; j++) {
        if (std::isfinite(data[j].logit) && (bits == NULL || llamabatch_mask_allows(bits, data[j].id))) {
            data[kept++] = data[j];
        }
    }
    return kept;
}

/* Top-k right after the grammar keeps the k highest logits the grammar allows, and the stages
 * after it see only those: so the grammar first checks the best candidates (by the logits the
 * stages before it leave), and only when fewer than k of them pass, the rest of the vocabulary;
 * the rest of the chain then runs on those that passed, best first: what it gets after a pass
 * over the whole vocabulary (the same tokens in the same order, so the same draw; tokens the
 * grammar refused would only trail with probability 0). Leaves cur_p selected; false when none
 * passed. */
static bool llamabatch_top_k_first(
        struct llama_sampler * smpl, int32_t grammar_at, int32_t top_k, llamabatch_masking * masking,
        llama_token_data_array & cur_p) {
    for (int32_t i = 0; i < grammar_at; i++) {
        llama_sampler_apply(llama_sampler_chain_get(smpl, i), &cur_p);
    }
    const auto better = [](const llama_token_data & a, const llama_token_data & b) {
        return a.logit > b.logit;
    };
    llama_token_data * data = cur_p.data;
    const size_t size = cur_p.size, k = (size_t) top_k;
    const size_t first = std::min(size, std::max<size_t>(8 * k, 256));
    std::partial_sort(data, data + first, data + size, better);
    // A kept mask serves at once; otherwise it is made only where the whole vocabulary is needed.
    const uint64_t * bits = masking != NULL && masking->find() ? masking->bits.data() : NULL;
    size_t kept = llamabatch_grammar_keep(smpl, grammar_at, bits, data, 0, first, 0, true);
    if (kept < k && first < size) {  // too few of the best passed: the rest of the vocabulary too
        const size_t from = kept;
        /* Without a kept mask, the grammar's own pass over the rest makes one: those kept from
         * both runs are every token it allows, when no logit was -inf before it (the first run
         * held the highest logits, so the rest tells). */
        const bool makes_mask =
            masking != NULL && bits == NULL && llamabatch_all_finite(data + first, size - first);
        if (masking != NULL && bits == NULL && !makes_mask) {
            bits = masking->get();
        }
        kept = llamabatch_grammar_keep(smpl, grammar_at, bits, data, first, size, kept, false);
        if (makes_mask) {
            masking->keep_allowed(data, kept, false);
        }
        std::sort(data + from, data + kept, better);  // they trail the first run's, best first
    }
    kept = std::min(kept, k);
    if (kept == 0) {
        return false;
    }
    cur_p = {data, kept, -1, true};
    const int32_t n = llama_sampler_chain_n(smpl);
    for (int32_t i = grammar_at + 1; i < n; i++) {
        llama_sampler_apply(llama_sampler_chain_get(smpl, i), &cur_p);
    }
    return true;
}

/* Accept token into the chain (its grammar too); -3 when the grammar then holds more than
 * max_stacks parse stacks (see below). Throws what llama.cpp throws. */
static int32_t llamabatch_accept_checked(
        struct llama_sampler * smpl, llama_token token, size_t max_stacks, char * err, size_t err_size) {
    llama_sampler_accept(smpl, token);
    const size_t n_stacks = max_stacks > 0 ? llamabatch_grammar_stacks(smpl) : 0;
    if (n_stacks > max_stacks) {
        std::string what = std::to_string(n_stacks) + " parse stacks";
        llamabatch_set_error(err, err_size, what.c_str());
        return -3;
    }
    return token;
}

/* llama_sampler_sample (CPU samplers), guarded: the chain is applied to the logits at idx,
 * and the chosen token is accepted only if its logit is finite. Returns the token; -1 when
 * the chain left no allowed token (a grammar at a dead end: accepting the token anyway throws,
 * or aborts for an end-of-generation token); -2 when llama.cpp threw (err says what); -3 when
 * the grammar holds more than max_stacks parse stacks after the token (an ambiguous grammar:
 * every stack is matched against the vocabulary at every step, and deduplicated pairwise).
 * max_stacks 0: not counted (the layout read is that of the pinned llama.cpp only). top_k: the
 * chain's top-k (0: off), which lets the grammar check the best candidates first (above).
 * masks: where the grammar's passes over the whole vocabulary are kept (NULL: none; the layout
 * read is the pinned version's), for the grammar whose text's digest is grammar_id. */
static int32_t llamabatch_sampler_sample_guarded(
        struct llama_sampler * smpl, struct llama_context * ctx, int32_t idx, size_t max_stacks,
        int32_t top_k, struct llamabatch_mask_cache * masks, const char * grammar_id, size_t grammar_id_len,
        char * err, size_t err_size) {
    try {
        const float * logits = llama_get_logits_ith(ctx, idx);
        if (logits == NULL) {
            llamabatch_set_error(err, err_size, "no logits at this batch index");
            return -2;
        }
        const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx)));
        thread_local std::vector<llama_token_data> cur;
        cur.resize(n_vocab);
        for (int32_t t = 0; t < n_vocab; t++) {
            cur[t] = llama_token_data{t, logits[t], 0.0f};
        }
        llama_token_data_array cur_p = {cur.data(), cur.size(), -1, false};
        int32_t mode = 0;
        const int32_t grammar_at = llamabatch_grammar_stage(smpl, &mode);
        thread_local llamabatch_masking masking;  // its buffers live on between calls
        llamabatch_masking * masked = NULL;
        if (grammar_at >= 0 && masks != NULL) {
            masking.cache = masks;
            masking.grammar_id = grammar_id;
            masking.grammar_id_len = grammar_id_len;
            masking.grammar = llama_sampler_chain_get(smpl, grammar_at);
            masking.n_vocab = n_vocab;
            masking.looked = masking.ready = false;
            masked = &masking;
        }
        if (grammar_at >= 0 && mode == 1) {
            /* Greedy under a grammar: the best token of the chain without its grammar, when the
             * grammar allows it, is the best token the grammar allows (the grammar only masks),
             * so one token is checked instead of the vocabulary; otherwise the whole chain runs,
             * as llama.cpp's common sampler does (there for every chain). */
            const int32_t n = llama_sampler_chain_n(smpl);
            for (int32_t i = 0; i < n; i++) {
                if (i != grammar_at) {
                    llama_sampler_apply(llama_sampler_chain_get(smpl, i), &cur_p);
                }
            }
            if (llamabatch_selected_ok(cur_p)) {
                llama_token_data one = {cur_p.data[cur_p.selected].id, 1.0f, 0.0f};
                llama_token_data_array one_p = {&one, 1, -1, false};
                llama_sampler_apply(llama_sampler_chain_get(smpl, grammar_at), &one_p);
                if (std::isfinite(one.logit)) {
                    return llamabatch_accept_checked(smpl, one.id, max_stacks, err, err_size);
                }
            }
        } else if (grammar_at >= 0 && mode == 2 && top_k > 0 &&
                llamabatch_top_k_first(smpl, grammar_at, top_k, masked, cur_p)) {
            if (!llamabatch_selected_ok(cur_p)) {
                return -1;
            }
            return llamabatch_accept_checked(smpl, cur_p.data[cur_p.selected].id, max_stacks, err, err_size);
        }
        if (mode != 0) {  // the whole chain, from the logits again
            for (int32_t t = 0; t < n_vocab; t++) {
                cur[t] = llama_token_data{t, logits[t], 0.0f};
            }
            cur_p = {cur.data(), cur.size(), -1, false};
        }
        if (masked != NULL) {
            llamabatch_chain_masked(smpl, grammar_at, *masked, cur_p);
        } else {
            llama_sampler_apply(smpl, &cur_p);
        }
        if (cur_p.selected < 0 || cur_p.selected >= (int64_t) cur_p.size ||
                !std::isfinite(cur_p.data[cur_p.selected].logit)) {
            return -1;
        }
        return llamabatch_accept_checked(smpl, cur_p.data[cur_p.selected].id, max_stacks, err, err_size);
    } catch (const std::exception & e) {
        llamabatch_set_error(err, err_size, e.what());
    } catch (...) {
        llamabatch_set_error(err, err_size, "unknown C++ exception");
    }
    return -2;
}

/* The character every parse stack must match next, when there is exactly one (each stack's
 * top a single-character element, all the same; no stack at its end, where the grammar could
 * stop): its code point; UINT32_MAX otherwise. Element types as llama-grammar.h numbers them
 * (pinned version): 3 a character, 5 and 6 a range or an alternative after it. */
static uint32_t llamabatch_forced_char(
        const std::vector<std::vector<const llama_grammar_element *>> & stacks) {
    uint32_t chr = UINT32_MAX;
    for (const auto & stack : stacks) {
        if (stack.empty()) {
            return UINT32_MAX;
        }
        const llama_grammar_element * top = stack.back();
        if (top->type != 3 || top[1].type == 5 || top[1].type == 6 ||
                (chr != UINT32_MAX && top->value != chr)) {
            return UINT32_MAX;
        }
        chr = top->value;
    }
    return chr;
}

static size_t llamabatch_put_utf8(uint32_t chr, char * out) {
    if (chr < 0x80) {
        out[0] = (char) chr;
        return 1;
    }
    if (chr < 0x800) {
        out[0] = (char) (0xC0 | (chr >> 6));
        out[1] = (char) (0x80 | (chr & 0x3F));
        return 2;
    }
    if (chr < 0x10000) {
        out[0] = (char) (0xE0 | (chr >> 12));
        out[1] = (char) (0x80 | ((chr >> 6) & 0x3F));
        out[2] = (char) (0x80 | (chr & 0x3F));
        return 3;
    }
    out[0] = (char) (0xF0 | (chr >> 18));
    out[1] = (char) (0x80 | ((chr >> 12) & 0x3F));
    out[2] = (char) (0x80 | ((chr >> 6) & 0x3F));
    out[3] = (char) (0x80 | (chr & 0x3F));
    return 4;
}

/* The most parse stacks the walk below goes on with, and the most stacks it visits in all (the
 * sum of their counts over the characters walked): an ambiguous grammar's stacks can double
 * with each character (r ::= "a" r "b" | "a" r "c" forces "a" forever), which sampling stops
 * at max_live_stacks after a token or two, and a walk of 256 characters would not. */
static const size_t LLAMABATCH_FORCED_MAX_STACKS = 64;
static const size_t LLAMABATCH_FORCED_MAX_WORK = 4096;

/* The text the chain's grammar forces next (the characters of llamabatch_forced_char, one
 * after another), UTF-8 in out, at most out_size bytes; *ends is set when the grammar can
 * only end after it. Returns the bytes written: 0 when the next character is free, without a
 * grammar, or while a lazy grammar waits for its trigger; -2 when llama.cpp threw (err). The
 * grammar's state is the same afterwards: its parse stacks are walked, then put back. The walk
 * stops early (what it found so far) past the bounds above. */
int32_t llamabatch_grammar_forced(
        struct llama_sampler * chain, char * out, size_t out_size, int32_t * ends, char * err,
        size_t err_size) {
    *ends = 0;
    int32_t mode = 0;
    const int32_t at = llamabatch_grammar_stage(chain, &mode);
    if (at < 0) {
        return 0;
    }
    auto * sampler = (struct llamabatch_sampler_grammar *) llama_sampler_chain_get(chain, at)->ctx;
    auto * head = (llamabatch_grammar_head *) sampler->grammar;
    if (head == NULL || head->awaiting_trigger || head->partial_utf8.n_remain != 0 ||
            head->stacks.size() > LLAMABATCH_FORCED_MAX_STACKS ||
            llamabatch_forced_char(head->stacks) == UINT32_MAX) {
        return 0;
    }
    std::vector<std::vector<const llama_grammar_element *>> saved;
    bool walked = false;
    size_t n = 0, work = 0;
    try {
        saved = head->stacks;
        walked = true;
        uint32_t chr;
        while ((chr = llamabatch_forced_char(head->stacks)) != UINT32_MAX) {
            work += head->stacks.size();
            if (head->stacks.size() > LLAMABATCH_FORCED_MAX_STACKS || work > LLAMABATCH_FORCED_MAX_WORK ||
                    chr > 0x10FFFF || (chr >= 0xD800 && chr <= 0xDFFF)) {  // (no UTF-8 for those)
                break;
            }
            char bytes[4];
            const size_t len = llamabatch_put_utf8(chr, bytes);
            if (n + len > out_size) {
                break;
            }
            std::memcpy(out + n, bytes, len);
            n += len;
            llama_grammar_accept(sampler->grammar, chr);
        }
        bool all_ended = !head->stacks.empty();
        for (const auto & stack : head->stacks) {
            all_ended = all_ended && stack.empty();
        }
        *ends = all_ended ? 1 : 0;
        head->stacks = std::move(saved);
        return (int32_t) n;
    } catch (const std::exception & e) {
        llamabatch_set_error(err, err_size, e.what());
    } catch (...) {
        llamabatch_set_error(err, err_size, "unknown C++ exception");
    }
    if (walked) {
        head->stacks = std::move(saved);
    }
    return -2;
}
"""


def cdef_source() -> str:
    return (HERE / "_cdefs.h").read_text()


def make_ffi(include_dir: Path, lib_dir: Path, extra_rpaths: list[str] | None = None) -> cffi.FFI:
    ffibuilder = cffi.FFI()
    ffibuilder.cdef(cdef_source())
    rpaths = [RUNTIME_RPATH, *(extra_rpaths or [])]
    ffibuilder.set_source(
        MODULE_NAME,
        C_SOURCE,
        include_dirs=[str(include_dir)],
        library_dirs=[str(lib_dir)],
        libraries=["llama"],
        extra_link_args=[f"-Wl,-rpath,{p}" for p in rpaths],
        extra_compile_args=["-O2", "-Wno-deprecated-declarations"],
        source_extension=".cpp",
    )
    return ffibuilder


def mtmd_cdef_source() -> str:
    return (HERE / "_mtmd_cdefs.h").read_text()


def make_mtmd_ffi(include_dir: Path, lib_dir: Path, extra_rpaths: list[str] | None = None) -> cffi.FFI:
    """The multimodal binding (``_mtmd_cdefs.h`` against the vendored ``mtmd.h``, linked to
    ``libmtmd``): a module of its own, so a build without libmtmd loses only vision."""
    ffibuilder = cffi.FFI()
    ffibuilder.cdef(mtmd_cdef_source())
    rpaths = [RUNTIME_RPATH, *(extra_rpaths or [])]
    ffibuilder.set_source(
        MTMD_MODULE_NAME,
        '#include "mtmd.h"\n',
        include_dirs=[str(include_dir)],
        library_dirs=[str(lib_dir)],
        libraries=["mtmd", "llama"],
        extra_link_args=[f"-Wl,-rpath,{p}" for p in rpaths],
        extra_compile_args=["-O2", "-Wno-deprecated-declarations"],
    )
    return ffibuilder
