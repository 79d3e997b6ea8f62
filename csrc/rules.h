// The update rules of the C++ backend: one update_<name> per rule of dpkern/rules.py, named
// like the reference's (reference.update_<name>) and the Triton ones (triton/rules.py), and
// the dispatch update() that step.cpp's block kernel calls once the clipped sum S and the
// noise z of a block are ready.
//
// Everything is known to Python by name: RULE_NAMES is exported as _C.rule_codes() and
// dpkern/backends/cpp.py looks each code up by the registry's name (a rule missing here is
// refused by the backend, never run as another); RULE_STATES (_C.rule_states()) gives each
// rule's states in the order of Param::state, and Python puts each buffer in its slot by
// name. Hyper-parameters arrive as a dict keyed by the dataclass field names
// (DPK_HYPER_FIELDS; bindings.cpp refuses any other key).
// Arithmetic follows reference.py operation by operation, in float32, with each Python
// scalar rounded to float32 where the reference multiplies a tensor by it.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "common.h"

namespace dpk {

// One line per rule (codes are private to the build; Python looks them up by name).
enum Rule : int {
  SGD = 0,
  ADAM = 1,
  ADAM_BC = 2,
  ADAMW = 3,
  ADAMW_BC = 4,
  MACADAM = 5,
  ADAFACTOR = 12,
};
// DP-MacAdam's variance term u (variance_estimate).
enum Variance : int { UNBIASED = 0, PAPER = 1, CODE = 2 };

struct Named {
  const char* name;
  int code;
};
// The registry's names (dpkern.rules.RuleSpec.name) of the rules implemented here.
inline constexpr Named RULE_NAMES[] = {
    {"sgd", SGD},
    {"adam", ADAM},
    {"adam_bc", ADAM_BC},
    {"adamw", ADAMW},
    {"adamw_bc", ADAMW_BC},
    {"macadam", MACADAM},
    {"adafactor", ADAFACTOR},
};
inline constexpr Named VARIANCE_NAMES[] = {{"unbiased", UNBIASED}, {"paper", PAPER}, {"code", CODE}};

// The slots of Param::state the update functions use, by state name, and each rule's
// states in slot order (the names are the registry's, checked at import by cpp.py).
enum Slot : int {
  MOMENTUM_BUFFER = 0,
  EXP_AVG = 0,
  EXP_AVG_SQ = 1,
  EXP_VAR = 2,
  SCALE = 3,
  ROW_VAR = 0,  // DP-Adafactor
  COL_VAR = 1,
  GHAT = 2,     // DP-Adafactor's fp32 scratch of g_hat (then U), provided by step.cpp
};
struct RuleStates {
  int rule;
  const char* names[MAX_STATES];
};
inline constexpr RuleStates RULE_STATES[] = {
    {SGD, {"momentum_buffer"}},
    {ADAM, {"exp_avg", "exp_avg_sq"}},
    {ADAM_BC, {"exp_avg", "exp_avg_sq"}},
    {ADAMW, {"exp_avg", "exp_avg_sq"}},
    {ADAMW_BC, {"exp_avg", "exp_avg_sq"}},
    {MACADAM, {"exp_avg", "exp_avg_sq", "exp_var", "scale"}},
    {ADAFACTOR, {"row_var", "col_var"}},
};

// The float and bool fields of the dpkern.hyper dataclasses (name, default), read from the
// Python dict by name. A new rule's hyper-parameters are added here.
// One field per line.
#define DPK_HYPER_FIELDS(X) \
  X(lr, 0.0)                \
  X(momentum, 0.0)          \
  X(dampening, 0.0)         \
  X(weight_decay, 0.0)      \
  X(nesterov, false)        \
  X(beta1, 0.9)             \
  X(beta2, 0.999)           \
  X(eps, 1e-8)              \
  X(gamma, 1e-8)            \
  X(h1, 1e-9)               \
  X(h2, 1e-6)               \
  X(beta2_decay, -0.8)      \
  X(eps1, 0x1p-23)          \
  X(eps2, 1e-3)             \
  X(d, 1.0)                 \
  X(noise_bias_correction, false)

// The hyper-parameters of one update rule (dpkern.hyper), as Python doubles.
struct Hyper {
  int rule = SGD;
  int variance = UNBIASED;  // variance_estimate, by name (VARIANCE_NAMES)
#define DPK_HYPER_MEMBER(name, init) decltype(init) name = init;
  DPK_HYPER_FIELDS(DPK_HYPER_MEMBER)
#undef DPK_HYPER_MEMBER
};

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
  // DP-Adafactor (SPEC 10.7): w_t = t^beta2_decay and 1 - w_t (lerp weights), phi_t,
  // eps1 and eps1^2 (float32, as the reference's tensor ops); rho_t, eps2, d (doubles, as
  // the reference's Python scalars); the correction on/off; w_t < 0.5 (lerp's branch).
  float af_w, af_one_minus_w, af_phi, af_eps1, af_eps1_sq;
  double af_rho, af_eps2, af_d;
  bool af_correct, af_lerp_low;
};

inline Consts make_consts(const Hyper& h, const DP& dp) {
  Consts c{};
  const double t = double(dp.step);
  c.rule = h.rule;
  c.variance = h.variance;
  c.noise_std = float(dp.noise_std);
  c.batch = float(dp.expected_batch_size);
  c.lr = float(h.lr);
  c.weight_decay = float(h.weight_decay);
  c.coupled_wd = h.weight_decay != 0;  // read by the rules whose decay is coupled
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
  const double af_w = std::pow(t, h.beta2_decay);
  c.af_w = float(af_w);
  c.af_one_minus_w = float(1 - af_w);
  c.af_lerp_low = af_w < 0.5;
  c.af_phi = float(dp.noise_var_avg);
  c.af_eps1 = float(h.eps1);
  c.af_eps1_sq = float(h.eps1 * h.eps1);
  c.af_rho = std::min(h.lr, 1 / std::pow(t, 0.5));
  c.af_eps2 = h.eps2;
  c.af_d = h.d;
  c.af_correct = h.noise_bias_correction;
  return c;
}

// ---------------------------------------------------------------------------------------
// The update rules on one block: update_<name><PT>(c, S, z, param, begin, len, sqrt_sum),
// PT the parameter's storage dtype. S = clipped sum (+ summed), z = noise; the privatised
// gradient is g_hat = (S + noise_std z) / B_e (SPEC section 4). State s of the rule is
// prm.state[SLOT] (RULE_STATES); sqrt_sum takes a block's partial sum of a
// global reduction (DP-MacAdam) and is left alone by the other rules.

// DP-SGD (SPEC 5.1): torch.optim.SGD on g_hat.
template <int PT>
DPK_INLINE void update_sgd(const Consts c, const float* __restrict S, float* __restrict z,
                           const Param& prm, int64_t begin, int64_t len, double&) {
  auto* __restrict p = static_cast<typename Storage<PT>::type*>(prm.data) + begin;
  float* __restrict buf = c.has_momentum ? prm.state[MOMENTUM_BUFFER] + begin : nullptr;
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

// The Adam family's shared loop: DECOUPLED = decay p first (AdamW), else coupled L2;
// BC = DP-AdamBC's denominator sqrt(max(v_hat - phi_hat, gamma)), else sqrt(v_hat) + eps.
template <int PT, bool DECOUPLED, bool BC>
DPK_INLINE void adam_family(const Consts c, const float* __restrict S, float* __restrict z,
                            const Param& prm, int64_t begin, int64_t len) {
  auto* __restrict p = static_cast<typename Storage<PT>::type*>(prm.data) + begin;
  float* __restrict m = prm.state[EXP_AVG] + begin;
  float* __restrict v = prm.state[EXP_AVG_SQ] + begin;
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

// DP-Adam (SPEC 5.2).
template <int PT>
DPK_INLINE void update_adam(const Consts c, const float* __restrict S, float* __restrict z,
                            const Param& prm, int64_t begin, int64_t len, double&) {
  adam_family<PT, false, false>(c, S, z, prm, begin, len);
}

// DP-AdamBC (SPEC 5.3).
template <int PT>
DPK_INLINE void update_adam_bc(const Consts c, const float* __restrict S, float* __restrict z,
                               const Param& prm, int64_t begin, int64_t len, double&) {
  adam_family<PT, false, true>(c, S, z, prm, begin, len);
}

// DP-AdamW (SPEC 5.4).
template <int PT>
DPK_INLINE void update_adamw(const Consts c, const float* __restrict S, float* __restrict z,
                             const Param& prm, int64_t begin, int64_t len, double&) {
  adam_family<PT, true, false>(c, S, z, prm, begin, len);
}

// DP-AdamW-BC (SPEC 5.5).
template <int PT>
DPK_INLINE void update_adamw_bc(const Consts c, const float* __restrict S, float* __restrict z,
                                const Param& prm, int64_t begin, int64_t len, double&) {
  adam_family<PT, true, true>(c, S, z, prm, begin, len);
}

// S_hat = clamp(S / kappa - b^2 sigma^2 / B_e^2, h1, h2) (reference.macadam_variance).
DPK_INLINE float macadam_variance(const Consts& c, float s, float b) {
  const float x = s / c.kappa - (b * b) * c.noise_var;
  const float lo = x < c.h1 ? c.h1 : x;
  return lo > c.h2 ? c.h2 : lo;
}

// DP-MacAdam (SPEC section 7): S is the clipped whitened sum; z's slot j is reused for
// sqrt(S_hat_j) once z_j is used.
template <int PT>
DPK_INLINE void update_macadam(const Consts c, const float* __restrict S, float* __restrict z,
                               const Param& prm, int64_t begin, int64_t len, double& sqrt_sum) {
  auto* __restrict p = static_cast<typename Storage<PT>::type*>(prm.data) + begin;
  float* __restrict m = prm.state[EXP_AVG] + begin;
  float* __restrict v = prm.state[EXP_AVG_SQ] + begin;
  float* __restrict var = prm.state[EXP_VAR] + begin;
  const float* __restrict b = prm.state[SCALE] + begin;
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
// DP-Adafactor (SPEC 10.7). Its update needs reductions over rows, columns and the whole
// tensor between g_hat and the update, so it runs in two phases: update_adafactor (the
// block phase, after the shared prologue) stores g_hat into the scratch slot GHAT; then
// adafactor_tensor (the tensor phase, update_tensor below, once per tensor) reduces ||p||^2
// and the row / column sums of g_hat^2, updates row_var / col_var, forms U in the scratch
// with ||U||^2, and applies the decay and the step. Sums are float64 accumulations of
// float32 terms (reference.update_adafactor).
template <int PT>
DPK_INLINE void update_adafactor(const Consts c, const float* __restrict S, float* __restrict z,
                                 const Param& prm, int64_t begin, int64_t len, double&) {
  float* __restrict g = prm.state[GHAT] + begin;
  for (int64_t j = 0; j < len; ++j) g[j] = (S[j] + c.noise_std * z[j]) / c.batch;
}

// torch.lerp(a, b, w): a + w (b - a) for w < 0.5, else b - (b - a)(1 - w).
DPK_INLINE float adafactor_lerp(const Consts& c, float a, float b) {
  return c.af_lerp_low ? a + c.af_w * (b - a) : b - (b - a) * c.af_one_minus_w;
}

// max(x - phi, gamma) with the correction, else x.
DPK_INLINE float adafactor_floor(const Consts& c, float x) {
  if (!c.af_correct) return x;
  const float y = x - c.af_phi;
  return y < c.gamma ? c.gamma : y;  // clamp(min=gamma); NaN stays NaN
}

template <int PT>
DPK_INLINE void adafactor_tensor(const Consts c, const Param& prm) {
  const int64_t n = prm.numel;
  if (n == 0) return;
  auto* __restrict p = static_cast<typename Storage<PT>::type*>(prm.data);
  float* __restrict g = prm.state[GHAT];
  float* __restrict row = prm.state[ROW_VAR];
  double pp = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    const float x = load<PT>(p, j);
    pp += double(x * x);
  }
  const double alpha = std::max(c.af_eps2, std::sqrt(pp) / std::sqrt(double(n))) * c.af_rho;
  if (prm.ndim >= 2) {  // factored over the trailing (R, C) matrix, L matrices
    float* __restrict col = prm.state[COL_VAR];
    const int64_t C = prm.inner, R = prm.matrix / prm.inner, L = n / prm.matrix;
    std::vector<double> rs(size_t(L * R), 0.0), cs(size_t(L * C), 0.0);
    for (int64_t l = 0; l < L; ++l)
      for (int64_t r = 0; r < R; ++r) {
        const float* __restrict gr = g + (l * R + r) * C;
        double acc = 0.0;
        for (int64_t k = 0; k < C; ++k) {
          const double sq = double(gr[k] * gr[k]);
          acc += sq;
          cs[size_t(l * C + k)] += sq;
        }
        rs[size_t(l * R + r)] = acc;
      }
    for (int64_t i = 0; i < L * R; ++i)
      row[i] = adafactor_lerp(c, row[i], float(rs[size_t(i)] / double(C)));
    for (int64_t i = 0; i < L * C; ++i)
      col[i] = adafactor_lerp(c, col[i], float(cs[size_t(i)] / double(R)));
    double uu = 0.0;
    for (int64_t l = 0; l < L; ++l) {
      double msum = 0.0;
      for (int64_t r = 0; r < R; ++r) msum += double(adafactor_floor(c, row[l * R + r]));
      const float m = float(msum / double(R));
      const float mean = m < c.af_eps1 ? c.af_eps1 : m;
      for (int64_t r = 0; r < R; ++r) {
        const float rt = adafactor_floor(c, row[l * R + r]);
        float* __restrict gr = g + (l * R + r) * C;
        for (int64_t k = 0; k < C; ++k) {
          const float v = (rt * adafactor_floor(c, col[l * C + k])) / mean;
          const float u = gr[k] / __builtin_sqrtf(v < c.af_eps1_sq ? c.af_eps1_sq : v);
          gr[k] = u;
          uu += double(u * u);
        }
      }
    }
    const double denom = std::max(1.0, std::sqrt(uu) / (std::sqrt(double(n)) * c.af_d));
    const float step = float(alpha / denom);
    for (int64_t j = 0; j < n; ++j) store<PT>(p, j, load<PT>(p, j) * c.decay - step * g[j]);
  } else {  // unfactored: row_var holds the variance (p.shape)
    double uu = 0.0;
    for (int64_t j = 0; j < n; ++j) {
      row[j] = adafactor_lerp(c, row[j], g[j] * g[j]);
      const float v = adafactor_floor(c, row[j]);
      const float u = g[j] / __builtin_sqrtf(v < c.af_eps1_sq ? c.af_eps1_sq : v);
      g[j] = u;
      uu += double(u * u);
    }
    const double denom = std::max(1.0, std::sqrt(uu) / (std::sqrt(double(n)) * c.af_d));
    const float step = float(alpha / denom);
    for (int64_t j = 0; j < n; ++j) store<PT>(p, j, load<PT>(p, j) * c.decay - step * g[j]);
  }
}

// Whether the rule has a tensor phase (update_tensor) after its block phase; step.cpp then
// gives each parameter an fp32 scratch of its size in the slot GHAT.
DPK_INLINE bool has_tensor_pass(int rule) { return rule == ADAFACTOR; }

DPK_INLINE void update_tensor(const Consts& c, const Param& p) {
  switch (c.rule) {
    case ADAFACTOR: DPK_DISPATCH_DTYPE(p.dtype, adafactor_tensor, c, p) break;
    default: break;
  }
}

// ---------------------------------------------------------------------------------------
// The dispatch: every rule by name of its case; to_hyper (bindings.cpp) has refused any
// other code before a kernel runs. Returns the block's partial sum (0 for most rules).
DPK_INLINE double update(const Consts& c, const float* __restrict S, float* __restrict z,
                         const Param& p, int64_t begin, int64_t len) {
  double sqrt_sum = 0.0;
  switch (c.rule) {
    case SGD: DPK_DISPATCH_DTYPE(p.dtype, update_sgd, c, S, z, p, begin, len, sqrt_sum) break;
    case ADAM: DPK_DISPATCH_DTYPE(p.dtype, update_adam, c, S, z, p, begin, len, sqrt_sum) break;
    case ADAM_BC:
      DPK_DISPATCH_DTYPE(p.dtype, update_adam_bc, c, S, z, p, begin, len, sqrt_sum) break;
    case ADAMW: DPK_DISPATCH_DTYPE(p.dtype, update_adamw, c, S, z, p, begin, len, sqrt_sum) break;
    case ADAMW_BC:
      DPK_DISPATCH_DTYPE(p.dtype, update_adamw_bc, c, S, z, p, begin, len, sqrt_sum) break;
    case MACADAM:
      DPK_DISPATCH_DTYPE(p.dtype, update_macadam, c, S, z, p, begin, len, sqrt_sum) break;
    case ADAFACTOR:
      DPK_DISPATCH_DTYPE(p.dtype, update_adafactor, c, S, z, p, begin, len, sqrt_sum) break;
    default: break;  // unreachable: unknown codes are refused at the binding
  }
  return sqrt_sum;
}

// Whether the rule's clipped sum is taken in the whitened space (DP-MacAdam: its
// accumulate reads exp_avg and scale, and a parameter without grad_sample contributes).
DPK_INLINE bool whitens(int rule) { return rule == MACADAM; }

}  // namespace dpk
