// Halide buffer views of the caller's C-contiguous float32 arrays (numpy
// shapes reversed: innermost first); with HALSTM_CUDA, of device pointers.
// Part of the driver: included once, by driver.cpp.

namespace {

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
    View() {
        std::memset(this, 0, sizeof(*this));
        buf.dim = dim;
    }
    View(const View &o) {
        std::memcpy(this, &o, sizeof(*this));
        buf.dim = dim;
    }
    View &operator=(const View &o) {   // (buf.dim points at this View's own dims)
        std::memmove(this, &o, sizeof(*this));
        buf.dim = dim;
        return *this;
    }
    halide_buffer_t *hb() { return &buf; }
};

// v moved along its array by n floats (the same view of a later step).
inline void advance(View &v, int64_t n) {
#ifdef HALSTM_CUDA
    v.buf.device += (uint64_t)(n * (int64_t)sizeof(float));
#else
    v.buf.host += n * (int64_t)sizeof(float);
#endif
}

#ifndef HALSTM_MODEL
// The leading (rows, H) of the (B, H) slice of a (T+1, B, H) or (T, B, H)
// array at step t.
View bh(const float *base, int t, int B, int rows) {
    return View(base + (int64_t)t * B * H, {{H, 1}, {rows, H}});
}

// The rows step t runs: batch_sizes[t] (sequences sorted longest first), or
// all B without batch sizes.
inline int step_rows(const int *batch_sizes, int t, int B) {
    return batch_sizes ? batch_sizes[t] : B;
}

// The batch sizes in a time loop's graph key (0: none): FNV-1a of the T sizes.
uint64_t rows_hash(const int *batch_sizes, int T) {
    if (!batch_sizes) return 0;
    uint64_t h = 1469598103934665603ull;
    for (int t = 0; t < T; t++) h = (h ^ (uint32_t)batch_sizes[t]) * 1099511628211ull;
    return h | 1;
}

// Plane i of a (rows, width, H) array: its (rows, H) slice i (a gate's of
// (B, G, H), a saved channel's of (B, S, H), a vector channel's of (B, NV, H)).
View plane(const float *base, int i, int width, int rows) {
    return View(base + (int64_t)i * H, {{H, 1}, {rows, width * H}});
}

// Row i of a (2, B, HP) state-gradient array, its leading `rows` of B:
// `units` (H or HP) used per row.
View dstate_row(const float *base, int i, int B, int units, int rows) {
    return View(base + (int64_t)i * B * HP, {{units, 1}, {rows, HP}});
}

// Panels (n/P, ..., P) of a weight as packed by halstm/pipeline: dims innermost first.
// (HP/P, G/PG, n_red, PG, P): ji, gate in its group, (group, red), jo (Pipe.panel_extents)
View panels_t(const float *w, int n_red) {
    return View(w, {{P, 1}, {PG, P}, {G / PG * n_red, PG * P}, {HP / P, n_red * G * P}});
}
View panels_in(const float *w, int n_pad) {  // (n_pad/P, G, H, P): ki, j, gate, ko
    return View(w, {{P, 1}, {H, P}, {G, H * P}, {n_pad / P, G * H * P}});
}
#if HALSTM_CPU_BF16
// A weight of reduction n_red as bf16 pair panels (halstm/bf16.py panels):
// (HP/P, gates, NH, P, 2) bf16, NH = n_red rounded up to 32, halved: k2, ji, q
View panels_bf16(const float *w, int n_red, int gates = G) {
    const int nh = (n_red + 31) / 32 * 16;
    View v(w, {{2, 1}, {P, 2}, {nh * gates * (HP / P), 2 * P}});
    v.buf.type.code = halide_type_bfloat;
    v.buf.type.bits = 16;
    return v;
}
#endif

#endif  // !HALSTM_MODEL

}  // namespace
