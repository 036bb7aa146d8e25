// The forward time loop: halstm_forward (HALSTM_FORWARD).
// Part of the driver: included once, by driver.cpp.

extern "C" {

#ifdef HALSTM_FORWARD
int halstm_pack(halide_buffer_t *, halide_buffer_t *, halide_buffer_t *, halide_buffer_t *);
#if HALSTM_ONEHOT
int halstm_gather(halide_buffer_t *, halide_buffer_t *, halide_buffer_t *, halide_buffer_t *);
#elif HALSTM_CUBLAS
int halstm_proj(halide_buffer_t *, halide_buffer_t *);   // b_ih -> xp: the bias on every row
#else
int halstm_proj(halide_buffer_t *, halide_buffer_t *, halide_buffer_t *, halide_buffer_t *);
#endif
// inputs xp, wp_hh, b_hh, prev[NS], [vec with NV] (with HALSTM_SPLIT then int panel0, panels);
// outputs new[NS], then (halstm_step, not halstm_step_infer: a forward that
// no backward follows) saved channels[S]. Called through Halide's argv
// entry points, whose arguments are buffers as given and pointers to scalars.
int halstm_step_argv(void **);
int halstm_step_infer_argv(void **);
#ifndef HALSTM_STEP_SPLITS
#define HALSTM_STEP_SPLITS 1
#endif
#ifdef HALSTM_VENDOR_STEP_ROWS
// the same with hg (B, G, HP), the step's product h W_hh^T, in place of wp_hh
// (with HALSTM_STEP_SPLITS > 1: (HALSTM_STEP_SPLITS, B, G, HP), its partial
// products over slices of h's units, summed by the step)
int halstm_step_vendor_argv(void **);
int halstm_step_vendor_infer_argv(void **);
#endif
#if HALSTM_UNITS_FWD || HALSTM_FOLD_FWD
// A step's product: inputs wp_hh, b_hh, h_prev, [int panel0, panels];
// output hg (B, G, HP) = b_hh + h W_hh^T, its units of those panels (steps
// in two parts: threads.h two_parts_wanted) or every unit (the first of
// folded steps).
int halstm_step_product_argv(void **);
#endif
#if HALSTM_UNITS_FWD
// Then the rest: halstm_step's arguments with hg in place of wp_hh (the
// whole of it) and no b_hh, the outputs cropped to a range of rows.
int halstm_step_cell_argv(void **);
int halstm_step_cell_infer_argv(void **);
#endif
#ifdef HALSTM_NARROW_ROWS
// halstm_step and halstm_step_infer scheduled for steps of up to
// HALSTM_NARROW_ROWS rows (pipeline.NARROW): the same arguments.
int halstm_step_narrow_argv(void **);
int halstm_step_narrow_infer_argv(void **);
#endif
#ifdef HALSTM_LOOP_ROWS
// Every step of a forward that no backward follows (pipeline.LOOP), for
// batches of up to HALSTM_LOOP_ROWS rows: inputs xp (all N rows), wp_hh,
// b_hh, [vec]; outputs states[NS], each (T+1, B, H), step 0 the initial
// state (read), steps 1..T written.
int halstm_loop_infer_argv(void **);
#endif
#if HALSTM_FOLD_FWD
// A folded step (pipeline.FOLD_FWD): halstm_step_cell's inputs, then
// wp_hh, b_hh; its outputs, then the next step's product (b_hh + h W_hh^T
// on the new h) as G outputs, each gate's (B, H) of a (B, G, HP).
int halstm_step_fold_argv(void **);
int halstm_step_fold_infer_argv(void **);
#endif

// x (T, B, K) float, or with HALSTM_ONEHOT (T, B) int32 class indices;
// w_ih (G*H, K); b_ih (G*H); w_hh (G*H, H); b_hh (G*H); vec (NV, H): the
// vector parameters (unused without, NV = 0)
// workspaces: wp_ih (HP/P, G/PG, K, PG, P); wp_hh (HP/P, G/PG, H, PG, P); xp (N, G, HP), or
// with HALSTM_XP_PANELS (HP/P, N, G, P): N rows, step t's from rows.h's
// StepRows::row0(t) (T*B without batch sizes); x_rows (N, K) floats or (N)
// int32 indices where StepRows is packed: x in that order; with
// HALSTM_FOLD_FWD 2*B*G*HP floats: the folded steps' products (else unused).
// out: saved (T, B, S, H), or NULL: the steps store no saved channels (a
// forward that no backward follows); states[NS] each (T+1, B, H): on return
// [0] holds init[s] (B, H) (NULL: zeros), [t+1] the state after step t.
// batch_sizes (T) int32, or NULL (B every step): step t runs rows [0,
// batch_sizes[t]) only (sequences sorted by length, longest first); the other
// rows of saved[t] are not written, those of states[t+1] are zeroed where
// StepRows is packed (a CPU build), else not written.
static int forward_loop(int T, int B, const int *batch_sizes, const void *x, const float *w_ih,
                        const float *b_ih, const float *w_hh, const float *b_hh, const float *vec,
                        float *wp_ih, float *wp_hh, float *xp, void *x_rows, float *saved,
                        float *const *states, const float *const *init);

// finals: NULL, or per state a (B, H) array (NULL: none) that receives its
// final value, states[s][T] (copied here: a copy from Python costs
// microseconds a state, each call); NULL where batch_sizes is given (each
// row's final is then at its own length: the caller takes them).
int halstm_forward(int T, int B, const int *batch_sizes, const void *x, const float *w_ih, const float *b_ih,
                   const float *w_hh, const float *b_hh, const float *vec, float *wp_ih, float *wp_hh,
                   float *xp, void *x_rows, float *saved, float *const *states,
                   const float *const *init, float *const *finals) {
    g_error[0] = 0;
    if (finals && batch_sizes) {
        halide_error(nullptr, "halstm_forward: finals must be NULL with batch_sizes");
        return -1;
    }
    int rc = forward_loop(T, B, batch_sizes, x, w_ih, b_ih, w_hh, b_hh, vec, wp_ih, wp_hh, xp,
                          x_rows, saved, states, init);
    for (int s = 0; !rc && finals && s < NS; s++)
        if (finals[s]) rc = put_floats(finals[s], states[s] + (int64_t)T * B * H, (size_t)B * H);
    return rc;
}

static int forward_loop(int T, int B, const int *batch_sizes, const void *x, const float *w_ih,
                        const float *b_ih, const float *w_hh, const float *b_hh, const float *vec,
                        float *wp_ih, float *wp_hh, float *xp, void *x_rows, float *saved,
                        float *const *states, const float *const *init) {
    // the initial states (copied here, not by the caller: a copy from
    // Python costs microseconds a state, each call)
    for (int s = 0; s < NS; s++) {
        const size_t n = (size_t)B * H;
        if (int rc = put_floats(states[s], init[s], n)) return rc;
    }
    View vw_ih(w_ih, {{K, 1}, {H, K}, {G, H * K}}), vw_hh(w_hh, {{H, 1}, {H, H}, {G, H * H}});
#if HALSTM_CPU_BF16
#if HALSTM_AMX_TILES
    if (int rc = amx_permitted()) return rc;
#endif
    View vwp_ih = panels_bf16(wp_ih, K), vwp_hh = panels_bf16(wp_hh, H);
#else
    View vwp_ih = panels_t(wp_ih, K), vwp_hh = panels_t(wp_hh, H);
#endif
    int rc = t_reuse_pack ? 0 : halstm_pack(vw_ih.hb(), vw_hh.hb(), vwp_ih.hb(), vwp_hh.hb());
    if (rc) return rc;
    // batch and time merged: N rows (step t's from row0(t))
    const StepRows sr(T, B, batch_sizes);
    const int N = (int)sr.count();
    if (sr.packed()) {
        sr.gather(x_rows, x, HALSTM_ONEHOT ? 1 : K);
        x = x_rows;
        for (int s = 0; s < NS; s++) sr.zero_padding(states[s] + (int64_t)B * H, H);
    }
    View vb_ih(b_ih, {{H, 1}, {G, H}}), vb_hh(b_hh, {{H, 1}, {G, H}});
    View vvec(vec, {{H, 1}, {NV, H}});
    // xp's rows [n0, n0 + rows) of N; XP_ROW: floats from one row to the next
#if HALSTM_XP_PANELS
    const int64_t XP_ROW = G * P;
#else
    const int64_t XP_ROW = G * HP;
#endif
    auto xp_rows = [&](int64_t n0, int rows) {
#if HALSTM_XP_PANELS   // (HP/P, N, G, P): panels of P units (pipeline/forward.py _xp_out)
        return View(xp + n0 * XP_ROW, {{P, 1}, {G, P}, {rows, G * P}, {HP / P, N * G * P}});
#else                  // (N, G, HP)
        return View(xp + n0 * XP_ROW, {{HP, 1}, {G, HP}, {rows, G * HP}});
#endif
    };
    View vxp = xp_rows(0, N);
#if HALSTM_ONEHOT
    View vids = View::ints(x, N);
    rc = halstm_gather(vids.hb(), vwp_ih.hb(), vb_ih.hb(), vxp.hb());
#elif HALSTM_CUBLAS
    rc = halstm_proj(vb_ih.hb(), vxp.hb());
    // then xp (T*B, G, HP) += x (T*B, K) W_ih^T
    if (!rc) {
        const void *a = operand((const float *)x, (int64_t)N * K, BUF_A);
        const void *w = operand(w_ih, (int64_t)G * H * K, BUF_B);
        rc = a && w ? gemm_gates("the projection x W_ih^T", N, K, a, w, 1.0f, xp) : -1;
    }
#else
    View vx((const float *)x, {{K, 1}, {N, K}});
    {
#if HALSTM_SPLIT
        PoolWork work((double)N * K * G * H, HALSTM_PROJ_SERIAL_MACS);
#endif
        rc = halstm_proj(vx.hb(), vwp_ih.hb(), vb_ih.hb(), vxp.hb());
    }
#endif
    if (rc) return rc;
#ifdef HALSTM_VENDOR_STEP_ROWS
    // the steps' recurrent products by cuBLAS where the batch is large
    // (cublas.h step_rows), into hg (B, G, HP)
    const bool vendor = B >= g_cublas.step_rows;
    // (HALSTM_STEP_SPLITS partial products, (B, G, HP) each: gemm_gates_split)
    const int64_t hg_split = (int64_t)B * G * HP;
    float *hg = vendor ? (float *)g_cublas.buffer(
                             BUF_HG, (size_t)hg_split * HALSTM_STEP_SPLITS * sizeof(float))
                       : nullptr;
    StepGemm step;
    if (vendor && (!hg || step.prepare(w_hh, B))) return -1;
#else
    const bool vendor = false;
    float *hg = nullptr;
    const int64_t hg_split = 0;
    struct { void *w, *act; } step = {};
#endif
#ifdef HALSTM_LOOP_ROWS
    // an inference forward of few rows, without batch sizes: every step in
    // one kernel, a block a batch row (pipeline.LOOP)
    if (!saved && !batch_sizes && !vendor && B <= HALSTM_LOOP_ROWS) {
        View whole[NS];
        void *args[4 + NS];
        int n = 0;
        args[n++] = vxp.hb(), args[n++] = vwp_hh.hb(), args[n++] = vb_hh.hb();
        if (NV) args[n++] = vvec.hb();
        for (int s = 0; s < NS; s++) {   // states[s] (T+1, B, H)
            whole[s] = View(states[s], {{H, 1}, {B, H}, {T + 1, B * H}});
            args[n++] = whole[s].hb();
        }
        return halstm_loop_infer_argv(args);
    }
#endif
    // Step t's views and argument list: built for the first step of each
    // row count, then moved along the arrays by pointer (building them,
    // a View a state and saved channel, took about 3% of a small layer's
    // forward on 2 cores).
    struct StepViews {
        View xp, hg, prev[NS], next[NS], sv[S > 0 ? S : 1], h_bits, next_hg[G];
        void *args[6 + 2 * NS + 2 + S + G];
        int rows = -1, t = 0;
    };
    // v's views and arguments for step t's rows, its outputs part's share:
    // xp, `product` (wp_hh, or the product hg), b_hh where `bias` (the
    // product lacks it), the states, [vec], [wp_hh, b_hh where `fold`: the
    // next step's product's], [part's range], the new states, the saved
    // channels. Returns the arguments' count.
    auto step_views = [&](StepViews &v, int t, int rows, const auto &part, View &product,
                          bool bias, bool fold = false) {
        (void)part;
        v.rows = rows, v.t = t;
        v.xp = xp_rows(sr.row0(t), rows);
        for (int s = 0; s < NS; s++) {
            v.prev[s] = bh(states[s], t, B, rows);
            v.next[s] = PART(bh(states[s], t + 1, B, rows), H, 1);
        }
        // saved channel c: the (rows, H) rows of saved[t] (B, S, H)
        const float *saved_t = saved + (int64_t)t * B * S * H;
        for (int c = 0; saved && c < S; c++)
            v.sv[c] = PART(plane(saved_t, c, S, rows), H, 1);
        int n = 0;
        v.args[n++] = v.xp.hb(), v.args[n++] = product.hb();
        if (bias) v.args[n++] = vb_hh.hb();
        for (int s = 0; s < NS; s++) v.args[n++] = v.prev[s].hb();
        if (NV) v.args[n++] = vvec.hb();
        if (fold) v.args[n++] = vwp_hh.hb(), v.args[n++] = vb_hh.hb();
#if HALSTM_SPLIT
        v.args[n++] = (void *)&part.q0, v.args[n++] = (void *)&part.nq;
#endif
        for (int s = 0; s < NS; s++) v.args[n++] = v.next[s].hb();
        if (saved)
            for (int c = 0; c < S; c++) v.args[n++] = v.sv[c].hb();
        return n;
    };
    // v's views moved along their arrays to step t (the same rows as v.t's)
    auto move_views = [&](StepViews &v, int t) {
        const int64_t steps = t - v.t;
        advance(v.xp, (sr.row0(t) - sr.row0(v.t)) * XP_ROW);
        v.t = t;
        for (int s = 0; s < NS; s++) {
            advance(v.prev[s], steps * B * H);
            advance(v.next[s], steps * B * H);
        }
        for (int c = 0; saved && c < S; c++) advance(v.sv[c], steps * B * S * H);
    };
    auto part_steps = [&](const auto &part, void *barrier) {
        (void)part, (void)barrier;
        int rc = 0;
        StepViews v;
        for (int t = 0; t < T; t++) {
            const int rows = step_rows(batch_sizes, t, B);
            if (!PART_HAS_ROWS(rows)) {   // (a part of rows past the step's: no call)
                if (!step_done(barrier, 0)) break;
                continue;
            }
#ifdef HALSTM_VENDOR_STEP_ROWS
            // hg (rows, G, HP) = h_t (rows, H) W_hh^T
            if (vendor) {   // (h_t's bf16 copy: step t-1 stored it, after t = 0)
                const void *h = step.activations(states[0] + (int64_t)t * B * H,
                                                 (int64_t)rows * H, t > 0);
                rc = h ? gemm_gates_split("the step's product h W_hh^T", rows, H, h, step.w,
                                          hg, HALSTM_STEP_SPLITS, hg_split)
                       : -1;
            }
            if (rc) {
                step_done(barrier, rc);
                break;
            }
#endif
            if (rows != v.rows) {
                v.hg = HALSTM_STEP_SPLITS == 1
                           ? View(hg, {{HP, 1}, {G, HP}, {rows, G * HP}})
                           : View(hg, {{HP, 1}, {G, HP}, {rows, G * HP},
                                       {HALSTM_STEP_SPLITS, (int)hg_split}});
                [[maybe_unused]] int n = step_views(v, t, rows, part, vendor ? v.hg : vwp_hh, true);
#if HALSTM_BF16
                // the new h's bf16 bits (rows, H): step t+1's product reads them
                v.h_bits = as_bf16(View((const float *)step.act, {{H, 1}, {rows, H}}));
                if (vendor) v.args[n++] = v.h_bits.hb();
#endif
            } else {     // the same rows of a later step: each view moved along its array
                move_views(v, t);
            }
            void **args = v.args;
            if (saved) {
#ifdef HALSTM_VENDOR_STEP_ROWS
                if (vendor) rc = halstm_step_vendor_argv(args);
                else
#endif
#ifdef HALSTM_NARROW_ROWS
                if (rows <= HALSTM_NARROW_ROWS) rc = halstm_step_narrow_argv(args);
                else
#endif
                rc = halstm_step_argv(args);
            } else {
#ifdef HALSTM_VENDOR_STEP_ROWS
                if (vendor) rc = halstm_step_vendor_infer_argv(args);
                else
#endif
#ifdef HALSTM_NARROW_ROWS
                if (rows <= HALSTM_NARROW_ROWS) rc = halstm_step_narrow_infer_argv(args);
                else
#endif
                rc = halstm_step_infer_argv(args);
            }
            if (!step_done(barrier, rc)) break;
        }
        return rc;
    };
#if HALSTM_FOLD_FWD
    // folded steps where their blocks (a warp of units by a batch row)
    // fit the GPU at once (fold_wanted): step t's rest and step t+1's
    // product in one kernel, the products alternating between the two
    // halves of x_rows
    const bool fold = !vendor && fold_wanted((int64_t)HP / P * B);
    if (fold && !x_rows) {
        halide_error(nullptr, "halstm_forward: no workspace x_rows for the folded steps\n");
        return -1;
    }
    float *const prod[2] = {(float *)x_rows, (float *)x_rows + (size_t)B * G * HP};
    auto fold_steps = [&]() {
        const int rows0 = step_rows(batch_sizes, 0, B);
        View h0 = bh(states[0], 0, B, rows0), hg0(prod[0], {{HP, 1}, {G, HP}, {rows0, G * HP}});
        void *first[] = {vwp_hh.hb(), vb_hh.hb(), h0.hb(), hg0.hb()};
        int rc = halstm_step_product_argv(first);
        // even and odd steps' views (their products' halves of x_rows),
        // each built for a row count, then moved along by two steps
        StepViews v[2];
        for (int t = 0; !rc && t < T; t++) {
            // step t's rows; the next product too (a superset of step t+1's)
            const int rows = step_rows(batch_sizes, t, B);
            StepViews &u = v[t & 1];
            if (rows != u.rows) {
                u.hg = View(prod[t & 1], {{HP, 1}, {G, HP}, {rows, G * HP}});
                int n = step_views(u, t, rows, 0, u.hg, false, true);
                for (int g = 0; g < G; g++) {   // gate g's (rows, H) of the next (rows, G, HP)
                    u.next_hg[g] = View(prod[(t + 1) & 1] + g * HP, {{H, 1}, {rows, G * HP}});
                    u.args[n++] = u.next_hg[g].hb();
                }
            } else {
                move_views(u, t);
            }
            rc = saved ? halstm_step_fold_argv(u.args) : halstm_step_fold_infer_argv(u.args);
        }
        return rc;
    };
    auto steps = [&]() { return fold ? fold_steps() : run_steps(T, B, batch_sizes, part_steps); };
#elif HALSTM_UNITS_FWD
    // each step in two parts: the product into hg (B, G, HP) in ranges of
    // `quantum` unit panels; once every range is in, the rest of the step
    // on each batch row; then the next step's product waits for every
    // row's h. Each thread takes its own share of a step's ranges, then of
    // its rows, then any left (take_items). Results do not depend on which
    // thread computes what.
    const double macs = (double)G * H * H * B;
    TwoParts two(two_parts_wanted(macs, T, B, batch_sizes), macs, T, B, batch_sizes,
                 (size_t)B * G * HP * sizeof(float));
    if (two.on && !two.ws.ptr) {
        halide_error(nullptr, "halstm_forward: out of memory for the steps' products\n");
        return -1;
    }
    auto two_part_steps = [&](const Part &me, SpinBarrier *barrier) {
        int rc = 0;
        const int n = barrier ? barrier->n : 1, panels = HP / P, quantum = two.quantum;
        float *prod = (float *)two.ws.ptr;
        // views built once per row count and moved along by pointer, as
        // part_steps' (h_t; every range's part of the products; each row
        // of this thread's own share); rows taken from another's share
        // get views built for the call
        View h, whole_hg;
        std::vector<View> range_hg(two.ranges);
        std::vector<StepViews> own((B + n - 1) / n);   // (never resized: args point into it)
        int built_rows = -1, built_t = 0;
        for (int t = 0; t < T; t++) {
            const int rows = step_rows(batch_sizes, t, B);
            if (rows != built_rows) {
                h = bh(states[0], t, B, rows);
                whole_hg = View(prod, {{HP, 1}, {G, HP}, {rows, G * HP}});
                for (int r = 0; r < two.ranges; r++)
                    range_hg[r] = part_of(whole_hg, Part{r * quantum, quantum, 0, rows}, HP, 2);
                for (auto &v : own) v.rows = -1;
                built_rows = rows;
            } else {
                advance(h, (int64_t)(t - built_t) * B * H);
            }
            built_t = t;
            rc = take_items(two.range_flags(), t + 1, two.ranges, me.q0 / quantum,
                            (me.q0 + me.nq) / quantum, [&](int r) {
                const int q0 = r * quantum;
                void *args[] = {vwp_hh.hb(), vb_hh.hb(), h.hb(), (void *)&q0, (void *)&quantum,
                                range_hg[r].hb()};
                return halstm_step_product_argv(args);
            });
            if (!step_done(barrier, rc)) break;
            int row0, row1;
            own_share(me, n, rows, &row0, &row1);
            rc = take_items(two.row_flags(), t + 1, rows, row0, row1, [&](int b) {   // row b's rest
                const Part part{0, panels, b, 1};
                StepViews spare, &v = b >= row0 && b < row1 ? own[b - row0] : spare;
                if (v.rows == rows) move_views(v, t);
                else step_views(v, t, rows, part, whole_hg, false);
                return saved ? halstm_step_cell_argv(v.args) : halstm_step_cell_infer_argv(v.args);
            });
            if (!step_done(barrier, rc)) break;
        }
        return rc;
    };
    auto steps = [&]() {
        return two.on ? run_split(macs, T, B, batch_sizes, two_part_steps, true)
                      : run_steps(T, B, batch_sizes, part_steps);
    };
#else
    auto steps = [&]() { return run_steps(T, B, batch_sizes, part_steps); };
#endif
    // (the vendor steps' GEMMs read w_hh or its copy, and write hg)
    uint64_t key[12 + NS] = {(uint64_t)T, (uint64_t)B, u64(xp), u64(wp_hh), u64(b_hh), u64(saved),
                             u64(vec), rows_hash(batch_sizes, T), u64(hg), u64(step.w),
                             u64(step.act), u64(x_rows)};
    for (int s = 0; s < NS; s++) key[12 + s] = u64(states[s]);
    return run_loop(key, 12 + NS, steps);
}
#endif  // HALSTM_FORWARD

}  // extern "C"
