// The compiled library's driver: owns the time loop, so that one call from
// Python runs a whole layer over a sequence. Compiled by aot.py together with
// the Halide pipelines of halstm/pipeline (halstm_pack, halstm_proj, halstm_step, halstm_step_infer;
// halstm_step_bwd, halstm_grads) and one Halide runtime.
//
// Built with -DHALSTM_MODEL (the char LM's head and optimizer pipelines of
// halstm/model/kernels.py: halstm_model_head, _sumsq, _adam, _sgd, _onehot; entry
// points at the end; sizes are runtime arguments), or with -DHALSTM_FORWARD
// or -DHALSTM_BACKWARD and the sizes:
//   NS states (h first), G gates, S saved channels, K input size,
//   H hidden size, P weight panel width, DXP_IS_DHG (backward: the cell's
//   dxp and dhg coincide), HALSTM_ONEHOT (x is one-hot input given as int32
//   class indices, numpy (T, B): a gather replaces the projection, and dW_ih
//   is a scatter-add; no dx). HP and KP are H and K rounded up to P.
// Arrays are C-contiguous float32 with numpy shapes given below; a Halide view
// lists the same axes innermost first. With -DHALSTM_CUDA every array pointer
// is a CUDA device pointer (in the call's context: halstm_cuda_set_context)
// and the views carry it as their device allocation: nothing is copied to or
// from the host.
#include <HalideRuntime.h>
#ifdef HALSTM_CUDA
#include <HalideRuntimeCuda.h>
#endif

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <cstdio>
#include <initializer_list>
#include <mutex>
#include <string>
#include <thread>
#include <vector>
#include <sched.h>
#include <unistd.h>
#if HALSTM_AMX_TILES
#include <sys/syscall.h>
#endif
#ifdef HALSTM_CUDA
#include <dlfcn.h>
#endif

#if HALSTM_CUBLAS && (!defined(HALSTM_CUDA) || HALSTM_XP_PANELS || HALSTM_ONEHOT)
#error "HALSTM_CUBLAS: CUDA builds with xp (T, B, G, HP) and float input only"
#endif

#define HP ((H + P - 1) / P * P)
#define KP ((K + P - 1) / P * P)
// the step pipelines' extra arguments with HALSTM_SPLIT: int panel0, panels
#if HALSTM_SPLIT
#define RANGE_ARGS , int, int
#else
#define RANGE_ARGS
#endif

// One concern per file, in this order (each uses only those before it):
#include "errors.h"       // the calling thread's last error
#include "views.h"        // Halide buffer views of the caller's arrays
#include "amx.h"          // permission to use AMX tiles (HALSTM_AMX_TILES)
#include "cuda_graphs.h"  // CUDA context, stream and graph-captured time loops
#include "cublas.h"       // vendor GEMMs (HALSTM_CUBLAS)
#include "memory.h"       // Halide's large host allocations kept for reuse
#include "threads.h"      // a time loop's steps split over the driver's threads
#include "rows.h"         // where each step's rows lie in the arrays over all steps
// halstm_set_reuse_pack: the calling thread's calls skip packing the
// weights (halstm_pack, halstm_pack_bwd) while it is on; the caller knows that
// the workspaces wp_* / wq_* still hold these weights' panels (runtime.py's
// pack keys).
thread_local int t_reuse_pack = 0;
extern "C" void halstm_set_reuse_pack(int on) { t_reuse_pack = on != 0; }

// The calling thread's settings for its next calls, all four at once (a
// call from Python costs about a microsecond; runtime.py makes this one
// before each halstm_forward and halstm_backward): the CUDA context and
// stream (halstm_cuda_set_context, halstm_cuda_set_stream; unused by CPU
// builds), the most threads of the steps (halstm_set_call_threads; 0:
// unset) and whether to skip packing the weights (halstm_set_reuse_pack).
extern "C" void halstm_set_call(void *context, void *stream, int threads, int reuse_pack) {
#ifdef HALSTM_CUDA
    halstm_cuda_set_context(context);
    halstm_cuda_set_stream(stream);
#else
    (void)context, (void)stream;
#endif
    halstm_set_call_threads(threads);
    halstm_set_reuse_pack(reuse_pack);
}

#include "forward.h"      // halstm_forward
#include "backward.h"     // halstm_backward
#include "model.h"        // the char LM's head and optimizer
