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
    int (*push)(void *) = nullptr;   // libcuda's cuCtxPushCurrent / cuCtxPopCurrent
    int (*pop)(void **) = nullptr;
    std::mutex lock;

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
            !sym(cuda, "cuCtxPushCurrent_v2", push) || !sym(cuda, "cuCtxPopCurrent_v2", pop)) {
            halide_error(nullptr, "cuBLAS: an entry point is missing from the library");
            return -1;
        }
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

    // Run f(handle) in the library's context, on the stream its kernels use.
    template <class F>
    int run(const char *what, F f) {
        if (!handle) {
            halide_error(nullptr, "cuBLAS: halstm_cublas_init was not called");
            return -1;
        }
        std::lock_guard<std::mutex> guard(lock);
        void *prev;
        if (push(g_context)) return fail("cuCtxPushCurrent", -1);
        int st = set_stream(handle, g_stream);
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
