// Vendor GEMMs (HALSTM_CUBLAS): the projection and the gradient GEMMs as
// cuBLAS GEMMs on the stream Halide's kernels run on, in the compute type
// HALSTM_COMPUTE (halstm/cublas.py COMPUTE_TYPES), fp32 results. With
// HALSTM_BF16 their operands are first rounded to bfloat16 copies by the
// pipeline halstm_to_bf16 (a step's weight once before the time loop; a
// step's activations are stored in bf16 by the step pipelines themselves),
// so that the GEMMs read half the bytes and run on bf16 tensor cores. cuBLAS is loaded
// with dlopen by halstm_cublas_init (no CUDA toolkit at build time): the
// few entry points are declared here with cuBLAS's v2 ABI.
// Part of the driver: included once, by driver.cpp.

#ifdef HALSTM_CUBLAS
#if HALSTM_BF16
extern "C" int halstm_to_bf16(halide_buffer_t *, halide_buffer_t *);   // (pipeline/grads.py)
#endif
namespace {

// cuBLAS's enums (cublas_api.h)
enum { OP_N = 0, OP_T = 1 };
enum { R_32F = 0, R_16BF = 14 };   // cudaDataType_t (library_types.h)
enum { GEMM_DEFAULT = -1 };   // cublasGemmAlgo_t

// Cublas::buffer's buffers: the vendor steps' products; bf16 copies of a
// GEMM's A and B operands, of the steps' weight and of a step's activations
enum { BUF_HG, BUF_A, BUF_B, BUF_STEP_W, BUF_STEP_ACT, BUFFERS };

struct Cublas {
    bool loaded = false;
    int (*create)(void **) = nullptr;
    int (*set_stream)(void *, void *) = nullptr;
    int (*gemm_ex)(void *, int, int, int, int, int, const void *, const void *, int, int,
                   const void *, int, int, const void *, void *, int, int, int, int) = nullptr;
    int (*gemm_batched)(void *, int, int, int, int, int, const void *, const void *, int, int,
                        long long, const void *, int, int, long long, const void *, void *,
                        int, int, long long, int, int, int) = nullptr;
    int (*set_workspace)(void *, void *, size_t) = nullptr;
    int (*push)(void *) = nullptr;   // libcuda's cuCtxPushCurrent / cuCtxPopCurrent
    int (*pop)(void **) = nullptr;
    int (*mem_alloc)(uint64_t *, size_t) = nullptr;   // libcuda's cuMemAlloc
    std::mutex lock;
    // A cuBLAS handle per CUDA context the library is called in (one a
    // device), made at the context's first GEMM
    static constexpr int CONTEXTS = 64;
    struct Handle {
        void *context = nullptr;
        void *handle = nullptr;
    };
    Handle handles[CONTEXTS];
    int nhandles = 0;
    // Device memory of the calls of one thread on one stream (g_stream) in
    // one context (the legacy stream, NULL, is every context's), so that
    // calls on two streams (halstm.torch's directions side by side), or
    // from two threads on one stream (whose direct calls may interleave
    // between an operand's copy and the GEMM reading it), never share it:
    // cuBLAS's workspace, ours so that nothing is allocated while a time
    // loop is captured into a graph (cuBLAS resets it on every stream
    // change), and grow-only buffers (BUFFERS): the vendor steps' products
    // hg (B, G, HP) and, with HALSTM_BF16, the operands' bf16 copies. Kept
    // for the library's life: graphs captured with them may still run.
    static constexpr size_t WORKSPACE = size_t(32) << 20;
    static constexpr int STREAMS = 32;
    struct Scratch {
        void *context = nullptr;
        void *stream = nullptr;
        std::thread::id thread;
        uint64_t workspace = 0;
        uint64_t buffer[BUFFERS] = {};
        size_t bytes[BUFFERS] = {};
    };
    Scratch scratch[STREAMS];
    int streams = 0;
#ifdef HALSTM_VENDOR_STEP_ROWS
    // steps of at least this many rows run their recurrent product by cuBLAS
    // (HALSTM_VENDOR_STEP_ROWS: the build's, or the environment's)
    int step_rows = HALSTM_VENDOR_STEP_ROWS;
#endif

    template <class Fn>
    bool sym(void *lib, const char *name, Fn &fn) {
        fn = (Fn)dlsym(lib, name);
        return fn != nullptr;
    }

    int fail(const char *what, int status) {
        char msg[512];
        snprintf(msg, sizeof(msg), "cuBLAS: %s failed (status %d)", what, status);
        halide_error(nullptr, msg);
        return -1;
    }

    int init(const char *path) {
        std::lock_guard<std::mutex> guard(lock);
        if (loaded) return 0;
        void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (!lib) {
            char msg[768];
            snprintf(msg, sizeof(msg), "cuBLAS: cannot load %s: %s", path, dlerror());
            halide_error(nullptr, msg);
            return -1;
        }
        void *cuda = libcuda();
        if (!cuda || !sym(lib, "cublasCreate_v2", create) ||
            !sym(lib, "cublasSetStream_v2", set_stream) ||
            !sym(lib, "cublasGemmEx", gemm_ex) ||
            !sym(lib, "cublasGemmStridedBatchedEx", gemm_batched) ||
            !sym(lib, "cublasSetWorkspace_v2", set_workspace) ||
            !sym(cuda, "cuCtxPushCurrent_v2", push) || !sym(cuda, "cuCtxPopCurrent_v2", pop) ||
            !sym(cuda, "cuMemAlloc_v2", mem_alloc)) {
            halide_error(nullptr, "cuBLAS: an entry point is missing from the library");
            return -1;
        }
#ifdef HALSTM_VENDOR_STEP_ROWS
        const char *env = getenv("HALSTM_VENDOR_STEP_ROWS");
        if (env && *env) step_rows = atoi(env);
#endif
        loaded = true;
        return 0;
    }

    // The handle of the calling thread's context (under lock), made at
    // its first use; nullptr where that fails.
    void *handle() {
        void *context = call_context();
        for (int i = 0; i < nhandles; i++)
            if (handles[i].context == context) return handles[i].handle;
        if (nhandles == CONTEXTS) {
            halide_error(nullptr, "cuBLAS: a library called in more than 64 CUDA contexts");
            return nullptr;
        }
        void *h = nullptr, *prev;
        if (push(context)) {
            fail("cuCtxPushCurrent", -1);
            return nullptr;
        }
        int st = create(&h);
        pop(&prev);
        if (st) {
            fail("cublasCreate", st);
            return nullptr;
        }
        handles[nhandles++] = {context, h};
        return h;
    }

    // Device memory, in the calling thread's context (0 where it fails).
    // Out of memory (CUDA_ERROR_OUT_OF_MEMORY, 2) with a hook set, before
    // the hook has run for this call: 0 and t_out_of_memory, no error
    // (retried() calls the hook, unlocked, then the call once more).
    uint64_t alloc(size_t bytes, const char *what) {
        void *prev;
        uint64_t p = 0;
        if (push(call_context())) return 0;
        int st = g_fail_allocs > 0 && g_fail_allocs-- > 0 ? 2 : mem_alloc(&p, bytes);
        pop(&prev);
        if (!st) return p;
        if (st == 2 && g_oom_hook && !t_after_hook) {
            t_out_of_memory = true;
            return 0;
        }
        fail(what, st);
        return 0;
    }

    // f() (which takes the lock), and where an allocation of it ran out of
    // memory, the hook (the caller's caches give their blocks back; called
    // holding no lock of ours) and f() once more.
    template <class F>
    auto retried(F f) -> decltype(f()) {
        t_out_of_memory = false;
        auto r = f();
        if (!t_out_of_memory) return r;
        t_out_of_memory = false;
        g_oom_hook();
        t_after_hook = true;
        r = f();
        t_after_hook = false;
        return r;
    }

    // The memory of this thread's calls on g_stream in its context (under
    // lock); nullptr where none can be had.
    Scratch *for_stream() {
        const std::thread::id me = std::this_thread::get_id();
        void *context = call_context();
        for (int i = 0; i < streams; i++)
            if (scratch[i].stream == g_stream && scratch[i].thread == me &&
                scratch[i].context == context)
                return &scratch[i];
        if (streams == STREAMS) {
            halide_error(nullptr, "cuBLAS: a library called on more than 32 (thread, stream, "
                                  "context) triples");
            return nullptr;
        }
        uint64_t ws = alloc(WORKSPACE, "cuMemAlloc of cuBLAS's workspace");
        if (!ws) return nullptr;
        Scratch &s = scratch[streams++];
        s.context = context, s.stream = g_stream, s.thread = me, s.workspace = ws;
        return &s;
    }

    // Buffer `which` of this thread on g_stream, of at least `bytes`: the previous one
    // while it is large enough, else a new one (the old stays allocated: a
    // captured graph may read it). nullptr where that fails. Call it before
    // a time loop, never while one is captured.
    void *buffer(int which, size_t bytes) {
        return retried([&]() -> void * {
            std::lock_guard<std::mutex> guard(lock);
            Scratch *s = for_stream();
            if (s && bytes > s->bytes[which]) {
                uint64_t p = alloc(bytes, "cuMemAlloc of a GEMM buffer");
                if (!p) return nullptr;
                s->buffer[which] = p, s->bytes[which] = bytes;
            }
            return s ? (void *)(uintptr_t)s->buffer[which] : nullptr;
        });
    }

    // Run f(handle) in the calling thread's context, on the stream its
    // kernels use.
    template <class F>
    int run(const char *what, F f) {
        if (!loaded) {
            halide_error(nullptr, "cuBLAS: halstm_cublas_init was not called");
            return -1;
        }
        return retried([&]() -> int {
            std::lock_guard<std::mutex> guard(lock);
            Scratch *s = for_stream();
            void *h = s ? handle() : nullptr;
            if (!h) return -1;
            void *prev;
            if (push(call_context())) return fail("cuCtxPushCurrent", -1);
            // (the stream Halide's kernels run on: get_stream in cuda_graphs.h)
            int st = set_stream(h, call_stream());
            if (st == 0) st = set_workspace(h, (void *)(uintptr_t)s->workspace, WORKSPACE);
            if (st == 0) st = f(h);
            pop(&prev);
            return st ? fail(what, st) : 0;
        });
    }
};

Cublas g_cublas;

// Row-major C (m x n, ldc, fp32) = op(A) op(B) + beta C, where op(A) is
// (m x k) and op(B) is (k x n), A and B of cudaDataType `type`; ta, tb: the
// operand is stored transposed (row-major k x m, resp. n x k). cuBLAS is
// column-major: it computes the transpose, C^T = op(B)^T op(A)^T, with the
// operands swapped.
int gemm_typed(const char *what, bool ta, bool tb, int m, int n, int k, const void *A, int lda,
               const void *B, int ldb, int type, float beta, float *C, int ldc) {
    const float alpha = 1.0f;
    return g_cublas.run(what, [&](void *h) {
        return g_cublas.gemm_ex(h, tb ? OP_T : OP_N, ta ? OP_T : OP_N, n, m, k, &alpha, B, type,
                                ldb, A, type, lda, &beta, C, R_32F, ldc, HALSTM_COMPUTE,
                                GEMM_DEFAULT);
    });
}

#if HALSTM_BF16
// A GEMM operand's element type, and its size in bytes
constexpr int OPERAND = R_16BF;
constexpr size_t OPERAND_BYTES = 2;

// v as a view of bfloat16 bits (uint16) rather than float32
View as_bf16(View v) {
    v.buf.type.code = halide_type_uint, v.buf.type.bits = 16;
    return v;
}

// dst (n) = src (n) rounded to bfloat16 (round to nearest even; NaN stays NaN)
int to_bf16(const float *src, int64_t n, void *dst) {
    if (n > INT32_MAX) {
        halide_error(nullptr, "to_bf16: more than 2^31 - 1 elements");
        return -1;
    }
    View vs(src, {{(int)n, 1}}), vd = as_bf16(View((const float *)dst, {{(int)n, 1}}));
    return halstm_to_bf16(vs.hb(), vd.hb());
}

// A GEMM operand of `elems` fp32 elements as the GEMM reads it: its bf16
// copy in buffer `which` (nullptr where that fails)
const void *operand(const float *src, int64_t elems, int which) {
    void *dst = g_cublas.buffer(which, (size_t)elems * OPERAND_BYTES);
    return dst && to_bf16(src, elems, dst) == 0 ? dst : nullptr;
}
#else
constexpr int OPERAND = R_32F;
constexpr size_t OPERAND_BYTES = 4;

const void *operand(const float *src, int64_t, int) { return src; }
#endif

// gemm_typed of fp32 operands, each as the GEMM reads it (operand)
int gemm_rows(const char *what, bool ta, bool tb, int m, int n, int k, const float *A, int lda,
              const float *B, int ldb, float beta, float *C, int ldc) {
    const void *a = operand(A, (int64_t)(ta ? k : m) * lda, BUF_A);
    const void *b = operand(B, (int64_t)(tb ? n : k) * ldb, BUF_B);
    if (!a || !b) return -1;
    return gemm_typed(what, ta, tb, m, n, k, a, lda, b, ldb, OPERAND, beta, C, ldc);
}

// C (rows, G, HP) = A (rows, n) W^T + beta C, A and W operands as the GEMM
// reads them (operand), W (G*H, n) a weight in PyTorch's layout: one GEMM
// where the gates' blocks of C are adjacent (HP = H), else one a gate.
int gemm_gates(const char *what, int rows, int n, const void *A, const void *W, float beta,
               float *C) {
    int rc = 0;
    for (int g = 0; rc == 0 && g < (HP == H ? 1 : G); g++)
        rc = gemm_typed(what, false, true, rows, HP == H ? G * H : H, n, A, n,
                        (const char *)W + (int64_t)g * H * n * OPERAND_BYTES, n, OPERAND, beta,
                        C + g * HP, G * HP);
    return rc;
}

#ifdef HALSTM_VENDOR_STEP_ROWS
// C (splits, rows, G, HP), split s at C + s * split_stride = A's units
// [s * n / splits, (s + 1) * n / splits) times W's: gemm_gates's product
// as `splits` partial products (split-K), one batched GEMM a gate block;
// the step pipeline sums them. n a multiple of splits.
int gemm_gates_split(const char *what, int rows, int n, const void *A, const void *W,
                     float *C, int splits, int64_t split_stride) {
    if (splits == 1) return gemm_gates(what, rows, n, A, W, 0.0f, C);
    const float alpha = 1.0f, beta = 0.0f;
    const int k = n / splits, cols = HP == H ? G * H : H;
    int rc = 0;
    for (int g = 0; rc == 0 && g < (HP == H ? 1 : G); g++) {
        const void *w = (const char *)W + (int64_t)g * H * n * OPERAND_BYTES;
        float *c = C + g * HP;
        // (column-major: C^T (cols x rows) = W_s (k x cols)^T A_s^T, as gemm_typed)
        rc = g_cublas.run(what, [&](void *h) {
            return g_cublas.gemm_batched(h, OP_T, OP_N, cols, rows, k, &alpha, w, OPERAND, n,
                                         k, A, OPERAND, n, k, &beta, c, R_32F, G * HP,
                                         split_stride, splits, HALSTM_COMPUTE, GEMM_DEFAULT);
        });
    }
    return rc;
}

// The steps' products: W_hh (G*H, H) as the GEMMs read it, made before the
// time loop (outside a captured graph), and each step's activations
// (at most B rows of G*H) as the GEMM reads them. With HALSTM_BF16 the step
// pipelines store them in bf16 (h for the next step, dhg for this one) into
// act, the GEMMs' operand; only the forward's initial h is converted here.
struct StepGemm {
    const void *w = nullptr;
    void *act = nullptr;      // HALSTM_BF16: the activations' copy
    int prepare(const float *w_hh, int B) {
        w = operand(w_hh, (int64_t)G * H * H, BUF_STEP_W);
#if HALSTM_BF16
        act = g_cublas.buffer(BUF_STEP_ACT, (size_t)B * G * H * OPERAND_BYTES);
        return w && act ? 0 : -1;
#else
        (void)B;
        return w ? 0 : -1;
#endif
    }
    // src (elems) as the GEMM reads it; written: a step pipeline already
    // stored its bf16 copy in act (then never nullptr)
    const void *activations(const float *src, int64_t elems, bool written) {
#if HALSTM_BF16
        if (written) return act;
        return to_bf16(src, elems, act) == 0 ? act : nullptr;
#else
        (void)elems, (void)written;
        return src;
#endif
    }
};
#endif

}  // namespace

extern "C" {
// Load cuBLAS from `library` (a path or soname); a handle is made per
// CUDA context at its first GEMM.
int halstm_cublas_init(const char *library) {
    g_error[0] = 0;
    return g_cublas.init(library);
}
}  // extern "C"
#endif  // HALSTM_CUBLAS
