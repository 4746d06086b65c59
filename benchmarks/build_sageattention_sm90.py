"""Build SageAttention 2 (thu-ml/SageAttention, Apache-2.0; measured: 2.2.0 at d1a57a5) for ONE purpose:
timing its Hopper kernel beside ours in ``bench_attention_int8.py`` (``LIBS=sage2``). Not used by the pack.

SageAttention 2 is not on PyPI (``pip install sageattention`` gives 1.0.6, the Triton-only version), so it is
built from source on the GPU machine. Its own ``setup.py`` compiles every architecture's modules and 64
instantiations of the sm90 kernel (head dim 64/128 x causal x Q granularity x LSE x fp16/bf16), which does not
fit one 10-minute device call. This script builds only what ``sageattn_qk_int8_pv_fp8_cuda_sm90`` needs on an
H200 -- ``sageattention._qattn_sm90`` and ``sageattention._fused``, for ``sm_90a`` -- with the dispatch
macros of ``csrc/dispatch_utils.h`` reduced to the instance H3 runs (head dim 128, bf16 output, non-causal, no
LSE; both Q granularities kept). The kernel code is untouched, so the instance timed is the one a full build
runs; the reduced module raises ``invalid_argument`` for any other instance.

Usage (on the GPU machine; needs nvcc >= 12.3, torch with its C++ headers, ninja):
    python3 benchmarks/build_sageattention_sm90.py SRC DEST
SRC: a SageAttention checkout (``sageattention/`` and ``csrc/``); DEST: a new folder, built in place; then
``PYTHONPATH=DEST python3 -c "import sageattention"``. Compiler flags: those of SageAttention's setup.py.
"""
import os
import shutil
import sys
import time


def _one_case(params: str, test: str, decl: str, error: str) -> str:
    """A dispatch macro body with a single case: ``if (test) { decl; __VA_ARGS__ } else { error; }``."""
    lines = [f"({params}, ...)", f"  if ({test}) {{", f"    {decl};", "    __VA_ARGS__", "  } else {",
             f"    {error};", "  }"]
    return " \\\n".join(lines)


# macro name -> its reduced definition (after "#define NAME")
MACROS = {
    "DISPATCH_HEAD_DIM": _one_case("head_dim, HEAD_DIM", "head_dim == 128", "constexpr int HEAD_DIM = 128",
                                   'throw std::invalid_argument("reduced build: head dim 128 only")'),
    "DISPATCH_CAUSAL": _one_case("is_causal, IS_CAUSAL", "is_causal == 0", "constexpr bool IS_CAUSAL = false",
                                 'throw std::invalid_argument("reduced build: non-causal only")'),
    "DISPATCH_RETURN_LSE": _one_case("return_lse, RETURN_LSE", "return_lse == 0", "constexpr bool RETURN_LSE = false",
                                     'throw std::invalid_argument("reduced build: no LSE")'),
    "DISPATCH_PYTORCH_DTYPE_TO_CTYPE_FP16": _one_case(
        "pytorch_dtype, c_type", "pytorch_dtype == at::ScalarType::BFloat16", "using c_type = nv_bfloat16",
        'TORCH_CHECK(false, "reduced build: bf16 only")'),
}


def reduce_dispatch(path: str) -> None:
    """Replace each macro in MACROS (a ``#define`` block ending at the next blank line) in ``path``.
    Raises ValueError naming the macro when the file does not hold it (another SageAttention version)."""
    s = open(path).read()
    for name, body in MACROS.items():
        i = s.find(f"#define {name}(")
        if i < 0:
            raise ValueError(f"{path}: no '#define {name}(' (expected SageAttention 2.2's dispatch_utils.h)")
        j = s.index("\n\n", i)
        s = s[:i] + f"#define {name}" + body + s[j:]
    open(path, "w").write(s)


def main(src: str, dest: str) -> None:
    if os.path.exists(dest):
        raise SystemExit(f"{dest} exists; give a new folder")
    for sub in ("sageattention", "csrc"):
        if not os.path.isdir(os.path.join(src, sub)):
            raise SystemExit(f"{src}: no {sub}/ (expected a SageAttention checkout)")
        shutil.copytree(os.path.join(src, sub), os.path.join(dest, sub))
    reduce_dispatch(os.path.join(dest, "csrc", "dispatch_utils.h"))
    import torch
    from setuptools import setup
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    cxx = ["-O3", "-std=c++17", "-DENABLE_BF16", abi]
    nvcc = ["-O3", "-std=c++17", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
            "--use_fast_math", "-Xptxas=-v", "-diag-suppress=174", abi,
            "-gencode", "arch=compute_90a,code=sm_90a"]
    exts = [CUDAExtension("sageattention._qattn_sm90",
                          ["csrc/qattn/pybind_sm90.cpp", "csrc/qattn/qk_int_sv_f8_cuda_sm90.cu"],
                          extra_compile_args={"cxx": cxx, "nvcc": nvcc}, extra_link_args=["-lcuda"]),
            CUDAExtension("sageattention._fused", ["csrc/fused/pybind.cpp", "csrc/fused/fused.cu"],
                          extra_compile_args={"cxx": cxx, "nvcc": nvcc})]
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
    t0 = time.perf_counter()
    cwd = os.getcwd()
    os.chdir(dest)
    try:
        setup(name="sageattention", version="2.2.0+sm90.h3", packages=["sageattention", "sageattention.triton"],
              ext_modules=exts, cmdclass={"build_ext": BuildExtension},
              script_args=["build_ext", "--inplace"])
    finally:
        os.chdir(cwd)
    print(f"built {dest} in {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
