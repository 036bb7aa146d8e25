// CPU threading: a time loop's steps split over the driver's own threads
// (HALSTM_SPLIT) or a shared OpenMP runtime's, Halide's parallel loops, and
// the thread count.
// Part of the driver: included once, by driver.cpp.

namespace {

// The OpenMP runtime the process's other work runs on (PyTorch's), where
// the caller shares it (halstm_use_openmp): the driver's step threads and
// Halide's parallel loops then run on its team, whose threads would
// otherwise spin on the same cores after each of that work's parallel
// regions (libgomp's default wait policy) while halstm's own threads
// compute. Functions of the GNU OpenMP ABI, which libgomp, LLVM's libomp
// and Intel's libiomp5 all export.
struct OpenMP {
    void (*parallel)(void (*)(void *), void *, unsigned, unsigned);   // GOMP_parallel
    int (*thread_num)();    // omp_get_thread_num
    int (*num_threads)();   // omp_get_num_threads
    int (*in_parallel)();   // omp_in_parallel
    int (*max_threads)();   // omp_get_max_threads
    pid_t pid;              // the process that named it (a fork's child may not use it)
};
std::atomic<const OpenMP *> g_openmp{nullptr};
thread_local int t_call_threads = 0;  // halstm_set_call_threads; 0: unset

// The shared OpenMP runtime where this call may use it: one is shared,
// the calling thread has no share of the cores of its own
// (halstm_set_call_threads: another call runs beside it, on threads of its
// own), and the process is the one that named it (libgomp's team in a
// fork's child waits for its parent's threads forever); else NULL.
const OpenMP *usable_openmp() {
    const OpenMP *omp = g_openmp.load(std::memory_order_acquire);
    return omp && t_call_threads <= 0 && omp->pid == getpid() ? omp : nullptr;
}

// Runs job(r) for each r in [0, n) at once, on threads of the shared
// OpenMP runtime (the calling thread runs r = 0). The team has as many
// threads as the runtime's own regions (its threads past n return at
// once): libgomp ends the pool's threads that a smaller team leaves out
// and starts them anew at the next full region (after torch's 8-thread
// ops, a 2-thread region took the process from 16 threads to 10).
// False where none is usable (usable_openmp), or the call is inside one
// of the runtime's parallel regions, or it gave a team of another size
// (nested regions, a thread limit): then nothing ran.
template <class F>
bool run_on_openmp(int n, F &job) {
    const OpenMP *omp = usable_openmp();
    if (!omp || n < 2 || omp->in_parallel()) return false;
    const int full = omp->max_threads();
    struct Team {
        const OpenMP *omp;
        F *job;
        int n, size;
        std::atomic<bool> ran{false};
    } team{omp, &job, n, full > n ? full : n};
    omp->parallel([](void *p) {
        Team &t = *(Team *)p;
        if (t.omp->num_threads() != t.size) return;   // (the same answer on every thread)
        const int r = t.omp->thread_num();
        if (r == 0) t.ran.store(true);
        if (r < t.n) (*t.job)(r);
    }, &team, (unsigned)team.size, 0);
    return team.ran.load();
}

std::atomic<int> g_threads{0};      // halstm_set_num_threads; 0: unset
std::atomic<int> g_last_threads{0}; // threads the last time loop ran on
std::atomic<int> g_last_wanted{0};  // ... and would have, had every CPU been free
std::atomic<bool> g_last_shared{false};   // ... on the shared OpenMP team

// Threads a call may use: as set for the calling thread
// (halstm_set_call_threads), else by halstm_set_num_threads, else
// HL_NUM_THREADS as for Halide's own pool, else the threads of the shared
// OpenMP runtime's regions where this call may use it (torch's
// set_num_threads), else the CPUs it may run on.
int threads_available() {
    int n = t_call_threads > 0 ? t_call_threads : g_threads.load();
    if (n > 0) return n;
    const char *env = getenv("HL_NUM_THREADS");
    n = env ? atoi(env) : 0;
    if (n > 0) return n;
    if (const OpenMP *omp = usable_openmp()) {
        n = omp->max_threads();
        if (n > 0) return n;
    }
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) n = CPU_COUNT(&set);
    if (n <= 0) n = (int)std::thread::hardware_concurrency();
    return n > 0 ? n : 1;
}

// Halide's parallel loops on as many of its pool's threads as their work
// is worth: while a PoolWork of `macs` multiply-adds lives on a thread, a
// parallel loop that thread runs is cut into at most macs / HALSTM_POOL_MACS
// tasks (each a run of consecutive iterations; one: the loop runs in
// turn on the calling thread), so that the pool wakes no more workers than
// that (each woken worker costs the loop a fork and join).
thread_local int t_pool_parts = 0;   // 0: no limit
halide_do_par_for_t g_halide_par_for = nullptr;   // Halide's own pool's

// A parallel loop on the shared OpenMP runtime's team (halstm_use_openmp;
// as many threads as iterations, at most `threads` (threads_available()),
// each taking the next iteration), else on Halide's pool. Returns the first
// nonzero code.
int par_for_pool(void *uc, halide_task_t task, int min, int size, uint8_t *closure,
                 int threads) {
    const int n = size < threads ? size : threads;
    std::atomic<int> next{0}, failed{0};
    auto loop = [&](int) {
        for (int i; !failed.load(std::memory_order_relaxed) && (i = next.fetch_add(1)) < size;)
            if (int rc = task(uc, min + i, closure)) {
                int none = 0;
                failed.compare_exchange_strong(none, rc);
            }
    };
    if (run_on_openmp(n, loop)) return failed.load();
    return g_halide_par_for(uc, task, min, size, closure);
}

struct Chunks {
    halide_task_t task;
    uint8_t *closure;
    int min, size, parts;
};

int run_chunk(void *uc, int i, uint8_t *closure) {
    const Chunks &c = *(const Chunks *)closure;
    const int lo = c.min + (int)((int64_t)c.size * i / c.parts);
    const int hi = c.min + (int)((int64_t)c.size * (i + 1) / c.parts);
    for (int j = lo; j < hi; j++)
        if (int rc = c.task(uc, j, c.closure)) return rc;
    return 0;
}

int par_for_in_parts(void *uc, halide_task_t task, int min, int size, uint8_t *closure) {
    const int parts = t_pool_parts;   // (0: the loop as Halide schedules it)
    Chunks c = {task, closure, min, size, parts};
    if (parts == 1) return run_chunk(uc, 0, (uint8_t *)&c);
    const int threads = threads_available();   // (once a loop: getenv, getpid, the affinity)
    if (parts <= 0 || parts >= size)
        return par_for_pool(uc, task, min, size, closure, threads);
    return par_for_pool(uc, run_chunk, 0, parts, (uint8_t *)&c, threads);
}

// Halide's parallel loops through par_for_in_parts from now (once).
void take_parallel_loops() {
    static const halide_do_par_for_t pool = g_halide_par_for =
        halide_set_custom_do_par_for(par_for_in_parts);
    (void)pool;
}

#if HALSTM_SPLIT
// serial_below: fewer macs run on the calling thread alone, unless the call
// may use the shared OpenMP team, whose threads wait actively (Halide's
// pool's sleep between calls, and cost more to wake than a small loop gains).
struct PoolWork {
    int was;
    explicit PoolWork(double macs, double serial_below = 0) : was(t_pool_parts) {
        take_parallel_loops();
        const double parts = macs < serial_below && !usable_openmp() ? 1 : macs / HALSTM_POOL_MACS;
        t_pool_parts = parts < 1 ? 1 : parts > (1 << 30) ? (1 << 30) : (int)parts;
    }
    ~PoolWork() { t_pool_parts = was; }
};

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

// The part of each step one thread computes: the units of panels
// [q0, q0 + nq) of the batch rows [b0, b0 + nb).
struct Part {
    int q0, nq, b0, nb;
    int thread = 0;   // run_split's: which of its threads
};

// A view with axis 0 (units; `units` of them in the array) cropped to the
// part's panels and axis `rows` (batch) to its rows.
View part_of(View v, const Part &part, int units, int rows) {
    int j0 = part.q0 * P, j1 = (part.q0 + part.nq) * P;
    v = crop(v, 0, j0, (j1 < units ? j1 : units) - j0);
    int r1 = part.b0 + part.nb, have = v.dim[rows].extent;   // (a step of fewer rows)
    return crop(v, rows, part.b0, (r1 < have ? r1 : have) - part.b0);
}

// How run_split takes a time loop's steps: ranges of rows (by_rows, of at
// least `least` rows) or of `quantum` unit panels; `units` such ranges at
// most; `wanted` threads the steps' work is worth.
struct SplitPlan {
    bool by_rows;
    int least, quantum, panels, units, wanted;
};

// Threads a time loop's steps are worth by their work (macs a step,
// HALSTM_SPLIT_MACS a thread; one where the whole loop is under
// HALSTM_SPLIT_CALL_MACS and would start threads of its own), at most units.
int worth_threads(double macs, int T, int units) {
    // starting a thread costs more (the shared OpenMP team's are started)
    if (macs * T < HALSTM_SPLIT_CALL_MACS && !usable_openmp()) return 1;
    double worth = macs / HALSTM_SPLIT_MACS;
    return worth < 1 ? 1 : worth > units ? units : (int)worth;
}

// by_units: ranges of units whatever the rows (a step that reduces over
// units, on a batch of too few rows: units_split_wanted).
SplitPlan plan_split(double macs, int T, int B, const int *batch_sizes, bool by_units = false) {
    const int least_rows = T > 0 ? step_rows(batch_sizes, T - 1, B) : B;   // the last step's
    static_assert(HP / P % HALSTM_SPLIT_QUANTUM == 0 && HP / P % HALSTM_SPLIT_QUANTUM_SMALL == 0,
                  "tiles of whole quanta");
    SplitPlan s;
    s.quantum = least_rows < HALSTM_SPLIT_SMALL_BELOW ? HALSTM_SPLIT_QUANTUM_SMALL
                                                      : HALSTM_SPLIT_QUANTUM;
    s.panels = HP / P;
    const bool small_w = (double)G * H * H * sizeof(float) <= HALSTM_SPLIT_BATCH_BYTES;
    s.least = HALSTM_SPLIT_ROWS_ONLY && small_w ? 1 : HALSTM_SPLIT_ROWS;
    s.by_rows = !by_units && (HALSTM_SPLIT_ROWS_ONLY || small_w) && B >= 2 * s.least;
    // (rows only: a step that reduces over units runs whole on one thread)
    s.units = s.by_rows ? B / s.least
              : HALSTM_SPLIT_ROWS_ONLY && !by_units ? 1 : s.panels / s.quantum;
    s.wanted = worth_threads(macs, T, s.units);
    return s;
}

// Whether a time loop of steps that reduce over units (HALSTM_SPLIT_ROWS_ONLY)
// takes ranges of units instead (each thread then computes the pointwise
// part of every unit, and its own units' product): where its batch has too
// few rows for two ranges and ranges of units are worth two threads, and
// a step has twice the work the LSTM's threads split from (every thread also
// repeats the rows' pointwise part; at K=H=128 B=1, 2^16 MACs a step,
// ranges of units took 0.97x-1.14x one thread's time).
bool units_split_wanted(double macs, int T, int B, const int *batch_sizes) {
    if (!HALSTM_SPLIT_ROWS_ONLY || threads_available() < 2 || macs < 4.0 * HALSTM_SPLIT_MACS)
        return false;
    return !plan_split(macs, T, B, batch_sizes).by_rows &&
           plan_split(macs, T, B, batch_sizes, true).wanted >= 2;
}

#if HALSTM_UNITS_FWD || HALSTM_UNITS_BWD
// Whether a time loop of steps that reduce over units runs each step in
// two parts, its product on ranges of units and the rest on ranges of
// rows, the threads meeting after each (pipeline.UNITS_FWD, UNITS_BWD),
// rather than whole steps on ranges of rows: where W_hh is larger than
// HALSTM_SPLIT_BATCH_BYTES (forward the knob rows_fwd_kib: every range of
// rows reads all of it each step) or the rows give fewer than two ranges,
// and ranges of units are worth two threads, on a step of at least 4 x
// HALSTM_SPLIT_MACS multiply-adds (one thread computes the rest of a
// one-row step while the others wait: at K=H=128 B=1, 2^16 MACs a step,
// two parts took 0.97x one thread's time on the Zen 5 VM, 1.29x on the
// 16-core Xeon).
bool two_parts_wanted(double macs, int T, int B, const int *batch_sizes) {
    if (threads_available() < 2 || macs < 4.0 * HALSTM_SPLIT_MACS) return false;
    const bool small_w = (double)G * H * H * sizeof(float) <= HALSTM_SPLIT_BATCH_BYTES;
    if (small_w && plan_split(macs, T, B, batch_sizes).by_rows) return false;
    return plan_split(macs, T, B, batch_sizes, true).wanted >= 2;
}

// A part of a step in two parts: work(k) for each of its n items (ranges
// of units, or rows) that nobody took, [own0, own1) first: each thread
// takes its own share first (the same every step: its part of W_hh and
// its rows' values stay in its core's cache), then any that another
// thread has not taken (a thread that the host slows down does less).
// flags[k] holds the stamp of the last step that took item k (stamps grow
// from step to step; the threads meet between steps). Returns the first
// nonzero code.
template <class F>
int take_items(std::atomic<int> *flags, int stamp, int n, int own0, int own1, const F &work) {
    for (int k = own0; k < own1; k++)
        if (flags[k].exchange(stamp) != stamp)
            if (int rc = work(k)) return rc;
    for (int k = 0; k < n; k++)
        if (flags[k].load(std::memory_order_relaxed) != stamp && flags[k].exchange(stamp) != stamp)
            if (int rc = work(k)) return rc;
    return 0;
}

// Thread part.thread's share of n items: [first, end), rounded up (with
// fewer items than threads, thread r has item r).
inline void own_share(const Part &part, int threads, int n, int *first, int *end) {
    *first = (int)(((int64_t)n * part.thread + threads - 1) / threads);
    *end = (int)(((int64_t)n * (part.thread + 1) + threads - 1) / threads);
}

// A time loop's steps in two parts: whether they run so (`on`), the
// product's ranges (of `quantum` unit panels: `ranges` a step), a
// workspace of `bytes` (ws.ptr NULL: out of memory) and take_items' flags
// of the ranges, then of the B rows.
struct TwoParts {
    const bool on;
    const int quantum, ranges;
    HostBlock ws;
    std::vector<std::atomic<int>> taken;
    TwoParts(bool on, double macs, int T, int B, const int *batch_sizes, size_t bytes)
        : on(on), quantum(plan_split(macs, T, B, batch_sizes, true).quantum),
          ranges(HP / P / quantum), ws(on ? bytes : 0), taken(on ? ranges + B : 0) {}
    std::atomic<int> *range_flags() { return taken.data(); }
    std::atomic<int> *row_flags() { return taken.data() + ranges; }
};
#endif

// The first nonzero code of a time loop's threads (rcs); a worker's error
// message (errors[r]) is copied into this thread's.
int first_error(const std::vector<int> &rcs, const std::vector<std::string> &errors) {
    for (size_t r = 0; r < rcs.size(); r++) {
        if (!rcs[r]) continue;
        if (r > 0) {
            size_t used = strnlen(g_error, sizeof(g_error) - 1);
            std::strncat(g_error, errors[r].c_str(), sizeof(g_error) - 1 - used);
        }
        return rcs[r];
    }
    return 0;
}

// Run body(part, barrier) on as many threads as the work of a step (macs)
// is worth (HALSTM_SPLIT_MACS each), where the whole loop (T steps) is
// worth starting threads for (HALSTM_SPLIT_CALL_MACS). Batch rows are independent through the
// whole time loop, so where every thread gets at least HALSTM_SPLIT_ROWS
// rows (a multiple of every step tile's rows) and W_hh is small enough to
// be read by every thread (HALSTM_SPLIT_BATCH_BYTES), each thread takes a
// range of rows and runs without meeting the others (barrier NULL).
// Otherwise each takes a range of whole quanta of unit panels
// (HALSTM_SPLIT_QUANTUM panels: the step tiles span that many at most;
// HALSTM_SPLIT_QUANTUM_SMALL where a step of the loop runs fewer than
// HALSTM_SPLIT_SMALL_BELOW rows, least_rows, and its tiles span more)
// and they meet at a barrier after every step; with HALSTM_SPLIT_ROWS_ONLY
// (a step that reduces over units) rows whatever W_hh's size, else one
// thread, and where W_hh is that small, ranges down to one row: such a
// step has no other way to use more cores than B / HALSTM_SPLIT_ROWS.
// Ranges of rows carry equal shares of the steps' rows where the batch
// has sizes per step (sorted longest first: the first range holds fewer
// rows). Barrier NULL when one
// thread runs it all. Returns the first nonzero code; a worker's error
// message is copied into this thread's.
template <class F>
int run_split(double macs, int T, int B, const int *batch_sizes, F body, bool by_units = false) {
    const SplitPlan s = plan_split(macs, T, B, batch_sizes, by_units);
    const bool by_rows = s.by_rows;
    const int least = s.least, quantum = s.quantum, panels = s.panels, units = s.units;
    const int wanted = s.wanted;
    const int threads = threads_available();
    const int n = wanted < threads ? wanted : threads;
    g_last_threads.store(n);
    g_last_wanted.store(wanted);
    g_last_shared.store(false);
    const Part whole{0, panels, 0, B};
    if (n == 1) return body(whole, nullptr);
    // bounds[r]: the first unit of range r; ranges of rows by equal shares
    // of the row-steps (unit u's: its rows' lengths; the last unit also has
    // the rows past the whole units), else of the units
    std::vector<int> bounds(n + 1);
    for (int r = 0; r <= n; r++) bounds[r] = (int)((int64_t)r * units / n);
    if (by_rows && batch_sizes) {
        std::vector<int64_t> work(units + 1, 0);   // work[u]: row-steps of units [0, u)
        for (int t = 0; t < T; t++)
            for (int u = 0; u < units; u++) {
                const int r0 = u * least, r1 = u == units - 1 ? B : r0 + least;
                const int rows = batch_sizes[t] < r1 ? batch_sizes[t] : r1;
                work[u + 1] += rows > r0 ? rows - r0 : 0;
            }
        for (int u = 0; u < units; u++) work[u + 1] += work[u];
        for (int r = 1, u = 0; r < n; r++) {
            while (u < units && work[u] * n < work[units] * r) u++;
            if (u > 0 && work[units] * r - work[u - 1] * n < work[u] * n - work[units] * r)
                u--;   // (the nearer of the two bounds around the share)
            const int lo = bounds[r - 1] + 1, hi = units - (n - r);
            bounds[r] = u < lo ? lo : u > hi ? hi : u;
        }
    }
    auto part = [&](int r) {
        int lo = bounds[r], hi = bounds[r + 1];
        if (by_rows)   // the last range also takes the rows past the whole units
            return Part{0, panels, lo * least, (r == n - 1 ? B : hi * least) - lo * least, r};
        return Part{lo * quantum, (hi - lo) * quantum, 0, B, r};
    };
    SpinBarrier barrier(n);
    SpinBarrier *meet = by_rows ? nullptr : &barrier;
    std::vector<int> rcs(n, 0);
    std::vector<std::string> errors(n);
    auto run_part = [&](int r) {
        if (r > 0) g_error[0] = 0;
        rcs[r] = body(part(r), meet);
        if (r > 0 && rcs[r]) errors[r] = g_error;
    };
    const bool shared = run_on_openmp(n, run_part);
    g_last_shared.store(shared);
    if (shared) return first_error(rcs, errors);
    std::atomic<int> go{0};   // 1: run; -1: a thread could not be started
    std::vector<std::thread> workers;
    try {
        for (int r = 1; r < n; r++) {
            workers.emplace_back([&, r]() {
                while (go.load(std::memory_order_acquire) == 0) cpu_relax();
                if (go.load() < 0) return;
                run_part(r);
            });
        }
    } catch (...) {   // no thread to spare: run the steps here
        go.store(-1, std::memory_order_release);
        for (auto &w : workers) w.join();
        g_last_threads.store(1);
        return body(whole, nullptr);
    }
    go.store(1, std::memory_order_release);
    run_part(0);
    for (auto &w : workers) w.join();
    return first_error(rcs, errors);
}

#endif  // HALSTM_SPLIT

#ifndef HALSTM_MODEL
// In a time loop, the views a thread's part of a step writes (PART: axis 0
// of `units` units, batch axis `rows`) and the step pipelines' range
// arguments (RANGE); with one thread doing all of it, the views whole.
#if HALSTM_SPLIT
#define PART(v, units, rows) part_of(v, part, units, rows)
#define PART_HAS_ROWS(n) (part.b0 < (n))
#define RANGE , part.q0, part.nq
#else
#define PART(v, units, rows) v
#define PART_HAS_ROWS(n) ((n) > 0)
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
// batch_sizes: the rows of each step (non-increasing), or NULL for B each.
template <class F>
int run_steps(int T, int B, const int *batch_sizes, F part_steps) {
#if HALSTM_SPLIT
    PoolWork work((double)G * H * H * B);   // (a step run whole: its own parallel loops)
    return run_split((double)G * H * H * B, T, B, batch_sizes,
                     [&](const Part &part, SpinBarrier *barrier) { return part_steps(part, barrier); });
#else
    (void)T, (void)B, (void)batch_sizes;
    return part_steps(0, nullptr);
#endif
}
#endif

}  // namespace

extern "C" {

// Share the OpenMP runtime of the process's other work (its GOMP_parallel,
// omp_get_thread_num, omp_get_num_threads, omp_in_parallel,
// omp_get_max_threads; parallel NULL: stop sharing): the steps' threads
// and Halide's parallel loops run on its team from the next call on.
void halstm_use_openmp(void *parallel, void *thread_num, void *num_threads, void *in_parallel,
                       void *max_threads) {
    static std::mutex lock;
    static std::vector<OpenMP *> kept;   // (a running call may still read the one replaced)
    std::lock_guard<std::mutex> hold(lock);
    OpenMP *omp = nullptr;
    if (parallel) {
        omp = new OpenMP{(void (*)(void (*)(void *), void *, unsigned, unsigned))parallel,
                         (int (*)())thread_num, (int (*)())num_threads, (int (*)())in_parallel,
                         (int (*)())max_threads, getpid()};
        kept.push_back(omp);
        take_parallel_loops();
    }
    g_openmp.store(omp, std::memory_order_release);
}

// Threads for Halide's parallel loops and (HALSTM_SPLIT) the driver's steps.
void halstm_set_num_threads(int n) {
    halide_set_num_threads(n);
    g_threads.store(n > 0 ? n : 0);
}

// Threads for the steps of the calls the calling thread makes from now
// (HALSTM_SPLIT; 0: as halstm_set_num_threads, HL_NUM_THREADS or the CPUs
// say): two calls at once, each on its share of the cores.
void halstm_set_call_threads(int n) {
#if HALSTM_SPLIT
    t_call_threads = n > 0 ? n : 0;
#else
    (void)n;
#endif
}

// Threads the last time loop's steps would have run on had every CPU been
// free: its steps' work and parts decide (HALSTM_SPLIT; else 0).
int halstm_step_threads_wanted(void) {
#if HALSTM_SPLIT
    return g_last_wanted.load();
#else
    return 0;
#endif
}

// Whether the last time loop's steps ran on the shared OpenMP runtime's
// team (halstm_use_openmp; HALSTM_SPLIT, else 0).
int halstm_steps_shared(void) {
#if HALSTM_SPLIT
    return g_last_shared.load();
#else
    return 0;
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

}  // extern "C"
