// The compiled library's driver: owns the time loop, so that one call from
// Python runs a whole layer over a sequence. Compiled by aot.py together with
// the Halide pipelines of pipeline.py (halstm_pack, halstm_proj, halstm_step, halstm_step_infer;
// halstm_step_bwd, halstm_grads) and one Halide runtime.
//
// Built with -DHALSTM_MODEL (the char LM's head and optimizer pipelines of
// halstm/model/kernels.py: halstm_model_head, _sumsq, _adam, _sgd, _onehot; entry
// points at the end; sizes are runtime arguments), or with -DHALSTM_FORWARD
// or -DHALSTM_BACKWARD and the sizes:
//   NS states (LSTM: h, c; GRU: h), G gates, S saved channels, K input size,
//   H hidden size, P weight panel width, DXP_IS_DHG (backward: the cell's
//   dxp and dhg coincide), HALSTM_ONEHOT (x is one-hot input given as int32
//   class indices, numpy (T, B): a gather replaces the projection, and dW_ih
//   is a scatter-add; no dx). HP and KP are H and K rounded up to P.
// Arrays are C-contiguous float32 with numpy shapes given below; a Halide view
// lists the same axes innermost first. With -DHALSTM_CUDA every array pointer
// is a CUDA device pointer (in the context given to halstm_cuda_init) and the
// views carry it as their device allocation: nothing is copied to or from
// the host.
#include <HalideRuntime.h>
#ifdef HALSTM_CUDA
#include <HalideRuntimeCuda.h>
#endif

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <cstdio>
#include <initializer_list>
#include <mutex>
#if HALSTM_SPLIT
#include <atomic>
#include <sched.h>
#include <string>
#include <thread>
#include <vector>
#endif
#ifdef HALSTM_CUDA
#include <dlfcn.h>
#endif

#define HP ((H + P - 1) / P * P)
#define KP ((K + P - 1) / P * P)
// the step pipelines' extra arguments with HALSTM_SPLIT: int panel0, panels
#if HALSTM_SPLIT
#define RANGE_ARGS , int, int
#else
#define RANGE_ARGS
#endif

namespace {

thread_local char g_error[8192];

struct View {
    halide_buffer_t buf;
    halide_dimension_t dim[4];
    // dims: (extent, stride) pairs, innermost first.
    View(const float *host, std::initializer_list<std::pair<int, int>> dims) {
        std::memset(this, 0, sizeof(*this));
#ifdef HALSTM_CUDA
        buf.device = (uint64_t)(uintptr_t)host;
        buf.device_interface = halide_cuda_device_interface();
#else
        buf.host = (uint8_t *)host;
#endif
        buf.type.code = halide_type_float;
        buf.type.bits = 32;
        buf.type.lanes = 1;
        buf.dimensions = (int)dims.size();
        buf.dim = dim;
        int d = 0;
        for (auto &e : dims) {
            dim[d].min = 0;
            dim[d].extent = e.first;
            dim[d].stride = e.second;
            d++;
        }
    }
    // A 1-D int32 array of n elements (class indices).
    static View ints(const void *host, int n) {
        View v((const float *)host, {{n, 1}});
        v.buf.type.code = halide_type_int;
        return v;
    }
    View(const View &o) {
        std::memcpy(this, &o, sizeof(*this));
        buf.dim = dim;
    }
    halide_buffer_t *hb() { return &buf; }
};

#ifndef HALSTM_MODEL
// A (B, H) slice of a (T+1, B, H) or (T, B, H) array at step t.
View bh(const float *base, int t, int B) {
    return View(base + (int64_t)t * B * H, {{H, 1}, {B, H}});
}

// Row i of a (2, B, HP) state-gradient array: `units` (H or HP) used per row.
View dstate_row(const float *base, int i, int B, int units) {
    return View(base + (int64_t)i * B * HP, {{units, 1}, {B, HP}});
}

// Panels (n/P, ..., P) of a weight as packed by pipeline.py: dims innermost first.
View panels_t(const float *w, int n_red) {  // (HP/P, n_red, G, P): ji, gate, red, jo
    return View(w, {{P, 1}, {G, P}, {n_red, G * P}, {HP / P, n_red * G * P}});
}
View panels_in(const float *w, int n_pad) {  // (n_pad/P, G, H, P): ki, j, gate, ko
    return View(w, {{P, 1}, {H, P}, {G, H * P}, {n_pad / P, G * H * P}});
}

#endif  // !HALSTM_MODEL

#ifdef HALSTM_CUDA
// A layer's time loop as one CUDA graph. Each step is a Halide pipeline
// call, and each call costs the host about as much as its kernel takes on
// the GPU at small sizes, so the GPU waited on launches (small_128_b16 on an
// H100: 10 us a forward step, one kernel). The loop's kernels are captured
// once into a graph and later calls launch the whole graph. What the loop
// launches depends only on T, B and the array pointers it is given (sizes
// are compiled in; the step pipelines allocate nothing), so a graph is
// cached under exactly those and replayed while they recur, as they do
// when the same workspaces come back from the allocator's pool.
void *g_context = nullptr;  // the CUcontext every kernel runs in

struct Graphs {
    // SLOTS: a training loop alternates two sets of saved states per layer
    // (the tape holds the last forward's while the next one runs), and the
    // layers after the first share a library: 2 * (layers - 1) keys a loop
    static constexpr int KEY = 16, SLOTS = 16;
    struct Slot {
        int n = 0;
        uint64_t key[KEY];
        void *exec = nullptr;
        uint64_t used = 0;
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

    Slot slots[SLOTS];
    uint64_t clock = 0;
    void *capture_stream = nullptr;
    bool enabled = false, warmed = false, capturing = false;
    long long replays = 0, captures = 0, direct = 0;
    std::mutex lock;

    template <class Fn>
    bool sym(void *lib, const char *name, Fn &fn) {
        fn = (Fn)dlsym(lib, name);
        return fn != nullptr;
    }

    void init(void *context, bool want) {
        std::lock_guard<std::mutex> guard(lock);
        if (!capture_stream) setup(context);
        enabled = want && capture_stream;
    }

    void setup(void *context) {
        void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
        if (!lib || !sym(lib, "cuStreamCreate", stream_create) ||
            !sym(lib, "cuStreamBeginCapture_v2", begin_capture) ||
            !sym(lib, "cuStreamEndCapture", end_capture) ||
            !sym(lib, "cuGraphInstantiateWithFlags", instantiate) ||
            !sym(lib, "cuGraphExecUpdate_v2", exec_update) ||
            !sym(lib, "cuGraphLaunch", launch) || !sym(lib, "cuGraphDestroy", graph_destroy) ||
            !sym(lib, "cuGraphExecDestroy", exec_destroy) ||
            !sym(lib, "cuCtxPushCurrent_v2", push) || !sym(lib, "cuCtxPopCurrent_v2", pop) ||
            !sym(lib, "cuGetErrorName", error_name)) {
            return;  // a driver without graphs: direct launches
        }
        void *prev;
        if (push(context) != 0) return;
        // capture only: nothing ever runs on this stream, and it does not
        // synchronize with the legacy stream (which would end a capture)
        const unsigned non_blocking = 1;
        if (stream_create(&capture_stream, non_blocking) != 0) capture_stream = nullptr;
        pop(&prev);
    }

    int fail(int rc, const char *what) {
        const char *name = "unknown";
        error_name(rc, &name);
        char msg[256];
        snprintf(msg, sizeof(msg), "CUDA: %s failed: %s", what, name);
        halide_error(nullptr, msg);
        return rc;
    }

    Slot *find(const uint64_t *key, int n) {
        for (Slot &s : slots)
            if (s.exec && s.n == n && std::memcmp(s.key, key, n * sizeof(uint64_t)) == 0) return &s;
        return nullptr;
    }

    // Run `steps` (the loop's Halide calls, returning the first nonzero
    // code) for `key` (T, B, pointers): from a cached graph, or captured
    // into a new one, or directly.
    template <class F>
    int run(const uint64_t *key, int n, F steps) {
        std::lock_guard<std::mutex> guard(lock);
        if (!enabled || !warmed || n > KEY) {
            // the first call runs directly: Halide loads its kernels then
            int rc = steps();
            warmed = rc == 0;
            direct++;
            return rc;
        }
        void *prev;
        int rc = push(g_context);
        if (rc) return fail(rc, "cuCtxPushCurrent");
        rc = replay_or_capture(key, n, steps);
        pop(&prev);
        return rc;
    }

    template <class F>
    int replay_or_capture(const uint64_t *key, int n, F steps) {
        Slot *hit = find(key, n);
        if (hit) {
            hit->used = ++clock;
            replays++;
            int rc = launch(hit->exec, nullptr);
            return rc ? fail(rc, "cuGraphLaunch") : 0;
        }
        const int relaxed = 2;  // CU_STREAM_CAPTURE_MODE_RELAXED
        int rc = begin_capture(capture_stream, relaxed);
        if (rc) return fail(rc, "cuStreamBeginCapture");
        capturing = true;
        int krc = steps();
        capturing = false;
        void *graph = nullptr;
        rc = end_capture(capture_stream, &graph);
        if (krc || rc) {
            if (graph) graph_destroy(graph);
            return krc ? krc : fail(rc, "cuStreamEndCapture");
        }
        captures++;
        // the least recently used slot; a graph of the same T and B
        // (same kernels, other pointers) is updated in place when it is
        // the oldest, which costs less than a new instantiation
        Slot *slot = &slots[0];
        for (Slot &s : slots)
            if (s.used < slot->used) slot = &s;
        char info[64];  // CUgraphExecUpdateResultInfo
        bool updated = slot->exec && slot->n == n && slot->key[0] == key[0] &&
                       slot->key[1] == key[1] && exec_update(slot->exec, graph, info) == 0;
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
        std::memcpy(slot->key, key, n * sizeof(uint64_t));
        slot->used = ++clock;
        rc = launch(slot->exec, nullptr);
        return rc ? fail(rc, "cuGraphLaunch") : 0;
    }
};

Graphs g_graphs;
#endif

// Run a time loop (`steps` returns the first nonzero code of its calls);
// key: T, B and every pointer the loop's calls are given.
template <class F>
int run_loop(std::initializer_list<uint64_t> key, F steps) {
#ifdef HALSTM_CUDA
    return g_graphs.run(key.begin(), (int)key.size(), steps);
#else
    (void)key;
    return steps();
#endif
}

uint64_t u64(const void *p) { return (uint64_t)(uintptr_t)p; }

// Halide's own large allocations (the grads pipeline's packed panels: 8 MB a
// call at the char LM's sizes, 52 MB at charrnn_512x2) come back at the same
// sizes every call. glibc hands such blocks back to the system when they are
// freed, so every call faulted them in again (about 6800 page faults a
// backward call at H=256, K=256 on the 2-core VM). Freed blocks of 1 MB or
// more are kept, a few per library, and handed out again for the same size.
struct BlockCache {
    static constexpr size_t MIN = 1 << 20, MAX_TOTAL = size_t(512) << 20;
    static constexpr int LIVE = 64, KEPT = 6;
    struct Block {
        void *ptr = nullptr;
        size_t size = 0;
    };
    std::mutex lock;
    Block live[LIVE];   // handed out, tracked so that free knows the size
    Block kept[KEPT];   // freed, ready for the next request of its size
    size_t kept_bytes = 0;

    void *take(size_t size) {
        std::lock_guard<std::mutex> guard(lock);
        for (Block &b : kept) {
            if (b.ptr && b.size == size) {
                void *p = b.ptr;
                kept_bytes -= b.size;
                b = Block();
                track(p, size);
                return p;
            }
        }
        return nullptr;
    }
    void track(void *p, size_t size) {  // under lock
        for (Block &b : live) {
            if (!b.ptr) {
                b.ptr = p;
                b.size = size;
                return;
            }
        }
    }
    // true: p is kept (the caller must not free it)
    bool keep(void *p) {
        std::lock_guard<std::mutex> guard(lock);
        for (Block &b : live) {
            if (b.ptr != p) continue;
            size_t size = b.size;
            b = Block();
            if (kept_bytes + size > MAX_TOTAL) return false;
            for (Block &k : kept) {
                if (!k.ptr) {
                    k.ptr = p;
                    k.size = size;
                    kept_bytes += size;
                    return true;
                }
            }
            return false;
        }
        return false;
    }
};

#if HALSTM_SPLIT
// Steps split across threads by the driver (the layout's split_steps): each
// thread runs the whole time loop over its own part of every step, a range
// of batch rows or of unit panels (the step pipelines take panel0 and
// panels, and their output views are cropped to the part; see run_split);
// threads with ranges of units meet at a spin barrier after every step,
// since the next step reads every unit of this one's state. A thread pool's
// fork and join per step (Halide's parallel loop) cost more than the step
// itself at small sizes: the profiler counted 13% of a K=H=512 B=64 step
// waiting for the other thread.

// A view with axis d cropped to [x0, x0 + w) (host points at the min).
View crop(View v, int d, int x0, int w) {
    v.buf.host += (int64_t)(x0 - v.dim[d].min) * v.dim[d].stride * (int64_t)sizeof(float);
    v.dim[d].min = x0;
    v.dim[d].extent = w;
    return v;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

// Pauses a thread spins at the barrier before it yields its core at every
// further check: a step's wait is microseconds, but another runtime's
// spinning threads (PyTorch's OpenMP pool after its work) may hold a core.
#ifndef SPIN_PAUSES
#define SPIN_PAUSES 256
#endif

struct SpinBarrier {
    explicit SpinBarrier(int n) : n(n) {}
    const int n;
    std::atomic<int> arrived{0}, phase{0};
    std::atomic<bool> failed{false};
    // Wait until all n threads arrive; false if any thread failed.
    bool wait() {
        int ph = phase.load(std::memory_order_acquire);
        if (arrived.fetch_add(1, std::memory_order_acq_rel) == n - 1) {
            arrived.store(0, std::memory_order_relaxed);
            phase.store(ph + 1, std::memory_order_release);
        } else {
            for (long spins = 0; phase.load(std::memory_order_acquire) == ph; spins++) {
                if (spins < SPIN_PAUSES) cpu_relax();
                else std::this_thread::yield();
            }
        }
        return !failed.load(std::memory_order_acquire);
    }
};

std::atomic<int> g_threads{0};      // halstm_set_num_threads; 0: unset
std::atomic<int> g_last_threads{0}; // threads the last time loop ran on

// Threads this process may use: as set by halstm_set_num_threads, else
// HL_NUM_THREADS as for Halide's own pool, else the CPUs it may run on.
int threads_available() {
    int n = g_threads.load();
    if (n > 0) return n;
    const char *env = getenv("HL_NUM_THREADS");
    n = env ? atoi(env) : 0;
    if (n > 0) return n;
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) n = CPU_COUNT(&set);
    if (n <= 0) n = (int)std::thread::hardware_concurrency();
    return n > 0 ? n : 1;
}

// The part of each step one thread computes: the units of panels
// [q0, q0 + nq) of the batch rows [b0, b0 + nb).
struct Part {
    int q0, nq, b0, nb;
};

// A view with axis 0 (units; `units` of them in the array) cropped to the
// part's panels and axis `rows` (batch) to its rows.
View part_of(View v, const Part &part, int units, int rows) {
    int j0 = part.q0 * P, j1 = (part.q0 + part.nq) * P;
    v = crop(v, 0, j0, (j1 < units ? j1 : units) - j0);
    return crop(v, rows, part.b0, part.nb);
}

// Run body(part, barrier) on as many threads as the work of a step (macs)
// is worth (HALSTM_SPLIT_MACS each), where the whole loop (T steps) is
// worth starting threads for (HALSTM_SPLIT_CALL_MACS). Batch rows are independent through the
// whole time loop, so where every thread gets at least HALSTM_SPLIT_ROWS
// rows (a multiple of every step tile's rows) and W_hh is small enough to
// be read by every thread (HALSTM_SPLIT_BATCH_BYTES), each thread takes a
// range of rows and runs without meeting the others (barrier NULL).
// Otherwise each takes a range of whole quanta of unit panels
// (HALSTM_SPLIT_QUANTUM panels: the step tiles span that many at most)
// and they meet at a barrier after every step. Barrier NULL when one
// thread runs it all. Returns the first nonzero code; a worker's error
// message is copied into this thread's.
template <class F>
int run_split(double macs, int T, int B, F body) {
    const int panels = HP / P, groups = panels / HALSTM_SPLIT_QUANTUM;
    static_assert(HP / P % HALSTM_SPLIT_QUANTUM == 0, "tiles of whole quanta");
    const bool by_rows = (double)G * H * H * sizeof(float) <= HALSTM_SPLIT_BATCH_BYTES &&
                         B >= 2 * HALSTM_SPLIT_ROWS;
    const int units = by_rows ? B / HALSTM_SPLIT_ROWS : groups;
    int n = threads_available();
    double worth = macs / HALSTM_SPLIT_MACS;
    if (worth < n) n = worth < 1 ? 1 : (int)worth;
    if (macs * T < HALSTM_SPLIT_CALL_MACS) n = 1;   // starting a thread costs more
    if (n > units) n = units;
    if (n < 1) n = 1;
    g_last_threads.store(n);
    const Part whole{0, panels, 0, B};
    if (n == 1) return body(whole, nullptr);
    auto part = [&](int r) {
        int lo = (int)((int64_t)r * units / n), hi = (int)((int64_t)(r + 1) * units / n);
        if (by_rows)   // the last range also takes the rows past the whole units
            return Part{0, panels, lo * HALSTM_SPLIT_ROWS,
                        (r == n - 1 ? B : hi * HALSTM_SPLIT_ROWS) - lo * HALSTM_SPLIT_ROWS};
        return Part{lo * HALSTM_SPLIT_QUANTUM, (hi - lo) * HALSTM_SPLIT_QUANTUM, 0, B};
    };
    SpinBarrier barrier(n);
    SpinBarrier *meet = by_rows ? nullptr : &barrier;
    std::vector<int> rcs(n, 0);
    std::vector<std::string> errors(n);
    std::atomic<int> go{0};   // 1: run; -1: a thread could not be started
    std::vector<std::thread> workers;
    try {
        for (int r = 1; r < n; r++) {
            workers.emplace_back([&, r]() {
                while (go.load(std::memory_order_acquire) == 0) cpu_relax();
                if (go.load() < 0) return;
                g_error[0] = 0;
                rcs[r] = body(part(r), meet);
                if (rcs[r]) errors[r] = g_error;
            });
        }
    } catch (...) {   // no thread to spare: run the steps here
        go.store(-1, std::memory_order_release);
        for (auto &w : workers) w.join();
        g_last_threads.store(1);
        return body(whole, nullptr);
    }
    go.store(1, std::memory_order_release);
    rcs[0] = body(part(0), meet);
    for (auto &w : workers) w.join();
    for (int r = 0; r < n; r++) {
        if (!rcs[r]) continue;
        if (r > 0) {
            size_t used = strnlen(g_error, sizeof(g_error) - 1);
            std::strncat(g_error, errors[r].c_str(), sizeof(g_error) - 1 - used);
        }
        return rcs[r];
    }
    return 0;
}

#endif  // HALSTM_SPLIT

#ifndef HALSTM_MODEL
// In a time loop, the views a thread's part of a step writes (PART: axis 0
// of `units` units, batch axis `rows`) and the step pipelines' range
// arguments (RANGE); with one thread doing all of it, the views whole.
#if HALSTM_SPLIT
#define PART(v, units, rows) part_of(v, part, units, rows)
#define RANGE , part.q0, part.nq
#else
#define PART(v, units, rows) v
#define RANGE
#endif

// After a step: false if this thread or another failed (stop the loop).
inline bool step_done(void *barrier, int rc) {
#if HALSTM_SPLIT
    if (barrier) {
        auto *b = (SpinBarrier *)barrier;
        if (rc) b->failed.store(true, std::memory_order_release);
        return b->wait();
    }
#else
    (void)barrier;
#endif
    return rc == 0;
}

// A time loop's steps: part_steps(part, barrier) on the driver's threads
// (HALSTM_SPLIT, see run_split), else the whole of every step here.
template <class F>
int run_steps(int T, int B, F part_steps) {
#if HALSTM_SPLIT
    return run_split((double)G * H * H * B, T, B, [&](const Part &part, SpinBarrier *barrier) {
        return part_steps(part, barrier);
    });
#else
    (void)T, (void)B;
    return part_steps(0, nullptr);
#endif
}
#endif

BlockCache g_blocks;

}  // namespace

extern "C" {

// Halide's runtime reports errors through this weak symbol; keep the message
// so that Python can raise it.
void halide_error(void *, const char *msg) {
    size_t used = strnlen(g_error, sizeof(g_error) - 1);
    std::strncat(g_error, msg, sizeof(g_error) - 1 - used);
}

const char *halstm_last_error(void) { return g_error; }

void *halide_malloc(void *user_context, size_t size) {
    if (size < BlockCache::MIN) return halide_default_malloc(user_context, size);
    void *p = g_blocks.take(size);
    if (p) return p;
    p = halide_default_malloc(user_context, size);
    if (p) {
        std::lock_guard<std::mutex> guard(g_blocks.lock);
        g_blocks.track(p, size);
    }
    return p;
}

void halide_free(void *user_context, void *ptr) {
    if (ptr && !g_blocks.keep(ptr)) halide_default_free(user_context, ptr);
}

// Threads for Halide's parallel loops and (HALSTM_SPLIT) the driver's steps.
void halstm_set_num_threads(int n) {
    halide_set_num_threads(n);
#if HALSTM_SPLIT
    g_threads.store(n > 0 ? n : 0);
#endif
}

// Threads the last time loop's steps ran on (HALSTM_SPLIT; else 0).
int halstm_step_threads(void) {
#if HALSTM_SPLIT
    return g_last_threads.load();
#else
    return 0;
#endif
}

#ifdef HALSTM_CUDA
static int acquire_context(void *, void **ctx, bool) {
    *ctx = g_context;
    return g_context ? 0 : halide_error_code_device_interface_no_device;
}
static int release_context(void *) { return 0; }

// Kernels run on the legacy default stream, as PyTorch's and CuPy's do,
// except while a time loop is being captured into a CUDA graph (below).
static int get_stream(void *, void *, void **stream) {
    *stream = g_graphs.capturing ? g_graphs.capture_stream : nullptr;
    return 0;
}

// Run every kernel in `context` (the caller's: device 0's primary context,
// shared with PyTorch and CuPy) and keep device allocations of intermediate
// stages between calls instead of freeing them every time step.
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
    g_graphs.init(context, HALSTM_CUDA_GRAPHS && !(env && env[0] == '0' && env[1] == 0));
    return halide_reuse_device_allocations(nullptr, true);
}

// Turn the time loops' graphs on (1) or off (0) for this library.
void halstm_cuda_use_graphs(int on) {
    std::lock_guard<std::mutex> guard(g_graphs.lock);
    g_graphs.enabled = HALSTM_CUDA_GRAPHS && on && g_graphs.capture_stream;
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

#ifdef HALSTM_FORWARD
int halstm_pack(halide_buffer_t *, halide_buffer_t *, halide_buffer_t *, halide_buffer_t *);
#if HALSTM_ONEHOT
int halstm_gather(halide_buffer_t *, halide_buffer_t *, halide_buffer_t *, halide_buffer_t *);
#else
int halstm_proj(halide_buffer_t *, halide_buffer_t *, halide_buffer_t *, halide_buffer_t *);
#endif
// inputs xp, wp_hh, b_hh, prev[NS] (with HALSTM_SPLIT then int panel0, panels);
// outputs new[NS], saved channels[S]
static_assert(S == 4, "the driver passes four saved channels; extend it for other cells");
#define HB halide_buffer_t *
#if NS == 1
int halstm_step(HB, HB, HB, HB RANGE_ARGS, HB, HB, HB, HB, HB);
#else
int halstm_step(HB, HB, HB, HB, HB RANGE_ARGS, HB, HB, HB, HB, HB, HB);
#endif
// the same without the saved channels (a forward that no backward follows)
#if NS == 1
int halstm_step_infer(HB, HB, HB, HB RANGE_ARGS, HB);
#else
int halstm_step_infer(HB, HB, HB, HB, HB RANGE_ARGS, HB, HB);
#endif
#undef HB

// x (T, B, K) float, or with HALSTM_ONEHOT (T, B) int32 class indices;
// w_ih (G*H, K); b_ih (G*H); w_hh (G*H, H); b_hh (G*H)
// workspaces: wp_ih (HP/P, K, G, P); wp_hh (HP/P, H, G, P); xp (T, B, G, HP), or
// with HALSTM_XP_PANELS (HP/P, T, B, G, P)
// out: saved (T, B, S, H), or NULL: the steps store no saved channels (a
// forward that no backward follows); states[NS] each (T+1, B, H), [0] holds the
// initial state on entry, [t+1] the state after step t on return.
int halstm_forward(int T, int B, const void *x, const float *w_ih, const float *b_ih,
                   const float *w_hh, const float *b_hh, float *wp_ih, float *wp_hh,
                   float *xp, float *saved, float *const *states) {
    g_error[0] = 0;
    View vw_ih(w_ih, {{K, 1}, {H, K}, {G, H * K}}), vw_hh(w_hh, {{H, 1}, {H, H}, {G, H * H}});
    View vwp_ih = panels_t(wp_ih, K), vwp_hh = panels_t(wp_hh, H);
    int rc = halstm_pack(vw_ih.hb(), vw_hh.hb(), vwp_ih.hb(), vwp_hh.hb());
    if (rc) return rc;
    // batch and time merged: N = T*B rows
    View vb_ih(b_ih, {{H, 1}, {G, H}}), vb_hh(b_hh, {{H, 1}, {G, H}});
    // xp's rows [n0, n0 + rows) of N = T*B (rows n = t*B + b)
    auto xp_rows = [&](int n0, int rows) {
#if HALSTM_XP_PANELS   // (HP/P, T*B, G, P): panels of P units (pipeline.py _xp_out)
        return View(xp + (int64_t)n0 * G * P, {{P, 1}, {G, P}, {rows, G * P}, {HP / P, T * B * G * P}});
#else                  // (T*B, G, HP)
        return View(xp + (int64_t)n0 * G * HP, {{HP, 1}, {G, HP}, {rows, G * HP}});
#endif
    };
    View vxp = xp_rows(0, T * B);
#if HALSTM_ONEHOT
    View vids = View::ints(x, T * B);
    rc = halstm_gather(vids.hb(), vw_ih.hb(), vb_ih.hb(), vxp.hb());
#else
    View vx((const float *)x, {{K, 1}, {T * B, K}});
    rc = halstm_proj(vx.hb(), vwp_ih.hb(), vb_ih.hb(), vxp.hb());
#endif
    if (rc) return rc;
    auto part_steps = [&](const auto &part, void *barrier) {
        (void)part, (void)barrier;
        int rc = 0;
        for (int t = 0; t < T; t++) {
            View xp_t = xp_rows(t * B, B);
            View h0 = bh(states[0], t, B), h1 = PART(bh(states[0], t + 1, B), H, 1);
#if NS == 2
            View c0 = bh(states[1], t, B), c1 = PART(bh(states[1], t + 1, B), H, 1);
#endif
            if (!saved) {
#if NS == 1
                rc = halstm_step_infer(xp_t.hb(), vwp_hh.hb(), vb_hh.hb(), h0.hb() RANGE, h1.hb());
#else
                rc = halstm_step_infer(xp_t.hb(), vwp_hh.hb(), vb_hh.hb(), h0.hb(), c0.hb() RANGE,
                                       h1.hb(), c1.hb());
#endif
            } else {
                const float *saved_t = saved + (int64_t)t * B * S * H;
                View s0 = PART(View(saved_t, {{H, 1}, {B, S * H}}), H, 1);
                View s1 = PART(View(saved_t + H, {{H, 1}, {B, S * H}}), H, 1);
                View s2 = PART(View(saved_t + 2 * H, {{H, 1}, {B, S * H}}), H, 1);
                View s3 = PART(View(saved_t + 3 * H, {{H, 1}, {B, S * H}}), H, 1);
#if NS == 1
                rc = halstm_step(xp_t.hb(), vwp_hh.hb(), vb_hh.hb(), h0.hb() RANGE, h1.hb(),
                                 s0.hb(), s1.hb(), s2.hb(), s3.hb());
#else
                rc = halstm_step(xp_t.hb(), vwp_hh.hb(), vb_hh.hb(), h0.hb(), c0.hb() RANGE,
                                 h1.hb(), c1.hb(), s0.hb(), s1.hb(), s2.hb(), s3.hb());
#endif
            }
            if (!step_done(barrier, rc)) break;
        }
        return rc;
    };
    auto steps = [&]() { return run_steps(T, B, part_steps); };
    return run_loop({(uint64_t)T, (uint64_t)B, u64(xp), u64(wp_hh), u64(b_hh), u64(saved),
                     u64(states[0]), u64(states[NS - 1])}, steps);
}
#endif  // HALSTM_FORWARD

#ifdef HALSTM_BACKWARD
#define HB halide_buffer_t *
// inputs saved, prev[NS], new[NS], dy, dnext[NS], w_hh (with HALSTM_SPLIT then
// int panel0, panels); outputs dxp, [dhg], dprev[NS]
#if NS == 1 && DXP_IS_DHG
int halstm_step_bwd(HB, HB, HB, HB, HB, HB RANGE_ARGS, HB, HB);
#elif NS == 1
int halstm_step_bwd(HB, HB, HB, HB, HB, HB RANGE_ARGS, HB, HB, HB);
#elif DXP_IS_DHG
int halstm_step_bwd(HB, HB, HB, HB, HB, HB, HB, HB, HB RANGE_ARGS, HB, HB, HB);
#else
int halstm_step_bwd(HB, HB, HB, HB, HB, HB, HB, HB, HB RANGE_ARGS, HB, HB, HB, HB);
#endif
#if HALSTM_FUSED_BWD
// inputs saved, prev[NS], new[NS], dy, dnext[1:NS], dh_add, dhg_next, w_hh;
// outputs (one Tuple) dh, dxp[G], [dhg[G]], dprev[1:NS], the next call's dh_add
#if NS == 1 && !DXP_IS_DHG && G == 3
int halstm_step_bwd_fused(HB, HB, HB, HB, HB, HB, HB, HB, HB, HB, HB, HB, HB, HB, HB);
#elif NS == 2 && DXP_IS_DHG && G == 4
int halstm_step_bwd_fused(HB, HB, HB, HB, HB, HB, HB, HB, HB, HB, HB, HB, HB, HB, HB, HB, HB);
#else
#error "HALSTM_FUSED_BWD: the driver passes the LSTM's and the GRU's arguments; extend it for this cell"
#endif
#endif
int halstm_pack_bwd(HB, HB, HB, HB);
#if HALSTM_ONEHOT && DXP_IS_DHG
int halstm_grads_ids(HB, HB, HB, HB, HB, HB, HB);
#elif HALSTM_ONEHOT
int halstm_grads_ids(HB, HB, HB, HB, HB, HB, HB, HB);
#elif DXP_IS_DHG
int halstm_grads(HB, HB, HB, HB, HB, HB, HB, HB, HB);
#else
int halstm_grads(HB, HB, HB, HB, HB, HB, HB, HB, HB, HB);
#endif

// x (T, B, K); w_ih (G*H, K); w_hh (G*H, H); saved (T, B, S, H) and
// states[NS] (T+1, B, H) from the forward call; dy (T, B, H);
// dstate[NS] each (2, B, HP): [0][:, :H] holds dL/d(final state) on entry;
// on return [T & 1][:, :H] holds dL/d(initial state) (the rows alternate).
// workspaces wq_ih (KP/P, G, H, P); wq_hh (HP/P, G, H, P);
//   dxp, dhg (T, B, G, H) (dhg unused when DXP_IS_DHG);
//   fused_ws (HALSTM_FUSED_BWD, else unused): B*G*H zeros, then 3*B*HP + 2*B*G*H floats
// out: dx (T, B, KP) (K used); dw_ih (G*H, K); db_ih (G*H); dw_hh (G*H, H); db_hh (G*H)
// dx NULL (CPU builds): the input gradient is not wanted and not computed
// (a first layer fed one-hot characters); the grads pipeline gets a dx of 0 rows.
// HALSTM_ONEHOT: x is (T, B) int32 class indices, and dx is not computed.
int halstm_backward(int T, int B, const void *x, const float *w_ih, const float *w_hh,
                    const float *saved, const float *const *states, const float *dy,
                    float *const *dstate, float *wq_ih, float *wq_hh, float *dxp, float *dhg,
                    float *fused_ws, float *dx, float *dw_ih, float *db_ih, float *dw_hh,
                    float *db_hh) {
    g_error[0] = 0;
    (void)dhg, (void)fused_ws;
    View vw_ih(w_ih, {{K, 1}, {H, K}, {G, H * K}}), vw_hh(w_hh, {{H, 1}, {H, H}, {G, H * H}});
#if HALSTM_RAW_BWD   // the products read the weights as given (no pack_bwd; wq unused)
    View &vwq_ih = vw_ih, &vwq_hh = vw_hh;
    const float *wq_key = w_hh;
    int rc = 0;
    (void)wq_ih, (void)wq_hh;
#else
    View vwq_ih = panels_in(wq_ih, KP), vwq_hh = panels_in(wq_hh, HP);
    const float *wq_key = wq_hh;
    int rc = halstm_pack_bwd(vw_ih.hb(), vw_hh.hb(), vwq_ih.hb(), vwq_hh.hb());
    if (rc) return rc;
#endif
#if HALSTM_FUSED_BWD
    // One call a step (pipeline.py _step_bwd_fused): call t (T-1 down to -1)
    // finishes step t+1's product and runs step t's pointwise backward.
    // fused_ws: zeros (B, G, H): dhg_next of the first call; add (2, B, HP):
    // the dh_add rows passed from call to call; dh (B, HP): dh of calls
    // t >= 0 (unused); scratch (2, B, G, H): call -1's dxp and dhg (unused).
    float *zeros = fused_ws, *add = zeros + (int64_t)B * G * H, *dh_scratch = add + 2 * B * HP;
    float *scratch = dh_scratch + (int64_t)B * HP;
    auto part_steps = [&](const auto &part, void *barrier) {
        (void)part, (void)barrier;
        int rc = 0;
        for (int t = T - 1; t >= -1; t--) {
            int u = t < 0 ? 0 : t;     // the step whose pointwise inputs are read
            int cur = (T - 1 - t) & 1, nxt = cur ^ 1;
            View saved_t(saved + (int64_t)u * B * S * H, {{H, 1}, {S, H}, {B, S * H}});
            View dy_t = bh(dy, u, B);
            View h0 = bh(states[0], u, B), h1 = bh(states[0], u + 1, B);
            const float *dhg_src = DXP_IS_DHG ? dxp : dhg;
            View dhg_next(t == T - 1 ? zeros : dhg_src + (int64_t)(t + 1) * B * G * H,
                          {{H, 1}, {G, H}, {B, G * H}});
            View dh_add = t == T - 1 ? dstate_row(dstate[0], 0, B, H) : dstate_row(add, (t + 1) & 1, B, H);
            View add_out = dstate_row(add, t & 1, B, H);
            View dh = t < 0 ? dstate_row(dstate[0], T & 1, B, H) : dstate_row(dh_scratch, 0, B, H);
            // a gate's plane of (B, G, H)
            auto plane = [&](float *base, int g) { return View(base + g * H, {{H, 1}, {B, G * H}}); };
            float *dxp_t = t < 0 ? scratch : dxp + (int64_t)t * B * G * H;
#if NS == 1
            float *dhg_t = t < 0 ? scratch + (int64_t)B * G * H : dhg + (int64_t)t * B * G * H;
            View d0 = plane(dxp_t, 0), d1 = plane(dxp_t, 1), d2 = plane(dxp_t, 2);
            View e0 = plane(dhg_t, 0), e1 = plane(dhg_t, 1), e2 = plane(dhg_t, 2);
            rc = halstm_step_bwd_fused(saved_t.hb(), h0.hb(), h1.hb(), dy_t.hb(), dh_add.hb(),
                                       dhg_next.hb(), vwq_hh.hb(), dh.hb(), d0.hb(), d1.hb(),
                                       d2.hb(), e0.hb(), e1.hb(), e2.hb(), add_out.hb());
#else
            View c0 = bh(states[1], u, B), c1 = bh(states[1], u + 1, B);
            View dc1 = dstate_row(dstate[1], cur, B, H), dc0 = dstate_row(dstate[1], nxt, B, H);
            View d0 = plane(dxp_t, 0), d1 = plane(dxp_t, 1), d2 = plane(dxp_t, 2), d3 = plane(dxp_t, 3);
            rc = halstm_step_bwd_fused(saved_t.hb(), h0.hb(), c0.hb(), h1.hb(), c1.hb(), dy_t.hb(),
                                       dc1.hb(), dh_add.hb(), dhg_next.hb(), vwq_hh.hb(), dh.hb(),
                                       d0.hb(), d1.hb(), d2.hb(), d3.hb(), dc0.hb(), add_out.hb());
#endif
            if (!step_done(barrier, rc)) break;
        }
        return rc;
    };
#else
    auto part_steps = [&](const auto &part, void *barrier) {
        (void)part, (void)barrier;
        int rc = 0;
        for (int t = T - 1; t >= 0; t--) {
            int cur = (T - 1 - t) & 1, nxt = cur ^ 1;
            View saved_t(saved + (int64_t)t * B * S * H, {{H, 1}, {S, H}, {B, S * H}});
            View dxp_t = PART(View(dxp + (int64_t)t * B * G * H, {{H, 1}, {G, H}, {B, G * H}}), H, 2);
            View dy_t = bh(dy, t, B);
            View h0 = bh(states[0], t, B), h1 = bh(states[0], t + 1, B);
            View dh1 = dstate_row(dstate[0], cur, B, H);
            View dh0 = PART(dstate_row(dstate[0], nxt, B, HP), HP, 1);
#if !DXP_IS_DHG
            View dhg_t = PART(View(dhg + (int64_t)t * B * G * H, {{H, 1}, {G, H}, {B, G * H}}), H, 2);
#endif
#if NS == 1 && DXP_IS_DHG
            rc = halstm_step_bwd(saved_t.hb(), h0.hb(), h1.hb(), dy_t.hb(), dh1.hb(), vwq_hh.hb() RANGE,
                                 dxp_t.hb(), dh0.hb());
#elif NS == 1
            rc = halstm_step_bwd(saved_t.hb(), h0.hb(), h1.hb(), dy_t.hb(), dh1.hb(), vwq_hh.hb() RANGE,
                                 dxp_t.hb(), dhg_t.hb(), dh0.hb());
#else
            View c0 = bh(states[1], t, B), c1 = bh(states[1], t + 1, B);
            View dc1 = dstate_row(dstate[1], cur, B, H);
            View dc0 = PART(dstate_row(dstate[1], nxt, B, H), H, 1);
#if DXP_IS_DHG
            rc = halstm_step_bwd(saved_t.hb(), h0.hb(), c0.hb(), h1.hb(), c1.hb(), dy_t.hb(), dh1.hb(),
                                 dc1.hb(), vwq_hh.hb() RANGE, dxp_t.hb(), dh0.hb(), dc0.hb());
#else
            rc = halstm_step_bwd(saved_t.hb(), h0.hb(), c0.hb(), h1.hb(), c1.hb(), dy_t.hb(), dh1.hb(),
                                 dc1.hb(), vwq_hh.hb() RANGE, dxp_t.hb(), dhg_t.hb(), dh0.hb(), dc0.hb());
#endif
#endif
            if (!step_done(barrier, rc)) break;
        }
        return rc;
    };
#endif  // HALSTM_FUSED_BWD
    auto steps = [&]() { return run_steps(T, B, part_steps); };
    rc = run_loop({(uint64_t)T, (uint64_t)B, u64(saved), u64(states[0]), u64(states[NS - 1]),
                   u64(dy), u64(dstate[0]), u64(dstate[NS - 1]), u64(wq_key), u64(dxp), u64(dhg),
                   u64(fused_ws)},
                  steps);
    if (rc) return rc;
    // dL/d(initial state) is now in dstate[s][T & 1] (the caller reads it there)
    // batch and time merged: N = T*B rows
    const int N = T * B;
    View vhs(states[0], {{H, 1}, {N, H}});
    View vdxp(dxp, {{H, 1}, {G, H}, {N, G * H}});
    View vdw_ih(dw_ih, {{K, 1}, {H, K}, {G, H * K}}), vdb_ih(db_ih, {{H, 1}, {G, H}});
    View vdw_hh(dw_hh, {{H, 1}, {H, H}, {G, H * H}}), vdb_hh(db_hh, {{H, 1}, {G, H}});
#if HALSTM_ONEHOT
    (void)dx;
    View vids = View::ints(x, N);
#if DXP_IS_DHG
    return halstm_grads_ids(vids.hb(), vhs.hb(), vdxp.hb(), vdw_ih.hb(), vdb_ih.hb(), vdw_hh.hb(),
                            vdb_hh.hb());
#else
    View vdhg(dhg, {{H, 1}, {G, H}, {N, G * H}});
    return halstm_grads_ids(vids.hb(), vhs.hb(), vdxp.hb(), vdhg.hb(), vdw_ih.hb(), vdb_ih.hb(),
                            vdw_hh.hb(), vdb_hh.hb());
#endif
#else
    View vx((const float *)x, {{K, 1}, {N, K}});
#ifdef HALSTM_CUDA
    View vdx(dx, {{KP, 1}, {N, KP}});
#else
    static float no_dx[KP];
    View vdx(dx ? dx : no_dx, {{KP, 1}, {dx ? N : 0, KP}});
#endif
#if DXP_IS_DHG
    return halstm_grads(vx.hb(), vhs.hb(), vdxp.hb(), vwq_ih.hb(), vdx.hb(), vdw_ih.hb(),
                        vdb_ih.hb(), vdw_hh.hb(), vdb_hh.hb());
#else
    View vdhg(dhg, {{H, 1}, {G, H}, {N, G * H}});
    return halstm_grads(vx.hb(), vhs.hb(), vdxp.hb(), vdhg.hb(), vwq_ih.hb(), vdx.hb(),
                        vdw_ih.hb(), vdb_ih.hb(), vdw_hh.hb(), vdb_hh.hb());
#endif
#endif  // HALSTM_ONEHOT
}
#endif  // HALSTM_BACKWARD

#ifdef HALSTM_MODEL
// The char LM's head and optimizer (halstm/model/kernels.py); numpy shapes.
typedef halide_buffer_t *HB;
int halstm_model_head(HB, HB, HB, HB, float, HB, HB, HB, HB);
int halstm_model_sumsq(HB, HB);
int halstm_model_adam(HB, HB, HB, HB, HB, float, float, float, float, float, HB, HB, HB);
int halstm_model_sgd(HB, HB, HB, HB, float, float, float, HB, HB);
int halstm_model_onehot(HB, HB);

// ids (N) int32 -> out (N, V): one-hot rows (all zero where an id is not in [0, V))
int halstm_onehot(int N, int V, const void *ids, float *out) {
    g_error[0] = 0;
    View vids = View::ints(ids, N), vout(out, {{V, 1}, {N, V}});
    return halstm_model_onehot(vids.hb(), vout.hb());
}

// y (N, H); w (V, H); b (V); targets (N) int32 in [0, V) -> loss (N) per
// row; dw (V, H), db (V), dy (N, H): gradients of scale * sum(loss).
int halstm_head(int N, int Hd, int V, const float *y, const float *w, const float *b,
                const void *targets, float scale, float *loss, float *dw, float *db,
                float *dy) {
    g_error[0] = 0;
    View vy(y, {{Hd, 1}, {N, Hd}}), vw(w, {{Hd, 1}, {V, Hd}}), vb(b, {{V, 1}});
    View vt = View::ints(targets, N), vloss(loss, {{N, 1}});
    View vdw(dw, {{Hd, 1}, {V, Hd}}), vdb(db, {{V, 1}}), vdy(dy, {{Hd, 1}, {N, Hd}});
    return halstm_model_head(vy.hb(), vw.hb(), vb.hb(), vt.hb(), scale, vloss.hb(), vdw.hb(),
                             vdb.hb(), vdy.hb());
}

// g (n) -> out[0] = sum g^2
int halstm_sumsq(int n, const float *g, float *out) {
    g_error[0] = 0;
    View vg(g, {{n, 1}}), vout(out, {{1, 1}});
    return halstm_model_sumsq(vg.hb(), vout.hb());
}

// In place on p, m, v (n): Adam with the gradient g clipped by the global
// norm sqrt(sum sq[0..P)) to max_norm (<= 0: no clipping).
int halstm_adam(int n, float *p, const float *g, float *m, float *v, int P, const float *sq,
                float c, float e, float b1, float b2, float max_norm) {
    g_error[0] = 0;
    View vp(p, {{n, 1}}), vg(g, {{n, 1}}), vm(m, {{n, 1}}), vv(v, {{n, 1}}), vsq(sq, {{P, 1}});
    View op(vp), om(vm), ov(vv);
    return halstm_model_adam(vp.hb(), vg.hb(), vm.hb(), vv.hb(), vsq.hb(), c, e, b1, b2,
                             max_norm, op.hb(), om.hb(), ov.hb());
}

// In place on p, buf (n): buf = momentum * buf + clipped g; p -= lr * buf.
int halstm_sgd(int n, float *p, const float *g, float *buf, int P, const float *sq, float lr,
               float momentum, float max_norm) {
    g_error[0] = 0;
    View vp(p, {{n, 1}}), vg(g, {{n, 1}}), vb(buf, {{n, 1}}), vsq(sq, {{P, 1}});
    View op(vp), ob(vb);
    return halstm_model_sgd(vp.hb(), vg.hb(), vb.hb(), vsq.hb(), lr, momentum, max_norm,
                            op.hb(), ob.hb());
}
#endif  // HALSTM_MODEL

}  // extern "C"
