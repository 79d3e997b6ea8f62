// Pass 1: per-sample norms over all parameters (reference.per_sample_norms, SPEC section 2)
// and DP-MacAdam's whitened norms (reference.whitened_norms, SPEC section 7).
//
// Work items are (tensor, row, chunk of CHUNK elements); each item's sum of squares is a
// double written to its own slot, and the slots are added per row in item order, so the
// result does not depend on the thread count.
#include <cmath>

#include "kernels.h"

namespace dpk {

namespace {

constexpr int64_t CHUNK = 8 * BLOCK;
constexpr int LANES = 16;        // independent float partial sums (one AVX-512 register)
constexpr int64_t SUB = 1024;    // elements per float partial sum before it goes to double

// Sum of squares of f(j), j in [0, n): float lanes over SUB elements, then double.
template <class F>
DPK_INLINE double sum_squares(int64_t n, F&& f) {
  double total = 0.0;
  for (int64_t a = 0; a < n; a += SUB) {
    const int64_t m = n - a < SUB ? n - a : SUB;
    float lanes[LANES] = {};
    int64_t j = 0;
    for (; j + LANES <= m; j += LANES)
      for (int l = 0; l < LANES; ++l) {
        const float v = f(a + j + l);
        lanes[l] += v * v;
      }
    for (; j < m; ++j) {
      const float v = f(a + j);
      lanes[0] += v * v;
    }
    for (int l = 0; l < LANES; ++l) total += double(lanes[l]);
  }
  return total;
}

template <int GT>
DPK_INLINE void row_sumsq(const void* x, int64_t n, double& out) {
  const auto* g = static_cast<const typename Storage<GT>::type*>(x);
  out = sum_squares(n, [g](int64_t j) __attribute__((always_inline)) { return load<GT>(g, j); });
}

// w = (g - m_hat) / b with m_hat = m / bc1 (0 when has_m_hat is false), g = 0 when x == nullptr.
template <int GT>
DPK_INLINE void whitened_row_sumsq(const void* x, const float* m, const float* b, float bc1,
                                   bool has_m_hat, int64_t n, double& out) {
  const auto* g = static_cast<const typename Storage<GT>::type*>(x);
  if (g == nullptr) {
    out = sum_squares(n, [=](int64_t j) __attribute__((always_inline)) {
      const float m_hat = has_m_hat ? m[j] / bc1 : 0.0f;
      return (0.0f - m_hat) / b[j];
    });
  } else {
    out = sum_squares(n, [=](int64_t j) __attribute__((always_inline)) {
      const float m_hat = has_m_hat ? m[j] / bc1 : 0.0f;
      return (load<GT>(g, j) - m_hat) / b[j];
    });
  }
}

DPK_CLONES double sumsq_block(const void* x, int dtype, int64_t n) {
  double out = 0.0;
  DPK_DISPATCH_DTYPE(dtype, row_sumsq, x, n, out)
  return out;
}

DPK_CLONES double whitened_sumsq_block(const void* x, int dtype, const float* m, const float* b,
                                       float bc1, bool has_m_hat, int64_t n) {
  double out = 0.0;
  DPK_DISPATCH_DTYPE(dtype, whitened_row_sumsq, x, m, b, bc1, has_m_hat, n, out)
  return out;
}

struct Item {
  int32_t tensor;
  int64_t row;  // -1: the same value for every row (whitened norm of an unused parameter)
  int64_t begin, len;
};

std::vector<Item> make_items(const std::vector<Flat>& tensors, int64_t batch, bool all_rows_if_none) {
  std::vector<Item> items;
  for (size_t k = 0; k < tensors.size(); ++k) {
    const Flat& t = tensors[k];
    if (t.data == nullptr && !all_rows_if_none) continue;
    const int64_t rows = t.data == nullptr ? 1 : batch;
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t a = 0; a < t.numel; a += CHUNK)
        items.push_back({int32_t(k), t.data == nullptr ? -1 : i, a,
                         t.numel - a < CHUNK ? t.numel - a : CHUNK});
  }
  return items;
}

// out[i] = sqrt(sum of the items of row i, in item order).
void reduce_rows(const std::vector<Item>& items, const std::vector<double>& partial,
                 int64_t batch, float* out) {
  std::vector<double> sq(size_t(batch), 0.0);
  for (size_t n = 0; n < items.size(); ++n) {
    if (items[n].row >= 0) {
      sq[size_t(items[n].row)] += partial[n];
    } else {
      for (auto& s : sq) s += partial[n];
    }
  }
  for (int64_t i = 0; i < batch; ++i) out[i] = float(std::sqrt(sq[size_t(i)]));
}

}  // namespace

void per_sample_norms(const std::vector<Flat>& grad_samples, int64_t batch, float* out) {
  const std::vector<Item> items = make_items(grad_samples, batch, false);
  std::vector<double> partial(items.size(), 0.0);
  const int64_t n = int64_t(items.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads()) if (n > 1)
  for (int64_t it = 0; it < n; ++it) {
    const Item& item = items[size_t(it)];
    const Flat& t = grad_samples[size_t(item.tensor)];
    const char* row = static_cast<const char*>(t.data) + (item.row * t.numel + item.begin) * dtype_size(t.dtype);
    partial[size_t(it)] = sumsq_block(row, t.dtype, item.len);
  }
  reduce_rows(items, partial, batch, out);
}

void whitened_norms(const std::vector<Flat>& grad_samples, const std::vector<const float*>& exp_avgs,
                    const std::vector<const float*>& scales, double bias_correction1,
                    int64_t batch, float* out) {
  const std::vector<Item> items = batch > 0 ? make_items(grad_samples, batch, true)
                                            : std::vector<Item>();
  std::vector<double> partial(items.size(), 0.0);
  const float bc1 = float(bias_correction1);
  const bool has_m_hat = bias_correction1 > 0;
  const int64_t n = int64_t(items.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads()) if (n > 1)
  for (int64_t it = 0; it < n; ++it) {
    const Item& item = items[size_t(it)];
    const Flat& t = grad_samples[size_t(item.tensor)];
    const char* row = nullptr;
    if (t.data != nullptr) {
      row = static_cast<const char*>(t.data) + (item.row * t.numel + item.begin) * dtype_size(t.dtype);
    }
    partial[size_t(it)] = whitened_sumsq_block(
        row, t.dtype, exp_avgs[size_t(item.tensor)] + item.begin,
        scales[size_t(item.tensor)] + item.begin, bc1, has_m_hat, item.len);
  }
  reduce_rows(items, partial, batch, out);
}

}  // namespace dpk
