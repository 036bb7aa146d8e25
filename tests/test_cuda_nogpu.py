"""halstm.cuda where no CUDA GPU is usable (CI): clear errors, targets kept
as written, the memory pool's size classes. tests/gpu covers the GPU."""
import pytest
from click.testing import CliRunner

import halstm
from halstm import cuda
from halstm.cli import main

needs_no_gpu = pytest.mark.skipif(cuda.available(), reason="a CUDA GPU is usable here")


@needs_no_gpu
def test_gpu_module_without_gpu_is_a_clear_error():
    with pytest.raises(cuda.CudaError, match="target 'host-cuda' needs a usable CUDA GPU"):
        halstm.LSTM(4, 8, target="host-cuda")
    assert issubclass(cuda.CudaError, halstm.KernelError)


@needs_no_gpu
def test_bench_on_a_gpu_target_without_gpu_exits_with_one_line():
    r = CliRunner().invoke(main, ["bench", "--target", "host-cuda", "--shapes", "small_128_b16",
                                  "--peers", ""])
    assert r.exit_code == 1
    assert "needs a usable CUDA GPU" in r.output and "Traceback" not in r.output


@needs_no_gpu
def test_host_cuda_is_kept_as_written_without_gpu():
    assert cuda.host_target("host-cuda") == "host-cuda"


def test_explicit_or_cpu_targets_are_never_changed():
    for t in ("host", "host-cuda-cuda_capability_80", "x86-64-linux-cuda", "arm-64-linux"):
        assert cuda.host_target(t) == t


def test_pool_size_classes():
    size = cuda._Pool.size
    assert size(1) == size(512) == 512 and size(513) == 1024
    assert size(1 << 20) == 1 << 20 and size((1 << 20) + 1) == 2 << 20
    assert size(5 << 20) == 6 << 20
