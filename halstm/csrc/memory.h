// Host memory: Halide's large allocations kept for reuse between calls.
// Part of the driver: included once, by driver.cpp.

namespace {

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

BlockCache g_blocks;

}  // namespace

extern "C" {

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

}  // extern "C"

namespace {

// A host block from halide_malloc (aligned as Halide's own; one of 1 MB or
// more comes back from the cache above), freed when it goes out of scope.
struct HostBlock {
    void *ptr;
    explicit HostBlock(size_t bytes) : ptr(bytes ? halide_malloc(nullptr, bytes) : nullptr) {}
    ~HostBlock() {
        if (ptr) halide_free(nullptr, ptr);
    }
    HostBlock(const HostBlock &) = delete;
    HostBlock &operator=(const HostBlock &) = delete;
};

}  // namespace
