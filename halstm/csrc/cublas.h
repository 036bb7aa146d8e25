// Vendor GEMMs (HALSTM_CUBLAS): the projection and the gradient GEMMs as
// cuBLAS SGEMMs on the stream Halide's kernels run on, with TF32 tensor-core
// math where built with HALSTM_TF32=1 (halstm/cublas.py). cuBLAS is loaded
// with dlopen by halstm_cublas_init (no CUDA toolkit at build time): the
// few entry points are declared here with cuBLAS's v2 ABI.
// Part of the driver: included once, by driver.cpp.

#ifdef HALSTM_CUBLAS
namespace {

// cuBLAS's enums (cublas_api.h)
enum { OP_N = 0, OP_T = 1 };
enum { DEFAULT_MATH = 0, TF32_TENSOR_OP_MATH = 3 };

struct Cublas {
    void *handle = nullptr;
    int (*create)(void **) = nullptr;
    int (*set_stream)(void *, void *) = nullptr;
    int (*set_math_mode)(void *, int) = nullptr;
    int (*sgemm)(void *, int, int, int, int, int, const float *, const float *, int,
                 const float *, int, const float *, float *, int) = nullptr;
    int (*set_workspace)(void *, void *, size_t) = nullptr;
    int (*push)(void *) = nullptr;   // libcuda's cuCtxPushCurrent / cuCtxPopCurrent
    int (*pop)(void **) = nullptr;
    int (*mem_alloc)(uint64_t *, size_t) = nullptr;   // libcuda's cuMemAlloc
    std::mutex lock;
    // Device memory of the calls on one stream (g_stream), so that calls on
    // two streams (halstm.torch's directions side by side) never share it:
    // cuBLAS's workspace, ours so that nothing is allocated while a time
    // loop is captured into a graph (cuBLAS resets it on every stream
    // change), and the vendor steps' products hg (B, G, HP). Kept for the
    // library's life: graphs captured with them may still run.
    static constexpr size_t WORKSPACE = size_t(32) << 20;
    static constexpr int STREAMS = 16;
    struct Scratch {
        void *stream = nullptr;
        uint64_t workspace = 0, hg = 0;
        size_t hg_bytes = 0;
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
        if (handle) return 0;
        void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (!lib) {
            char msg[768];
            snprintf(msg, sizeof(msg), "cuBLAS: cannot load %s: %s", path, dlerror());
            halide_error(nullptr, msg);
            return -1;
        }
        void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
        if (!cuda || !sym(lib, "cublasCreate_v2", create) ||
            !sym(lib, "cublasSetStream_v2", set_stream) ||
            !sym(lib, "cublasSetMathMode", set_math_mode) || !sym(lib, "cublasSgemm_v2", sgemm) ||
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
        void *prev;
        if (push(g_context)) return fail("cuCtxPushCurrent", -1);
        int st = create(&handle);
        if (st == 0) st = set_math_mode(handle, HALSTM_TF32 ? TF32_TENSOR_OP_MATH : DEFAULT_MATH);
        pop(&prev);
        if (st) {
            handle = nullptr;
            return fail("cublasCreate", st);
        }
        return 0;
    }

    // Device memory, in the library's context (0 where it fails).
    uint64_t alloc(size_t bytes, const char *what) {
        void *prev;
        uint64_t p = 0;
        if (push(g_context)) return 0;
        int st = mem_alloc(&p, bytes);
        pop(&prev);
        if (st) fail(what, st);
        return st ? 0 : p;
    }

    // The memory of g_stream's calls (under lock); nullptr where none can
    // be had.
    Scratch *for_stream() {
        for (int i = 0; i < streams; i++)
            if (scratch[i].stream == g_stream) return &scratch[i];
        if (streams == STREAMS) {
            halide_error(nullptr, "cuBLAS: a library called on more than 16 streams");
            return nullptr;
        }
        uint64_t ws = alloc(WORKSPACE, "cuMemAlloc of cuBLAS's workspace");
        if (!ws) return nullptr;
        Scratch &s = scratch[streams++];
        s.stream = g_stream, s.workspace = ws;
        return &s;
    }

    // A buffer of at least `bytes` for the steps' products on g_stream: the
    // previous one while it is large enough, else a new one (the old stays
    // allocated: a captured graph may read it). nullptr where that fails.
    float *hg_buffer(size_t bytes) {
        std::lock_guard<std::mutex> guard(lock);
        Scratch *s = for_stream();
        if (s && bytes > s->hg_bytes) {
            uint64_t p = alloc(bytes, "cuMemAlloc of the steps' products");
            if (!p) return nullptr;
            s->hg = p, s->hg_bytes = bytes;
        }
        return s ? (float *)(uintptr_t)s->hg : nullptr;
    }

    // Run f(handle) in the library's context, on the stream its kernels use.
    template <class F>
    int run(const char *what, F f) {
        if (!handle) {
            halide_error(nullptr, "cuBLAS: halstm_cublas_init was not called");
            return -1;
        }
        std::lock_guard<std::mutex> guard(lock);
        Scratch *s = for_stream();
        if (!s) return -1;
        void *prev;
        if (push(g_context)) return fail("cuCtxPushCurrent", -1);
        // (the stream Halide's kernels run on: get_stream in cuda_graphs.h)
        int st = set_stream(handle, g_graphs.capturing ? g_graphs.capture_stream : g_stream);
        if (st == 0) st = set_workspace(handle, (void *)(uintptr_t)s->workspace, WORKSPACE);
        if (st == 0) st = f(handle);
        pop(&prev);
        return st ? fail(what, st) : 0;
    }
};

Cublas g_cublas;

// Row-major C (m x n, ldc) = alpha op(A) op(B) + beta C, where op(A) is
// (m x k) and op(B) is (k x n); ta, tb: the operand is stored transposed
// (row-major k x m, resp. n x k). cuBLAS is column-major: it computes the
// transpose, C^T = op(B)^T op(A)^T, with the operands swapped.
int gemm_rows(const char *what, bool ta, bool tb, int m, int n, int k, const float *A, int lda,
              const float *B, int ldb, float beta, float *C, int ldc) {
    const float alpha = 1.0f;
    return g_cublas.run(what, [&](void *h) {
        return g_cublas.sgemm(h, tb ? OP_T : OP_N, ta ? OP_T : OP_N, n, m, k, &alpha, B, ldb, A,
                              lda, &beta, C, ldc);
    });
}

// C (rows, G, HP) = A (rows, n) W^T + beta C, W (G*H, n) a weight in
// PyTorch's layout: one GEMM where the gates' blocks of C are adjacent
// (HP = H), else one a gate.
int gemm_gates(const char *what, int rows, int n, const float *A, const float *W, float beta,
               float *C) {
    int rc = 0;
    for (int g = 0; rc == 0 && g < (HP == H ? 1 : G); g++)
        rc = gemm_rows(what, false, true, rows, HP == H ? G * H : H, n, A, n,
                       W + (int64_t)g * H * n, n, beta, C + g * HP, G * HP);
    return rc;
}

}  // namespace

extern "C" {
// Load cuBLAS from `library` (a path or soname) and make this library's
// handle, in the context halstm_cuda_init was given.
int halstm_cublas_init(const char *library) {
    g_error[0] = 0;
    return g_cublas.init(library);
}
}  // extern "C"
#endif  // HALSTM_CUBLAS
