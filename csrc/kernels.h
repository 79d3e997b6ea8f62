// The C++ entry points behind dpkern._C, one per function of dpkern/backends/reference.py
// (the buffers they take are in common.h, the update rules in rules.h).
// Every pointer is a raw buffer that Python has already checked (CPU, dense, contiguous,
// dtype, size): nothing here validates user input.
#pragma once

#include <cstdint>
#include <vector>

#include "common.h"
#include "rules.h"

namespace dpk {

void philox_words(const int64_t* index, int64_t n, uint64_t key, uint64_t step,
                  uint32_t stream, int64_t* out);
void gaussian_noise(float* out, int64_t n, uint64_t key, uint64_t step, uint64_t offset,
                    uint32_t stream);
void normal_from_words(const uint32_t* words, int64_t n, float* out);
// The rounding stream (SPEC 3.2): rho of global elements [offset, offset + n), and float32
// x rounded stochastically to bf16 bits with them.
void rounding_bits(int64_t* out, int64_t n, uint64_t key, uint64_t step, uint64_t offset);
void stochastic_round_bf16(const float* x, int64_t n, uint64_t key, uint64_t step,
                           uint64_t offset, uint16_t* out);

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
