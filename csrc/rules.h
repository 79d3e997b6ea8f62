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
  SGD_SCHEDULE_FREE = 13,
  ADAMW_SCHEDULE_FREE = 14,
  RMSPROP = 6,
  ADAGRAD = 7,
  ADADELTA = 10,
  ADEMAMIX = 11,
  RADAM = 8,
  LION = 9,
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
    {"sgd_schedule_free", SGD_SCHEDULE_FREE},
    {"adamw_schedule_free", ADAMW_SCHEDULE_FREE},
    {"rmsprop", RMSPROP},
    {"adagrad", ADAGRAD},
    {"adadelta", ADADELTA},
    {"ademamix", ADEMAMIX},
    {"radam", RADAM},
    {"lion", LION},
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
  SF_Z = 0,
  SF_EXP_AVG_SQ = 1,
  SQUARE_AVG = 0,           // DP-RMSprop, DP-Adadelta
  RMS_MOMENTUM_BUFFER = 1,  // DP-RMSprop
  GRAD_AVG = 2,             // DP-RMSprop
  SUM = 0,                  // DP-Adagrad
  ACC_DELTA = 1,
  ACC_DELTA_NOISE_VAR = 2,
  EXP_AVG_SLOW = 2,         // DP-AdEMAMix (exp_avg, exp_avg_sq as the Adam family's)
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
    {SGD_SCHEDULE_FREE, {"z"}},
    {ADAMW_SCHEDULE_FREE, {"z", "exp_avg_sq"}},
    {RMSPROP, {"square_avg", "momentum_buffer", "grad_avg"}},
    {ADAGRAD, {"sum"}},
    {ADADELTA, {"square_avg", "acc_delta", "acc_delta_noise_var"}},
    {ADEMAMIX, {"exp_avg", "exp_avg_sq", "exp_avg_slow"}},
    {RADAM, {"exp_avg", "exp_avg_sq"}},
    {LION, {"exp_avg"}},
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
  X(warmup_steps, 0.0)      \
  X(r, 0.0)                 \
  X(weight_lr_power, 2.0)   \
  X(noise_bias_correction, false) \
  X(weight_sum, 0.0)        \
  X(lr_max, -1.0)           \
  X(alpha, 0.99)            \
  X(centered, false)        \
  X(lr_decay, 0.0)          \
  X(initial_accumulator_value, 0.0) \
  X(rho, 0.9)               \
  X(beta3, 0.9999)          \
  X(t_alpha_beta3, 0.0)     \
  X(decoupled_weight_decay, false) \
  X(beta2_decay, -0.8)      \
  X(eps1, 0x1p-23)          \
  X(eps2, 1e-3)             \
  X(d, 1.0)                 \
  X(rms_phase, 0.0)         \
  X(rms_scale, 1.0)

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
  float sf_lr, sf_y_coef, sf_ckp1;                          // schedule-free
  bool sf_lerp_small, sf_correct;
  float alpha, one_minus_alpha, phi;                        // RMSprop, Adagrad
  bool centered, noise_bias_correction;
  float clr;                                                // Adagrad
  bool bc;                                                  // noise_bias_correction
  float rho, one_minus_rho;                                 // DP-Adadelta
  float beta3, one_minus_beta3, ade_a, ade_b, ade_e, ade_g;  // DP-AdEMAMix (SPEC 10.6)
  // DP-RAdam (SPEC 10.3): host-side functions of (beta2, t)
  bool radam_decoupled, radam_adaptive, radam_bc;
  float radam_sqrt_bc2, radam_rect;
  // DP-Adafactor (SPEC 10.7): w_t = t^beta2_decay and 1 - w_t (lerp weights), phi_t,
  // eps1 and eps1^2 (float32, as the reference's tensor ops); rho_t, eps2, d (doubles, as
  // the reference's Python scalars); the correction on/off; w_t < 0.5 (lerp's branch).
  float af_w, af_one_minus_w, af_phi, af_eps1, af_eps1_sq;
  double af_rho, af_eps2, af_d;
  bool af_correct, af_lerp_low;
  // update_rms_clip (SPEC 10.9), set by the host: 0 = off; 1 = pass A (states and the
  // blocks' / tensors' sums of U^2, no parameter write); 2 = pass B (the step with
  // lr * rms_scale; DP-Adafactor's with (alpha_t / denom) * rms_scale, in its tensor phase).
  int rms_phase;
  double rms_scale;  // s (pass B); DP-Adafactor's step size is (alpha_t / denom) s
};

// (alpha_t, beta3_t) of DP-AdEMAMix at step t (dpkern.rules.ademamix_schedule, in double).
inline void ademamix_schedule(const Hyper& h, double t, double& alpha_t, double& beta3_t) {
  const double T = h.t_alpha_beta3;
  if (T == 0 || t >= T) {
    alpha_t = h.alpha;
    beta3_t = h.beta3;
    return;
  }
  const double a = t / T;
  alpha_t = std::fmin(t * h.alpha / T, h.alpha);
  const double l1 = std::log(h.beta1), l3 = std::log(h.beta3);
  beta3_t = std::fmin(std::exp(l1 * l3 / ((1 - a) * l3 + a * l1)), h.beta3);
}

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
  // Schedule-free (SPEC 10.8): dpkern.rules.schedule_free_scalars, in double.
  if (h.rule == SGD_SCHEDULE_FREE || h.rule == ADAMW_SCHEDULE_FREE) {
    const double k = t - 1;
    const double sched = k < h.warmup_steps ? (k + 1) / h.warmup_steps : 1.0;
    const double lr = h.lr * sched;
    const double lr_max = lr >= h.lr_max ? lr : h.lr_max;
    const double weight = std::pow(k + 1, h.r) * std::pow(lr_max, h.weight_lr_power);
    const double weight_sum = h.weight_sum + weight;
    const double ckp1 = weight_sum != 0 ? weight / weight_sum : 0.0;
    const double beta = h.rule == SGD_SCHEDULE_FREE ? h.momentum : h.beta1;
    c.sf_lr = float(lr);
    c.sf_y_coef = float(lr * (beta * (1 - ckp1) - 1));
    c.sf_ckp1 = float(ckp1);
    c.sf_lerp_small = std::fabs(c.sf_ckp1) < 0.5f;  // torch.lerp's test, in float32
    c.sf_correct = h.rule == ADAMW_SCHEDULE_FREE && h.noise_bias_correction;
  }
  c.alpha = float(h.alpha);
  c.one_minus_alpha = float(1 - h.alpha);
  c.centered = h.centered;
  c.noise_bias_correction = h.noise_bias_correction;
  c.phi = h.noise_bias_correction ? float(dp.noise_var_avg) : 0.0f;  // phi_t (not bias-corrected)
  c.clr = float(h.lr / (1 + (t - 1) * h.lr_decay));
  c.bc = h.noise_bias_correction;
  c.rho = float(h.rho);
  c.one_minus_rho = float(1 - h.rho);
  if (h.rule == ADEMAMIX) {  // dpkern.rules.ademamix_scalars
    double alpha_t, beta3_t;
    ademamix_schedule(h, t, alpha_t, beta3_t);
    const double bc1 = 1 - std::pow(h.beta1, t), bc2 = 1 - std::pow(h.beta2, t);
    const double s = std::sqrt(bc2);
    c.beta3 = float(beta3_t);
    c.one_minus_beta3 = float(1 - beta3_t);
    c.ade_a = float(h.lr * s / bc1);
    c.ade_b = float(h.lr * alpha_t * s);
    c.ade_e = float(h.eps * s);
    c.ade_g = float(h.noise_bias_correction ? h.gamma * bc2 : 0.0);
  }
  if (h.rule == RADAM) {  // reference.update_radam / rules.radam_rectification, in double
    const double rho_inf = 2 / (1 - h.beta2) - 1;
    const double bc2 = 1 - std::pow(h.beta2, t);
    const double rho_t = rho_inf - 2 * t * std::pow(h.beta2, t) / bc2;
    c.radam_decoupled = h.decoupled_weight_decay;
    c.radam_adaptive = rho_t > 5.0;
    c.radam_bc = h.noise_bias_correction;
    c.radam_sqrt_bc2 = float(std::pow(bc2, 0.5));
    c.radam_rect = c.radam_adaptive ? float(std::pow((rho_t - 4) * (rho_t - 2) * rho_inf /
                                                         ((rho_inf - 4) * (rho_inf - 2) * rho_t),
                                                     0.5))
                                    : 1.0f;
  }
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
  c.rms_phase = int(h.rms_phase);
  c.rms_scale = h.rms_scale;
  if (c.rms_phase == 2) c.lr = float(h.lr * h.rms_scale);  // (lr s) m_hat / denom
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

// update_rms_clip (SPEC 10.9), DP-AdamW / DP-AdamW-BC. Pass A: the moments as
// adam_family, and the block's sum of U^2, U = m_hat / denom (float32, squared in float32,
// accumulated in float64); the parameter is not written.
template <bool BC>
DPK_INLINE float adamw_denom(const Consts& c, float v_hat) {
  if (BC) {
    const float d = v_hat - c.phi_hat;
    return __builtin_sqrtf(d < c.gamma ? c.gamma : d);
  }
  return __builtin_sqrtf(v_hat) + c.eps;
}

template <bool BC>
DPK_INLINE void adamw_rms_moments(const Consts c, const float* __restrict S, float* __restrict z,
                                  const Param& prm, int64_t begin, int64_t len, double& uu) {
  float* __restrict m = prm.state[EXP_AVG] + begin;
  float* __restrict v = prm.state[EXP_AVG_SQ] + begin;
  double acc = 0.0;
  for (int64_t j = 0; j < len; ++j) {
    const float g = (S[j] + c.noise_std * z[j]) / c.batch;
    const float mj = m[j] * c.beta1 + c.one_minus_beta1 * g;
    const float vj = v[j] * c.beta2 + (c.one_minus_beta2 * g) * g;
    m[j] = mj;
    v[j] = vj;
    const float u = (mj / c.bias_correction1) / adamw_denom<BC>(c, vj / c.bias_correction2);
    acc += double(u * u);
  }
  uu = acc;
}

// Pass B: p <- p (1 - lr wd) - ((lr s) m_hat) / denom from the stored moments (c.lr holds
// lr * s), the operations of adam_family.
template <int PT, bool BC>
DPK_INLINE void adamw_rms_apply(const Consts c, const Param& prm, int64_t begin, int64_t len) {
  auto* __restrict p = static_cast<typename Storage<PT>::type*>(prm.data) + begin;
  const float* __restrict m = prm.state[EXP_AVG] + begin;
  const float* __restrict v = prm.state[EXP_AVG_SQ] + begin;
  for (int64_t j = 0; j < len; ++j) {
    const float pj = load<PT>(p, j) * c.decay;
    const float m_hat = m[j] / c.bias_correction1, v_hat = v[j] / c.bias_correction2;
    store<PT>(p, j, pj - (c.lr * m_hat) / adamw_denom<BC>(c, v_hat));
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
                             const Param& prm, int64_t begin, int64_t len, double& uu) {
  if (c.rms_phase == 1) return adamw_rms_moments<false>(c, S, z, prm, begin, len, uu);
  adam_family<PT, true, false>(c, S, z, prm, begin, len);
}

// DP-AdamW-BC (SPEC 5.5).
template <int PT>
DPK_INLINE void update_adamw_bc(const Consts c, const float* __restrict S, float* __restrict z,
                                const Param& prm, int64_t begin, int64_t len, double& uu) {
  if (c.rms_phase == 1) return adamw_rms_moments<true>(c, S, z, prm, begin, len, uu);
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

// Schedule-free DP-SGD and DP-AdamW (SPEC 10.8): p holds y; z (SF_Z) is the base sequence,
// p itself at the parameter's first step; ADAMW: u = g_hat / denominator (SF_EXP_AVG_SQ),
// else u = g_hat; then the decay at y, y <- lerp(y, z, c_t) + y_coef u, z <- z - lr u.
template <int PT, bool ADAMW>
DPK_INLINE void schedule_free(const Consts c, const float* __restrict S, float* __restrict z,
                              const Param& prm, int64_t begin, int64_t len) {
  auto* __restrict p = static_cast<typename Storage<PT>::type*>(prm.data) + begin;
  float* __restrict zs = prm.state[SF_Z] + begin;
  float* __restrict v = ADAMW ? prm.state[SF_EXP_AVG_SQ] + begin : nullptr;
  for (int64_t j = 0; j < len; ++j) {
    const float g = (S[j] + c.noise_std * z[j]) / c.batch;
    const float pj = load<PT>(p, j);
    const float zj = c.first_step ? pj : zs[j];
    float u = g;
    if (ADAMW) {
      const float vj = v[j] * c.beta2 + (c.one_minus_beta2 * g) * g;
      v[j] = vj;
      const float v_hat = vj / c.bias_correction2;
      float denom;
      if (c.sf_correct) {
        const float d = v_hat - c.phi_hat;
        denom = __builtin_sqrtf(d < c.gamma ? c.gamma : d);  // clamp(min=gamma)
      } else {
        denom = __builtin_sqrtf(v_hat) + c.eps;
      }
      u = g / denom;
    }
    if (c.coupled_wd) u = u + c.weight_decay * pj;
    float y = c.sf_lerp_small ? pj + c.sf_ckp1 * (zj - pj) : zj - (zj - pj) * (1.0f - c.sf_ckp1);
    y = y + c.sf_y_coef * u;
    zs[j] = zj - c.sf_lr * u;
    store<PT>(p, j, y);
  }
}

// Schedule-free DP-SGD (SPEC 10.8).
template <int PT>
DPK_INLINE void update_sgd_schedule_free(const Consts c, const float* __restrict S,
                                         float* __restrict z, const Param& prm, int64_t begin,
                                         int64_t len, double&) {
  schedule_free<PT, false>(c, S, z, prm, begin, len);
}

// Schedule-free DP-AdamW (SPEC 10.8).
template <int PT>
DPK_INLINE void update_adamw_schedule_free(const Consts c, const float* __restrict S,
                                           float* __restrict z, const Param& prm, int64_t begin,
                                           int64_t len, double&) {
  schedule_free<PT, true>(c, S, z, prm, begin, len);
}

// DP-RMSprop (SPEC 10.1): torch.optim.RMSprop on g_hat; avg = sqrt(v) + eps, or
// sqrt(v - grad_avg^2) + eps (centered), or sqrt(max(v - phi, gamma)) + eps (noise bias
// correction); momentum: buf = momentum buf + g / avg, p -= lr buf.
template <int PT>
DPK_INLINE void update_rmsprop(const Consts c, const float* __restrict S, float* __restrict z,
                               const Param& prm, int64_t begin, int64_t len, double&) {
  auto* __restrict p = static_cast<typename Storage<PT>::type*>(prm.data) + begin;
  float* __restrict v = prm.state[SQUARE_AVG] + begin;
  float* __restrict buf = c.momentum > 0 ? prm.state[RMS_MOMENTUM_BUFFER] + begin : nullptr;
  float* __restrict ga = c.centered ? prm.state[GRAD_AVG] + begin : nullptr;
  for (int64_t j = 0; j < len; ++j) {
    float g = (S[j] + c.noise_std * z[j]) / c.batch;
    const float pj = load<PT>(p, j);
    if (c.coupled_wd) g = g + c.weight_decay * pj;
    const float vj = v[j] * c.alpha + (c.one_minus_alpha * g) * g;
    v[j] = vj;
    float avg;
    if (c.centered) {
      const float gaj = ga[j] + c.one_minus_alpha * (g - ga[j]);
      ga[j] = gaj;
      avg = __builtin_sqrtf(vj - gaj * gaj) + c.eps;
    } else if (c.noise_bias_correction) {
      const float d = vj - c.phi;
      avg = __builtin_sqrtf(d < c.gamma ? c.gamma : d) + c.eps;  // clamp(min=gamma); NaN stays NaN
    } else {
      avg = __builtin_sqrtf(vj) + c.eps;
    }
    if (c.momentum > 0) {
      const float b = buf[j] * c.momentum + g / avg;
      buf[j] = b;
      store<PT>(p, j, pj - c.lr * b);
    } else {
      store<PT>(p, j, pj - c.lr * (g / avg));
    }
  }
}

// DP-Adagrad (SPEC 10.2): torch.optim.Adagrad on g_hat; sum += g^2,
// p -= clr g / (sqrt(sum) + eps), or sqrt(max(sum - phi, gamma)) + eps.
template <int PT>
DPK_INLINE void update_adagrad(const Consts c, const float* __restrict S, float* __restrict z,
                               const Param& prm, int64_t begin, int64_t len, double&) {
  auto* __restrict p = static_cast<typename Storage<PT>::type*>(prm.data) + begin;
  float* __restrict acc = prm.state[SUM] + begin;
  for (int64_t j = 0; j < len; ++j) {
    float g = (S[j] + c.noise_std * z[j]) / c.batch;
    const float pj = load<PT>(p, j);
    if (c.coupled_wd) g = g + c.weight_decay * pj;
    const float a = acc[j] + g * g;
    acc[j] = a;
    float std_;
    if (c.noise_bias_correction) {
      const float d = a - c.phi;
      std_ = __builtin_sqrtf(d < c.gamma ? c.gamma : d) + c.eps;  // clamp(min=gamma)
    } else {
      std_ = __builtin_sqrtf(a) + c.eps;
    }
    store<PT>(p, j, pj - c.clr * (g / std_));
  }
}

// ---------------------------------------------------------------------------------------
// DP-Adadelta (SPEC 10.5): torch.optim.Adadelta on g_hat; with the correction, v - phi_t
// (floored at gamma) and u - psi (floored at 0) under the square roots, and psi's EMA.
template <int PT>
DPK_INLINE void update_adadelta(const Consts c, const float* __restrict S, float* __restrict z,
                                const Param& prm, int64_t begin, int64_t len, double&) {
  auto* __restrict p = static_cast<typename Storage<PT>::type*>(prm.data) + begin;
  float* __restrict v = prm.state[SQUARE_AVG] + begin;
  float* __restrict u = prm.state[ACC_DELTA] + begin;
  float* __restrict psi = c.bc ? prm.state[ACC_DELTA_NOISE_VAR] + begin : nullptr;
  for (int64_t j = 0; j < len; ++j) {
    float g = (S[j] + c.noise_std * z[j]) / c.batch;
    const float pj = load<PT>(p, j);
    if (c.coupled_wd) g = g + c.weight_decay * pj;
    const float vj = v[j] * c.rho + (c.one_minus_rho * g) * g;
    v[j] = vj;
    float den, num;
    if (c.bc) {
      const float d = vj - c.phi;
      den = __builtin_sqrtf((d < c.gamma ? c.gamma : d) + c.eps);  // clamp(min=gamma)
      const float e = u[j] - psi[j];
      num = __builtin_sqrtf((e < 0.0f ? 0.0f : e) + c.eps);  // clamp(min=0); NaN stays
    } else {
      den = __builtin_sqrtf(vj + c.eps);
      num = __builtin_sqrtf(u[j] + c.eps);
    }
    const float coef = num / den;
    const float delta = coef * g;
    u[j] = u[j] * c.rho + (c.one_minus_rho * delta) * delta;
    if (c.bc) psi[j] = psi[j] * c.rho + ((c.one_minus_rho * coef) * coef) * c.noise_var;
    store<PT>(p, j, pj - c.lr * delta);
  }
}

// ---------------------------------------------------------------------------------------
// DP-AdEMAMix (SPEC 10.6), in its computed form p (1 - lr wd) - (A m1 + B m2) / (sqrt(vc)
// + E), vc = v or max(v - phi_t, G) (reference.update_ademamix).
template <int PT>
DPK_INLINE void update_ademamix(const Consts c, const float* __restrict S, float* __restrict z,
                                const Param& prm, int64_t begin, int64_t len, double&) {
  auto* __restrict p = static_cast<typename Storage<PT>::type*>(prm.data) + begin;
  float* __restrict m1 = prm.state[EXP_AVG] + begin;
  float* __restrict v = prm.state[EXP_AVG_SQ] + begin;
  float* __restrict m2 = prm.state[EXP_AVG_SLOW] + begin;
  for (int64_t j = 0; j < len; ++j) {
    const float g = (S[j] + c.noise_std * z[j]) / c.batch;
    const float pj = load<PT>(p, j) * c.decay;
    const float m1j = m1[j] * c.beta1 + c.one_minus_beta1 * g;
    const float m2j = m2[j] * c.beta3 + c.one_minus_beta3 * g;
    const float vj = v[j] * c.beta2 + (c.one_minus_beta2 * g) * g;
    m1[j] = m1j;
    m2[j] = m2j;
    v[j] = vj;
    float vc = vj;
    if (c.bc) {
      const float d = vj - c.phi;
      vc = d < c.ade_g ? c.ade_g : d;
    }
    store<PT>(p, j, pj - (c.ade_a * m1j + c.ade_b * m2j) / (__builtin_sqrtf(vc) + c.ade_e));
  }
}

// ---------------------------------------------------------------------------------------
// DP-RAdam (SPEC 10.3): torch.optim.RAdam on g_hat. ADAPTIVE: rho_t > 5 (the rectified
// step), else the warm-up step lr m_hat; BC: denominator sqrt(max(v_hat - phi_hat, gamma)),
// else torch's (1 / (sqrt(v) + eps)) sqrt(1 - beta2^t).
template <int PT, bool ADAPTIVE, bool BC>
DPK_INLINE void radam_loop(const Consts c, const float* __restrict S, float* __restrict z,
                           const Param& prm, int64_t begin, int64_t len) {
  auto* __restrict p = static_cast<typename Storage<PT>::type*>(prm.data) + begin;
  float* __restrict m = prm.state[EXP_AVG] + begin;
  float* __restrict v = prm.state[EXP_AVG_SQ] + begin;
  for (int64_t j = 0; j < len; ++j) {
    float g = (S[j] + c.noise_std * z[j]) / c.batch;
    float pj = load<PT>(p, j);
    if (c.coupled_wd) {  // weight_decay != 0
      if (c.radam_decoupled) {
        pj = pj * c.decay;
      } else {
        g = g + c.weight_decay * pj;
      }
    }
    const float mj = m[j] * c.beta1 + c.one_minus_beta1 * g;
    const float vj = v[j] * c.beta2 + (c.one_minus_beta2 * g) * g;
    m[j] = mj;
    v[j] = vj;
    const float m_hat = mj / c.bias_correction1;
    float step;
    if (!ADAPTIVE) {
      step = m_hat * c.lr;
    } else if (BC) {
      const float d = vj / c.bias_correction2 - c.phi_hat;
      step = ((m_hat * c.lr) * c.radam_rect) / __builtin_sqrtf(d < c.gamma ? c.gamma : d);
    } else {
      const float adaptive = (1.0f / (__builtin_sqrtf(vj) + c.eps)) * c.radam_sqrt_bc2;
      step = ((m_hat * c.lr) * adaptive) * c.radam_rect;
    }
    store<PT>(p, j, pj - step);
  }
}

template <int PT>
DPK_INLINE void update_radam(const Consts c, const float* __restrict S, float* __restrict z,
                             const Param& prm, int64_t begin, int64_t len, double&) {
  if (!c.radam_adaptive) {
    radam_loop<PT, false, false>(c, S, z, prm, begin, len);
  } else if (c.radam_bc) {
    radam_loop<PT, true, true>(c, S, z, prm, begin, len);
  } else {
    radam_loop<PT, true, false>(c, S, z, prm, begin, len);
  }
}

// ---------------------------------------------------------------------------------------
// DP-Lion (SPEC 10.4): lion_pytorch.Lion on g_hat; sign(0) = sign(NaN) = 0 (torch.sign).
template <int PT>
DPK_INLINE void update_lion(const Consts c, const float* __restrict S, float* __restrict z,
                            const Param& prm, int64_t begin, int64_t len, double&) {
  auto* __restrict p = static_cast<typename Storage<PT>::type*>(prm.data) + begin;
  float* __restrict m = prm.state[EXP_AVG] + begin;
  for (int64_t j = 0; j < len; ++j) {
    const float g = (S[j] + c.noise_std * z[j]) / c.batch;
    const float pj = load<PT>(p, j) * c.decay;
    const float cj = m[j] * c.beta1 + c.one_minus_beta1 * g;
    const float sign = cj > 0.0f ? 1.0f : (cj < 0.0f ? -1.0f : 0.0f);
    m[j] = m[j] * c.beta2 + c.one_minus_beta2 * g;
    store<PT>(p, j, pj - c.lr * sign);
  }
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

// alpha_t = max(eps2, RMS(p)) rho_t, of the parameter before the decay.
template <int PT>
DPK_INLINE double adafactor_alpha(const Consts& c, const Param& prm) {
  const int64_t n = prm.numel;
  const auto* __restrict p = static_cast<const typename Storage<PT>::type*>(prm.data);
  double pp = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    const float x = load<PT>(p, j);
    pp += double(x * x);
  }
  return std::max(c.af_eps2, std::sqrt(pp) / std::sqrt(double(n))) * c.af_rho;
}

// max(1, RMS(U) / d) from ||U||^2.
DPK_INLINE double adafactor_denom(const Consts& c, double uu, int64_t n) {
  return std::max(1.0, std::sqrt(uu) / (std::sqrt(double(n)) * c.af_d));
}

// Step 4 of SPEC 10.7: p <- p (1 - lr wd) - step U (U in the scratch), one rounding.
template <int PT>
DPK_INLINE void adafactor_store(const Consts& c, const Param& prm, float step) {
  auto* __restrict p = static_cast<typename Storage<PT>::type*>(prm.data);
  const float* __restrict g = prm.state[GHAT];
  for (int64_t j = 0; j < prm.numel; ++j) store<PT>(p, j, load<PT>(p, j) * c.decay - step * g[j]);
}

// Steps 2-3 of SPEC 10.7 on one non-empty tensor (the parameter read, not written): the
// states updated, U formed in the scratch GHAT; alpha_t and max(1, RMS(U) / d) out, ||U||^2
// returned (float64 sums of float32 terms, in element order).
template <int PT>
DPK_INLINE double adafactor_direction(const Consts& c, const Param& prm, double& alpha,
                                      double& denom) {
  const int64_t n = prm.numel;
  float* __restrict g = prm.state[GHAT];
  float* __restrict row = prm.state[ROW_VAR];
  alpha = adafactor_alpha<PT>(c, prm);
  double uu = 0.0;
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
  } else {  // unfactored: row_var holds the variance (p.shape)
    for (int64_t j = 0; j < n; ++j) {
      row[j] = adafactor_lerp(c, row[j], g[j] * g[j]);
      const float v = adafactor_floor(c, row[j]);
      const float u = g[j] / __builtin_sqrtf(v < c.af_eps1_sq ? c.af_eps1_sq : v);
      g[j] = u;
      uu += double(u * u);
    }
  }
  denom = adafactor_denom(c, uu, n);
  return uu;
}

// The tensor phase. rms_phase 0: the step with step size alpha_t / denom. update_rms_clip
// (SPEC 10.9): pass A (1) stops before the parameter write and adds ||U||^2 / denom^2 to
// *uu_out (U stays in the scratch, which the host keeps for pass B); pass B (2) re-forms
// alpha_t from the unchanged parameter and denom from the stored U (the same sums in the
// same order, so the same doubles) and steps with ((alpha_t / denom) s), a double rounded
// once: s = 1 is the unclipped step bit for bit.
template <int PT>
DPK_INLINE void adafactor_tensor(const Consts c, const Param& prm, double* uu_out) {
  const int64_t n = prm.numel;
  if (n == 0) return;
  double alpha, denom;
  if (c.rms_phase == 2) {
    alpha = adafactor_alpha<PT>(c, prm);
    const float* __restrict g = prm.state[GHAT];
    double uu = 0.0;
    for (int64_t j = 0; j < n; ++j) uu += double(g[j] * g[j]);
    denom = adafactor_denom(c, uu, n);
    adafactor_store<PT>(c, prm, float((alpha / denom) * c.rms_scale));
    return;
  }
  const double uu = adafactor_direction<PT>(c, prm, alpha, denom);
  if (c.rms_phase == 1) {
    *uu_out = uu / (denom * denom);
    return;
  }
  adafactor_store<PT>(c, prm, float(alpha / denom));
}

// Whether the rule has a tensor phase (update_tensor) after its block phase; step.cpp then
// gives each parameter an fp32 scratch of its size in the slot GHAT.
DPK_INLINE bool has_tensor_pass(int rule) { return rule == ADAFACTOR; }

// uu_out: update_rms_clip's pass A stores the tensor's sum of U^2 there (SPEC 10.9).
DPK_INLINE void update_tensor(const Consts& c, const Param& p, double* uu_out) {
  switch (c.rule) {
    case ADAFACTOR: DPK_DISPATCH_PARAM_DTYPE(p.dtype, adafactor_tensor, c, p, uu_out) break;
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
    case SGD: DPK_DISPATCH_PARAM_DTYPE(p.dtype, update_sgd, c, S, z, p, begin, len, sqrt_sum) break;
    case ADAM: DPK_DISPATCH_PARAM_DTYPE(p.dtype, update_adam, c, S, z, p, begin, len, sqrt_sum) break;
    case ADAM_BC:
      DPK_DISPATCH_PARAM_DTYPE(p.dtype, update_adam_bc, c, S, z, p, begin, len, sqrt_sum) break;
    case ADAMW: DPK_DISPATCH_PARAM_DTYPE(p.dtype, update_adamw, c, S, z, p, begin, len, sqrt_sum) break;
    case ADAMW_BC:
      DPK_DISPATCH_PARAM_DTYPE(p.dtype, update_adamw_bc, c, S, z, p, begin, len, sqrt_sum) break;
    case MACADAM:
      DPK_DISPATCH_PARAM_DTYPE(p.dtype, update_macadam, c, S, z, p, begin, len, sqrt_sum) break;
    case SGD_SCHEDULE_FREE:
      DPK_DISPATCH_PARAM_DTYPE(p.dtype, update_sgd_schedule_free, c, S, z, p, begin, len, sqrt_sum)
      break;
    case ADAMW_SCHEDULE_FREE:
      DPK_DISPATCH_PARAM_DTYPE(p.dtype, update_adamw_schedule_free, c, S, z, p, begin, len, sqrt_sum)
      break;
    case RMSPROP:
      DPK_DISPATCH_PARAM_DTYPE(p.dtype, update_rmsprop, c, S, z, p, begin, len, sqrt_sum) break;
    case ADAGRAD:
      DPK_DISPATCH_PARAM_DTYPE(p.dtype, update_adagrad, c, S, z, p, begin, len, sqrt_sum) break;
    case ADADELTA:
      DPK_DISPATCH_PARAM_DTYPE(p.dtype, update_adadelta, c, S, z, p, begin, len, sqrt_sum) break;
    case ADEMAMIX:
      DPK_DISPATCH_PARAM_DTYPE(p.dtype, update_ademamix, c, S, z, p, begin, len, sqrt_sum) break;
    case RADAM:
      DPK_DISPATCH_PARAM_DTYPE(p.dtype, update_radam, c, S, z, p, begin, len, sqrt_sum) break;
    case LION: DPK_DISPATCH_PARAM_DTYPE(p.dtype, update_lion, c, S, z, p, begin, len, sqrt_sum) break;
    case ADAFACTOR:
      DPK_DISPATCH_PARAM_DTYPE(p.dtype, update_adafactor, c, S, z, p, begin, len, sqrt_sum) break;
    default: break;  // unreachable: unknown codes are refused at the binding
  }
  return sqrt_sum;
}

// update_rms_clip's pass B on one block (SPEC 10.9); rules without the option do nothing
// (cpp.py never asks them).
// DP-Adafactor's is its tensor phase (adafactor_tensor), not a block function.
DPK_INLINE bool has_rms_clip(int rule) {
  return rule == ADAMW || rule == ADAMW_BC || rule == ADAFACTOR;
}

template <int PT>
DPK_INLINE void rms_apply_adamw(const Consts c, const Param& p, int64_t begin, int64_t len) {
  adamw_rms_apply<PT, false>(c, p, begin, len);
}
template <int PT>
DPK_INLINE void rms_apply_adamw_bc(const Consts c, const Param& p, int64_t begin, int64_t len) {
  adamw_rms_apply<PT, true>(c, p, begin, len);
}

DPK_INLINE void rms_apply(const Consts& c, const Param& p, int64_t begin, int64_t len) {
  switch (c.rule) {
    case ADAMW: DPK_DISPATCH_PARAM_DTYPE(p.dtype, rms_apply_adamw, c, p, begin, len) break;
    case ADAMW_BC: DPK_DISPATCH_PARAM_DTYPE(p.dtype, rms_apply_adamw_bc, c, p, begin, len) break;
    default: break;
  }
}

// Whether the rule's clipped sum is taken in the whitened space (DP-MacAdam: its
// accumulate reads exp_avg and scale, and a parameter without grad_sample contributes).
DPK_INLINE bool whitens(int rule) { return rule == MACADAM; }

}  // namespace dpk
