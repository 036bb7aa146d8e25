// The backward time loop (BPTT) and the gradients over all steps:
// halstm_backward (HALSTM_BACKWARD).
// Part of the driver: included once, by driver.cpp.

extern "C" {

#ifdef HALSTM_BACKWARD
#define HB halide_buffer_t *
// inputs saved, prev[NS], new[NS], dy, dnext[NS], w_hh, [vec, dvec sums] (with HALSTM_SPLIT then
// int panel0, panels); outputs dxp, [dhg], dprev[NS], [dvec sums]
// (the step pipelines are called through Halide's argv entry points:
// buffers as given, pointers to scalars)
int halstm_step_bwd_argv(void **);
#if HALSTM_FUSED_BWD
// inputs saved, prev[NS], new[NS], dy, dnext[1:NS], dh_add, dhg_next, w_hh, [vec, dvec sums];
// outputs (one Tuple) dh, dxp[G], [dhg[G]], dprev[1:NS], dvec sums[NV], the next call's dh_add
// (called through Halide's argv entry point: buffers as given)
int halstm_step_bwd_fused_argv(void **);
#if HALSTM_CPU_BF16
// step_bwd_fused with its product of bf16 operands, for steps of more than
// HALSTM_NARROW_ROWS rows: the same arguments, w_hh as W_hh^T's bf16 pair
// panels (pack_bwd's third output)
int halstm_step_bwd_bf16_argv(void **);
#endif
#endif
#if HALSTM_UNITS_BWD
// step_bwd on ranges of units, where the batch has too few rows for the
// driver's ranges of rows (threads.h units_split_wanted)
int halstm_step_bwd_units_argv(void **);
// A step in two parts (threads.h two_parts_wanted): step_bwd_cell, step_bwd's
// arguments without w_hh, its dprev[0] h's pointwise term alone (B, H of HP);
// then step_bwd_product: inputs dhg (B, G, H), w_hh, that term, int panel0,
// panels; output dprev[0] (B, HP), the term plus the product, those units.
int halstm_step_bwd_cell_argv(void **);
int halstm_step_bwd_product_argv(void **);
#endif
#if HALSTM_FOLD_BWD
// step_bwd as one kernel on a GPU (pipeline.FOLD_BWD): step_bwd's inputs;
// its outputs as planes: dxp[G], [dhg[G]], dprev[NS] (h's over H units),
// dvec sums[NV], each a gate's (channel's) (B, H) of its (B, G, H) ((B, NV, H))
int halstm_step_bwd_fold_argv(void **);
#endif
#ifdef HALSTM_VENDOR_STEP_ROWS
// step_bwd without its product (and without w_hh): the driver adds dhg W_hh
// to dprev[0] by cuBLAS
int halstm_step_bwd_vendor_argv(void **);
#endif
#if HALSTM_CPU_BF16   // (a third output: W_hh^T's bf16 pair panels, after wq_hh's)
int halstm_pack_bwd(HB, HB, HB, HB, HB);
#else
int halstm_pack_bwd(HB, HB, HB, HB);
#endif
// inputs x (or ids), hs, dxp, [dhg], [w_ih], [dvec rows]; outputs [dx], dw_ih, db_ih,
// dw_hh, db_hh, [dvec] (through Halide's argv entry point)
int halstm_grads_argv(void **);
int halstm_grads_ids_argv(void **);

// x (T, B, K); w_ih (G*H, K); w_hh (G*H, H); vec (NV, H) (unused without
// vector parameters, NV = 0); saved (T, B, S, H) and
// states[NS] (T+1, B, H) from the forward call; dy (T, B, H);
// dstate[NS] each (2, B, HP): [0][:, :H] holds dL/d(final state) on entry,
// the rest zeros, unless dfinal (the last argument) is given; on return
// [T & 1][:, :H] holds dL/d(initial state) (the rows alternate).
// dfinal: NULL, or per state dL/d(final state) (B, H) (NULL: zeros), which
// this call puts into dstate (zeroed here first): without batch_sizes, and
// in CUDA builds only where HP == H.
// workspaces wq_ih (KP/P, G, H, P); wq_hh (HP/P, G, H, P), with HALSTM_CPU_BF16
//   followed by W_hh^T's bf16 pair panels (HP/P, 1, NH, P, 2), NH = G*H
//   rounded up to 32, halved;
//   dxp, dhg (N, G, H) (dhg unused when DXP_IS_DHG): N rows, step t's from
//   rows.h's StepRows::row0(t) (T*B without batch sizes);
//   fused_ws (HALSTM_FUSED_BWD, else unused): B*G*H zeros, then
//     3*B*HP + 2*B*G*H + B*NV*H floats
//   dvec_rows (2, B, NV, H) zeros (unused with NV = 0): the vector gradients'
//     sums per batch row over the steps run so far; step t reads
//     [(T-1-t) & 1] and writes its sums with its own added to the other;
//     after step 0 they are in [T & 1]
//   rows_ws where StepRows is packed (else unused): x (N, K) floats or (N)
//     int32 indices, h_{t-1} (N, H) and dx (N, KP) in that order
// out: dx (T, B, KP) (K used); dw_ih (G*H, K); db_ih (G*H); dw_hh (G*H, H); db_hh (G*H);
//   dvec (NV, H)
// dx NULL: the input gradient is not wanted and not computed (a first layer
// fed one-hot characters, an input that needs no gradient): CPU builds give
// the grads pipeline a dx of 0 rows, CUDA builds with cuBLAS GEMMs skip their
// dx GEMM; other CUDA builds need dx.
// HALSTM_ONEHOT: x is (T, B) int32 class indices, and dx is not computed.
// batch_sizes (T) int32, or NULL (B every step): step t runs rows [0,
// batch_sizes[t]) only, as in halstm_forward. Then the caller zeroes dxp,
// and dhg where StepRows is padded (the rows no step writes enter
// the gradients' sums as zeros), puts a row's final-state gradient where its last step reads it
// (dstate[s][(T - length) & 1]; the fused step's dh_add rows: fused_ws's
// add[length & 1]), and finds every dL/d(initial state) in [T & 1].
int halstm_backward(int T, int B, const int *batch_sizes, const void *x, const float *w_ih, const float *w_hh,
                    const float *vec, const float *saved, const float *const *states,
                    const float *dy, float *const *dstate, float *wq_ih, float *wq_hh,
                    float *dxp, float *dhg, float *fused_ws, float *dvec_rows, float *rows_ws, float *dx,
                    float *dw_ih, float *db_ih, float *dw_hh, float *db_hh, float *dvec,
                    const float *const *dfinal) {
    g_error[0] = 0;
    (void)dhg, (void)fused_ws;
    if (dfinal) {   // dstate's entry contents made here (see above)
#ifdef HALSTM_CUDA
        const bool pitched = HP != H;
#else
        const bool pitched = false;
#endif
        if (batch_sizes || pitched) {
            halide_error(nullptr, "halstm_backward: dfinal must be NULL with batch_sizes "
                                  "(and in CUDA builds where HP != H)");
            return -1;
        }
        for (int s = 0; s < NS; s++) {
            if (int rc = put_floats(dstate[s], nullptr, (size_t)2 * B * HP)) return rc;
            if (!dfinal[s]) continue;
            if (HP == H) {
                if (int rc = put_floats(dstate[s], dfinal[s], (size_t)B * H)) return rc;
            } else {
                for (int b = 0; b < B; b++)
                    std::memcpy(dstate[s] + (int64_t)b * HP, dfinal[s] + (int64_t)b * H,
                                H * sizeof(float));
            }
        }
    }
    View vvec(vec, {{H, 1}, {NV, H}});
    View vw_ih(w_ih, {{K, 1}, {H, K}, {G, H * K}}), vw_hh(w_hh, {{H, 1}, {H, H}, {G, H * H}});
    const StepRows sr(T, B, batch_sizes);
    if (sr.packed()) {   // (the rows no step writes enter the sums as zeros)
        sr.zero_gaps(dxp, G * H);
        if (!DXP_IS_DHG) sr.zero_gaps(dhg, G * H);
    }
#if HALSTM_RAW_BWD   // the products read the weights as given (no pack_bwd; wq unused)
    View &vwq_ih = vw_ih, &vwq_hh = vw_hh;
    const float *wq_key = w_hh;
    int rc = 0;
    (void)wq_ih, (void)wq_hh;
#else
    View vwq_ih = panels_in(wq_ih, KP), vwq_hh = panels_in(wq_hh, HP);
    const float *wq_key = wq_hh;
#if HALSTM_CPU_BF16
#if HALSTM_AMX_TILES
    if (int rc = amx_permitted()) return rc;
#endif
    View vwt_hh = panels_bf16(wq_hh + (int64_t)HP * G * H, G * H, 1);
    int rc = t_reuse_pack ? 0 : halstm_pack_bwd(vw_ih.hb(), vw_hh.hb(), vwq_ih.hb(), vwq_hh.hb(),
                                                vwt_hh.hb());
#else
    int rc = t_reuse_pack ? 0 : halstm_pack_bwd(vw_ih.hb(), vw_hh.hb(), vwq_ih.hb(), vwq_hh.hb());
#endif
    if (rc) return rc;
#endif
    // Backward step t's unfused call: its views and argument list, for
    // step_bwd (w_hh given; h's gradient over HP units, the product's) or,
    // with vendor, step_bwd_vendor (no w_hh: the driver adds the product;
    // h's gradient over H units), or, with fold, step_bwd_fold (w_hh
    // given; the outputs as planes, h's gradient over H units).
    struct StepArgs {
        View saved, dxp, dhg, dy, dvec, dvec_in, prev[NS], next[NS], dnext[NS], dprev[NS],
            dhg_bits, planes[2 * G + NV];
        void *args[11 + 4 * NS + 2 * G + NV];
    };
    // dhg_bits: with HALSTM_BF16, where step_bwd_vendor stores dhg's bf16 bits
    auto step_args = [&](StepArgs &v, int t, int rows, const auto &part, bool vendor,
                         const void *dhg_bits = nullptr, bool fold = false) {
        (void)part, (void)dhg_bits;
        const int cur = (T - 1 - t) & 1, nxt = cur ^ 1;
        v.saved = View(saved + (int64_t)t * B * S * H, {{H, 1}, {S, H}, {rows, S * H}});
        v.dxp = PART(View(dxp + sr.row0(t) * G * H, {{H, 1}, {G, H}, {rows, G * H}}), H, 2);
        v.dhg = PART(View(dhg + sr.row0(t) * G * H, {{H, 1}, {G, H}, {rows, G * H}}), H, 2);
        v.dy = bh(dy, t, B, rows);
        v.dvec_in = View(dvec_rows + cur * B * NV * H, {{H, 1}, {NV, H}, {rows, NV * H}});
        v.dvec = PART(View(dvec_rows + nxt * B * NV * H, {{H, 1}, {NV, H}, {rows, NV * H}}),
                      H, 2);
        for (int s = 0; s < NS; s++) {
            v.prev[s] = bh(states[s], t, B, rows), v.next[s] = bh(states[s], t + 1, B, rows);
            v.dnext[s] = dstate_row(dstate[s], cur, B, H, rows);
            const int units = s == 0 && !vendor && !fold ? HP : H;
            v.dprev[s] = PART(dstate_row(dstate[s], nxt, B, units, rows), units, 1);
        }
        int n = 0;
        v.args[n++] = v.saved.hb();
        for (int s = 0; s < NS; s++) v.args[n++] = v.prev[s].hb();
        for (int s = 0; s < NS; s++) v.args[n++] = v.next[s].hb();
        v.args[n++] = v.dy.hb();
        for (int s = 0; s < NS; s++) v.args[n++] = v.dnext[s].hb();
        if (!vendor) v.args[n++] = vwq_hh.hb();
        if (NV) v.args[n++] = vvec.hb(), v.args[n++] = v.dvec_in.hb();
#if HALSTM_SPLIT
        v.args[n++] = (void *)&part.q0, v.args[n++] = (void *)&part.nq;
#endif
        if (fold) {   // a gate's (channel's) plane: (rows, H) of (rows, G, H) ((rows, NV, H))
            int m = 0;
            auto put = [&](View p) { v.planes[m] = p, v.args[n++] = v.planes[m++].hb(); };
            for (int g = 0; g < G; g++) put(plane(dxp + sr.row0(t) * G * H, g, G, rows));
            for (int g = 0; !DXP_IS_DHG && g < G; g++)
                put(plane(dhg + sr.row0(t) * G * H, g, G, rows));
            for (int s = 0; s < NS; s++) v.args[n++] = v.dprev[s].hb();
            for (int c = 0; c < NV; c++) put(plane(dvec_rows + nxt * B * NV * H, c, NV, rows));
            return;
        }
        v.args[n++] = v.dxp.hb();
        if (!DXP_IS_DHG) v.args[n++] = v.dhg.hb();
        for (int s = 0; s < NS; s++) v.args[n++] = v.dprev[s].hb();
        if (NV) v.args[n++] = v.dvec.hb();
#if HALSTM_BF16
        if (vendor) {   // (rows, G, H) bits
            v.dhg_bits = as_bf16(View((const float *)dhg_bits, {{H, 1}, {G, H}, {rows, G * H}}));
            v.args[n++] = v.dhg_bits.hb();
        }
#endif
    };
#if HALSTM_FUSED_BWD
    // One call a step (pipeline/backward.py _step_bwd_fused): call t (T-1 down to -1)
    // finishes step t+1's product and runs step t's pointwise backward.
    // fused_ws: zeros (B, G, H): dhg_next of the first call; add (2, B, HP):
    // the dh_add rows passed from call to call; dh (B, HP): dh of calls
    // t >= 0 (unused); scratch (2, B, G, H) then (B, NV, H): call -1's dxp, dhg
    // and dvec (unused).
    float *zeros = fused_ws, *add = zeros + (int64_t)B * G * H, *dh_scratch = add + 2 * B * HP;
    float *scratch = dh_scratch + (int64_t)B * HP;
    auto part_steps = [&](const auto &part, void *barrier) {
        (void)part, (void)barrier;
        int rc = 0;
        for (int t = T - 1; t >= -1; t--) {
            int u = t < 0 ? 0 : t;     // the step whose pointwise inputs are read
            int cur = (T - 1 - t) & 1, nxt = cur ^ 1;
            // step u's rows (step t+1's, which the product finishes, are as
            // many or fewer: its other rows of dhg_next are zeros)
            const int rows = step_rows(batch_sizes, u, B);
            if (!PART_HAS_ROWS(rows)) {   // (a part of rows past the step's: no call)
                if (!step_done(barrier, 0)) break;
                continue;
            }
            // the inputs whole; the outputs this thread's part of the units or rows
            View saved_t(saved + (int64_t)u * B * S * H, {{H, 1}, {S, H}, {rows, S * H}});
            View dy_t = bh(dy, u, B, rows);
            View h0 = bh(states[0], u, B, rows), h1 = bh(states[0], u + 1, B, rows);
            const float *dhg_src = DXP_IS_DHG ? dxp : dhg;
            View dhg_next(t == T - 1 ? zeros : dhg_src + sr.row0(t + 1) * G * H,
                          {{H, 1}, {G, H}, {rows, G * H}});
            View dh_add = t == T - 1 ? dstate_row(dstate[0], 0, B, H, rows)
                                     : dstate_row(add, (t + 1) & 1, B, H, rows);
            View add_out = PART(dstate_row(add, t & 1, B, H, rows), H, 1);
            View dh = PART(t < 0 ? dstate_row(dstate[0], T & 1, B, H, rows)
                                 : dstate_row(dh_scratch, 0, B, H, rows), H, 1);
            float *dxp_t = t < 0 ? scratch : dxp + sr.row0(t) * G * H;
            View prev[NS], next[NS], dnext[NS], dprev[NS];
            for (int s = 1; s < NS; s++) {   // (h's are above: h0, h1, dh_add, dh)
                prev[s] = bh(states[s], u, B, rows), next[s] = bh(states[s], u + 1, B, rows);
                dnext[s] = dstate_row(dstate[s], cur, B, H, rows);
                dprev[s] = PART(dstate_row(dstate[s], nxt, B, H, rows), H, 1);
            }
            void *args[13 + 4 * NS + 2 * G + NV];
            int n = 0;
            args[n++] = saved_t.hb(), args[n++] = h0.hb();
            for (int s = 1; s < NS; s++) args[n++] = prev[s].hb();
            args[n++] = h1.hb();
            for (int s = 1; s < NS; s++) args[n++] = next[s].hb();
            args[n++] = dy_t.hb();
            for (int s = 1; s < NS; s++) args[n++] = dnext[s].hb();
#if HALSTM_CPU_BF16   // (steps of few rows: the float32 step, whose tiles fit them)
            const bool bf16 = rows > HALSTM_NARROW_ROWS;
            View &vw_step = bf16 ? vwt_hh : vwq_hh;
            int (*const step_bwd)(void **) = bf16 ? halstm_step_bwd_bf16_argv
                                                 : halstm_step_bwd_fused_argv;
#else
            View &vw_step = vwq_hh;
            int (*const step_bwd)(void **) = halstm_step_bwd_fused_argv;
#endif
            args[n++] = dh_add.hb(), args[n++] = dhg_next.hb(), args[n++] = vw_step.hb();
            // the vector gradients' sums: read [cur], written to [nxt] (call -1:
            // scratch, unused)
            float *dvec_t = t < 0 ? scratch + 2 * (int64_t)B * G * H
                                  : dvec_rows + nxt * (int64_t)B * NV * H;
            View dvec_in(t < 0 ? dvec_t : dvec_rows + cur * (int64_t)B * NV * H,
                         {{H, 1}, {NV, H}, {rows, NV * H}});
            if (NV) args[n++] = vvec.hb(), args[n++] = dvec_in.hb();
#if HALSTM_SPLIT
            args[n++] = (void *)&part.q0, args[n++] = (void *)&part.nq;
#endif
            args[n++] = dh.hb();
            View dplanes[G];
            for (int g = 0; g < G; g++) args[n++] = (dplanes[g] = PART(plane(dxp_t, g, G, rows), H, 1)).hb();
#if !DXP_IS_DHG
            float *dhg_t = t < 0 ? scratch + (int64_t)B * G * H : dhg + sr.row0(t) * G * H;
            View eplanes[G];
            for (int g = 0; g < G; g++) args[n++] = (eplanes[g] = PART(plane(dhg_t, g, G, rows), H, 1)).hb();
#endif
            for (int s = 1; s < NS; s++) args[n++] = dprev[s].hb();
            // dvec channel c: a plane of the sums (B, NV, H)
            View vplanes[NV > 0 ? NV : 1];
            for (int c = 0; c < NV; c++)
                args[n++] = (vplanes[c] = PART(plane(dvec_t, c, NV, rows), H, 1)).hb();
            args[n++] = add_out.hb();
            rc = step_bwd(args);
            if (!step_done(barrier, rc)) break;
        }
        return rc;
    };
#else
#if HALSTM_FOLD_BWD
    // folded steps where step_fold's would fold (fold_wanted: blocks of a
    // warp of units by a batch row, each redoing its row's pointwise part)
    const bool fold = fold_wanted((int64_t)HP / P * B);
    int (*const step_bwd)(void **) = fold ? halstm_step_bwd_fold_argv : halstm_step_bwd_argv;
#else
    const bool fold = false;
    int (*const step_bwd)(void **) = halstm_step_bwd_argv;
#endif
    auto part_steps = [&](const auto &part, void *barrier) {
        (void)part, (void)barrier;
        int rc = 0;
        for (int t = T - 1; t >= 0; t--) {
            const int rows = step_rows(batch_sizes, t, B);
            if (!PART_HAS_ROWS(rows)) {   // (a part of rows past the step's: no call)
                if (!step_done(barrier, 0)) break;
                continue;
            }
            StepArgs v;
            step_args(v, t, rows, part, false, nullptr, fold);
            rc = step_bwd(v.args);
            if (!step_done(barrier, rc)) break;
        }
        return rc;
    };
#endif  // HALSTM_FUSED_BWD
#ifdef HALSTM_VENDOR_STEP_ROWS
    // Where the batch is large (cublas.h step_rows): step_bwd's pointwise
    // part, then dh_prev += dhg W_hh by cuBLAS, a step after another.
    const bool vendor = B >= g_cublas.step_rows;
    StepGemm step;
    if (vendor && step.prepare(w_hh, B)) return -1;
    auto vendor_steps = [&](const auto &part, void *barrier) {
        (void)part;
        int rc = 0;
        for (int t = T - 1; t >= 0; t--) {
            const int nxt = ((T - 1 - t) & 1) ^ 1;   // (the row dh_prev goes to)
            const int rows = step_rows(batch_sizes, t, B);
            StepArgs v;
            step_args(v, t, rows, part, true, step.act);
            rc = halstm_step_bwd_vendor_argv(v.args);
            // dh_prev (rows, H of HP) += dhg (rows, G*H) W_hh (G*H, H)
            // (dhg as the GEMM reads it: step_bwd_vendor stored its bf16 copy)
            const float *dhg_rows = (DXP_IS_DHG ? dxp : dhg) + sr.row0(t) * G * H;
            if (!rc)
                rc = gemm_typed("the step's product dhg W_hh", false, false, rows, H, G * H,
                                step.activations(dhg_rows, (int64_t)rows * G * H, true), G * H,
                                step.w, H, OPERAND, 1.0f, dstate[0] + (int64_t)nxt * B * HP, HP);
            if (!step_done(barrier, rc)) break;
        }
        return rc;
    };
    auto steps = [&]() {
        return vendor ? run_steps(T, B, batch_sizes, vendor_steps)
                      : run_steps(T, B, batch_sizes, part_steps);
    };
#else
    const bool vendor = false;
    struct { void *w, *act; } step = {};
#if HALSTM_UNITS_BWD
    // a batch of too few rows for ranges of rows: ranges of units
    const double macs = (double)G * H * H * B;
    const bool by_units = units_split_wanted(macs, T, B, batch_sizes);
    auto units_steps = [&](const auto &part, void *barrier) {
        int rc = 0;
        for (int t = T - 1; t >= 0; t--) {
            StepArgs v;
            step_args(v, t, step_rows(batch_sizes, t, B), part, false);
            rc = halstm_step_bwd_units_argv(v.args);
            if (!step_done(barrier, rc)) break;
        }
        return rc;
    };
    // ranges of rows that would each read too large a W_hh: each step in two
    // parts, the pointwise part on rows (its h term into own_ws (B, HP)),
    // then dh_prev on ranges of units; each thread its own share first
    // (take_items)
    TwoParts two(!by_units && two_parts_wanted(macs, T, B, batch_sizes), macs, T, B,
                 batch_sizes, (size_t)B * HP * sizeof(float));
    if (two.on && !two.ws.ptr) {
        halide_error(nullptr, "halstm_backward: out of memory for the steps' h terms\n");
        return -1;
    }
    auto two_part_steps = [&](const Part &me, SpinBarrier *barrier) {
        int rc = 0;
        const int n = barrier ? barrier->n : 1, quantum = two.quantum;
        float *own = (float *)two.ws.ptr;
        for (int t = T - 1; t >= 0; t--) {
            const int rows = step_rows(batch_sizes, t, B), nxt = ((T - 1 - t) & 1) ^ 1;
            int row0, row1;
            own_share(me, n, rows, &row0, &row1);
            rc = take_items(two.row_flags(), T - t, rows, row0, row1, [&](int b) {
                const Part part{0, HP / P, b, 1};
                StepArgs v;
                step_args(v, t, rows, part, true);
                v.dprev[0] = PART(dstate_row(own, 0, B, H, rows), H, 1);   // (args point at it)
                return halstm_step_bwd_cell_argv(v.args);
            });
            if (!step_done(barrier, rc)) break;
            View dhg_t((DXP_IS_DHG ? dxp : dhg) + sr.row0(t) * G * H, {{H, 1}, {G, H}, {rows, G * H}});
            View own_t = dstate_row(own, 0, B, H, rows);
            rc = take_items(two.range_flags(), T - t, two.ranges, me.q0 / quantum,
                            (me.q0 + me.nq) / quantum, [&](int r) {
                const Part part{r * quantum, quantum, 0, rows};
                View dh = PART(dstate_row(dstate[0], nxt, B, HP, rows), HP, 1);
                void *args[] = {dhg_t.hb(), vwq_hh.hb(), own_t.hb(), (void *)&part.q0,
                                (void *)&part.nq, dh.hb()};
                return halstm_step_bwd_product_argv(args);
            });
            if (!step_done(barrier, rc)) break;
        }
        return rc;
    };
    auto steps = [&]() {
        return by_units ? run_split(macs, T, B, batch_sizes, units_steps, true)
               : two.on ? run_split(macs, T, B, batch_sizes, two_part_steps, true)
                        : run_steps(T, B, batch_sizes, part_steps);
    };
#else
    auto steps = [&]() { return run_steps(T, B, batch_sizes, part_steps); };
#endif
#endif
    uint64_t key[14 + 2 * NS] = {(uint64_t)T, (uint64_t)B, u64(saved), u64(dy), u64(wq_key),
                                 u64(dxp), u64(dhg), u64(fused_ws), u64(vec), u64(dvec_rows),
                                 rows_hash(batch_sizes, T), (uint64_t)vendor, u64(step.w),
                                 u64(step.act)};
    for (int s = 0; s < NS; s++) key[14 + 2 * s] = u64(states[s]), key[15 + 2 * s] = u64(dstate[s]);
    rc = run_loop(key, 14 + 2 * NS, steps);
    if (rc) return rc;
    // dL/d(initial state) is now in dstate[s][T & 1] (the caller reads it there)
    // batch and time merged: N rows; where packed, x and h_{t-1} (states[0]'s
    // first T steps) copied to the steps' rows, dx made there and put in place
    // after
    const int N = (int)sr.count();
    float *x_rows = rows_ws, *h_rows = rows_ws + (int64_t)N * (HALSTM_ONEHOT ? 1 : K);
    float *dx_rows = h_rows + (int64_t)N * H, *dx_out = dx;
    const float *hs = states[0];
    if (sr.packed()) {
        sr.gather(x_rows, x, HALSTM_ONEHOT ? 1 : K);
        sr.gather(h_rows, states[0], H);
        x = x_rows, hs = h_rows;
        if (dx) dx = dx_rows;
    }
    View vhs(hs, {{H, 1}, {N, H}});
    View vdxp(dxp, {{H, 1}, {G, H}, {N, G * H}});
    View vdw_ih(dw_ih, {{K, 1}, {H, K}, {G, H * K}}), vdb_ih(db_ih, {{H, 1}, {G, H}});
    View vdw_hh(dw_hh, {{H, 1}, {H, H}, {G, H * H}}), vdb_hh(db_hh, {{H, 1}, {G, H}});
    View vdhg(dhg, {{H, 1}, {G, H}, {N, G * H}});
    // (the vector gradients' sums per batch row)
    View vdvec_rows(dvec_rows + (T & 1) * (int64_t)B * NV * H, {{H, 1}, {NV, H}, {B, NV * H}});
    View vdvec(dvec, {{H, 1}, {NV, H}});
    void *args[12];
    int n = 0;
#if HALSTM_CUBLAS
    // the sums over rows (biases, vector parameters) by Halide, then dx and
    // dW by cuBLAS, all on one stream
    args[n++] = vdxp.hb();
    if (!DXP_IS_DHG) args[n++] = vdhg.hb();
    if (NV) args[n++] = vdvec_rows.hb();
    args[n++] = vdb_ih.hb(), args[n++] = vdb_hh.hb();
    if (NV) args[n++] = vdvec.hb();
    rc = halstm_grads_argv(args);
    const float *dhg_rows = DXP_IS_DHG ? dxp : dhg;   // (N, G*H)
    // dx (N, KP) = dxp (N, G*H) W_ih (G*H, K), its first K columns
    if (!rc && dx)
        rc = gemm_rows("dx = dxp W_ih", false, false, N, K, G * H, dxp, G * H, w_ih, K, 0.0f,
                       dx, KP);
    // dW_ih (G*H, K) = dxp^T x (N, K); dW_hh (G*H, H) = dhg^T h (N, H): h_{t-1} of each row
    if (!rc) rc = gemm_rows("dW_ih = dxp^T x", true, false, G * H, K, N, dxp, G * H,
                            (const float *)x, K, 0.0f, dw_ih, K);
    if (!rc) rc = gemm_rows("dW_hh = dhg^T h", true, false, G * H, H, N, dhg_rows, G * H,
                            hs, H, 0.0f, dw_hh, H);
    (void)dx_out;
    return rc;
#else
#if HALSTM_ONEHOT
    (void)dx;
    View vx = View::ints(x, N);
#else
    View vx((const float *)x, {{K, 1}, {N, K}});
#ifdef HALSTM_CUDA
    View vdx(dx, {{KP, 1}, {N, KP}});
#else
    static float no_dx[KP];
    View vdx(dx ? dx : no_dx, {{KP, 1}, {dx ? N : 0, KP}});
#endif
#endif
    args[n++] = vx.hb(), args[n++] = vhs.hb(), args[n++] = vdxp.hb();
    if (!DXP_IS_DHG) args[n++] = vdhg.hb();
#if !HALSTM_ONEHOT
    args[n++] = vwq_ih.hb();
#endif
    if (NV) args[n++] = vdvec_rows.hb();
#if !HALSTM_ONEHOT
    args[n++] = vdx.hb();
#endif
    args[n++] = vdw_ih.hb(), args[n++] = vdb_ih.hb(), args[n++] = vdw_hh.hb();
    args[n++] = vdb_hh.hb();
    if (NV) args[n++] = vdvec.hb();
    {
#if HALSTM_SPLIT
        PoolWork work((double)N * (K + H) * G * H);   // (dW_ih, dW_hh; dx as many again)
#endif
#if HALSTM_ONEHOT
        rc = halstm_grads_ids_argv(args);
#else
        rc = halstm_grads_argv(args);
#endif
    }
    if (!rc && sr.packed() && dx_out) sr.scatter(dx_out, dx, KP);
    return rc;
#endif  // HALSTM_CUBLAS
}
#endif  // HALSTM_BACKWARD

}  // extern "C"
