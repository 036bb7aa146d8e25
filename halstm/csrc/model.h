// The char LM's head and optimizer entry points, and the modules' array
// operations on a GPU (HALSTM_MODEL).
// Part of the driver: included once, by driver.cpp.

extern "C" {

#ifdef HALSTM_MODEL
// The char LM's head and optimizer (halstm/model/kernels.py); numpy shapes.
typedef halide_buffer_t *HB;
int halstm_model_head(HB, HB, HB, HB, float, HB, HB, HB, HB);
int halstm_model_sumsq(HB, HB);
int halstm_model_adam(HB, HB, HB, HB, HB, float, float, float, float, float, HB, HB, HB);
int halstm_model_sgd(HB, HB, HB, HB, float, float, float, HB, HB);
int halstm_model_onehot(HB, HB);
int halstm_model_rows(HB, HB, HB);
int halstm_model_add(HB, HB, HB);
int halstm_model_mul(HB, HB, HB);
int halstm_model_dropout(uint32_t, uint32_t, uint32_t, float, HB);

// src (R, n); idx (M) int32 -> out (M, n): row idx[m] of src, zeros where idx[m] < 0
int halstm_rows(int R, int M, int n, const float *src, const void *idx, float *out) {
    g_error[0] = 0;
    View vsrc(src, {{n, 1}, {R, n}}), vidx = View::ints(idx, M), vout(out, {{n, 1}, {M, n}});
    return halstm_model_rows(vsrc.hb(), vidx.hb(), vout.hb());
}

// a, b (n) -> out (n) = a + b, or (halstm_mul) a * b
int halstm_add(int n, const float *a, const float *b, float *out) {
    g_error[0] = 0;
    View va(a, {{n, 1}}), vb(b, {{n, 1}}), vout(out, {{n, 1}});
    return halstm_model_add(va.hb(), vb.hb(), vout.hb());
}
int halstm_mul(int n, const float *a, const float *b, float *out) {
    g_error[0] = 0;
    View va(a, {{n, 1}}), vb(b, {{n, 1}}), vout(out, {{n, 1}});
    return halstm_model_mul(va.hb(), vb.hb(), vout.hb());
}

// out (n): a dropout mask, scale where the hash of (key0, key1, i) keeps
// element i (its top 24 bits >= threshold), else 0 (halstm/model/kernels.py)
int halstm_dropout(int n, uint32_t key0, uint32_t key1, uint32_t threshold, float scale,
                   float *out) {
    g_error[0] = 0;
    View vout(out, {{n, 1}});
    return halstm_model_dropout(key0, key1, threshold, scale, vout.hb());
}

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
