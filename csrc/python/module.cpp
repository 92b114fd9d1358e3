// The Python extension module fusedmha._C. The ops themselves are reached
// through torch.ops.fusedmha (registered by libfusedmha, which this module
// links); this module only carries what torch.ops cannot.

#include <fusedmha/build_info.h>

#include <torch/extension.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fusedmha native module (build information, the CPU's FMA peak and memory read)";
  m.def(
      "build_info",
      []() {
        const fusedmha::BuildInfo info = fusedmha::build_info();
        pybind11::dict d;
        d["version"] = info.version;
        d["torch_version"] = info.torch_version;
        d["cpu_isas"] = info.cpu_isas;
        d["cpu_isa_in_use"] = info.cpu_isa_in_use;
        d["cuda"] = info.cuda;
        return d;
      },
      "Version, the torch version built against, the CPU ISA levels compiled, the level in "
      "use now, and whether CUDA kernels are compiled in.");
  m.def("cpu_fma_peak_gflops", &fusedmha::cpu_fma_peak_gflops, pybind11::arg("seconds") = 0.25,
        pybind11::call_guard<pybind11::gil_scoped_release>(),
        "The fp32 FMA peak of this machine in GFLOP/s: register-only FMA chains at the ISA "
        "level in use, on every intra-op thread at once, the fastest of five rounds that take "
        "about `seconds` together.");
  m.def(
      "cpu_memory_read",
      [](const at::Tensor& buffer) {
        TORCH_CHECK(buffer.is_cpu() && buffer.is_contiguous(),
                    "fusedmha._C.cpu_memory_read: expected a contiguous CPU tensor, got ",
                    buffer.device(), buffer.is_contiguous() ? "" : " (not contiguous)");
        return fusedmha::cpu_memory_read(buffer.const_data_ptr(),
                                         static_cast<int64_t>(buffer.nbytes()));
      },
      pybind11::arg("buffer"), pybind11::call_guard<pybind11::gil_scoped_release>(),
      "One pass of vector loads over a contiguous CPU tensor's bytes on every intra-op "
      "thread (returns the sum of the floats read): the benchmarks' memory-read yardstick.");
}
