// Pass 2 (reference.step): clip + sum + noise + moment update + parameter update in one
// pass over each tensor, the update being the rule's update_<name> (rules.h); plus
// reference.accumulate and reference.macadam_update_scale.
//
// The grid of BLOCK-element blocks (aligned to the global noise index) is shared out among
// threads; inside a block the per-sample rows are read once each (samples in the inner
// loop over a block of coordinates), the clipped sum, noise and update live in two small
// stack buffers, and each state is read and written once. Nothing of size B x d or d is
// allocated, except the fp32 scratch of g_hat of a rule with a tensor phase (DP-Adafactor,
// whose update needs row, column and tensor reductions of g_hat: rules.h). Arithmetic
// follows reference.py operation by operation, in float32, with each Python scalar rounded
// to float32 where the reference multiplies a tensor by it.
#include <cmath>

#include "kernels.h"
#include "philox.h"

namespace dpk {

namespace {

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
  if (whitens(c.rule)) {
    DPK_DISPATCH_DTYPE(gs.dtype, whitened_clipped_sum, c, gs.data, p.numel, begin, len, clip,
                       batch, p.state[EXP_AVG] + begin, p.state[SCALE] + begin, acc)
  } else if (gs.data != nullptr) {
    DPK_DISPATCH_DTYPE(gs.dtype, clipped_sum, gs.data, p.numel, begin, len, clip, batch, acc)
  }
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
  if (p.dtype != BF16_SR) return update(c, S, z, p, begin, len);  // rules.h
  // stochastic rounding (SPEC 3.2): the block's rounding bits, read by store<BF16_SR>
  alignas(64) uint16_t rho[BLOCK];
  rounding_range(dp.key, dp.noise_step, p.offset + uint64_t(begin), len, rho);
  sr_bits = rho;
  const double out = update(c, S, z, p, begin, len);
  sr_bits = nullptr;
  return out;
}

// The tensor phase of one parameter (rules.h, update_tensor; uu_out: update_rms_clip's
// pass A puts the tensor's sum of U^2 there); a BF16_SR parameter's stores read the
// rounding bits of the whole tensor.
void tensor_phase(const Consts& c, const DP& dp, const Param& p, double* uu_out) {
  if (p.dtype != BF16_SR) return update_tensor(c, p, uu_out);
  std::vector<uint16_t> rho(size_t(p.numel));
  rounding_range(dp.key, dp.noise_step, p.offset, p.numel, rho.data());
  sr_bits = rho.data();
  update_tensor(c, p, uu_out);
  sr_bits = nullptr;
}

// update_rms_clip's pass B on one block (SPEC 10.9): the step from the stored moments; a
// BF16_SR parameter's stores read the block's rounding bits.
DPK_CLONES void rms_apply_block(const Consts& c, const DP& dp, const Param& p, int64_t begin,
                                int64_t len) {
  if (p.dtype != BF16_SR) return rms_apply(c, p, begin, len);
  alignas(64) uint16_t rho[BLOCK];
  rounding_range(dp.key, dp.noise_step, p.offset + uint64_t(begin), len, rho);
  sr_bits = rho;
  rms_apply(c, p, begin, len);
  sr_bits = nullptr;
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

double step(const Hyper& h, const DP& dp, const std::vector<Param>& given, const float* clip,
            int64_t batch) {
  const Consts c = make_consts(h, dp);
  // A rule with a tensor phase (rules.h, DP-Adafactor): its blocks store g_hat into an fp32
  // scratch per parameter (slot GHAT), then update_tensor runs once per tensor. The host
  // provides that scratch for update_rms_clip (pass A leaves U there for pass B); else it
  // is allocated here.
  const bool tensor_pass = has_tensor_pass(c.rule);
  std::vector<std::vector<float>> scratch(tensor_pass ? given.size() : 0);
  std::vector<Param> with_scratch;
  if (tensor_pass) {
    with_scratch = given;
    for (size_t k = 0; k < given.size(); ++k) {
      if (given[k].state[GHAT] != nullptr || given[k].numel == 0) continue;
      scratch[k].resize(size_t(given[k].numel));
      with_scratch[k].state[GHAT] = scratch[k].data();
    }
  }
  // bf16 parameters round stochastically (SPEC 3.2); not in update_rms_clip's pass A,
  // which stores no parameter
  const bool sr = dp.stochastic_rounding && c.rms_phase != 1;
  if (sr) {
    if (!tensor_pass) with_scratch = given;
    for (Param& p : with_scratch)
      if (p.dtype == BF16) p.dtype = BF16_SR;
  }
  const std::vector<Param>& params = tensor_pass || sr ? with_scratch : given;
  const std::vector<Block> blocks = param_blocks(params);
  const int64_t nb = int64_t(blocks.size());
  if (c.rms_phase == 2 && tensor_pass) {  // pass B of a tensor-phase rule: per tensor
    const int64_t nt = int64_t(params.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads()) if (nt > 1)
    for (int64_t k = 0; k < nt; ++k) tensor_phase(c, dp, params[size_t(k)], nullptr);
    return 0.0;
  }
  if (c.rms_phase == 2) {  // update_rms_clip's pass B (SPEC 10.9): no prologue, no noise
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads()) if (nb > 1)
    for (int64_t n = 0; n < nb; ++n) {
      const Block& blk = blocks[size_t(n)];
      rms_apply_block(c, dp, params[size_t(blk.tensor)], blk.begin, blk.len);
    }
    return 0.0;
  }
  std::vector<double> partial(blocks.size(), 0.0);
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads()) if (nb > 1)
  for (int64_t n = 0; n < nb; ++n) {
    const Block& blk = blocks[size_t(n)];
    partial[size_t(n)] = step_block(c, dp, params[size_t(blk.tensor)], blk.begin, blk.len, clip, batch);
  }
  std::vector<double> tensor_uu(tensor_pass ? params.size() : 0, 0.0);
  if (tensor_pass) {
    const int64_t nt = int64_t(params.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads()) if (nt > 1)
    for (int64_t k = 0; k < nt; ++k) tensor_phase(c, dp, params[size_t(k)], &tensor_uu[size_t(k)]);
  }
  double total = 0.0;
  for (double x : partial) total += x;  // block order: independent of the thread count
  for (double x : tensor_uu) total += x;  // tensor order (pass A of a tensor-phase rule)
  return total;
}

void accumulate(const Hyper& h, const DP& dp, const std::vector<Param>& params,
                const float* clip, int64_t batch) {
  const Consts c = make_consts(h, dp);
  std::vector<Param> used;  // a parameter without grad_sample adds nothing, except for MacAdam
  for (const Param& p : params)
    if (p.grad_sample.data != nullptr || whitens(h.rule)) used.push_back(p);
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
