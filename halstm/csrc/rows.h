// Where each step's rows lie in the arrays over all steps' rows: xp, dxp,
// dhg and the vector gradients' rows, and the GEMMs over them (the
// projection, the weight gradients, dx).
// Part of the driver: included once, by driver.cpp.
//
// Padded: step t's B rows start at row t*B, as in the caller's (T, B, ...)
// arrays. Packed (CPU builds given batch sizes): step t's block holds its
// batch_sizes[t] rows, then zero rows up to the step before's size (the
// fused backward step reads step t+1's dhg over step t's rows); the GEMMs
// then run over these rows only, not over the sequences' padding. Their
// other operands (x, h_{t-1}; dx) are copied to (from) that order.

namespace {

#ifndef HALSTM_MODEL
#define PARALLEL_COPY_BYTES (1 << 20)

struct StepRows {
    int T, B;
    const int *bs;
    std::vector<int64_t> start;   // packed: the T+1 block starts; padded: empty

    StepRows(int T, int B, const int *batch_sizes) : T(T), B(B), bs(batch_sizes) {
#ifndef HALSTM_CUDA
        if (!bs) return;
        start.resize(T + 1);
        start[0] = 0;
        for (int t = 0; t < T; t++) start[t + 1] = start[t] + capacity(t);
#endif
    }
    bool packed() const { return !start.empty(); }
    // step t's rows, and its block's (the rows before it: zeros)
    int rows(int t) const { return step_rows(bs, t, B); }
    int capacity(int t) const { return rows(t > 0 ? t - 1 : 0); }
    int64_t row0(int t) const { return packed() ? start[t] : (int64_t)t * B; }
    int64_t count() const { return packed() ? start[T] : (int64_t)T * B; }

    // Packed only, 4-byte elements, one task a step: on Halide's thread pool
    // from PARALLEL_COPY_BYTES (a fork and join of the pool costs about as
    // much as copying a few hundred KiB).
    // dst (count, w) = src's step rows: row b of step t at src + (t*B + b)*w;
    // a block's other rows zero.
    void gather(void *dst, const void *src, int w) const {
        copy_steps(dst, src, w, true);
    }
    // dst (T, B, w) = src (count, w)'s step rows in their places; the
    // padding rows zero.
    void scatter(void *dst, const void *src, int w) const {
        copy_steps(dst, src, w, false);
    }
    // dst (T, B, w): the rows past each step's zero.
    void zero_padding(void *dst, int w) const {
        copy_steps(dst, nullptr, w, false);
    }
    // Zero the rows of dst (count, w) past each step's.
    void zero_gaps(void *dst, int w) const {
        for (int t = 0; t < T; t++)
            std::memset((float *)dst + (row0(t) + rows(t)) * w, 0,
                        (size_t)(capacity(t) - rows(t)) * w * sizeof(float));
    }

  private:
    struct Copy {
        const StepRows *self;
        char *dst;
        const char *src;
        int w;
        bool to_packed;
    };
    static int copy_step(void *, int t, uint8_t *closure) {
        const Copy &c = *(const Copy *)closure;
        const StepRows &r = *c.self;
        const size_t row = (size_t)c.w * 4;
        const int64_t padded = (int64_t)t * r.B, packed = r.row0(t);
        const int n = r.rows(t), room = c.to_packed ? r.capacity(t) : r.B;
        char *d = c.dst + (c.to_packed ? packed : padded) * row;
        if (c.src) std::memcpy(d, c.src + (c.to_packed ? padded : packed) * row, n * row);
        std::memset(d + n * row, 0, (room - n) * row);
        return 0;
    }
    void copy_steps(void *dst, const void *src, int w, bool to_packed) const {
        Copy c = {this, (char *)dst, (const char *)src, w, to_packed};
        if ((double)T * B * w * 4 >= PARALLEL_COPY_BYTES) {
            halide_do_par_for(nullptr, copy_step, 0, T, (uint8_t *)&c);
        } else {
            for (int t = 0; t < T; t++) copy_step(nullptr, t, (uint8_t *)&c);
        }
    }
};
#endif  // !HALSTM_MODEL

}  // namespace
