// The C++ entry points behind dpkern._C, one per function of dpkern/backends/reference.py.
// Every pointer is a raw buffer that Python has already checked (CPU, dense, contiguous,
// dtype, size): nothing here validates user input.
#pragma once

#include <cstdint>
#include <vector>

#include "common.h"

namespace dpk {

// Update rules, in the order of dpkern.hyper.RULES.
enum Rule : int { SGD = 0, ADAM = 1, ADAM_BC = 2, ADAMW = 3, ADAMW_BC = 4, MACADAM = 5 };
// DP-MacAdam's variance term u, in the order of dpkern.hyper.VARIANCE_ESTIMATES.
enum Variance : int { UNBIASED = 0, PAPER = 1, CODE = 2 };

// The hyper-parameters of one update rule (dpkern.hyper), as Python doubles; each is
// rounded to float32 where the reference multiplies a float32 tensor by it.
struct Hyper {
  int rule = SGD;
  double lr = 0, momentum = 0, dampening = 0, weight_decay = 0;
  bool nesterov = false;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, gamma = 1e-8, h1 = 1e-9, h2 = 1e-6;
  int variance = UNBIASED;
};

// dpkern.hyper.DPStep.
struct DP {
  uint64_t key = 0, step = 1;  // step: the rule's t (bias corrections, first-step cases)
  uint64_t noise_step = 1;     // the noise stream's counter (the optimizer's global step)
  uint32_t stream = 0;
  double noise_std = 0, expected_batch_size = 1, noise_var_avg = 0;
};

// A flat tensor: data (nullptr = None), dtype code, number of elements (per row for a
// per-sample gradient, whose rows are [B, numel]).
struct Flat {
  const void* data = nullptr;
  int dtype = F32;
  int64_t numel = 0;
};

// One parameter of a step / accumulate call.
struct Param {
  void* data = nullptr;           // the parameter (step) or the fp32 buffer (accumulate)
  int dtype = F32;
  int64_t numel = 0;
  uint64_t offset = 0;            // global index of element 0 in the noise stream
  Flat grad_sample;               // [B, numel], or data == nullptr (unused this step)
  const float* summed = nullptr;  // fp32 sum of earlier micro-batches, or nullptr
  float* state[4] = {nullptr, nullptr, nullptr, nullptr};  // reference.STATE_NAMES order
};

void philox_words(const int64_t* index, int64_t n, uint64_t key, uint64_t step,
                  uint32_t stream, int64_t* out);
void gaussian_noise(float* out, int64_t n, uint64_t key, uint64_t step, uint64_t offset,
                    uint32_t stream);
void normal_from_words(const uint32_t* words, int64_t n, float* out);

void per_sample_norms(const std::vector<Flat>& grad_samples, int64_t batch, float* out);
void whitened_norms(const std::vector<Flat>& grad_samples, const std::vector<const float*>& exp_avgs,
                    const std::vector<const float*>& scales, double bias_correction1,
                    int64_t batch, float* out);

void accumulate(const Hyper& h, const DP& dp, const std::vector<Param>& params,
                const float* clip, int64_t batch);
double step(const Hyper& h, const DP& dp, const std::vector<Param>& params, const float* clip,
            int64_t batch);
void macadam_update_scale(const Hyper& h, const DP& dp, const std::vector<float*>& exp_vars,
                          const std::vector<float*>& scales, const std::vector<int64_t>& numels,
                          double sqrt_sum);

// The blocks of a list of tensors: element ranges of at most BLOCK elements, whose
// boundaries lie on multiples of BLOCK of the global index (offset + element).
std::vector<Block> make_blocks(const std::vector<int64_t>& numels,
                               const std::vector<uint64_t>& offsets, int64_t block = BLOCK);

}  // namespace dpk
