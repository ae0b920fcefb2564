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
#include <string>
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
struct llamabatch_sampler_grammar {
    const struct llama_vocab * vocab;
    std::string grammar_str;
    std::string grammar_root;
    struct llama_grammar * grammar;
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

/* The grammar stage's index, and how the chain may spare the grammar a pass over the whole
 * vocabulary (mode): 1, the chain ends in greedy selection; 2, top-k comes right after the
 * grammar. -1: neither. */
static int32_t llamabatch_grammar_stage(struct llama_sampler * chain, int32_t * mode) {
    const int32_t n = llama_sampler_chain_n(chain);
    for (int32_t i = 0; i < n - 1; i++) {
        if (std::strcmp(llama_sampler_name(llama_sampler_chain_get(chain, i)), "grammar") == 0) {
            if (std::strcmp(llama_sampler_name(llama_sampler_chain_get(chain, n - 1)), "greedy") == 0) {
                *mode = 1;
                return i;
            }
            if (std::strcmp(llama_sampler_name(llama_sampler_chain_get(chain, i + 1)), "top-k") == 0) {
                *mode = 2;
                return i;
            }
            return -1;
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
        struct llama_sampler * smpl, int32_t grammar_at, llama_token_data * data, size_t start, size_t end,
        size_t kept, bool sorted) {
    llama_token_data_array part = {data + start, end - start, -1, sorted};
    llama_sampler_apply(llama_sampler_chain_get(smpl, grammar_at), &part);
    for (size_t j = start; j < end; j++) {
        if (std::isfinite(data[j].logit)) {
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
        struct llama_sampler * smpl, int32_t grammar_at, int32_t top_k, llama_token_data_array & cur_p) {
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
    size_t kept = llamabatch_grammar_keep(smpl, grammar_at, data, 0, first, 0, true);
    if (kept < k && first < size) {  // too few of the best passed: the rest of the vocabulary too
        const size_t from = kept;
        kept = llamabatch_grammar_keep(smpl, grammar_at, data, first, size, kept, false);
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
 * chain's top-k (0: off), which lets the grammar check the best candidates first (above). */
static int32_t llamabatch_sampler_sample_guarded(
        struct llama_sampler * smpl, struct llama_context * ctx, int32_t idx, size_t max_stacks,
        int32_t top_k, char * err, size_t err_size) {
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
                llamabatch_top_k_first(smpl, grammar_at, top_k, cur_p)) {
            if (!llamabatch_selected_ok(cur_p)) {
                return -1;
            }
            return llamabatch_accept_checked(smpl, cur_p.data[cur_p.selected].id, max_stacks, err, err_size);
        }
        if (grammar_at >= 0) {  // the whole chain, from the logits again
            for (int32_t t = 0; t < n_vocab; t++) {
                cur[t] = llama_token_data{t, logits[t], 0.0f};
            }
            cur_p = {cur.data(), cur.size(), -1, false};
        }
        llama_sampler_apply(smpl, &cur_p);
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
