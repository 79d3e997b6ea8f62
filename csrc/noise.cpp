// The noise stream's entry points (reference.philox_words, reference.gaussian_noise), the
// block grid and the thread count.
#include "kernels.h"
#include "philox.h"

#ifdef __linux__
#include <sys/mman.h>
#endif

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define DPK_X86 1
#endif

namespace dpk {

// ---------------------------------------------------------------------------------------
// Philox groups (philox.h): GROUP_PAIRS consecutive counters, four independent chains.
namespace {

void philox_group_portable(uint32_t lo0, uint32_t hi, uint32_t c2, uint32_t c3, uint32_t k0,
                           uint32_t k1, GroupWords& words) {
  for (int l = 0; l < GROUP_PAIRS; ++l) {
    uint32_t x0 = lo0 + uint32_t(l), x1 = hi, x2 = c2, x3 = c3;
    philox4x32_10(x0, x1, x2, x3, k0, k1);
    words[0][l] = x0;
    words[1][l] = x1;
    words[2][l] = x2;
    words[3][l] = x3;
  }
}

#ifdef DPK_X86
// GCC 12's avx512fintrin.h trips -Wuninitialized on its own _mm512_undefined_* helpers.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// One pair per 64-bit lane, its words in the low halves: vpmuludq reads only the low 32
// bits of each lane, so the full 64-bit products come out directly (high word: one shift;
// low word: the product itself, whose high half is ignored by the next multiply and
// dropped by the final narrowing). Six instructions per round for W pairs.
__attribute__((target("avx512f"))) void philox_group_avx512(
    uint32_t lo0, uint32_t hi, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1,
    GroupWords& words) {
  constexpr int V = 4;  // 32 pairs at a time: 16 state registers, no spills
  const __m512i m0 = _mm512_set1_epi64(PHILOX_M0), m1 = _mm512_set1_epi64(PHILOX_M1);
  const __m512i iota = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7);
  for (int base = 0; base < GROUP_PAIRS; base += 8 * V) {
    __m512i x0[V], x1[V], x2[V], x3[V];
    for (int v = 0; v < V; ++v) {
      x0[v] = _mm512_add_epi64(_mm512_set1_epi64(int64_t(lo0 + uint32_t(base + 8 * v))), iota);
      x1[v] = _mm512_set1_epi64(int64_t(hi));
      x2[v] = _mm512_set1_epi64(int64_t(c2));
      x3[v] = _mm512_set1_epi64(int64_t(c3));
    }
    for (int r = 0; r < 10; ++r) {
      const __m512i kk0 = _mm512_set1_epi32(int(k0 + uint32_t(r) * PHILOX_W0));
      const __m512i kk1 = _mm512_set1_epi32(int(k1 + uint32_t(r) * PHILOX_W1));
      for (int v = 0; v < V; ++v) {
        const __m512i p0 = _mm512_mul_epu32(x0[v], m0);
        const __m512i p1 = _mm512_mul_epu32(x2[v], m1);
        x0[v] = _mm512_ternarylogic_epi32(_mm512_srli_epi64(p1, 32), x1[v], kk0, 0x96);  // xor3
        x2[v] = _mm512_ternarylogic_epi32(_mm512_srli_epi64(p0, 32), x3[v], kk1, 0x96);
        x1[v] = p1;
        x3[v] = p0;
      }
    }
    // The low halves, narrowed (vpmovqd) and joined into 16-word vectors: whole 64-byte
    // stores, which the transform's 64-byte loads can forward from.
    const __m512i* xs[4] = {x0, x1, x2, x3};
    for (int w = 0; w < 4; ++w) {
      for (int v = 0; v < V; v += 2) {
        const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi64_epi32(xs[w][v])),
                                                _mm512_cvtepi64_epi32(xs[w][v + 1]), 1);
        _mm512_store_si512(reinterpret_cast<__m512i*>(&words[w][base + 8 * v]), both);
      }
    }
  }
}

__attribute__((target("avx2"))) void philox_group_avx2(
    uint32_t lo0, uint32_t hi, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1,
    GroupWords& words) {
  constexpr int V = GROUP_PAIRS / 8;
  const __m256i m0 = _mm256_set1_epi64x(PHILOX_M0), m1 = _mm256_set1_epi64x(PHILOX_M1);
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256i x0[V], x1[V], x2[V], x3[V];
  for (int v = 0; v < V; ++v) {
    x0[v] = _mm256_add_epi32(_mm256_set1_epi32(int(lo0 + 8u * uint32_t(v))), iota);
    x1[v] = _mm256_set1_epi32(int(hi));
    x2[v] = _mm256_set1_epi32(int(c2));
    x3[v] = _mm256_set1_epi32(int(c3));
  }
  for (int r = 0; r < 10; ++r) {
    const __m256i kk0 = _mm256_set1_epi32(int(k0 + uint32_t(r) * PHILOX_W0));
    const __m256i kk1 = _mm256_set1_epi32(int(k1 + uint32_t(r) * PHILOX_W1));
    for (int v = 0; v < V; ++v) {
      const __m256i e0 = _mm256_mul_epu32(x0[v], m0);
      const __m256i o0 = _mm256_mul_epu32(_mm256_srli_epi64(x0[v], 32), m0);
      const __m256i e1 = _mm256_mul_epu32(x2[v], m1);
      const __m256i o1 = _mm256_mul_epu32(_mm256_srli_epi64(x2[v], 32), m1);
      const __m256i hi0 = _mm256_blend_epi32(_mm256_srli_epi64(e0, 32), o0, 0xAA);
      const __m256i lo_0 = _mm256_blend_epi32(e0, _mm256_slli_epi64(o0, 32), 0xAA);
      const __m256i hi1 = _mm256_blend_epi32(_mm256_srli_epi64(e1, 32), o1, 0xAA);
      const __m256i lo_1 = _mm256_blend_epi32(e1, _mm256_slli_epi64(o1, 32), 0xAA);
      x0[v] = _mm256_xor_si256(_mm256_xor_si256(hi1, x1[v]), kk0);
      x2[v] = _mm256_xor_si256(_mm256_xor_si256(hi0, x3[v]), kk1);
      x1[v] = lo_1;
      x3[v] = lo_0;
    }
  }
  for (int v = 0; v < V; ++v) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(&words[0][8 * v]), x0[v]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(&words[1][8 * v]), x1[v]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(&words[2][8 * v]), x2[v]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(&words[3][8 * v]), x3[v]);
  }
}

#pragma GCC diagnostic pop

int detect_philox_path() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return 2;
  if (__builtin_cpu_supports("avx2")) return 1;
  return 0;
}
#else
int detect_philox_path() { return 0; }
#endif

const int g_cpu_philox_path = detect_philox_path();
int g_philox_path = g_cpu_philox_path;

}  // namespace

void philox_group(uint32_t lo0, uint32_t hi, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1,
                  GroupWords& words) {
#ifdef DPK_X86
  if (g_philox_path == 2) return philox_group_avx512(lo0, hi, c2, c3, k0, k1, words);
  if (g_philox_path == 1) return philox_group_avx2(lo0, hi, c2, c3, k0, k1, words);
#endif
  philox_group_portable(lo0, hi, c2, c3, k0, k1, words);
}

int philox_path() { return g_philox_path; }

int set_philox_path(int path) {
  g_philox_path = path < 0 ? g_cpu_philox_path : (path < g_cpu_philox_path ? path : g_cpu_philox_path);
  return g_philox_path;
}

namespace {
int g_num_threads = 0;  // <= 0: OpenMP's default (OMP_NUM_THREADS or the core count)
}

int num_threads() {
#ifdef _OPENMP
  return g_num_threads > 0 ? g_num_threads : omp_get_max_threads();
#else
  return 1;
#endif
}

void set_num_threads(int n) { g_num_threads = n; }

std::vector<Block> make_blocks(const std::vector<int64_t>& numels,
                               const std::vector<uint64_t>& offsets, int64_t block) {
  std::vector<Block> blocks;
  for (size_t k = 0; k < numels.size(); ++k) {
    const uint64_t first = offsets.empty() ? 0 : offsets[k];
    const uint64_t end = first + uint64_t(numels[k]);
    for (uint64_t a = first; a < end;) {
      const uint64_t next = (a / uint64_t(block) + 1) * uint64_t(block);
      const uint64_t b = next < end ? next : end;
      blocks.push_back({int32_t(k), int64_t(a - first), int64_t(b - a)});
      a = b;
    }
  }
  return blocks;
}

namespace {

DPK_CLONES void noise_block(uint64_t key, uint64_t step, uint32_t stream, uint64_t first,
                            int64_t n, float* out) {
  noise_range(key, step, stream, first, n, out);
}

DPK_CLONES void words_block(const int64_t* index, int64_t n, uint64_t key, uint64_t step,
                            uint32_t stream, int64_t* out) {
  const uint32_t c2 = counter2(step), c3 = counter3(step, stream);
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t pair = uint64_t(index[i]) >> 1;
    uint32_t x0 = uint32_t(pair), x1 = uint32_t(pair >> 32), x2 = c2, x3 = c3;
    philox4x32_10(x0, x1, x2, x3, uint32_t(key), uint32_t(key >> 32));
    out[4 * i] = x0;
    out[4 * i + 1] = x1;
    out[4 * i + 2] = x2;
    out[4 * i + 3] = x3;
  }
}

DPK_CLONES void transform_block(const uint32_t* words, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t* w = words + 4 * i;
    normal_from_words(w[0], w[1], w[2], w[3], out[2 * i], out[2 * i + 1]);
  }
}

}  // namespace

void philox_words(const int64_t* index, int64_t n, uint64_t key, uint64_t step,
                  uint32_t stream, int64_t* out) {
  const int64_t nb = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static) num_threads(num_threads()) if (nb > 1)
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t a = b * BLOCK, len = n - a < BLOCK ? n - a : BLOCK;
    words_block(index + a, len, key, step, stream, out + 4 * a);
  }
}

namespace {
// A large output is usually fresh memory (torch.empty): its first write faults in each
// page, and with 4 KiB pages those faults cost about as much as drawing the noise. Ask for
// transparent huge pages on the 2 MiB-aligned interior (what PyTorch's own
// THP_MEM_ALLOC_ENABLE does for every allocation); advice only: it changes no value, and
// where the kernel refuses it nothing happens.
void advise_huge_pages(void* p, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t HUGE = uintptr_t(2) << 20;
  const uintptr_t a = (uintptr_t(p) + HUGE - 1) & ~(HUGE - 1);
  const uintptr_t b = (uintptr_t(p) + uintptr_t(bytes)) & ~(HUGE - 1);
  if (b >= a + 2 * HUGE) (void)madvise(reinterpret_cast<void*>(a), b - a, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}
}  // namespace

void gaussian_noise(float* out, int64_t n, uint64_t key, uint64_t step, uint64_t offset,
                    uint32_t stream) {
  advise_huge_pages(out, n * int64_t(sizeof(float)));
  const std::vector<Block> blocks = make_blocks({n}, {offset});
  const int64_t nb = int64_t(blocks.size());
#pragma omp parallel for schedule(dynamic, 4) num_threads(num_threads()) if (nb > 1)
  for (int64_t b = 0; b < nb; ++b) {
    const Block& blk = blocks[size_t(b)];
    noise_block(key, step, stream, offset + uint64_t(blk.begin), blk.len, out + blk.begin);
  }
}

void normal_from_words(const uint32_t* words, int64_t n, float* out) {
  transform_block(words, n, out);
}

namespace {
DPK_CLONES void round_block(const float* x, int64_t n, uint64_t key, uint64_t step,
                            uint64_t first, uint16_t* out) {
  alignas(64) uint16_t rho[BLOCK];
  rounding_range(key, step, first, n, rho);
  for (int64_t j = 0; j < n; ++j) out[j] = f32_to_bf16_sr(x[j], rho[j]);
}
}  // namespace

void rounding_bits(int64_t* out, int64_t n, uint64_t key, uint64_t step, uint64_t offset) {
  const std::vector<Block> blocks = make_blocks({n}, {offset});
  const int64_t nb = int64_t(blocks.size());
#pragma omp parallel for schedule(dynamic, 4) num_threads(num_threads()) if (nb > 1)
  for (int64_t b = 0; b < nb; ++b) {
    const Block& blk = blocks[size_t(b)];
    alignas(64) uint16_t rho[BLOCK];
    rounding_range(key, step, offset + uint64_t(blk.begin), blk.len, rho);
    for (int64_t j = 0; j < blk.len; ++j) out[blk.begin + j] = rho[j];
  }
}

void stochastic_round_bf16(const float* x, int64_t n, uint64_t key, uint64_t step,
                           uint64_t offset, uint16_t* out) {
  const std::vector<Block> blocks = make_blocks({n}, {offset});
  const int64_t nb = int64_t(blocks.size());
#pragma omp parallel for schedule(dynamic, 4) num_threads(num_threads()) if (nb > 1)
  for (int64_t b = 0; b < nb; ++b) {
    const Block& blk = blocks[size_t(b)];
    round_block(x + blk.begin, blk.len, key, step, offset + uint64_t(blk.begin), out + blk.begin);
  }
}

}  // namespace dpk
