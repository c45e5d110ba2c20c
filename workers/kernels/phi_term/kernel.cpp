// φ completion's per-step term on the CPU (see ops.py for the contracts): the distilled map's head-wise MLP, the
// packing of a step's newly attended keys, the remainder's subtraction and evaluation, and kvstash_phi_step, all
// of it in one call.
//
// Why a kernel: at 4k tokens of the shipped model a step's φ term is a few hundred thousand multiply-adds per
// layer but was about 40 small torch ops (each a few microseconds of dispatch and allocation on one core). Plain
// C++ with extern "C" entry points, loaded through ctypes (no torch headers), single threaded (a call is tens of
// microseconds). Loops run over 16-float vectors (GCC vector extensions) or contiguous channels so that g++ -O3
// vectorizes them; exp is a vectorizable polynomial (Cephes' expf, about 1 ulp) and the GELU's erf is the formula
// torch's vectorized CPU GELU uses (Abramowitz-Stegun 7.1.26 with exp), so results match torch to float32
// rounding. Each MLP row is computed alone (the same bits whatever rows come with it).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// Cephes' expf on a clamped argument c, for a float or 16 lanes: returns e^(c - fx ln 2) by its polynomial and sets
// fx, c / ln 2 rounded to nearest (the caller scales by 2^fx).
template <class T>
inline T exp_reduced(T c, T& fx) {
  fx = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  T r = c - fx * 0.693359375f;
  r = r - fx * -2.12194440e-4f;
  const T z = r * r;
  T y = T{} + 1.9875691500e-4f;  // T{} + x: x itself, or x on every lane
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  return y * z + r + 1.0f;
}

// e^x to about 1 ulp; 0 below -87.3 (where float32 goes denormal) and for -inf, clamped to e^88 above.
inline float exp_f(float x) {
  const bool tiny = x < -87.33654f;
  float fx;
  const float y = exp_reduced(std::min(std::max(x, -87.33654f), 88.0f), fx);
  const int32_t n = static_cast<int32_t>(fx);
  const int32_t bits = (n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return tiny ? 0.0f : y * scale;
}

// The weights of one layer of a HeadwiseMLP (phi_maps.py): [H, D, E], [H, E], [H, E, E], [H, E], [H, E, E], [H, E],
// [H], [H, E, F], [H, F], each contiguous.
struct Mlp {
  const float* w0;
  const float* b0;
  const float* w1;
  const float* b1;
  const float* w2;
  const float* b2;
  const float* alpha;
  const float* wo;
  const float* bo;
  int64_t d, e, f;
};

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;
constexpr int64_t kRows = 4;  // rows through the MLP together: each weight vector loaded once for 4 rows
// Weight rows prefetched ahead. 64: past a 64-row matrix that is the next head's same matrix (the weights are
// [H, rows, cols]). 8, 16, 32 and 64 measured alike within this VM's noise (a step's weights come from L3).
constexpr int64_t kAhead = 64;

inline v16f splat(float x) { return v16f{} + x; }
inline v16f load(const float* p) {
  v16f r;
  std::memcpy(&r, p, sizeof r);
  return r;
}
inline void store(float* p, v16f x) { std::memcpy(p, &x, sizeof x); }

// exp_f on 16 lanes.
inline v16f exp_v(v16f x) {
  const v16i tiny = x < -87.33654f;
  v16f c = x < -87.33654f ? splat(-87.33654f) : x;
  c = c > 88.0f ? splat(88.0f) : c;
  v16f fx;
  const v16f y = exp_reduced(c, fx);
  const v16i bits = (__builtin_convertvector(fx, v16i) + 127) << 23;
  v16f scale;
  std::memcpy(&scale, &bits, sizeof scale);
  const v16f out = y * scale;
  return tiny ? splat(0.0f) : out;
}

// torch's vectorized CPU GELU (approximate="none"): x * 0.5 * (1 + erf(x / sqrt 2)), erf per A&S 7.1.26; one body
// for a float and for 16 lanes (|e| as a select: the same value as fabs, -0 and NaN included).
template <class T, T (*Exp)(T)>
inline T gelu_of(T x) {
  const T e = x * 0.70710678118654752440f;
  const T ax = e < 0.0f ? -e : e;
  const T t = 1.0f / (0.3275911f * ax + 1.0f);
  T r = 1.061405429f * t + -1.453152027f;
  r = r * t + 1.421413741f;
  r = r * t + -0.284496736f;
  r = r * t + 0.254829592f;
  const T ex = -Exp(-(e * e));
  T erf = (ex * t) * r + 1.0f;
  erf = e < 0.0f ? -erf : erf;
  return (x * 0.5f) * (1.0f + erf);
}

inline float gelu_f(float x) { return gelu_of<float, exp_f>(x); }
inline v16f gelu_v(v16f x) { return gelu_of<v16f, exp_v>(x); }

// Columns [c0, c0 + 16 C) of y[r, :] = x[r, 0:k] @ w[k, m] + b for kRows rows: one pass down w's rows (each row's
// C vectors read once, in order: the weights stream from memory, where a decode step finds them), C * kRows
// accumulators in registers.
template <int C>
inline void affine4_cols(const float* __restrict x, const float* __restrict w, const float* __restrict b, int64_t k,
                         int64_t m, int64_t c0, float* __restrict y) {
  v16f acc[kRows][C] = {};
  for (int64_t i = 0; i < k; ++i) {
    v16f wv[C];
    // a step finds the weights in L3 at best: ask for them kAhead rows ahead
    for (int c = 0; c < C; ++c) __builtin_prefetch(w + (i + kAhead) * m + c0 + c * kLanes, 0, 3);
    for (int c = 0; c < C; ++c) wv[c] = load(w + i * m + c0 + c * kLanes);
    for (int r = 0; r < kRows; ++r) {
      const float xi = x[r * k + i];
      for (int c = 0; c < C; ++c) acc[r][c] += xi * wv[c];
    }
  }
  for (int c = 0; c < C; ++c) {
    const v16f bv = load(b + c0 + c * kLanes);
    for (int r = 0; r < kRows; ++r) store(y + r * m + c0 + c * kLanes, acc[r][c] + bv);
  }
}

// y[r, 0:m] = x[r, 0:k] @ w[k, m] + b for kRows rows (x, y row strides k, m), m a multiple of 16: torch's matmul
// followed by the bias add. Each output's sum runs over i in order, whatever the column blocking.
inline void affine4(const float* __restrict x, const float* __restrict w, const float* __restrict b, int64_t k,
                    int64_t m, float* __restrict y) {
  int64_t c0 = 0;
  for (; c0 + 4 * kLanes <= m; c0 += 4 * kLanes) affine4_cols<4>(x, w, b, k, m, c0, y);
  switch ((m - c0) / kLanes) {
    case 3: affine4_cols<3>(x, w, b, k, m, c0, y); break;
    case 2: affine4_cols<2>(x, w, b, k, m, c0, y); break;
    case 1: affine4_cols<1>(x, w, b, k, m, c0, y); break;
    default: break;
  }
}

// kRows rows through head h's MLP: log φ(x) [kRows, f]; e and f multiples of 16. scratch: 3 * kRows * e floats.
void mlp_rows(const Mlp& p, int64_t h, const float* x, float* out, float* scratch) {
  const int64_t d = p.d, e = p.e, f = p.f;
  float* g0 = scratch;
  float* a = scratch + kRows * e;
  float* g1 = scratch + 2 * kRows * e;
  affine4(x, p.w0 + h * d * e, p.b0 + h * e, d, e, g0);
  affine4(g0, p.w1 + h * e * e, p.b1 + h * e, e, e, a);
  for (int64_t j = 0; j < kRows * e; j += kLanes) store(a + j, gelu_v(load(a + j)));
  affine4(a, p.w2 + h * e * e, p.b2 + h * e, e, e, g1);  // delta
  const float al = p.alpha[h];
  for (int64_t j = 0; j < kRows * e; j += kLanes) store(g1 + j, load(g0 + j) + al * load(g1 + j));
  affine4(g1, p.wo + h * e * f, p.bo + h * f, e, f, out);
}

// y[0:m] = x[0:k] @ w[k, m] (w row-major), then + b (any m).
inline void affine(const float* __restrict x, const float* __restrict w, const float* __restrict b, int64_t k,
                   int64_t m, float* __restrict y) {
  std::fill(y, y + m, 0.0f);
  for (int64_t i = 0; i < k; ++i) {
    const float xi = x[i];
    const float* __restrict wr = w + i * m;
#pragma omp simd
    for (int64_t j = 0; j < m; ++j) y[j] += xi * wr[j];
  }
#pragma omp simd
  for (int64_t j = 0; j < m; ++j) y[j] += b[j];
}

// One row through head h's MLP (any sizes): log φ(x) [f].
void mlp_row(const Mlp& p, int64_t h, const float* x, float* out, float* g0, float* a, float* g1) {
  const int64_t d = p.d, e = p.e, f = p.f;
  affine(x, p.w0 + h * d * e, p.b0 + h * e, d, e, g0);
  affine(g0, p.w1 + h * e * e, p.b1 + h * e, e, e, a);
  for (int64_t j = 0; j < e; ++j) a[j] = gelu_f(a[j]);
  affine(a, p.w2 + h * e * e, p.b2 + h * e, e, e, g1);  // delta
  const float al = p.alpha[h];
  for (int64_t j = 0; j < e; ++j) g1[j] = g0[j] + al * g1[j];
  affine(g1, p.wo + h * e * f, p.bo + h * f, e, f, out);
}

}  // namespace

// log φ of rows x [B, H, n, D] (contiguous) through head h's MLP -> out [B, H, n, F]. ptrs: the 9 weight pointers
// of Mlp in order. Returns 0.
namespace {

// T_K[j, :] = sum_i w_i[j] v_i (i in order) for count entries: feature weights ws[i] [f], value rows vs[i] [d].
// Blocks of 4 features x C vectors of channels in registers where d is a multiple of 16 up to 64.
template <int C>
void value_sums_blocked(const float* const* ws, const float* const* vs, int64_t count, int64_t f, float* tk) {
  const int64_t d = C * kLanes;
  int64_t j0 = 0;
  for (; j0 + 4 <= f; j0 += 4) {
    v16f acc[4][C] = {};
    for (int64_t i = 0; i < count; ++i) {
      v16f vv[C];
      for (int c = 0; c < C; ++c) vv[c] = load(vs[i] + c * kLanes);
      for (int jj = 0; jj < 4; ++jj) {
        const float wj = ws[i][j0 + jj];
        for (int c = 0; c < C; ++c) acc[jj][c] += wj * vv[c];
      }
    }
    for (int jj = 0; jj < 4; ++jj)
      for (int c = 0; c < C; ++c) store(tk + (j0 + jj) * d + c * kLanes, acc[jj][c]);
  }
  for (; j0 < f; ++j0) {
    v16f acc[C] = {};
    for (int64_t i = 0; i < count; ++i)
      for (int c = 0; c < C; ++c) acc[c] += ws[i][j0] * load(vs[i] + c * kLanes);
    for (int c = 0; c < C; ++c) store(tk + j0 * d + c * kLanes, acc[c]);
  }
}

void feature_value_sums(const float* const* ws, const float* const* vs, int64_t count, int64_t f, int64_t d,
                        float* tk) {
  switch (d % kLanes == 0 ? d / kLanes : 0) {
    case 1: value_sums_blocked<1>(ws, vs, count, f, tk); return;
    case 2: value_sums_blocked<2>(ws, vs, count, f, tk); return;
    case 3: value_sums_blocked<3>(ws, vs, count, f, tk); return;
    case 4: value_sums_blocked<4>(ws, vs, count, f, tk); return;
    default: break;
  }
  std::fill(tk, tk + f * d, 0.0f);
  for (int64_t i = 0; i < count; ++i)
    for (int64_t j = 0; j < f; ++j) {
      const float wj = ws[i][j];
      float* __restrict tr = tk + j * d;
      const float* __restrict vr = vs[i];
#pragma omp simd
      for (int64_t c = 0; c < d; ++c) tr[c] += wj * vr[c];
    }
}

struct MlpScratch {
  std::vector<float> s, xb, ob;
  explicit MlpScratch(const Mlp& p) : s(3 * kRows * p.e), xb(kRows * p.d), ob(kRows * p.f) {}
};

// Rows x [n, d] (contiguous) of head h -> out [n, f]. Blocks of kRows rows where the sizes allow (the last one
// zero-padded), else row by row: either way each row's result does not depend on the rows beside it.
void mlp_head(const Mlp& p, int64_t h, const float* x, int64_t n, float* out, MlpScratch& w) {
  const int64_t d = p.d, e = p.e, f = p.f;
  const bool blocked = e % kLanes == 0 && f % kLanes == 0;
  int64_t i = 0;
  for (; blocked && i + kRows <= n; i += kRows) mlp_rows(p, h, x + i * d, out + i * f, w.s.data());
  if (blocked && i < n) {
    std::fill(w.xb.begin(), w.xb.end(), 0.0f);
    std::memcpy(w.xb.data(), x + i * d, (n - i) * d * sizeof(float));
    mlp_rows(p, h, w.xb.data(), w.ob.data(), w.s.data());
    std::memcpy(out + i * f, w.ob.data(), (n - i) * f * sizeof(float));
    i = n;
  }
  for (; i < n; ++i) mlp_row(p, h, x + i * d, out + i * f, w.s.data(), w.s.data() + e, w.s.data() + 2 * e);
}

Mlp mlp_of(const float* const* ptrs, int64_t d, int64_t e, int64_t f) {
  return Mlp{ptrs[0], ptrs[1], ptrs[2], ptrs[3], ptrs[4], ptrs[5], ptrs[6], ptrs[7], ptrs[8], d, e, f};
}

}  // namespace

// log φ of rows x [B, H, n, D] (contiguous) through head h's MLP -> out [B, H, n, F]. ptrs: the 9 weight pointers
// of Mlp in order. Returns 0.
extern "C" int kvstash_phi_mlp(const float* const* ptrs, int64_t d, int64_t e, int64_t f, const float* x,
                               int64_t b, int64_t h, int64_t n, float* out) {
  const Mlp p = mlp_of(ptrs, d, e, f);
  MlpScratch w(p);
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t hi = 0; hi < h; ++hi) {
      const int64_t r0 = (bi * h + hi) * n;
      mlp_head(p, hi, x + r0 * d, n, out + r0 * f, w);
    }
  return 0;
}

// The step's entries whose features are not cached yet: for (t, h, i) valid (valid[t, h, i], or i < counts[t, h]
// where valid is null) and have[h, tok] == 0 (tok = tokens[t, h, i] clamped to [0, n_tab - 1]), its key row is
// copied to packed [T, H, W, D] (W = the most such entries of any (t, h), rows past a head's own count zeroed) and
// idx[t, h, i] = its packed position; else idx = -1. Key row of (t, h, i): k + t*st + h*sh + row*sr with row =
// max(rows[t, h, i], 0), or i where rows is null. Returns W.
extern "C" int64_t kvstash_phi_pack(int64_t t_n, int64_t h_n, int64_t n, int64_t d, const float* k, int64_t st,
                                    int64_t sh, int64_t sr, const int64_t* rows, const uint8_t* valid,
                                    const int64_t* counts, const int64_t* tokens, const uint8_t* have, int64_t n_tab,
                                    int32_t* idx, float* packed) {
  int64_t width = 0;
  for (int64_t th = 0; th < t_n * h_n; ++th) {
    const int64_t h = th % h_n;
    int64_t c = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t e = th * n + i;
      const bool ok = valid ? valid[e] != 0 : i < counts[th];
      const int64_t tok = std::min(std::max<int64_t>(tokens[e], 0), n_tab - 1);
      const bool fresh = ok && !have[h * (n_tab + 1) + tok];
      idx[e] = fresh ? static_cast<int32_t>(c) : -1;
      c += fresh;
    }
    width = std::max(width, c);
  }
  for (int64_t th = 0; th < t_n * h_n; ++th) {
    const int64_t t = th / h_n, h = th % h_n;
    float* dst = packed + th * width * d;
    int64_t c = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (idx[th * n + i] < 0) continue;
      const int64_t row = rows ? std::max<int64_t>(rows[th * n + i], 0) : i;
      std::memcpy(dst + c * d, k + t * st + h * sh + row * sr, d * sizeof(float));
      ++c;
    }
    std::fill(dst + c * d, dst + width * d, 0.0f);
  }
  return width;
}

// The remainder pseudo-entry (phi.py: term). Per (t, h), the valid entries' features w (each from: lp [T, H, L, F]
// at idx[t, h, i] when idx is given and idx >= 0 -- then w = exp(lp - m) is also stored into the table w_tab
// [H, n_tab + 1, F] at tok and have[h, tok] set; from the table when idx < 0; from lp at i when idx is null) are
// summed with their values v (row as in pack, strides vst/vsh/vsr); the sums are subtracted from the cache
// (m [H, F], u [H, F], tc [H, F, D]) with the clamp of phi.subtract, and the remainder evaluated against
// lpq [T, H, G, F]: log_z [T, H, G] (-inf where the entries' count >= n_mid) and mean [T, H, G, D].
extern "C" int kvstash_phi_term(int64_t t_n, int64_t h_n, int64_t g_n, int64_t n, int64_t d, int64_t f,
                                int64_t n_tab, int64_t l_n, int64_t n_mid, const float* v, int64_t vst, int64_t vsh,
                                int64_t vsr, const int64_t* rows, const uint8_t* valid, const int64_t* counts,
                                const int64_t* tokens, float* w_tab, uint8_t* have, const float* lp,
                                const int32_t* idx, const float* m, const float* u, const float* tc,
                                const float* lpq, float rel_tol, float u_floor, float* log_z, float* mean) {
  std::vector<float> uk(f), tk(f * d), ur(f), w(f), a(f), wbuf(lp != nullptr && idx == nullptr ? n * f : 0);
  std::vector<const float*> srcs(n), vrows(n);
  for (int64_t th = 0; th < t_n * h_n; ++th) {
    const int64_t t = th / h_n, h = th % h_n;
    const float* mh = m + h * f;
    int64_t count = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t e = th * n + i;
      if (!(valid ? valid[e] != 0 : i < counts[th])) continue;
      const float* src;
      if (idx != nullptr) {
        const int64_t tok = std::min(std::max<int64_t>(tokens[e], 0), n_tab - 1);
        float* slot = w_tab + (h * (n_tab + 1) + tok) * f;
        if (idx[e] >= 0) {
          const float* lr = lp + (th * l_n + idx[e]) * f;
#pragma omp simd
          for (int64_t j = 0; j < f; ++j) slot[j] = exp_f(lr[j] - mh[j]);
          have[h * (n_tab + 1) + tok] = 1;
        }
        src = slot;
      } else if (lp == nullptr) {  // every valid entry's features are in the table (kvstash_phi_step)
        const int64_t tok = std::min(std::max<int64_t>(tokens[e], 0), n_tab - 1);
        src = w_tab + (h * (n_tab + 1) + tok) * f;
      } else {
        const float* lr = lp + (th * l_n + i) * f;
        float* wr = wbuf.data() + count * f;
#pragma omp simd
        for (int64_t j = 0; j < f; ++j) wr[j] = exp_f(lr[j] - mh[j]);
        src = wr;
      }
      const int64_t row = rows ? std::max<int64_t>(rows[e], 0) : i;
      srcs[count] = src;
      vrows[count] = v + t * vst + h * vsh + row * vsr;
      ++count;
    }
    // u_K = sum_i w_i, T_K = sum_i w_i v_i, entries in order for every (feature, channel)
    std::fill(uk.begin(), uk.end(), 0.0f);
    for (int64_t i = 0; i < count; ++i) {
      const float* src = srcs[i];
#pragma omp simd
      for (int64_t j = 0; j < f; ++j) uk[j] += src[j];
    }
    feature_value_sums(srcs.data(), vrows.data(), count, f, d, tk.data());
    if (counts != nullptr) count = counts[th];
    // subtract (phi.subtract): u_R = u - u_K, T_R = T - T_K; a feature at most rel_tol * u keeps no mass
    const float* uh = u + h * f;
    const float* th_c = tc + h * f * d;
    for (int64_t j = 0; j < f; ++j) {
      const float r = uh[j] - uk[j];
      const bool empty = r <= rel_tol * uh[j];
      ur[j] = empty ? u_floor : r;
      float* __restrict tr = tk.data() + j * d;
      const float* __restrict cr = th_c + j * d;
      if (empty) {
        std::fill(tr, tr + d, 0.0f);
      } else {
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) tr[c] = cr[c] - tr[c];
      }
      a[j] = mh[j] + std::log(ur[j]);
    }
    // evaluate (phi.evaluate): a = log φq + (m + log u_R); log_z = LSE_f a; mean = softmax_f(a) . (T_R / u_R)
    for (int64_t j = 0; j < f; ++j) {
      float* __restrict tr = tk.data() + j * d;
      const float uj = ur[j];
#pragma omp simd
      for (int64_t c = 0; c < d; ++c) tr[c] = tr[c] / uj;
    }
    const bool nothing_left = count >= n_mid;
    for (int64_t g = 0; g < g_n; ++g) {
      const float* q = lpq + (th * g_n + g) * f;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < f; ++j) {
        w[j] = q[j] + a[j];
        mx = std::max(mx, w[j]);
      }
      float s = 0.0f;
      for (int64_t j = 0; j < f; ++j) {
        w[j] = exp_f(w[j] - mx);
        s += w[j];
      }
      log_z[th * g_n + g] = nothing_left ? -std::numeric_limits<float>::infinity() : mx + std::log(s);
      float* __restrict out = mean + (th * g_n + g) * d;
      std::fill(out, out + d, 0.0f);
      for (int64_t j = 0; j < f; ++j) {
        const float pj = w[j] / s;
        const float* __restrict tr = tk.data() + j * d;
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) out[c] += pj * tr[c];
      }
    }
  }
  return 0;
}

// One step of the term with the distilled map in the kernel too: the query rows q [T, H, G, D] through the query
// MLP (head h * G + g; kptrs/qptrs: each map's 9 weight pointers of the layer), the valid entries whose features
// are not in the table (as kvstash_phi_pack finds them; keys at k with strides st/sh/sr) through the key MLP, their
// exp(log φk - m) stored in the table, then kvstash_phi_term on the table. Rows go through the MLPs in the same
// blocks as kvstash_phi_mlp: the bits of phi_pack + phi_mlp + phi_term. lpq: scratch [T, H, G, F].
extern "C" int kvstash_phi_step(int64_t t_n, int64_t h_n, int64_t g_n, int64_t n, int64_t d, int64_t f, int64_t e,
                                int64_t n_tab, int64_t n_mid, const float* k, int64_t st, int64_t sh, int64_t sr,
                                const float* v, int64_t vst, int64_t vsh, int64_t vsr, const int64_t* rows,
                                const uint8_t* valid, const int64_t* counts, const int64_t* tokens, float* w_tab,
                                uint8_t* have, const float* const* kptrs, const float* const* qptrs, const float* q,
                                float* lpq, const float* m, const float* u, const float* tc, float rel_tol,
                                float u_floor, float* log_z, float* mean) {
  const Mlp qm = mlp_of(qptrs, d, e, f), km = mlp_of(kptrs, d, e, f);
  MlpScratch scratch(qm);
  for (int64_t t = 0; t < t_n; ++t)  // query head hq = h * G + g: rows [T, H * G, 1, D]
    for (int64_t hq = 0; hq < h_n * g_n; ++hq)
      mlp_head(qm, hq, q + (t * h_n * g_n + hq) * d, 1, lpq + (t * h_n * g_n + hq) * f, scratch);
  std::vector<float> xs(n * d), lp(n * f);
  std::vector<int64_t> slot(n);
  for (int64_t th = 0; th < t_n * h_n; ++th) {
    const int64_t t = th / h_n, h = th % h_n;
    int64_t c = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t at = th * n + i;
      if (!(valid ? valid[at] != 0 : i < counts[th])) continue;
      const int64_t tok = std::min(std::max<int64_t>(tokens[at], 0), n_tab - 1);
      if (have[h * (n_tab + 1) + tok]) continue;
      have[h * (n_tab + 1) + tok] = 1;  // set now: a token twice in one (t, h) is mapped once
      const int64_t row = rows ? std::max<int64_t>(rows[at], 0) : i;
      std::memcpy(xs.data() + c * d, k + t * st + h * sh + row * sr, d * sizeof(float));
      slot[c++] = tok;
    }
    if (c == 0) continue;
    mlp_head(km, h, xs.data(), c, lp.data(), scratch);
    const float* mh = m + h * f;
    for (int64_t j = 0; j < c; ++j) {
      float* dst = w_tab + (h * (n_tab + 1) + slot[j]) * f;
      const float* lr = lp.data() + j * f;
      for (int64_t x = 0; x < f; ++x) dst[x] = exp_f(lr[x] - mh[x]);
    }
  }
  return kvstash_phi_term(t_n, h_n, g_n, n, d, f, n_tab, 0, n_mid, v, vst, vsh, vsr, rows, valid, counts, tokens,
                          w_tab, have, nullptr, nullptr, m, u, tc, lpq, rel_tol, u_floor, log_z, mean);
}
