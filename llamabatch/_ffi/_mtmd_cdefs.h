/* The part of mtmd.h (libmtmd, llama.cpp's multimodal library) that llamabatch uses, for
 * cffi's API mode: a second extension module, ``llamabatch._ffi._mtmd``, so that a llama.cpp
 * build without libmtmd still loads the text-only binding.
 *
 * Hand-written as _cdefs.h is: only what the project calls; structs end in `...;` so the
 * compiler completes their layout from the vendored header. The llama.cpp objects it takes
 * (model, context) are opaque here: their pointers come from ``_llama`` as addresses.
 */

typedef int32_t llama_pos;
typedef int32_t llama_token;

struct llama_model;
struct llama_context;

enum ggml_log_level { GGML_LOG_LEVEL_ERROR, ... };
typedef void (*ggml_log_callback)(enum ggml_log_level level, const char * text, void * user_data);

enum mtmd_input_chunk_type {
    MTMD_INPUT_CHUNK_TYPE_TEXT, MTMD_INPUT_CHUNK_TYPE_IMAGE, MTMD_INPUT_CHUNK_TYPE_AUDIO, ...
};

typedef struct mtmd_context mtmd_context;
typedef struct mtmd_bitmap mtmd_bitmap;
typedef struct mtmd_input_chunk mtmd_input_chunk;
typedef struct mtmd_input_chunks mtmd_input_chunks;
typedef struct mtmd_image_tokens mtmd_image_tokens;

/* an image embedding's M-RoPE position (temporal, width, height sections; z unused) */
struct mtmd_decoder_pos {
    uint32_t t;
    uint32_t x;
    uint32_t y;
    uint32_t z;
};

typedef struct mtmd_input_text {
    const char * text;
    size_t text_len;
    bool add_special;
    bool parse_special;
} mtmd_input_text;

struct mtmd_context_params {
    bool use_gpu;
    bool print_timings;
    int n_threads;
    bool warmup;
    ...;
};

/* the causal mask of the text model's attention: off while an image that needs it decodes */
void llama_set_causal_attn(struct llama_context * ctx, bool causal_attn);

const char * mtmd_default_marker(void);
struct mtmd_context_params mtmd_context_params_default(void);
mtmd_context * mtmd_init_from_file(const char * mmproj_fname, const struct llama_model * text_model,
                                   const struct mtmd_context_params ctx_params);
void mtmd_free(mtmd_context * ctx);
bool mtmd_decode_use_non_causal(const mtmd_context * ctx, const mtmd_input_chunk * chunk);
bool mtmd_decode_use_mrope(const mtmd_context * ctx);
bool mtmd_support_vision(const mtmd_context * ctx);
void mtmd_log_set(ggml_log_callback log_callback, void * user_data);

mtmd_bitmap * mtmd_bitmap_init(uint32_t nx, uint32_t ny, const unsigned char * data);
void mtmd_bitmap_free(mtmd_bitmap * bitmap);
void mtmd_bitmap_set_id(mtmd_bitmap * bitmap, const char * id);

mtmd_input_chunks * mtmd_input_chunks_init(void);
size_t mtmd_input_chunks_size(const mtmd_input_chunks * chunks);
const mtmd_input_chunk * mtmd_input_chunks_get(const mtmd_input_chunks * chunks, size_t idx);
void mtmd_input_chunks_free(mtmd_input_chunks * chunks);

enum mtmd_input_chunk_type mtmd_input_chunk_get_type(const mtmd_input_chunk * chunk);
const llama_token * mtmd_input_chunk_get_tokens_text(const mtmd_input_chunk * chunk, size_t * n_tokens_output);
size_t mtmd_input_chunk_get_n_tokens(const mtmd_input_chunk * chunk);
llama_pos mtmd_input_chunk_get_n_pos(const mtmd_input_chunk * chunk);
const mtmd_image_tokens * mtmd_input_chunk_get_tokens_image(const mtmd_input_chunk * chunk);
struct mtmd_decoder_pos mtmd_image_tokens_get_decoder_pos(const mtmd_image_tokens * image_tokens,
                                                          llama_pos pos_0, size_t i);
mtmd_input_chunk * mtmd_input_chunk_copy(const mtmd_input_chunk * chunk);
void mtmd_input_chunk_free(mtmd_input_chunk * chunk);

int32_t mtmd_tokenize(const mtmd_context * ctx, mtmd_input_chunks * output, const mtmd_input_text * text,
                      const mtmd_bitmap * const * bitmaps, size_t n_bitmaps);
int32_t mtmd_encode_chunk(mtmd_context * ctx, const mtmd_input_chunk * chunk);
float * mtmd_get_output_embd(mtmd_context * ctx);

/* several images' encodes in one encoder graph, where the projector supports it; a batch
 * belongs to its context and does not own its chunks */
typedef struct mtmd_batch mtmd_batch;
mtmd_batch * mtmd_batch_init(mtmd_context * ctx);
void mtmd_batch_free(mtmd_batch * batch);
int32_t mtmd_batch_add_chunk(mtmd_batch * batch, const mtmd_input_chunk * chunk);
int32_t mtmd_batch_encode(mtmd_batch * batch);
float * mtmd_batch_get_output_embd(mtmd_batch * batch, const mtmd_input_chunk * chunk);
