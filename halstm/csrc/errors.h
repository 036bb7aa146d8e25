// The last error of the calling thread: Halide's runtime reports errors
// through halide_error, and Python reads them with halstm_last_error.
// Part of the driver: included once, by driver.cpp.

namespace {

thread_local char g_error[8192];

}  // namespace

extern "C" {

// Halide's runtime reports errors through this weak symbol; keep the message
// so that Python can raise it.
void halide_error(void *, const char *msg) {
    size_t used = strnlen(g_error, sizeof(g_error) - 1);
    std::strncat(g_error, msg, sizeof(g_error) - 1 - used);
}

const char *halstm_last_error(void) { return g_error; }

}  // extern "C"
