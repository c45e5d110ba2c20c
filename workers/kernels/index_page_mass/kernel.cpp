// Top-K's page mass on the CPU, scored on the key index's low-bit codes (see ops.py for the contract).
//
// Why a kernel: the torch path decodes the index to float32 keys (8x the bytes of 4-bit codes) and writes every
// mid token's logits, softmax and page sums to memory; at 4k tokens that traffic, not the arithmetic, is what a
// step pays. Here each 16-token tile of codes is unpacked in L1, scored against the query rows, and reduced at
// once to a per-page (max, sum of exp) pair per row: the per-token logits never leave the cache.
//
// Plain C++ with an extern "C" entry point, loaded through ctypes: no torch or pybind headers, so a build takes
// about a second. Threads are std::threads over KV heads, only for calls large enough to pay for them (ops.py:
// IndexPageMassConfig), not OpenMP: torch brings its own OpenMP runtime, and a second one in the process is trouble. Loops are written over the 16 lanes of a tile so that g++ -O3 vectorizes them.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;  // tokens per tile (the codes' layout, ops.py: CodeTiles)
constexpr float kLog2e = 1.4426950408889634f;
constexpr int kRowGroup = 4;  // query rows scored together (a decode step's GQA group of the shipped model: 4)
static_assert(kRowGroup == 4, "hsum4 and the row loops assume groups of 4 rows");

// GCC/Clang vector extensions: one tile's 16 tokens per vector (one AVX-512 register, two AVX2 ones); plain loops
// over 16 lanes were not vectorized reliably by g++ 12.
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint8_t v16b __attribute__((vector_size(16)));

inline v16f splat(float x) { return v16f{} + x; }

// 16 bytes zero-extended to int32 lanes: one vpmovzxbd where available (g++ 12 scalarizes a
// __builtin_convertvector from uint8 lanes, and the unpacking then costs more than the products).
#if defined(__AVX512F__)
#include <immintrin.h>
inline v16i widen(const uint8_t* p) {
  return (v16i)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#elif defined(__AVX2__)
#include <immintrin.h>
inline v16i widen(const uint8_t* p) {
  v16i out;
  const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
  std::memcpy(&out, &a, 32);
  std::memcpy(reinterpret_cast<char*>(&out) + 32, &b, 32);
  return out;
}
#else
inline v16i widen(const uint8_t* p) {
  v16b b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, v16i);
}
#endif

// 2^x to about 1 ulp for -126 <= x <= 0, clamped outside (below -126 gives ~1e-38, not 0: only valid lanes are
// summed). Cephes' expf polynomial on the reduced argument; rounding by the 1.5 * 2^23 trick.
inline v16f exp2_neg(v16f x) {
  x = x < -126.0f ? splat(-126.0f) : x;
  x = x > 0.0f ? splat(0.0f) : x;
  const v16f n = (x + 12582912.0f) - 12582912.0f;
  const v16f r = (x - n) * 0.6931471805599453f;
  v16f p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
  return p * (v16f)bits;  // a vector cast keeps the bits
}

typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

// Horizontal max and sum by halving (a serial loop over the lanes was a visible share of a tile's time).
inline float hmax(v16f v) {
  const v8f a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const v8f b = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v8f m8 = a > b ? a : b;
  const v4f c = __builtin_shufflevector(m8, m8, 0, 1, 2, 3), e = __builtin_shufflevector(m8, m8, 4, 5, 6, 7);
  const v4f m4 = c > e ? c : e;
  const float x = m4[0] > m4[1] ? m4[0] : m4[1], y = m4[2] > m4[3] ? m4[2] : m4[3];
  return x > y ? x : y;
}

inline float hsum(v16f v) {
  const v8f s8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4f s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) + __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// The 4 horizontal sums of a, b, c, d at once (a tile's 4 rows on one page): fewer shuffles, shorter chains.
inline v4f hsum4(v16f a, v16f b, v16f c, v16f d) {
  const v16f ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                  __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const v16f cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                  __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  v16f x = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  x += __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  x += __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v4f{x[0], x[4], x[8], x[12]};
}

// Whether any lane of l is above m.
inline bool exceeds(v16f l, float m) {
#if defined(__AVX512F__)
  return _mm512_cmp_ps_mask(reinterpret_cast<__m512>(l), _mm512_set1_ps(m), _CMP_GT_OQ) != 0;
#else
  return hmax(l) > m;
#endif
}

// Adds (m, s) -- a sum s of 2^(l - m) -- into a page's running pair.
inline void combine(float& pm, float& ps, float m, float s) {
  if (s == 0.0f) return;
  if (ps == 0.0f) {
    pm = m;
    ps = s;
  } else if (m > pm) {
    ps = ps * std::exp2(pm - m) + s;
    pm = m;
  } else {
    ps += s * std::exp2(m - pm);
  }
}

template <int kBits>
void head_page_mass(const uint8_t* tiles, const float* lo, const float* step, const float* q, float* out,
                    int64_t n_heads, int64_t h, int64_t d, int64_t block, int64_t rows, int64_t group,
                    int64_t start, int64_t end, int64_t page, int64_t p0, int64_t n_pages, float scale) {
  constexpr int64_t kPerByte = 8 / kBits;
  const int64_t bytes = d / kPerByte;  // code bytes per token
  const float ninf = -std::numeric_limits<float>::infinity();
  const int64_t padded_rows = (rows + kRowGroup - 1) / kRowGroup * kRowGroup;  // extra rows: zeros, unused
  std::vector<v16f> buf(d), logits(padded_rows);
  std::vector<float> w(padded_rows * d, 0.0f), qlo(padded_rows, 0.0f);
  const int64_t stride = (n_pages + kLanes - 1) / kLanes * kLanes;  // per row: pages, padded to whole vectors
  std::vector<float> pm(rows * stride, ninf), ps(rows * stride, 0.0f), run_max(padded_rows, ninf);
  v16f lane;
  for (int i = 0; i < 16; ++i) lane[i] = static_cast<float>(i);
  const float sc = scale * kLog2e;  // logits in base 2: the softmax is the same, exp2 is cheaper
  int64_t cur_block = -1;
  for (int64_t tile = start / kLanes; tile * kLanes < end; ++tile) {
    const int64_t n0 = tile * kLanes;
    const int64_t a = std::max(start, n0) - n0, z = std::min(end, n0 + kLanes) - n0;  // valid lanes [a, z)
    const uint8_t* c = tiles + tile * bytes * kLanes;
    // unpack: byte j of a token holds channel j (8 bits) or channels 2j (low nibble) and 2j + 1 (high)
    for (int64_t j = 0; j < bytes; ++j) {
      const v16i ci = widen(c + j * kLanes);
      if (kBits == 8) {
        buf[j] = __builtin_convertvector(ci, v16f);
      } else {
        buf[2 * j] = __builtin_convertvector(ci & 0xF, v16f);
        buf[2 * j + 1] = __builtin_convertvector(ci >> 4, v16f);
      }
    }
    // a tile spans one block when block is a multiple of 16 (the default, 64); any block size is handled
    for (int64_t b = (n0 + a) / block; b * block < n0 + z; ++b) {
      if (b != cur_block) {  // per block: q . k = q . lo + (q * step) . codes, both scaled
        cur_block = b;
        const float* lb = lo + b * d;
        const float* sb = step + b * d;
        for (int64_t r = 0; r < rows; ++r) {
          const float* qr = q + r * d;
          float acc = 0.0f;
#pragma omp simd reduction(+ : acc)  // a float sum is only vectorized when allowed to reorder
          for (int64_t k = 0; k < d; ++k) {
            w[r * d + k] = qr[k] * sb[k] * sc;
            acc += qr[k] * lb[k];
          }
          qlo[r] = acc * sc;
        }
      }
      const float ba = static_cast<float>(std::max(a, b * block - n0));
      const float bz = static_cast<float>(std::min(z, (b + 1) * block - n0));
      const auto in_block = (lane >= ba) & (lane < bz);
      for (int64_t r = 0; r < rows; r += kRowGroup) {
        // 4 rows at once, even and odd channels apart: 8 independent FMA chains (latency 4, two ports), each code
        // vector loaded once for the 4 rows
        const float* wr = w.data() + r * d;
        v16f acc[kRowGroup], acc_odd[kRowGroup];
        for (int i = 0; i < kRowGroup; ++i) {
          acc[i] = splat(qlo[r + i]);
          acc_odd[i] = splat(0.0f);
        }
        int64_t k = 0;
        for (; k + 1 < d; k += 2) {
          const v16f b0 = buf[k], b1 = buf[k + 1];
          for (int i = 0; i < kRowGroup; ++i) {
            acc[i] += wr[i * d + k] * b0;
            acc_odd[i] += wr[i * d + k + 1] * b1;
          }
        }
        if (k < d)
          for (int i = 0; i < kRowGroup; ++i) acc[i] += wr[i * d + k] * buf[k];
        for (int i = 0; i < kRowGroup; ++i) logits[r + i] = in_block ? acc[i] + acc_odd[i] : logits[r + i];
      }
    }
    // per row: 2^(l - m) per lane against the row's running max m, summed per page the lanes fall in. The max
    // moves on a few tiles of a row only; a horizontal max per tile sat on every tile's dependency chain.
    const auto valid = (lane >= static_cast<float>(a)) & (lane < static_cast<float>(z));
    if ((n0 + a) / page == (n0 + z - 1) / page) {  // the tile's valid lanes on one page (page % 16 == 0: always)
      const int64_t u = (n0 + a) / page - p0;
      for (int64_t r = 0; r < rows; r += kRowGroup) {  // padded rows (zero logits) are summed, never stored
        v16f e[kRowGroup];
        for (int i = 0; i < kRowGroup; ++i) {
          const v16f l = valid ? logits[r + i] : splat(ninf);
          if (exceeds(l, run_max[r + i])) run_max[r + i] = std::max(run_max[r + i], hmax(l));
          e[i] = valid ? exp2_neg(l - run_max[r + i]) : splat(0.0f);
        }
        const v4f sums = hsum4(e[0], e[1], e[2], e[3]);
        for (int i = 0; i < kRowGroup && r + i < rows; ++i)
          combine(pm[(r + i) * stride + u], ps[(r + i) * stride + u], run_max[r + i], sums[i]);
      }
      continue;
    }
    for (int64_t r = 0; r < rows; ++r) {
      const v16f l = valid ? logits[r] : splat(ninf);
      if (exceeds(l, run_max[r])) run_max[r] = std::max(run_max[r], hmax(l));
      const float m = run_max[r];
      const v16f e = valid ? exp2_neg(l - m) : splat(0.0f);
      for (int64_t t = a; t < z;) {  // one run when the page size is a multiple of 16 (the store's: 16)
        const int64_t u = (n0 + t) / page;
        const int64_t run_end = std::min(z, (u + 1) * page - n0);
        const float fa = static_cast<float>(t), fz = static_cast<float>(run_end);
        const float sum = (t == a && run_end == z) ? hsum(e) : hsum((lane >= fa) & (lane < fz) ? e : splat(0.0f));
        combine(pm[r * stride + u - p0], ps[r * stride + u - p0], m, sum);
        t = run_end;
      }
    }
  }
  // each row's softmax mass per page, averaged over the group's rows: out[t, h, u]. The running max is the row's
  // max, and no page's reference is above it; vectorized over pages (libm's exp2 per page was ~10% of a call).
  std::vector<float> mass(stride);
  for (int64_t r = 0; r < rows; ++r) {
    const float gm = run_max[r];
    if (gm == ninf) continue;  // no mid token (cannot happen for a non-empty range)
    v16f total = splat(0.0f);
    for (int64_t u = 0; u < stride; u += kLanes) {
      v16f m, s;
      std::memcpy(&m, pm.data() + r * stride + u, sizeof m);
      std::memcpy(&s, ps.data() + r * stride + u, sizeof s);
      const v16f x = s > 0.0f ? s * exp2_neg(m - gm) : splat(0.0f);  // empty pages (pm -inf) stay 0
      std::memcpy(mass.data() + u, &x, sizeof x);
      total += x;
    }
    const float inv = 1.0f / (hsum(total) * static_cast<float>(group));
    float* o = out + ((r / group) * n_heads + h) * n_pages;
    for (int64_t u = 0; u < n_pages; ++u) o[u] += mass[u] * inv;
  }
}

}  // namespace

// tiles [H, n_tiles, bytes, 16] uint8; lo, step [H, blocks, D] float32; q [H, R, D] float32 (rows r = t * G + g);
// out [T, H, n_pages] float32, zeroed by the caller; KV heads split over up to n_threads threads (each head's
// pages are its own: the same bits whatever the split). Returns 0, or -1 for unsupported bits.
extern "C" int kvstash_index_page_mass(const uint8_t* tiles, const float* lo, const float* step, const float* q,
                                       float* out, int64_t n_heads, int64_t n_tiles, int64_t d, int64_t bits,
                                       int64_t block, int64_t blocks, int64_t rows, int64_t group, int64_t start,
                                       int64_t end, int64_t page, int64_t p0, int64_t n_pages, float scale,
                                       int64_t n_threads) {
  if (bits != 4 && bits != 8) return -1;
  const int64_t bytes = d * bits / 8;
  auto heads = [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) {
      const uint8_t* th = tiles + h * n_tiles * bytes * kLanes;
      const float* lh = lo + h * blocks * d;
      const float* sh = step + h * blocks * d;
      const float* qh = q + h * rows * d;
      if (bits == 4)
        head_page_mass<4>(th, lh, sh, qh, out, n_heads, h, d, block, rows, group, start, end, page, p0, n_pages,
                          scale);
      else
        head_page_mass<8>(th, lh, sh, qh, out, n_heads, h, d, block, rows, group, start, end, page, p0, n_pages,
                          scale);
    }
  };
  const int64_t n = std::max<int64_t>(1, std::min(n_threads, n_heads));
  std::vector<std::thread> pool;
  for (int64_t i = 1; i < n; ++i) pool.emplace_back(heads, i * n_heads / n, (i + 1) * n_heads / n);
  heads(0, n_heads / n);  // the calling thread takes the first share
  for (auto& th : pool) th.join();
  return 0;
}

// 1 when this build has the AVX-512 code paths. Only those are measured faster than torch's product over decoded
// keys (4k tokens of the shipped model: 0.10 ms against 0.33; an AVX2 build takes 0.48, plain x86-64 0.79), so the
// loader prefers torch without them (ops.py: cpu_kernel_preferred).
extern "C" int kvstash_index_page_mass_avx512() {
#if defined(__AVX512F__)
  return 1;
#else
  return 0;
#endif
}
