// Pass 2 (reference.step): clip + sum + noise + moment update + parameter update in one
// pass over each tensor, for the six update rules; plus reference.accumulate and
// reference.macadam_update_scale.
//
// The grid of BLOCK-element blocks (aligned to the global noise index) is shared out among
// threads; inside a block the per-sample rows are read once each (samples in the inner
// loop over a block of coordinates), the clipped sum, noise and update live in two small
// stack buffers, and each state is read and written once. Nothing of size B x d or d is
// allocated. Arithmetic follows reference.py operation by operation, in float32, with each
// Python scalar rounded to float32 where the reference multiplies a tensor by it.
#include <cmath>

#include "kernels.h"
#include "philox.h"

namespace dpk {

namespace {

// The float32 constants of one step, derived from the doubles of Hyper and DP. The block
// kernels take it by value: a local copy whose fields the vectoriser sees as invariants.
struct Consts {
  int rule, variance;
  float noise_std, batch;                                   // sigma * C, B_e
  float lr, weight_decay, momentum, one_minus_dampening;    // SGD
  bool coupled_wd, has_momentum, nesterov, first_step;
  float beta1, beta2, one_minus_beta1, one_minus_beta2;     // Adam family
  float bias_correction1, bias_correction2, decay, eps, gamma, phi_hat;
  bool has_m_hat_prev;                                      // MacAdam
  float bias_correction1_prev, kappa, noise_var, h1, h2;
  bool want_sqrt_sum;
};

Consts make_consts(const Hyper& h, const DP& dp) {
  Consts c{};
  const double t = double(dp.step);
  c.rule = h.rule;
  c.variance = h.variance;
  c.noise_std = float(dp.noise_std);
  c.batch = float(dp.expected_batch_size);
  c.lr = float(h.lr);
  c.weight_decay = float(h.weight_decay);
  c.coupled_wd = h.weight_decay != 0 && (h.rule == SGD || h.rule == ADAM || h.rule == ADAM_BC);
  c.momentum = float(h.momentum);
  c.has_momentum = h.momentum != 0;
  c.one_minus_dampening = float(1 - h.dampening);
  c.nesterov = h.nesterov;
  c.first_step = dp.step == 1;
  c.beta1 = float(h.beta1);
  c.beta2 = float(h.beta2);
  c.one_minus_beta1 = float(1 - h.beta1);
  c.one_minus_beta2 = float(1 - h.beta2);
  c.bias_correction1 = float(1 - std::pow(h.beta1, t));
  c.bias_correction2 = float(1 - std::pow(h.beta2, t));
  c.decay = float(1 - h.lr * h.weight_decay);
  c.eps = float(h.eps);
  c.gamma = float(h.gamma);
  c.phi_hat = float(dp.noise_var_avg / (1 - std::pow(h.beta2, t)));
  const double bc1_prev = 1 - std::pow(h.beta1, t - 1);
  c.has_m_hat_prev = bc1_prev > 0;  // false at t = 1 (m_hat_0 = 0)
  c.bias_correction1_prev = float(bc1_prev);
  c.kappa = float(2 * (h.beta1 - std::pow(h.beta1, t)) / (1 + h.beta1));
  c.noise_var = float(std::pow(dp.noise_std / dp.expected_batch_size, 2.0));
  c.h1 = float(h.h1);
  c.h2 = float(h.h2);
  c.want_sqrt_sum = h.rule == MACADAM && dp.step >= 2;
  return c;
}

// ---------------------------------------------------------------------------------------
// The clipped per-sample sum of a block (reference._contribution): acc[j] = sum_i c_i x_ij
// over the rows with c_i != 0 (a zeroed row never reaches the sum, even if it holds NaN).
template <int GT>
DPK_INLINE void clipped_sum(const void* gs, int64_t numel, int64_t begin, int64_t len,
                            const float* clip, int64_t batch, float* __restrict acc) {
  const auto* rows = static_cast<const typename Storage<GT>::type*>(gs) + begin;
  for (int64_t i = 0; i < batch; ++i) {
    const float ci = clip[i];
    if (ci == 0.0f) continue;
    const auto* __restrict row = rows + i * numel;
    for (int64_t j = 0; j < len; ++j) acc[j] += ci * load<GT>(row, j);
  }
}

// DP-MacAdam: the same sum of the whitened rows w_i = (g_i - m_hat_prev) / b; a parameter
// without a grad_sample (gs == nullptr) has g_i = 0.
template <int GT>
DPK_INLINE void whitened_clipped_sum(const Consts c, const void* gs, int64_t numel, int64_t begin,
                                     int64_t len, const float* clip, int64_t batch,
                                     const float* __restrict m, const float* __restrict b,
                                     float* __restrict acc) {
  alignas(64) float m_hat[BLOCK];
  for (int64_t j = 0; j < len; ++j)
    m_hat[j] = c.has_m_hat_prev ? m[j] / c.bias_correction1_prev : 0.0f;
  const auto* rows = static_cast<const typename Storage<GT>::type*>(gs);
  for (int64_t i = 0; i < batch; ++i) {
    const float ci = clip[i];
    if (ci == 0.0f) continue;
    if (rows == nullptr) {
      for (int64_t j = 0; j < len; ++j) acc[j] += ci * ((0.0f - m_hat[j]) / b[j]);
    } else {
      const auto* __restrict row = rows + i * numel + begin;
      for (int64_t j = 0; j < len; ++j) acc[j] += ci * ((load<GT>(row, j) - m_hat[j]) / b[j]);
    }
  }
}

// acc = the block's clipped contribution (zero when there is none).
DPK_INLINE void contribution(const Consts& c, const Param& p, int64_t begin, int64_t len,
                             const float* clip, int64_t batch, float* __restrict acc) {
  for (int64_t j = 0; j < len; ++j) acc[j] = 0.0f;
  if (clip == nullptr || batch == 0) return;
  const Flat& gs = p.grad_sample;
  if (c.rule == MACADAM) {
    DPK_DISPATCH_DTYPE(gs.dtype, whitened_clipped_sum, c, gs.data, p.numel, begin, len, clip,
                       batch, p.state[0] + begin, p.state[3] + begin, acc)
  } else if (gs.data != nullptr) {
    DPK_DISPATCH_DTYPE(gs.dtype, clipped_sum, gs.data, p.numel, begin, len, clip, batch, acc)
  }
}

// ---------------------------------------------------------------------------------------
// The update rules on one block. S = clipped sum (+ summed), z = noise; the privatised
// gradient is g_hat = (S + noise_std z) / B_e (SPEC section 4).
template <int PT>
DPK_INLINE void update_sgd(const Consts c, const float* __restrict S, float* __restrict z,
                           const Param& prm, int64_t begin, int64_t len, double&) {
  auto* __restrict p = static_cast<typename Storage<PT>::type*>(prm.data) + begin;
  float* __restrict buf = c.has_momentum ? prm.state[0] + begin : nullptr;
  for (int64_t j = 0; j < len; ++j) {
    float g = (S[j] + c.noise_std * z[j]) / c.batch;
    const float pj = load<PT>(p, j);
    if (c.coupled_wd) g = g + c.weight_decay * pj;
    if (c.has_momentum) {
      const float b = c.first_step ? g : buf[j] * c.momentum + c.one_minus_dampening * g;
      buf[j] = b;
      g = c.nesterov ? g + c.momentum * b : b;
    }
    store<PT>(p, j, pj - c.lr * g);
  }
}

// DP-Adam (DECOUPLED = false), DP-AdamW (true); BC: the DP-AdamBC denominator.
template <bool DECOUPLED, bool BC>
struct AdamFamily {
  template <int PT>
  static DPK_INLINE void update(const Consts c, const float* __restrict S, float* __restrict z,
                                const Param& prm, int64_t begin, int64_t len, double&) {
    auto* __restrict p = static_cast<typename Storage<PT>::type*>(prm.data) + begin;
    float* __restrict m = prm.state[0] + begin;
    float* __restrict v = prm.state[1] + begin;
    for (int64_t j = 0; j < len; ++j) {
      float g = (S[j] + c.noise_std * z[j]) / c.batch;
      float pj = load<PT>(p, j);
      if (DECOUPLED) {
        pj = pj * c.decay;
      } else if (c.coupled_wd) {
        g = g + c.weight_decay * pj;
      }
      const float mj = m[j] * c.beta1 + c.one_minus_beta1 * g;
      const float vj = v[j] * c.beta2 + (c.one_minus_beta2 * g) * g;
      m[j] = mj;
      v[j] = vj;
      const float m_hat = mj / c.bias_correction1, v_hat = vj / c.bias_correction2;
      float denom;
      if (BC) {
        const float d = v_hat - c.phi_hat;
        denom = __builtin_sqrtf(d < c.gamma ? c.gamma : d);  // clamp(min=gamma); NaN stays NaN
      } else {
        denom = __builtin_sqrtf(v_hat) + c.eps;
      }
      store<PT>(p, j, pj - (c.lr * m_hat) / denom);
    }
  }
};
using Adam = AdamFamily<false, false>;
using AdamBC = AdamFamily<false, true>;
using AdamW = AdamFamily<true, false>;
using AdamWBC = AdamFamily<true, true>;

// S_hat = clamp(S / kappa - b^2 sigma^2 / B_e^2, h1, h2) (reference.macadam_variance).
DPK_INLINE float macadam_variance(const Consts& c, float s, float b) {
  const float x = s / c.kappa - (b * b) * c.noise_var;
  const float lo = x < c.h1 ? c.h1 : x;
  return lo > c.h2 ? c.h2 : lo;
}

// Sum of x[0..n) in double, in a fixed order (8 interleaved partial sums).
DPK_INLINE double ordered_sum(const float* __restrict x, int64_t n) {
  double part[8] = {};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int l = 0; l < 8; ++l) part[l] += double(x[j + l]);
  for (; j < n; ++j) part[0] += double(x[j]);
  double total = 0.0;
  for (int l = 0; l < 8; ++l) total += part[l];
  return total;
}

// DP-MacAdam (SPEC section 7): z's slot j is reused for sqrt(S_hat_j) once z_j is used.
template <int PT>
DPK_INLINE void update_macadam(const Consts c, const float* __restrict S, float* __restrict z,
                               const Param& prm, int64_t begin, int64_t len, double& sqrt_sum) {
  auto* __restrict p = static_cast<typename Storage<PT>::type*>(prm.data) + begin;
  float* __restrict m = prm.state[0] + begin;
  float* __restrict v = prm.state[1] + begin;
  float* __restrict var = prm.state[2] + begin;
  const float* __restrict b = prm.state[3] + begin;
  // m_hat_prev = m / (1 - beta1^(t-1)), or 0 at t = 1: divide always, select on a float
  // (a select on a bool, or a division under a condition, keeps GCC from vectorising).
  const float bc1_prev = c.has_m_hat_prev ? c.bias_correction1_prev : 1.0f;
  const float keep = c.has_m_hat_prev ? 1.0f : 0.0f;
  for (int64_t j = 0; j < len; ++j) {
    const float w_tilde = (S[j] + c.noise_std * z[j]) / c.batch;
    const float m_hat_prev = keep != 0.0f ? m[j] / bc1_prev : 0.0f;
    const float g = b[j] * w_tilde + m_hat_prev;
    const float mj = m[j] * c.beta1 + c.one_minus_beta1 * g;
    const float vj = v[j] * c.beta2 + (c.one_minus_beta2 * g) * g;
    m[j] = mj;
    v[j] = vj;
    const float m_hat = mj / c.bias_correction1, v_hat = vj / c.bias_correction2;
    store<PT>(p, j, load<PT>(p, j) - (c.lr * m_hat) / (__builtin_sqrtf(v_hat) + c.gamma));
    const float u = c.variance == UNBIASED ? (g - m_hat_prev) * (g - m_hat)
                    : c.variance == PAPER  ? (g - m_hat) * (g - m_hat)
                                           : (g - m_hat_prev) * (g - m_hat_prev);
    const float s = var[j] * c.beta1 + c.one_minus_beta1 * u;
    var[j] = s;
    z[j] = __builtin_sqrtf(macadam_variance(c, s, b[j]));
  }
  if (c.want_sqrt_sum) sqrt_sum = ordered_sum(z, len);
}

// ---------------------------------------------------------------------------------------
// One block of one parameter: clipped sum, + summed, noise, update. Returns the block's
// sum of sqrt(S_hat) (DP-MacAdam, t >= 2), else 0.
DPK_CLONES double step_block(const Consts& c, const DP& dp, const Param& p, int64_t begin,
                             int64_t len, const float* clip, int64_t batch) {
  alignas(64) float S[BLOCK];
  alignas(64) float z[BLOCK];
  contribution(c, p, begin, len, clip, batch, S);
  if (p.summed != nullptr) {
    const float* __restrict summed = p.summed + begin;
    for (int64_t j = 0; j < len; ++j) S[j] = summed[j] + S[j];
  }
  if (c.noise_std != 0.0f) {
    noise_range(dp.key, dp.noise_step, dp.stream, p.offset + uint64_t(begin), len, z);
  } else {  // 0 * z == 0 for every (finite) z: skip generating it
    for (int64_t j = 0; j < len; ++j) z[j] = 0.0f;
  }
  double sqrt_sum = 0.0;
  switch (c.rule) {
    case SGD: DPK_DISPATCH_DTYPE(p.dtype, update_sgd, c, S, z, p, begin, len, sqrt_sum) break;
    case ADAM: DPK_DISPATCH_DTYPE(p.dtype, Adam::update, c, S, z, p, begin, len, sqrt_sum) break;
    case ADAM_BC: DPK_DISPATCH_DTYPE(p.dtype, AdamBC::update, c, S, z, p, begin, len, sqrt_sum) break;
    case ADAMW: DPK_DISPATCH_DTYPE(p.dtype, AdamW::update, c, S, z, p, begin, len, sqrt_sum) break;
    case ADAMW_BC: DPK_DISPATCH_DTYPE(p.dtype, AdamWBC::update, c, S, z, p, begin, len, sqrt_sum) break;
    case MACADAM: DPK_DISPATCH_DTYPE(p.dtype, update_macadam, c, S, z, p, begin, len, sqrt_sum) break;
  }
  return sqrt_sum;
}

// buffers += the block's clipped contribution (reference.accumulate).
DPK_CLONES void accumulate_block(const Consts& c, const Param& p, int64_t begin, int64_t len,
                                 const float* clip, int64_t batch) {
  alignas(64) float S[BLOCK];
  contribution(c, p, begin, len, clip, batch, S);
  float* __restrict buf = static_cast<float*>(p.data) + begin;
  for (int64_t j = 0; j < len; ++j) buf[j] = buf[j] + S[j];
}

// b <- S_hat^(1/4) * sqrt(sum_j S_hat_j^(1/2)) (reference.macadam_update_scale).
DPK_CLONES void scale_block(const Consts c, const float* __restrict var, float* __restrict b,
                            int64_t len, float root) {
  for (int64_t j = 0; j < len; ++j)
    b[j] = __builtin_sqrtf(__builtin_sqrtf(macadam_variance(c, var[j], b[j]))) * root;
}

std::vector<Block> param_blocks(const std::vector<Param>& params) {
  std::vector<int64_t> numels;
  std::vector<uint64_t> offsets;
  for (const Param& p : params) {
    numels.push_back(p.numel);
    offsets.push_back(p.offset);
  }
  return make_blocks(numels, offsets);
}

}  // namespace

double step(const Hyper& h, const DP& dp, const std::vector<Param>& params, const float* clip,
            int64_t batch) {
  const Consts c = make_consts(h, dp);
  const std::vector<Block> blocks = param_blocks(params);
  const int64_t nb = int64_t(blocks.size());
  std::vector<double> partial(blocks.size(), 0.0);
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads()) if (nb > 1)
  for (int64_t n = 0; n < nb; ++n) {
    const Block& blk = blocks[size_t(n)];
    partial[size_t(n)] = step_block(c, dp, params[size_t(blk.tensor)], blk.begin, blk.len, clip, batch);
  }
  double total = 0.0;
  for (double x : partial) total += x;  // block order: independent of the thread count
  return total;
}

void accumulate(const Hyper& h, const DP& dp, const std::vector<Param>& params,
                const float* clip, int64_t batch) {
  const Consts c = make_consts(h, dp);
  std::vector<Param> used;  // a parameter without grad_sample adds nothing, except for MacAdam
  for (const Param& p : params)
    if (p.grad_sample.data != nullptr || h.rule == MACADAM) used.push_back(p);
  const std::vector<Block> blocks = param_blocks(used);
  const int64_t nb = int64_t(blocks.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads()) if (nb > 1)
  for (int64_t n = 0; n < nb; ++n) {
    const Block& blk = blocks[size_t(n)];
    accumulate_block(c, used[size_t(blk.tensor)], blk.begin, blk.len, clip, batch);
  }
}

void macadam_update_scale(const Hyper& h, const DP& dp, const std::vector<float*>& exp_vars,
                          const std::vector<float*>& scales, const std::vector<int64_t>& numels,
                          double sqrt_sum) {
  if (dp.step < 2) return;
  const Consts c = make_consts(h, dp);
  const float root = float(std::sqrt(sqrt_sum));
  const std::vector<Block> blocks = make_blocks(numels, {});
  const int64_t nb = int64_t(blocks.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads()) if (nb > 1)
  for (int64_t n = 0; n < nb; ++n) {
    const Block& blk = blocks[size_t(n)];
    scale_block(c, exp_vars[size_t(blk.tensor)] + blk.begin, scales[size_t(blk.tensor)] + blk.begin,
                blk.len, root);
  }
}

}  // namespace dpk
