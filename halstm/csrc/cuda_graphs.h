// CUDA: the context and stream Halide's kernels run in, and time loops
// captured into CUDA graphs and replayed. Without HALSTM_CUDA a time loop
// runs directly (run_loop).
// Part of the driver: included once, by driver.cpp.

namespace {

uint64_t u64(const void *p) { return (uint64_t)(uintptr_t)p; }

#ifdef HALSTM_CUDA
// The CUDA driver library (libcuda.so.1, else libcuda.so, as Halide's
// runtime looks for it), opened once; nullptr where there is none. Every
// driver entry point of the library's own code and of Halide's runtime
// (halide_cuda_get_symbol below) comes from it.
void *libcuda() {
    static void *lib = [] {
        void *l = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
        return l ? l : dlopen("libcuda.so", RTLD_NOW | RTLD_GLOBAL);
    }();
    return lib;
}

// A layer's time loop as one CUDA graph. Each step is a Halide pipeline
// call, and each call costs the host about as much as its kernel takes on
// the GPU at small sizes, so the GPU waited on launches (small_128_b16 on an
// H100: 10 us a forward step, one kernel). The loop's kernels are captured
// once into a graph and later calls launch the whole graph. What the loop
// launches depends only on T, B and the array pointers it is given (sizes
// are compiled in; the step pipelines allocate nothing), so a graph is
// cached under exactly those and replayed while they recur, as they do
// when the same workspaces come back from the allocator's pool.
// The CUcontext of the calling thread's calls (halstm_cuda_set_context:
// the primary context of the device its arrays are on), else g_context
// (halstm_cuda_init's). Per thread, as g_stream below.
void *g_context = nullptr;
thread_local void *t_context = nullptr;
void *call_context() { return t_context ? t_context : g_context; }
// The CUstream the calling thread's calls run on (halstm_cuda_set_stream;
// NULL: legacy). Per thread, so that threads calling one library at once
// (the GIL is released in ctypes calls) each keep their own stream.
thread_local void *g_stream = nullptr;
// Called where a device allocation of the library's own (cuBLAS's
// workspace, its buffers) failed for lack of memory, before it is tried
// once more: the caller's allocators give back the blocks they cache
// (halstm_cuda_set_oom_hook; halstm.cuda.on_out_of_memory).
void (*g_oom_hook)(void) = nullptr;
// The next allocations of the library's own that fail as out of memory
// without trying (halstm_cuda_fail_allocs: tests of the hook).
std::atomic<int> g_fail_allocs{0};
// This thread's call: an allocation ran out of memory (the hook may
// help); the hook has run (a failure now is the call's).
thread_local bool t_out_of_memory = false, t_after_hook = false;

struct Graphs {
    // SLOTS: a training loop alternates two sets of saved states per layer
    // (the tape holds the last forward's while the next one runs), and the
    // layers after the first share a library: 2 * (layers - 1) keys a loop,
    // times the chunks of a wavefront (halstm/wavefront.py GRAPHS)
    static constexpr int KEY = 24, SLOTS = 64;
    struct Slot {
        int n = 0;
        uint64_t key[KEY];
        void *context = nullptr;
        void *exec = nullptr;
        uint64_t used = 0;
    };
    // What a library keeps per CUDA context it is called in (one a device
    // of the process): the stream its loops are captured on, whether a
    // loop has run there directly (Halide loads its kernels into a context
    // at its first call there), and the device's multiprocessors
    static constexpr int CONTEXTS = 64;
    struct Context {
        void *context = nullptr;
        void *capture = nullptr;
        bool warmed = false;
        int multiprocessors = 0;
    };
    // CUDA driver entry points (libcuda is already loaded by the caller)
    int (*stream_create)(void **, unsigned) = nullptr;
    int (*begin_capture)(void *, int) = nullptr;
    int (*end_capture)(void *, void **) = nullptr;
    int (*instantiate)(void **, void *, unsigned long long) = nullptr;
    int (*exec_update)(void *, void *, void *) = nullptr;
    int (*launch)(void *, void *) = nullptr;
    int (*graph_destroy)(void *) = nullptr;
    int (*exec_destroy)(void *) = nullptr;
    int (*push)(void *) = nullptr;
    int (*pop)(void **) = nullptr;
    int (*error_name)(int, const char **) = nullptr;
    int (*is_capturing)(void *, int *) = nullptr;
    int (*ctx_device)(int *) = nullptr;
    int (*attribute)(int *, int, int) = nullptr;

    Slot slots[SLOTS];
    Context contexts[CONTEXTS];
    int ncontexts = 0;
    uint64_t clock = 0;
    bool basic = false, loaded = false, enabled = false;   // (setup)
    // the stream this thread is capturing a time loop on (under lock), or
    // NULL: its kernels go there; another thread's calls meanwhile keep
    // their stream
    static thread_local void *capturing;
    long long replays = 0, captures = 0, direct = 0;
    std::mutex lock;

    template <class Fn>
    bool sym(void *lib, const char *name, Fn &fn) {
        fn = (Fn)dlsym(lib, name);
        return fn != nullptr;
    }

    void init(bool want) {
        std::lock_guard<std::mutex> guard(lock);
        if (!basic) setup();
        enabled = want && loaded;
    }

    // basic: the contexts' entry points; loaded: the graphs' too (a driver
    // without graphs: direct launches)
    void setup() {
        void *lib = libcuda();
        basic = lib && sym(lib, "cuCtxPushCurrent_v2", push) &&
                sym(lib, "cuCtxPopCurrent_v2", pop) && sym(lib, "cuCtxGetDevice", ctx_device) &&
                sym(lib, "cuDeviceGetAttribute", attribute) &&
                sym(lib, "cuGetErrorName", error_name);
        loaded = basic && sym(lib, "cuStreamCreate", stream_create) &&
                 sym(lib, "cuStreamBeginCapture_v2", begin_capture) &&
                 sym(lib, "cuStreamEndCapture", end_capture) &&
                 sym(lib, "cuGraphInstantiateWithFlags", instantiate) &&
                 sym(lib, "cuGraphExecUpdate_v2", exec_update) &&
                 sym(lib, "cuGraphLaunch", launch) && sym(lib, "cuGraphDestroy", graph_destroy) &&
                 sym(lib, "cuGraphExecDestroy", exec_destroy) &&
                 sym(lib, "cuStreamIsCapturing", is_capturing);
    }

    // The entry of `context` (under lock), made at its first use; nullptr
    // past CONTEXTS contexts.
    Context *entry(void *context) {
        for (int i = 0; i < ncontexts; i++)
            if (contexts[i].context == context) return &contexts[i];
        if (ncontexts == CONTEXTS || !basic) return nullptr;
        Context &c = contexts[ncontexts++];
        c.context = context;
        void *prev;
        if (push(context) != 0) return &c;
        // capture only: nothing ever runs on this stream, and it does not
        // synchronize with the legacy stream (which would end a capture)
        const unsigned non_blocking = 1;
        if (loaded && stream_create(&c.capture, non_blocking) != 0) c.capture = nullptr;
        int dev = 0, n = 0;
        const int MULTIPROCESSOR_COUNT = 16;   // CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
        if (ctx_device(&dev) == 0 && attribute(&n, MULTIPROCESSOR_COUNT, dev) == 0)
            c.multiprocessors = n;
        pop(&prev);
        return &c;
    }

    // The multiprocessors of the calling thread's context's device, or 0
    // where they cannot be read
    int multiprocessors() {
        std::lock_guard<std::mutex> guard(lock);
        Context *c = entry(call_context());
        return c ? c->multiprocessors : 0;
    }

    int fail(int rc, const char *what) {
        const char *name = "unknown";
        error_name(rc, &name);
        char msg[256];
        snprintf(msg, sizeof(msg), "CUDA: %s failed: %s", what, name);
        halide_error(nullptr, msg);
        return rc;
    }

    Slot *find(const uint64_t *key, int n, void *context) {
        for (Slot &s : slots)
            if (s.exec && s.n == n && s.context == context &&
                std::memcmp(s.key, key, n * sizeof(uint64_t)) == 0)
                return &s;
        return nullptr;
    }

    // Whether the calling thread's stream is being captured by the caller
    // (torch.compile's mode="reduce-overhead", torch.cuda.graph): then a
    // loop's kernels go straight into the caller's graph, since a graph of
    // ours would be launched from the caller's graph, and its pointers
    // would be those of the caller's private memory pool.
    bool caller_capturing() const {
        int status = 0;  // CU_STREAM_CAPTURE_STATUS_ACTIVE is 1
        return is_capturing && is_capturing(g_stream, &status) == 0 && status == 1;
    }

    // Run `steps` (the loop's Halide calls, returning the first nonzero
    // code) for `key` (T, B, pointers): from a cached graph, or captured
    // into a new one, or directly.
    template <class F>
    int run(const uint64_t *key, int n, F steps) {
        std::lock_guard<std::mutex> guard(lock);
        void *context = call_context();
        Context *c = enabled ? entry(context) : nullptr;
        // a loop of one step (key[0] is T) runs directly: its graph would
        // replay the launches of one step, saving nothing, and a caller
        // stepping a cell gets fresh arrays each call, whose pointers
        // seldom recur, so most of its calls would capture a new graph
        if (!c || !c->capture || !c->warmed || n > KEY || key[0] < 2 || caller_capturing()) {
            // the first call in a context runs directly: Halide loads its
            // kernels then
            int rc = steps();
            if (c) c->warmed = rc == 0;
            direct++;
            return rc;
        }
        void *prev;
        int rc = push(context);
        if (rc) return fail(rc, "cuCtxPushCurrent");
        rc = replay_or_capture(key, n, context, c->capture, steps);
        pop(&prev);
        return rc;
    }

    template <class F>
    int replay_or_capture(const uint64_t *key, int n, void *context, void *stream, F steps) {
        Slot *hit = find(key, n, context);
        if (hit) {
            hit->used = ++clock;
            replays++;
            int rc = launch(hit->exec, g_stream);
            return rc ? fail(rc, "cuGraphLaunch") : 0;
        }
        const int relaxed = 2;  // CU_STREAM_CAPTURE_MODE_RELAXED
        int rc = begin_capture(stream, relaxed);
        if (rc) return fail(rc, "cuStreamBeginCapture");
        capturing = stream;
        int krc = steps();
        capturing = nullptr;
        void *graph = nullptr;
        rc = end_capture(stream, &graph);
        if (krc || rc) {
            if (graph) graph_destroy(graph);
            return krc ? krc : fail(rc, "cuStreamEndCapture");
        }
        captures++;
        // the least recently used slot; a graph of the same T and B in the
        // same context (same kernels, other pointers) is updated in place
        // when it is the oldest, which costs less than a new instantiation
        Slot *slot = &slots[0];
        for (Slot &s : slots)
            if (s.used < slot->used) slot = &s;
        char info[64];  // CUgraphExecUpdateResultInfo
        bool updated = slot->exec && slot->n == n && slot->context == context &&
                       slot->key[0] == key[0] && slot->key[1] == key[1] &&
                       exec_update(slot->exec, graph, info) == 0;
        if (!updated) {
            if (slot->exec) exec_destroy(slot->exec);
            slot->exec = nullptr;
            rc = instantiate(&slot->exec, graph, 0);
            if (rc) {
                slot->exec = nullptr;
                graph_destroy(graph);
                return fail(rc, "cuGraphInstantiate");
            }
        }
        graph_destroy(graph);
        slot->n = n;
        slot->context = context;
        std::memcpy(slot->key, key, n * sizeof(uint64_t));
        slot->used = ++clock;
        rc = launch(slot->exec, g_stream);
        return rc ? fail(rc, "cuGraphLaunch") : 0;
    }
};

thread_local void *Graphs::capturing = nullptr;
Graphs g_graphs;

// The stream the calling thread's kernels and copies go to
void *call_stream() { return g_graphs.capturing ? g_graphs.capturing : g_stream; }

// Copies and fills of device memory on the calling thread's stream
// (libcuda's asynchronous memcpy and memset, in its context).
struct DeviceCopies {
    int (*copy)(uint64_t, uint64_t, size_t, void *) = nullptr;   // cuMemcpyDtoDAsync_v2
    int (*fill)(uint64_t, unsigned, size_t, void *) = nullptr;   // cuMemsetD32Async
    int (*push)(void *) = nullptr;
    int (*pop)(void **) = nullptr;

    bool load() {
        void *lib = libcuda();
        return lib && (copy = (decltype(copy))dlsym(lib, "cuMemcpyDtoDAsync_v2")) &&
               (fill = (decltype(fill))dlsym(lib, "cuMemsetD32Async")) &&
               (push = (decltype(push))dlsym(lib, "cuCtxPushCurrent_v2")) &&
               (pop = (decltype(pop))dlsym(lib, "cuCtxPopCurrent_v2"));
    }

    // dst[0, n) = src[0, n) floats, or zeros where src is NULL; nothing
    // where src is dst (a chunk of a time loop whose initial state is the
    // previous chunk's last, in place)
    int put(float *dst, const float *src, size_t n) {
        if (src == dst) return 0;
        if (!copy) {
            halide_error(nullptr, "CUDA: halstm_cuda_init has not loaded libcuda's copies");
            return -1;
        }
        int rc = push(call_context());
        if (rc) return rc;
        rc = src ? copy(u64(dst), u64(src), n * sizeof(float), g_stream)
                 : fill(u64(dst), 0, n, g_stream);
        void *prev;
        pop(&prev);
        if (rc) halide_error(nullptr, "CUDA: copying or zeroing a state failed");
        return rc;
    }
};
DeviceCopies g_copies;

// Whether a time loop's steps fold (pipeline.FOLD_FWD, FOLD_BWD): where
// each step's `blocks` run at once, one a multiprocessor of the calling
// thread's device, so that the blocks that compute the same batch row's
// rest side by side add no time. HALSTM_FOLD_STEPS=0 or 1 in the
// environment: never or always (for measuring).
int g_fold_steps = -1;

bool fold_wanted(int64_t blocks) {
    return g_fold_steps >= 0 ? g_fold_steps == 1 : blocks <= g_graphs.multiprocessors();
}
#endif

// dst[0, n) = src[0, n) floats (device memory in CUDA builds, on the call's
// stream), zeros where src is NULL, nothing where src is dst.
int put_floats(float *dst, const float *src, size_t n) {
#ifdef HALSTM_CUDA
    return g_copies.put(dst, src, n);
#else
    if (!src) std::memset(dst, 0, n * sizeof(float));
    else if (src != dst) std::memcpy(dst, src, n * sizeof(float));
    return 0;
#endif
}

// Run a time loop (`steps` returns the first nonzero code of its calls);
// key: T, B and every pointer the loop's calls are given.
template <class F>
int run_loop(const uint64_t *key, int n, F steps) {
#ifdef HALSTM_CUDA
    return g_graphs.run(key, n, steps);
#else
    (void)key, (void)n;
    return steps();
#endif
}

}  // namespace

#ifdef HALSTM_CUDA
namespace {

// Halide's CUDA runtime launches every kernel with the cuLaunchKernel that
// halide_cuda_get_symbol gives it, and never lets a kernel's function use
// more than the 48 KiB of shared memory it gets without opting in
// (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES): a launch asking for
// more fails. The driver hands it a cuLaunchKernel that opts in first
// (cuda.loop_infer keeps W_hh in up to a block's whole shared memory).
using LaunchKernel = int (*)(void *, unsigned, unsigned, unsigned, unsigned, unsigned,
                             unsigned, unsigned, void *, void **, void **);
using FuncSetAttribute = int (*)(void *, int, int);
LaunchKernel g_launch_kernel = nullptr;
FuncSetAttribute g_func_set_attribute = nullptr;

int launch_kernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                  unsigned bz, unsigned shared, void *stream, void **params, void **extra) {
    const unsigned SHARED_WITHOUT_OPT_IN = 48 << 10;
    const int MAX_DYNAMIC_SHARED_SIZE_BYTES = 8;   // CU_FUNC_ATTRIBUTE_...
    if (shared > SHARED_WITHOUT_OPT_IN) {
        int rc = g_func_set_attribute(f, MAX_DYNAMIC_SHARED_SIZE_BYTES, (int)shared);
        if (rc != 0) return rc;
    }
    return g_launch_kernel(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra);
}

}  // namespace
#endif

extern "C" {

#ifdef HALSTM_CUDA
// (Halide's runtime: its WEAK default loads libcuda and looks the name up)
void *halide_cuda_get_symbol(void *, const char *name) {
    void *lib = libcuda();
    void *symbol = lib ? dlsym(lib, name) : nullptr;
    if (symbol && std::strcmp(name, "cuLaunchKernel") == 0) {
        g_launch_kernel = (LaunchKernel)symbol;
        g_func_set_attribute = (FuncSetAttribute)dlsym(lib, "cuFuncSetAttribute");
        if (g_func_set_attribute) return (void *)&launch_kernel;
    }
    return symbol;
}

static int acquire_context(void *, void **ctx, bool) {
    *ctx = call_context();
    return *ctx ? 0 : halide_error_code_device_interface_no_device;
}
static int release_context(void *) { return 0; }

// Kernels run on the stream halstm_cuda_set_stream named (the legacy
// default stream, as PyTorch's and CuPy's default, unless told), except
// while a time loop is being captured into a CUDA graph (below).
static int get_stream(void *, void *, void **stream) {
    *stream = call_stream();
    return 0;
}

// Run every kernel in `context` (the primary context of the device the
// library is loaded for, shared with PyTorch and CuPy) unless a call names
// another (halstm_cuda_set_context), and keep device allocations of
// intermediate stages between calls instead of freeing them every time
// step (Halide keeps them, and its loaded kernels, per context).
//
// Halide's CUDA runtime JIT-compiles each pipeline's PTX with at most 64
// registers a thread unless HL_CUDA_JIT_MAX_REGISTERS says otherwise; the
// cuda schedule's register tiles need more (at 64, the projection's 64
// accumulators spilled: 8.9 ms against 1.6 ms for the same-sized dx GEMM
// with 16, deepbench_1024 on an H100). A value the user set is kept.
// HALSTM_CUDA_GRAPHS=0 in the environment turns the time loops' graphs off;
// so does a schedule whose layout does not promise `cuda_graphs` (compiled
// in as HALSTM_CUDA_GRAPHS=0): a step pipeline that allocates a stage in
// device memory would have that allocation baked into the graph, and Halide
// may free it (halide_cuda_release_unused_device_allocations, or when an
// allocation fails) while the graph still uses it.
int halstm_cuda_init(void *context) {
    setenv("HL_CUDA_JIT_MAX_REGISTERS", HALSTM_CUDA_MAX_REGISTERS, 0);
    g_context = context;
    halide_set_cuda_acquire_context(acquire_context);
    halide_set_cuda_release_context(release_context);
    halide_set_cuda_get_stream(get_stream);
    const char *env = getenv("HALSTM_CUDA_GRAPHS");
    g_graphs.init(HALSTM_CUDA_GRAPHS && !(env && env[0] == '0' && env[1] == 0));
    if (!g_copies.load()) return halide_error_code_device_interface_no_device;
    const char *fold = getenv("HALSTM_FOLD_STEPS");
    g_fold_steps = fold && (fold[0] == '0' || fold[0] == '1') && !fold[1] ? fold[0] - '0' : -1;
    return halide_reuse_device_allocations(nullptr, true);
}

// The CUstream this library's next calls from the calling thread run on
// (NULL: the legacy default stream); a caller keeps calls on several
// streams from overlapping.
void halstm_cuda_set_stream(void *stream) { g_stream = stream; }

// The function called where the library's own device allocation finds
// no memory, before it tries once more (NULL: none).
void halstm_cuda_set_oom_hook(void (*hook)(void)) { g_oom_hook = hook; }

// Make the library's next n own device allocations fail as out of memory
// (tests: each failure calls the hook, and the retry allocates).
void halstm_cuda_fail_allocs(int n) { g_fail_allocs = n; }

// The CUcontext this library's next calls from the calling thread run in
// (NULL: halstm_cuda_init's): the primary context of the device whose
// arrays they are given; the stream (halstm_cuda_set_stream) is one of it.
void halstm_cuda_set_context(void *context) { t_context = context; }

// Turn the time loops' graphs on (1) or off (0) for this library.
void halstm_cuda_use_graphs(int on) {
    std::lock_guard<std::mutex> guard(g_graphs.lock);
    g_graphs.enabled = HALSTM_CUDA_GRAPHS && on && g_graphs.loaded;
}

// Counters of the time loops' graphs: [0] loops run from a cached graph,
// [1] loops captured (each also run from its new graph), [2] loops run by
// direct launches (the first call of a library, graphs off or unavailable).
void halstm_cuda_graph_stats(long long *out) {
    out[0] = g_graphs.replays;
    out[1] = g_graphs.captures;
    out[2] = g_graphs.direct;
}
#endif

}  // extern "C"
