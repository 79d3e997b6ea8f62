// dpkern noise stream v1 (SPEC section 3): Philox-4x32-10 words and the word -> standard
// normal transform.
//
// z_j is a pure function of (key, step, stream, j): noise_range() computes whole groups of
// NOISE_GROUP elements aligned to the global index grid with one fixed vector code path, so
// the value of an element never depends on how a range is split across threads or calls.
//
// Every float32 operation of SPEC section 3 is done as the spec writes it; ln, cos and sin
// are evaluated in double and rounded once, so z is the correctly rounded result of each
// step (up to rare hard cases) and bit-identical on every CPU and clone (the extension is
// built with -ffp-contract=off: no FMA contraction). The reference's torch.log/cos are
// within 1 ulp of that; a float32 polynomial would add a few more ulps, which the
// ill-conditioned updates (the DP-AdamBC and DP-MacAdam clamps) amplify past 1e-5.
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

// ln(x) of a float x in [2^-126, 1], evaluated in double and rounded once: correctly
// rounded except in rare hard cases (fdlibm's log core: x = 2^k (1 + f),
// sqrt(1/2) <= 1 + f < sqrt(2), s = f / (2 + f), degree-14 polynomial, error < 1 ulp of
// double). The float32 result is what a correctly rounded float32 log returns.
DPK_INLINE float log_f32_cr(float x) {
  constexpr double Lg1 = 6.666666666666735130e-01, Lg2 = 3.999999999940941908e-01;
  constexpr double Lg3 = 2.857142874366239149e-01, Lg4 = 2.222219843214978396e-01;
  constexpr double Lg5 = 1.818357216161805012e-01, Lg6 = 1.531383769920937332e-01;
  constexpr double Lg7 = 1.479819860511658591e-01;
  constexpr double ln2 = 6.93147180559945286227e-01;
  uint32_t ix = f32_bits(x) + (0x3f800000u - 0x3f3504f3u);
  const double k = double(int32_t(ix >> 23) - 0x7f);
  ix = (ix & 0x007fffffu) + 0x3f3504f3u;
  const double f = double(f32_from_bits(ix)) - 1.0;  // exact
  const double s = f / (2.0 + f);
  const double z = s * s, w = z * z;
  const double t1 = w * (Lg2 + w * (Lg4 + w * Lg6));
  const double t2 = z * (Lg1 + w * (Lg3 + w * (Lg5 + w * Lg7)));
  const double hfsq = 0.5 * f * f;
  return float(k * ln2 - ((hfsq - s * (hfsq + (t1 + t2))) - f));
}

// cos(theta), sin(theta) of a float theta in [0, 2 pi + 1e-6], in double and rounded once:
// reduction by pi/2 in double (q <= 4: exact to ~1e-20), fdlibm's kernel polynomials.
DPK_INLINE void sincos_f32_cr(float theta, float& c, float& s) {
  constexpr double two_over_pi = 6.36619772367581382433e-01;
  constexpr double pio2_1 = 1.57079632673412561417e+00, pio2_1t = 6.07710050650619224932e-11;
  constexpr double S1 = -1.66666666666666324348e-01, S2 = 8.33333333332248946124e-03;
  constexpr double S3 = -1.98412698298579493134e-04, S4 = 2.75573137070700676789e-06;
  constexpr double S5 = -2.50507602534068634195e-08, S6 = 1.58969099521155010221e-10;
  constexpr double C1 = 4.16666666666666019037e-02, C2 = -1.38888888888741095749e-03;
  constexpr double C3 = 2.48015872894767294178e-05, C4 = -2.75573143513906633035e-07;
  constexpr double C5 = 2.08757232129817482790e-09, C6 = -1.13596475577881948265e-11;
  const double x = double(theta);
  const int32_t q = int32_t(x * two_over_pi + 0.5);
  const double qd = double(q);
  const double r = (x - qd * pio2_1) - qd * pio2_1t;
  const double z = r * r;
  const double sn = r + r * z * (S1 + z * (S2 + z * (S3 + z * (S4 + z * (S5 + z * S6)))));
  const double cs = 1.0 - 0.5 * z + z * z * (C1 + z * (C2 + z * (C3 + z * (C4 + z * (C5 + z * C6)))));
  const bool swap = (q & 1) != 0;
  const float c0 = float(swap ? sn : cs), s0 = float(swap ? cs : sn);
  c = f32_from_bits(f32_bits(c0) ^ (uint32_t((q + 1) & 2) << 30));
  s = f32_from_bits(f32_bits(s0) ^ (uint32_t(q & 2) << 30));
}

// The word -> normal transform of SPEC section 3: z for lane 0 (zc) and lane 1 (zs).
DPK_INLINE void normal_from_words(uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3,
                                  float& zc, float& zs) {
  // Each sum in this order, in float32 (the products with powers of two are exact).
  const float U = ((float(r0) * 0x1p-32f + float(r1) * 0x1p-64f) + float(r3) * 0x1p-96f) + 0x1p-97f;
  const float V = ((float(~r0) * 0x1p-32f + float(~r1) * 0x1p-64f) + float(~r3) * 0x1p-96f) + 0x1p-97f;
  const bool small_u = r0 < 0x80000000u;
  const float w = 1.0f - V;
  const float lx = log_f32_cr(small_u ? U : w);  // one log serves whichever branch is taken
  const float L_log1p = w == 1.0f ? V : ((-lx) * V) / (1.0f - w);
  const float L = small_u ? -lx : L_log1p;
  const float R = __builtin_sqrtf(2.0f * L);
  const float theta = TWO_PI_F32 * (float(r2) * 0x1p-32f);
  float c, s;
  sincos_f32_cr(theta, c, s);
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

}  // namespace dpk
