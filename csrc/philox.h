// dpkern noise stream v1 (SPEC section 3): Philox-4x32-10 words and the word -> standard
// normal transform.
//
// z_j is a pure function of (key, step, stream, j): noise_range() computes whole groups of
// NOISE_GROUP elements aligned to the global index grid with one fixed vector code path, so
// the value of an element never depends on how a range is split across threads or calls.
//
// The float32 sums of SPEC section 3 are done exactly as the spec writes them; ln, cos and
// sin are float32 polynomials (Cephes) with no division and no table, so the transform
// vectorises whole (16 lanes with AVX-512). Against a float64 evaluation, z stays within
// 0.3 of the SPEC's tolerance max(2e-6, 1e-6 |z|) (bound from exhaustive checks of the
// radius over every float U and V in [2^-97, 1/2] and of cos / sin over all 2^32 values of
// r2; tests/test_cpp_backend.py checks random and edge words). The extension is built with
// -ffp-contract=off (no FMA contraction) and uses only IEEE-rounded operations, so z is
// bit-identical on every CPU, clone and thread count.
#pragma once

#include "common.h"

namespace dpk {

constexpr uint32_t PHILOX_M0 = 0xD2511F53u, PHILOX_M1 = 0xCD9E8D57u;  // round multipliers
constexpr uint32_t PHILOX_W0 = 0x9E3779B9u, PHILOX_W1 = 0xBB67AE85u;  // Weyl key increments
// float32(2 pi), the constant of SPEC section 3 (reference.TWO_PI_F32).
constexpr float TWO_PI_F32 = 6.28318548202514648438f;

// Philox-4x32-10 in place on the counter words (Salmon et al. 2011). The 32x32 -> 64-bit
// products vectorise (vpmuludq).
DPK_INLINE void philox4x32_10(uint32_t& c0, uint32_t& c1, uint32_t& c2, uint32_t& c3,
                              uint32_t k0, uint32_t k1) {
  for (int r = 0; r < 10; ++r) {
    const uint64_t p0 = uint64_t(PHILOX_M0) * c0;
    const uint64_t p1 = uint64_t(PHILOX_M1) * c2;
    const uint32_t n0 = uint32_t(p1 >> 32) ^ c1 ^ k0;
    const uint32_t n2 = uint32_t(p0 >> 32) ^ c3 ^ k1;
    c1 = uint32_t(p1);
    c3 = uint32_t(p0);
    c0 = n0;
    c2 = n2;
    k0 += PHILOX_W0;
    k1 += PHILOX_W1;
  }
}

// Counter words c2, c3 of step t and stream s: (t mod 2^32, (s << 16) | ((t >> 32) mod 2^16)).
DPK_INLINE uint32_t counter2(uint64_t step) { return uint32_t(step); }
DPK_INLINE uint32_t counter3(uint64_t step, uint32_t stream) {
  return ((stream & 0xFFFFu) << 16) | uint32_t((step >> 32) & 0xFFFFu);
}

// ln(x) of a normal float x in [2^-126, 1], in float32 (Cephes logf, S. Moshier): x =
// 2^k (1 + f), sqrt(1/2) <= 1 + f < sqrt(2) (f exact), ln(1 + f) = f - f^2/2 + f^3 P(f),
// k ln 2 in two parts. No division and no table, so the loops over it vectorise whole
// (16 lanes with AVX-512). Error about 1 ulp, relative to ln x, including x near 1 (the
// log1p branch) and x down to 2^-97 (the tail).
DPK_INLINE float log_f32(float x) {
  uint32_t ix = f32_bits(x) + (0x3f800000u - 0x3f3504f3u);
  const float k = float(int32_t(ix >> 23) - 0x7f);
  ix = (ix & 0x007fffffu) + 0x3f3504f3u;
  const float f = f32_from_bits(ix) - 1.0f;  // exact (Sterbenz)
  const float z = f * f;
  float p = 7.0376836292e-2f;
  p = p * f - 1.1514610310e-1f;
  p = p * f + 1.1676998740e-1f;
  p = p * f - 1.2420140846e-1f;
  p = p * f + 1.4249322787e-1f;
  p = p * f - 1.6668057665e-1f;
  p = p * f + 2.0000714765e-1f;
  p = p * f - 2.4999993993e-1f;
  p = p * f + 3.3333331174e-1f;
  float y = p * f * z;
  y = y + k * -2.12194440e-4f;  // ln 2 = 0.693359375 - 2.12194440e-4 (first part exact)
  y = y - 0.5f * z;
  return (f + y) + k * 0.693359375f;
}

// cos(theta), sin(theta) of a float theta in [0, 2 pi + 1e-6], in float32 (Cephes
// sinf/cosf): theta = q pi/2 + r, |r| <= pi/4, q <= 4, with pi/2 in three parts (q times
// the first two is exact, theta - q P1 is exact by Sterbenz), then the minimax
// polynomials of sin and cos on [-pi/4, pi/4] (about 0.5 ulp each) and the quadrant's
// swap and signs. Absolute error near the zeros of cos and sin is a few 1e-8 times |r|.
DPK_INLINE void sincos_f32(float theta, float& c, float& s) {
  constexpr float P1 = 1.5703125f, P2 = 4.837512969970703125e-4f, P3 = 7.54978995489188216e-8f;
  const int32_t q = int32_t(theta * 0.636619772367581343f + 0.5f);  // theta >= 0: round
  const float qf = float(q);
  const float r = ((theta - qf * P1) - qf * P2) - qf * P3;
  const float z = r * r;
  const float sn = ((-1.9515295891e-4f * z + 8.3321608736e-3f) * z - 1.6666654611e-1f) * z * r + r;
  const float cs = (((2.443315711809948e-5f * z - 1.388731625493765e-3f) * z + 4.166664568298827e-2f) * z) * z -
                   0.5f * z + 1.0f;
  const bool swap = (q & 1) != 0;
  const float c0 = swap ? sn : cs, s0 = swap ? cs : sn;
  c = f32_from_bits(f32_bits(c0) ^ (uint32_t((q + 1) & 2) << 30));
  s = f32_from_bits(f32_bits(s0) ^ (uint32_t(q & 2) << 30));
}

// The word -> normal transform of SPEC section 3: z for lane 0 (zc) and lane 1 (zs).
// Only the uniform a lane's branch uses is summed: U from (r0, r1, r3) if r0 < 2^31, else V
// from their complements (the same float32 sums as the SPEC, in the same order). The
// log1p branch, L = -ln(1 - V) with w = 1 - V, is -ln w + (V - d) / w with d = 1 - w (w - 1
// and V - d are exact by Sterbenz, and 1 / w = (1 + d)(1 + d^2) to a relative 1/16 of a
// correction that is at most 2^-25): within a fraction of an ulp of the SPEC's
// ((-ln w) V) / (1 - w), equal to V where w == 1, and without a division.
//
// radius(X, small_u) = R = sqrt(2 L) from X = U (small_u) or X = V.
DPK_INLINE float radius(float X, bool small_u) {
  const float arg = small_u ? X : 1.0f - X;  // U or w
  const float lx = log_f32(arg);
  const float d = 1.0f - arg;
  const float corr = small_u ? 0.0f : ((X - d) * (1.0f + d)) * (1.0f + d * d);
  const float L = corr - lx;
  return __builtin_sqrtf(2.0f * L);
}

DPK_INLINE void normal_from_words(uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3,
                                  float& zc, float& zs) {
  const uint32_t flip = uint32_t(int32_t(r0) >> 31);  // 0: U branch (r0 < 2^31); ~0: V
  const float X = ((float(r0 ^ flip) * 0x1p-32f + float(r1 ^ flip) * 0x1p-64f) +
                   float(r3 ^ flip) * 0x1p-96f) + 0x1p-97f;  // U or V
  const float R = radius(X, flip == 0);
  const float theta = TWO_PI_F32 * (float(r2) * 0x1p-32f);
  float c, s;
  sincos_f32(theta, c, s);
  zc = R * c;
  zs = R * s;
}

// Philox words of the NOISE_GROUP / 2 pairs (lo0 + l, hi), l < NOISE_GROUP / 2: words[w][l]
// is word r_w of pair l. Defined in noise.cpp: hand-vectorised for AVX-512 and AVX2
// (vpmuludq; compilers turn the 32x32 -> 64-bit products into slower 64-bit multiplies) with
// a portable loop for other CPUs, picked at run time. All paths give the same integers.
constexpr int GROUP_PAIRS = int(NOISE_GROUP / 2);
using GroupWords = uint32_t[4][GROUP_PAIRS];
void philox_group(uint32_t lo0, uint32_t hi, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1,
                  GroupWords& words);
// The Philox path philox_group takes: 2 = AVX-512, 1 = AVX2, 0 = portable; set_philox_path
// lowers it (for tests) and returns the path now in use (never above what the CPU has).
int philox_path();
int set_philox_path(int path);

// Elements [first, first + NOISE_GROUP) of the stream, first a multiple of NOISE_GROUP.
// The transform is one fixed loop over the group: the compiler vectorises it whole, with no
// scalar remainder, so every element always comes out of the same instructions.
DPK_INLINE void noise_group(uint64_t key, uint64_t step, uint32_t stream, uint64_t first,
                            float* __restrict out) {
  const uint64_t pair0 = first >> 1;  // a multiple of GROUP_PAIRS: its low word never carries
  alignas(64) GroupWords w;
  philox_group(uint32_t(pair0), uint32_t(pair0 >> 32), counter2(step), counter3(step, stream),
               uint32_t(key), uint32_t(key >> 32), w);
  alignas(64) float zc[GROUP_PAIRS];
  alignas(64) float zs[GROUP_PAIRS];
  for (int l = 0; l < GROUP_PAIRS; ++l) normal_from_words(w[0][l], w[1][l], w[2][l], w[3][l], zc[l], zs[l]);
  for (int l = 0; l < GROUP_PAIRS; ++l) {
    out[2 * l] = zc[l];
    out[2 * l + 1] = zs[l];
  }
}

// z for the global elements [first, first + n): whole aligned groups, written straight to
// out where a group lies inside the range, through a small buffer at the two ends.
DPK_INLINE void noise_range(uint64_t key, uint64_t step, uint32_t stream, uint64_t first,
                            int64_t n, float* __restrict out) {
  if (n <= 0) return;
  const uint64_t end = first + uint64_t(n);
  for (uint64_t g = first - first % NOISE_GROUP; g < end; g += NOISE_GROUP) {
    if (g >= first && g + NOISE_GROUP <= end) {
      noise_group(key, step, stream, g, out + (g - first));
    } else {
      alignas(64) float tmp[NOISE_GROUP];
      noise_group(key, step, stream, g, tmp);
      const uint64_t a = g < first ? first : g;
      const uint64_t b = g + NOISE_GROUP < end ? g + NOISE_GROUP : end;
      for (uint64_t j = a; j < b; ++j) out[j - first] = tmp[j - g];
    }
  }
}

// The rounding stream (SPEC 3.2): rho_j = w_j >> 16, w_j = r0 (lane 0) or r2 (lane 1) of
// the noise stream's counter of j under stream ROUNDING_STREAM. Elements [first, first +
// NOISE_GROUP) of it, first a multiple of NOISE_GROUP (the same vector Philox as the noise).
DPK_INLINE void rounding_group(uint64_t key, uint64_t step, uint64_t first,
                               uint16_t* __restrict out) {
  const uint64_t pair0 = first >> 1;
  alignas(64) GroupWords w;
  philox_group(uint32_t(pair0), uint32_t(pair0 >> 32), counter2(step),
               counter3(step, ROUNDING_STREAM), uint32_t(key), uint32_t(key >> 32), w);
  for (int l = 0; l < GROUP_PAIRS; ++l) {
    out[2 * l] = uint16_t(w[0][l] >> 16);
    out[2 * l + 1] = uint16_t(w[2][l] >> 16);
  }
}

// rho for the global elements [first, first + n), as noise_range.
DPK_INLINE void rounding_range(uint64_t key, uint64_t step, uint64_t first, int64_t n,
                               uint16_t* __restrict out) {
  if (n <= 0) return;
  const uint64_t end = first + uint64_t(n);
  for (uint64_t g = first - first % NOISE_GROUP; g < end; g += NOISE_GROUP) {
    if (g >= first && g + NOISE_GROUP <= end) {
      rounding_group(key, step, g, out + (g - first));
    } else {
      alignas(64) uint16_t tmp[NOISE_GROUP];
      rounding_group(key, step, g, tmp);
      const uint64_t a = g < first ? first : g;
      const uint64_t b = g + NOISE_GROUP < end ? g + NOISE_GROUP : end;
      for (uint64_t j = a; j < b; ++j) out[j - first] = tmp[j - g];
    }
  }
}

}  // namespace dpk
