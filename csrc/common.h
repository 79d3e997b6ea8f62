// Shared definitions of the dpkern C++ CPU backend: storage dtypes, 16-bit conversions,
// the coordinate block grid, function multiversioning and the thread count.
//
// No PyTorch headers anywhere in csrc/: Python passes raw data pointers, sizes and dtype
// codes, after checking dtype, device, contiguity and sizes (dpkern/backends/cpp.py).
#pragma once

#include <cstdint>
#include <cstring>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace dpk {

// Storage dtype codes, as sent by dpkern/backends/cpp.py (_DTYPE_CODES). BF16_SR is never
// sent: step() gives it to the bf16 parameters of a step with stochastic rounding (SPEC
// 3.2), whose stores then read the rounding bits of the running block (sr_bits below).
enum DType : int { F32 = 0, BF16 = 1, F16 = 2, F64 = 3, BF16_SR = 4 };

// Coordinate blocks: every pass walks the global element index space (SPEC section 3) in
// blocks of BLOCK elements aligned to multiples of BLOCK, so that which elements share a
// block never depends on the thread count. NOISE_GROUP elements (NOISE_GROUP / 2 Philox
// calls) are always generated together by the same vector code (philox.h).
constexpr int64_t BLOCK = 2048;
constexpr int64_t NOISE_GROUP = 128;
static_assert(BLOCK % NOISE_GROUP == 0, "blocks hold whole noise groups");

#define DPK_INLINE inline __attribute__((always_inline))

// Function multiversioning: the hot block kernels are compiled for x86-64-v4 (AVX-512),
// x86-64-v3 (AVX2 + FMA) and the baseline, and the dynamic loader picks the best one for
// the CPU it runs on (an ifunc), so one portable binary runs on any x86-64 machine.
// Everything a kernel calls is always_inline, so it is compiled inside each clone.
// Define DPK_NO_CLONES (setup.py does, if the compiler rejects the attribute) to build a
// single baseline version.
#if !defined(DPK_NO_CLONES) && defined(__x86_64__) && defined(__linux__) && \
    defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define DPK_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#define DPK_MULTIVERSIONED 1
#else
#define DPK_CLONES
#endif

DPK_INLINE uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

DPK_INLINE float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// bfloat16 <-> float32: c10::BFloat16's conversion (round to nearest even, NaN -> 0x7FC0).
DPK_INLINE float bf16_to_f32(uint16_t h) { return f32_from_bits(uint32_t(h) << 16); }

DPK_INLINE uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  uint16_t rounded = uint16_t((u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16);
  return f != f ? uint16_t(0x7FC0) : rounded;
}

// IEEE half <-> float32, branch-free (M. Maratyszcza's FP16 library, which c10::Half uses;
// exact, round to nearest even). Written with selects so that loops over it vectorise.
DPK_INLINE float f16_to_f32(uint16_t h) {
  const uint32_t w = uint32_t(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = f32_from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = f32_from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t bits = two_w < (1u << 27) ? f32_bits(denormalized) : f32_bits(normalized);
  return f32_from_bits(sign | bits);
}

DPK_INLINE uint16_t f32_to_f16(float f) {
  float base = (__builtin_fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = f32_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  base = f32_from_bits((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = f32_bits(base);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  return uint16_t((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

// Stochastic rounding to bfloat16 (SPEC 3.2): (bits(f) + rho) >> 16 with rho the 16 rounding
// bits of the element; NaN as f32_to_bf16 gives it. No carry leaves bit 31 for a non-NaN f.
DPK_INLINE uint16_t f32_to_bf16_sr(float f, uint32_t rho) {
  const uint16_t rounded = uint16_t((f32_bits(f) + rho) >> 16);
  return f != f ? uint16_t(0x7FC0) : rounded;
}

// The rounding bits of the elements a BF16_SR store writes: element i of the pointer that
// the store is given (the block's parameter slice, or the whole tensor in a tensor phase)
// has bits sr_bits[i]. Set by step.cpp around each update, per thread.
inline thread_local const uint16_t* sr_bits = nullptr;

DPK_INLINE int64_t dtype_size(int dtype) { return dtype == F32 ? 4 : dtype == F64 ? 8 : 2; }

// Typed element access: Storage<DT>::type is the C++ element type of dtype code DT.
template <int DT> struct Storage;
template <> struct Storage<F32> { using type = float; };
template <> struct Storage<BF16> { using type = uint16_t; };
template <> struct Storage<F16> { using type = uint16_t; };
template <> struct Storage<F64> { using type = double; };
template <> struct Storage<BF16_SR> { using type = uint16_t; };

template <int DT>
DPK_INLINE float load(const typename Storage<DT>::type* p, int64_t i) {
  if constexpr (DT == F32) return p[i];
  else if constexpr (DT == BF16 || DT == BF16_SR) return bf16_to_f32(p[i]);
  else if constexpr (DT == F16) return f16_to_f32(p[i]);
  else return float(p[i]);
}

template <int DT>
DPK_INLINE void store(typename Storage<DT>::type* p, int64_t i, float v) {
  if constexpr (DT == F32) p[i] = v;
  else if constexpr (DT == BF16) p[i] = f32_to_bf16(v);
  else if constexpr (DT == F16) p[i] = f32_to_f16(v);
  else if constexpr (DT == BF16_SR) p[i] = f32_to_bf16_sr(v, sr_bits[i]);
  else p[i] = double(v);
}

// FN<DT>(args...) with DT the compile-time dtype of a runtime dtype code. A macro rather
// than a lambda: a lambda's body is a separate function that target_clones would not clone.
#define DPK_DISPATCH_DTYPE(code, FN, ...)                \
  switch (code) {                                        \
    case ::dpk::F32: FN<::dpk::F32>(__VA_ARGS__); break;   \
    case ::dpk::BF16: FN<::dpk::BF16>(__VA_ARGS__); break; \
    case ::dpk::F16: FN<::dpk::F16>(__VA_ARGS__); break;   \
    default: FN<::dpk::F64>(__VA_ARGS__); break;         \
  }

// The same for a parameter's dtype, which may also be BF16_SR (stochastic rounding).
#define DPK_DISPATCH_PARAM_DTYPE(code, FN, ...)                \
  switch (code) {                                              \
    case ::dpk::F32: FN<::dpk::F32>(__VA_ARGS__); break;         \
    case ::dpk::BF16: FN<::dpk::BF16>(__VA_ARGS__); break;       \
    case ::dpk::BF16_SR: FN<::dpk::BF16_SR>(__VA_ARGS__); break; \
    case ::dpk::F16: FN<::dpk::F16>(__VA_ARGS__); break;         \
    default: FN<::dpk::F64>(__VA_ARGS__); break;               \
  }

// Thread count of every parallel region (set_num_threads; <= 0 means OpenMP's default).
int num_threads();
void set_num_threads(int n);

// dpkern.hyper.DPStep.
struct DP {
  uint64_t key = 0, step = 1;  // step: the rule's t (bias corrections, first-step cases)
  uint64_t noise_step = 1;     // the noise stream's counter (the optimizer's global step)
  uint32_t stream = 0;
  double noise_std = 0, expected_batch_size = 1, noise_var_avg = 0;
  bool stochastic_rounding = false;  // bf16 parameters: SPEC 3.2 (the rounding stream)
};

// The Philox stream id of the rounding stream (dpkern.hyper.ROUNDING_STREAM).
constexpr uint32_t ROUNDING_STREAM = 2;

// A flat tensor: data (nullptr = None), dtype code, number of elements (per row for a
// per-sample gradient, whose rows are [B, numel]).
struct Flat {
  const void* data = nullptr;
  int dtype = F32;
  int64_t numel = 0;
};

// Kernel states a rule may have (dpkern.rules.RuleSpec.kernel_states), exported as
// _C.max_states().
constexpr int MAX_STATES = 6;

// One parameter of a step / accumulate call.
struct Param {
  void* data = nullptr;           // the parameter (step) or the fp32 buffer (accumulate)
  int dtype = F32;
  int64_t numel = 0;
  uint64_t offset = 0;            // global index of element 0 in the noise stream
  Flat grad_sample;               // [B, numel], or data == nullptr (unused this step)
  const float* summed = nullptr;  // fp32 sum of earlier micro-batches, or nullptr
  // The rule's kernel states in RuleSpec.kernel_states order, of any shape: flat element j
  // of the parameter has index j of a "param" state, j / inner of a "row" state and
  // (j / matrix) * inner + j % inner of a "col" state (dpkern.rules.factor_sizes).
  float* state[MAX_STATES] = {};
  int64_t inner = 1, matrix = 0;
  int64_t ndim = 1;  // the parameter's dimensions (a factored rule factors ndim >= 2 only)
};

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

// One work item of the block grid: elements [begin, begin + len) of tensor `tensor`.
struct Block {
  int32_t tensor;
  int64_t begin;
  int64_t len;
};

}  // namespace dpk
