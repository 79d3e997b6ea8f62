// dpkern._C: pybind11 bindings of the C++ CPU backend. Buffers arrive as integer data
// pointers (0 = None) with dtype codes and sizes, already checked by
// dpkern/backends/cpp.py; the GIL is released while the kernels run.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "kernels.h"
#include "philox.h"

namespace py = pybind11;
using dpk::DP;
using dpk::Flat;
using dpk::Hyper;
using dpk::Param;

namespace {

template <class T>
T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

template <size_t N>
py::dict name_table(const dpk::Named (&table)[N]) {
  py::dict out;
  for (const auto& e : table) out[e.name] = e.code;
  return out;
}

template <size_t N>
bool has_code(const dpk::Named (&table)[N], int code) {
  for (const auto& e : table)
    if (e.code == code) return true;
  return false;
}

template <size_t N>
int code_of(const dpk::Named (&table)[N], const std::string& name, const char* what) {
  for (const auto& e : table)
    if (name == e.name) return e.code;
  throw py::value_error(std::string("dpkern._C: unknown ") + what + " '" + name + "'");
}

// The dict of dpkern/backends/cpp.py: "rule" (a code of RULE_NAMES, found by name there),
// the hyper-parameter dataclass's fields by name, "variance_estimate" by name. A rule
// code or a key this extension does not know is refused, never run as something else.
Hyper to_hyper(const py::dict& d) {
  Hyper h;
  h.rule = d["rule"].cast<int>();
  if (!has_code(dpk::RULE_NAMES, h.rule))
    throw py::value_error("dpkern._C: unknown update rule code " + std::to_string(h.rule));
  for (const auto& item : d) {
    const std::string key = item.first.cast<std::string>();
    if (key == "rule") continue;
    if (key == "variance_estimate") {
      h.variance = code_of(dpk::VARIANCE_NAMES, item.second.cast<std::string>(),
                           "variance_estimate");
      continue;
    }
#define DPK_READ_FIELD(name, init)                                 \
    if (key == #name) {                                            \
      h.name = item.second.cast<decltype(h.name)>();               \
      continue;                                                    \
    }
    DPK_HYPER_FIELDS(DPK_READ_FIELD)
#undef DPK_READ_FIELD
    throw py::value_error("dpkern._C: unknown hyper-parameter '" + key + "'");
  }
  return h;
}

// (key, step, stream, noise_std, expected_batch_size, noise_var_avg, noise_step,
// stochastic_rounding)
using DPTuple =
    std::tuple<uint64_t, uint64_t, uint32_t, double, double, double, uint64_t, bool>;

DP to_dp(const DPTuple& t) {
  DP dp;
  std::tie(dp.key, dp.step, dp.stream, dp.noise_std, dp.expected_batch_size, dp.noise_var_avg,
           dp.noise_step, dp.stochastic_rounding) = t;
  return dp;
}

// (data, dtype, numel)
using FlatTuple = std::tuple<uintptr_t, int, int64_t>;

std::vector<Flat> to_flats(const std::vector<FlatTuple>& ts) {
  std::vector<Flat> out;
  for (const auto& [data, dtype, numel] : ts) out.push_back({ptr<const void>(data), dtype, numel});
  return out;
}

// (data, dtype, numel, offset, grad_sample, grad_sample dtype, summed, [states], inner,
// matrix, ndim)
using ParamTuple = std::tuple<uintptr_t, int, int64_t, uint64_t, uintptr_t, int, uintptr_t,
                              std::vector<uintptr_t>, int64_t, int64_t, int64_t>;

std::vector<Param> to_params(const std::vector<ParamTuple>& ts) {
  std::vector<Param> out;
  for (const auto& [data, dtype, numel, offset, gs, gs_dtype, summed, states, inner, matrix,
                    ndim] : ts) {
    if (states.size() > size_t(dpk::MAX_STATES))
      throw py::value_error("dpkern._C: more states than MAX_STATES");
    Param p;
    p.data = ptr<void>(data);
    p.dtype = dtype;
    p.numel = numel;
    p.offset = offset;
    p.grad_sample = {ptr<const void>(gs), gs_dtype, numel};
    p.summed = ptr<const float>(summed);
    for (size_t s = 0; s < states.size(); ++s) p.state[s] = ptr<float>(states[s]);
    p.inner = inner;
    p.matrix = matrix;
    p.ndim = ndim;
    out.push_back(p);
  }
  return out;
}

template <class T>
std::vector<T*> to_ptrs(const std::vector<uintptr_t>& ps) {
  std::vector<T*> out;
  for (uintptr_t p : ps) out.push_back(ptr<T>(p));
  return out;
}

// Which clone the CPU runs (the dynamic loader applies the same test).
const char* cpu_level() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("x86-64-v4")) return "x86-64-v4";
  if (__builtin_cpu_supports("x86-64-v3")) return "x86-64-v3";
  return "x86-64";
#else
  return "unknown";
#endif
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "dpkern C++ CPU backend (raw buffers; use dpkern.backends.cpp, which checks them)";

  m.def("philox_words", [](uintptr_t index, int64_t n, uint64_t key, uint64_t step,
                           uint32_t stream, uintptr_t out) {
    py::gil_scoped_release nogil;
    dpk::philox_words(ptr<const int64_t>(index), n, key, step, stream, ptr<int64_t>(out));
  });
  m.def("gaussian_noise", [](uintptr_t out, int64_t n, uint64_t key, uint64_t step,
                             uint64_t offset, uint32_t stream) {
    py::gil_scoped_release nogil;
    dpk::gaussian_noise(ptr<float>(out), n, key, step, offset, stream);
  });
  m.def("normal_from_words", [](uintptr_t words, int64_t n, uintptr_t out) {
    py::gil_scoped_release nogil;
    dpk::normal_from_words(ptr<const uint32_t>(words), n, ptr<float>(out));
  }, "z (lane 0, lane 1) of n Philox words [n, 4] (uint32) into out [n, 2] (float32)");
  m.def("rounding_bits", [](uintptr_t out, int64_t n, uint64_t key, uint64_t step,
                            uint64_t offset) {
    py::gil_scoped_release nogil;
    dpk::rounding_bits(ptr<int64_t>(out), n, key, step, offset);
  }, "rho (SPEC 3.2) of global elements [offset, offset + n) into out (int64)");
  m.def("stochastic_round_bf16", [](uintptr_t x, int64_t n, uint64_t key, uint64_t step,
                                    uint64_t offset, uintptr_t out) {
    py::gil_scoped_release nogil;
    dpk::stochastic_round_bf16(ptr<const float>(x), n, key, step, offset, ptr<uint16_t>(out));
  }, "float32 x [n] rounded stochastically (SPEC 3.2) into out [n] (bf16 bits)");
  m.def("per_sample_norms", [](const std::vector<FlatTuple>& gs, int64_t batch, uintptr_t out) {
    const auto flats = to_flats(gs);
    py::gil_scoped_release nogil;
    dpk::per_sample_norms(flats, batch, ptr<float>(out));
  });
  m.def("whitened_norms", [](const std::vector<FlatTuple>& gs, const std::vector<uintptr_t>& exp_avgs,
                             const std::vector<uintptr_t>& scales, double bias_correction1,
                             int64_t batch, uintptr_t out) {
    const auto flats = to_flats(gs);
    const auto m = to_ptrs<const float>(exp_avgs), b = to_ptrs<const float>(scales);
    py::gil_scoped_release nogil;
    dpk::whitened_norms(flats, m, b, bias_correction1, batch, ptr<float>(out));
  });
  m.def("accumulate", [](const py::dict& hyper, const DPTuple& dp,
                         const std::vector<ParamTuple>& params, uintptr_t clip, int64_t batch) {
    const Hyper h = to_hyper(hyper);
    const auto ps = to_params(params);
    py::gil_scoped_release nogil;
    dpk::accumulate(h, to_dp(dp), ps, ptr<const float>(clip), batch);
  });
  m.def("step", [](const py::dict& hyper, const DPTuple& dp, const std::vector<ParamTuple>& params,
                   uintptr_t clip, int64_t batch) {
    const Hyper h = to_hyper(hyper);
    const auto ps = to_params(params);
    py::gil_scoped_release nogil;
    return dpk::step(h, to_dp(dp), ps, ptr<const float>(clip), batch);
  });
  m.def("macadam_update_scale", [](const py::dict& hyper, const DPTuple& dp,
                                   const std::vector<uintptr_t>& exp_vars,
                                   const std::vector<uintptr_t>& scales,
                                   const std::vector<int64_t>& numels, double sqrt_sum) {
    const Hyper h = to_hyper(hyper);
    const auto s = to_ptrs<float>(exp_vars), b = to_ptrs<float>(scales);
    py::gil_scoped_release nogil;
    dpk::macadam_update_scale(h, to_dp(dp), s, b, numels, sqrt_sum);
  });

  m.def("rule_codes", []() { return name_table(dpk::RULE_NAMES); },
        "{rule name (dpkern.rules): code} of the update rules this extension implements");
  m.def("rule_states", []() {
    py::dict out;
    for (const auto& r : dpk::RULE_STATES) {
      const char* rule = nullptr;
      for (const auto& e : dpk::RULE_NAMES)
        if (e.code == r.rule) rule = e.name;
      py::list names;
      for (const char* n : r.names)
        if (n != nullptr) names.append(n);
      out[rule] = names;
    }
    return out;
  }, "{rule name: its kernel states in the order of the state pointers}");
  m.def("max_states", []() { return dpk::MAX_STATES; }, "kernel states a rule may have");

  m.def("set_num_threads", &dpk::set_num_threads,
        "threads of every parallel region (<= 0: OpenMP's default)");
  m.def("get_num_threads", &dpk::num_threads);
  m.def("set_philox_path", &dpk::set_philox_path,
        "for tests: 2 = AVX-512, 1 = AVX2, 0 = portable Philox (capped by the CPU; < 0 = "
        "best); returns the path in use");
  m.def("build_info", []() {
    py::dict info;
#ifdef _OPENMP
    info["openmp"] = true;
#else
    info["openmp"] = false;
#endif
#ifdef DPK_MULTIVERSIONED
    info["multiversioned"] = true;
#else
    info["multiversioned"] = false;
#endif
    info["cpu_level"] = cpu_level();
    info["philox_path"] = dpk::philox_path();
    info["block"] = dpk::BLOCK;
    info["noise_group"] = dpk::NOISE_GROUP;
    return info;
  });
}
