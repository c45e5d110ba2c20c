// Double-P's per-step bookkeeping on the CPU after the stage-1 masses (see ops.py for the contract).
//
// Why a kernel: at 4k tokens a step has about 256 clusters per KV head, and the numpy form of the ranking, the two
// top-p prefixes, the budgeted stage 2, the exact clusters' token ids and the approximated clusters is some forty
// small array ops per layer, each costing more in dispatch than in arithmetic. Here they are two loops per row.
//
// Every floating-point value is computed with the same IEEE double operations in the same order as the torch /
// numpy forms (a sequential cumulative sum, `(csum - m) / total`, `csum / total`), so the selection is the same bit
// for bit; built with -ffp-contract=off so that no multiply-add is fused. Plain C++ with extern "C" entry points,
// loaded through ctypes (workers/kernels/index_page_mass/build.py builds and caches it).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// torch's CPU sum of a contiguous float64 row (ATen's cascade_sum: vectorized_inner_sum / row_sum /
// multi_row_sum, vectors of `width` lanes, 4 rows of ILP, 4 cascade levels), the same additions in the same order,
// so the same bits. `width` is what the torch build uses (ops.py checks it against torch.sum at load, and keeps
// torch's sum where nothing matches).
int64_t ceil_log2(int64_t x) { return x <= 2 ? 1 : 64 - __builtin_clzll(static_cast<uint64_t>(x - 1)); }

// Items i < size of `width` lanes, the k-th of 4 rows of item i at in + i * row + k * col; out [4][8].
void multi_row_sum(const double* in, int64_t row, int64_t col, int64_t size, int64_t width, double* out) {
  constexpr int kLevels = 4;
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(size) / kLevels);
  const int64_t level_step = int64_t{1} << level_power;
  const int64_t level_mask = level_step - 1;
  double acc[kLevels][4][8] = {};
  int64_t i = 0;
  while (i + level_step <= size) {
    for (int64_t j = 0; j < level_step; ++j) {
      const double* base = in + (i + j) * row;
      for (int k = 0; k < 4; ++k)
        for (int64_t w = 0; w < width; ++w) acc[0][k][w] += base[k * col + w];
    }
    i += level_step;
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < 4; ++k)
        for (int64_t w = 0; w < width; ++w) {
          acc[j][k][w] += acc[j - 1][k][w];
          acc[j - 1][k][w] = 0.0;
        }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < size; ++i) {
    const double* base = in + i * row;
    for (int k = 0; k < 4; ++k)
      for (int64_t w = 0; w < width; ++w) acc[0][k][w] += base[k * col + w];
  }
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < 4; ++k)
      for (int64_t w = 0; w < width; ++w) acc[0][k][w] += acc[j][k][w];
  for (int k = 0; k < 4; ++k)
    for (int64_t w = 0; w < width; ++w) out[k * 8 + w] = acc[0][k][w];
}

// row_sum: `size` items of `width` lanes, item i at in + i * item.
void row_sum(const double* in, int64_t item, int64_t size, int64_t width, double* res) {
  const int64_t size_ilp = size / 4;
  double part[4 * 8];
  multi_row_sum(in, item * 4, item, size_ilp, width, part);
  for (int64_t i = size_ilp * 4; i < size; ++i)
    for (int64_t w = 0; w < width; ++w) part[w] += in[i * item + w];
  for (int k = 1; k < 4; ++k)
    for (int64_t w = 0; w < width; ++w) part[w] += part[k * 8 + w];
  for (int64_t w = 0; w < width; ++w) res[w] = part[w];
}

double torch_sum(const double* x, int64_t n, int64_t width) {
  double v[8];
  if (n >= width) {  // vectorized_inner_sum
    const int64_t vec_size = n / width;
    row_sum(x, width, vec_size, width, v);
    double acc = 0.0;
    for (int64_t k = vec_size * width; k < n; ++k) acc += x[k];
    for (int64_t w = 0; w < width; ++w) acc += v[w];
    return 0.0 + acc;  // the output starts at 0 and accumulates
  }
  row_sum(x, 1, n, 1, v);  // scalar_inner_sum
  return 0.0 + v[0];
}

}  // namespace

extern "C" {

// Rank each row's masses [R, C] (non-negative float32): descending, ties to the lower id (the numpy form's unique
// int64 keys: the float's bits above, the id below), and m = the masses in rank order as float64 (torch sums each
// row of it for the total between the two calls).
int kvstash_dp_rank(const float* mass, int64_t rows, int64_t c, int32_t* order, double* m) {
  std::vector<int64_t> key(static_cast<size_t>(c));
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = mass + r * c;
    for (int64_t j = 0; j < c; ++j) {
      int32_t bits;
      std::memcpy(&bits, &x[j], 4);
      const uint64_t k = static_cast<uint64_t>(int64_t{0x7FFFFFFF} - int64_t{bits});
      key[j] = static_cast<int64_t>((k << 32) | static_cast<uint64_t>(j));
    }
    std::sort(key.begin(), key.end());
    int32_t* o = order + r * c;
    double* mr = m + r * c;
    for (int64_t j = 0; j < c; ++j) {
      const int32_t id = static_cast<int32_t>(key[j] & 0xFFFFFFFF);
      o[j] = id;
      mr[j] = static_cast<double>(x[id]);
    }
  }
  return 0;
}

// The selection after the ranking. Rows r are (query token, KV head), heads fastest: head r % hkv. csum: each row's
// sequential prefix sums of m (torch's CPU cumsum order), made here only as far as a threshold or the budget reads
// them (cum = csum / total is non-decreasing: the count of ranks below a threshold is the first rank at or above
// it). sizes, starts: int32 (see ops.py). total == nullptr:
// every cluster exact (a budget covering the mid region). budget < 0: none. Writes each row's exact token ids
// ascending then `pad` (row stride info[0]) into tokens (capacity tok_cap), counts [R], and with fallback the
// approximated clusters' ids ascending then the other ids ascending (row stride info[3]) into cids (capacity R * C),
// ccounts [R]. info: [token width, exact tokens in all, exact clusters in all, centroid width, centroids in all].
static int dp_select(const int32_t* order, const double* m, const double* total, const int32_t* sizes,
              const int32_t* starts, const uint8_t* nonempty, const int32_t* perm, int64_t rows, int64_t hkv,
              int64_t c, int64_t groups, double p1, double p2, int64_t budget, int64_t pad, int64_t fallback,
              int64_t* tokens, int64_t tok_cap, int64_t* counts, int64_t* cids, int64_t* ccounts, int64_t* info) {
  if (rows <= 0 || hkv <= 0 || rows % hkv || groups <= 0 || rows % groups) return 1;
  std::vector<int64_t> stage1(rows), n_exact(rows);
  std::vector<double> csum(static_cast<size_t>(rows * c));
  for (int64_t r = 0; r < rows; ++r) {
    if (total == nullptr) {
      stage1[r] = n_exact[r] = c;
      continue;
    }
    const double* mr = m + r * c;
    double* cs = csum.data() + r * c;
    const double tot = total[r];
    int64_t below1 = 0, below2 = 0;
    double acc = 0.0;
    for (int64_t j = 0; j < c; ++j) {
      acc += mr[j];
      cs[j] = acc;
      const double cum = acc / tot;
      if (!(cum < p1) && !(cum < p2)) break;  // non-decreasing: no later rank is below either threshold
      below1 += cum < p1;
      below2 += cum < p2;
    }
    stage1[r] = std::min(below1 + 1, c);
    n_exact[r] = std::min(std::min(below2 + 1, c), stage1[r]);
  }
  auto ranked_size = [&](int64_t r, int64_t j) { return sizes[(r % hkv) * c + order[r * c + j]]; };
  if (total != nullptr && budget >= 0) {
    // shared_top_p: per group of rows, the eligible (row, rank) entries by the mass ranked before them (a stable
    // sort: ties in row-major order), taken while the group's cumulative size fits the budget.
    int64_t w = 0;
    for (int64_t r = 0; r < rows; ++r) w = std::max(w, n_exact[r]);
    const int64_t per = rows / groups;
    std::vector<std::pair<double, int64_t>> entry;
    std::vector<int64_t> taken(rows);
    for (int64_t g = 0; g < groups; ++g) {
      entry.clear();
      for (int64_t i = 0; i < per; ++i) {
        const int64_t r = g * per + i;
        for (int64_t j = 0; j < n_exact[r]; ++j) {  // the others are +inf: sorted last, never taken
          entry.emplace_back((csum[r * c + j] - m[r * c + j]) / total[r], i * w + j);  // j < n_exact: made
        }
      }
      std::stable_sort(entry.begin(), entry.end(),
                       [](const auto& a, const auto& b) { return a.first < b.first; });
      int64_t cost = 0;
      for (const auto& e : entry) {
        const int64_t r = g * per + e.second / w;
        cost += ranked_size(r, e.second % w);
        if (cost > budget) break;  // sizes are non-negative: the cost never falls back under the budget
        ++taken[r];
      }
    }
    for (int64_t r = 0; r < rows; ++r) n_exact[r] = taken[r];
  }
  int64_t width = 0, n_ids = 0, n_clusters = 0;
  for (int64_t r = 0; r < rows; ++r) {
    int64_t n = 0;
    for (int64_t j = 0; j < n_exact[r]; ++j) n += ranked_size(r, j);
    counts[r] = n;
    width = std::max(width, n);
    n_ids += n;
    n_clusters += n_exact[r];
  }
  if (width * rows > tok_cap) return 2;
  for (int64_t r = 0; r < rows; ++r) {
    int64_t* out = tokens + r * width;
    int64_t at = 0;
    const int64_t h = r % hkv;
    for (int64_t j = 0; j < n_exact[r]; ++j) {
      const int64_t id = order[r * c + j];
      const int32_t* src = perm + starts[h * c + id];
      for (int64_t i = 0, n = sizes[h * c + id]; i < n; ++i) out[at++] = src[i];
    }
    std::sort(out, out + at);
    std::fill(out + at, out + width, pad);
  }
  info[0] = width;
  info[1] = n_ids;
  info[2] = n_clusters;
  info[3] = info[4] = 0;
  if (!fallback) return 0;
  // Approximated: ranks [n_exact, stage1) of nonempty clusters, listed by id (mask_to_index: set ids ascending,
  // then the unset ones ascending up to the widest row).
  std::vector<uint8_t> approx(static_cast<size_t>(rows * c), 0);
  int64_t cwidth = 0, n_approx = 0;
  for (int64_t r = 0; r < rows; ++r) {
    uint8_t* a = approx.data() + r * c;
    const uint8_t* ne = nonempty + (r % hkv) * c;
    for (int64_t j = n_exact[r]; j < stage1[r]; ++j) a[order[r * c + j]] = 1;
    int64_t n = 0;
    for (int64_t id = 0; id < c; ++id) {
      a[id] &= ne[id];
      n += a[id];
    }
    ccounts[r] = n;
    cwidth = std::max(cwidth, n);
    n_approx += n;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* a = approx.data() + r * c;
    int64_t* out = cids + r * cwidth;
    int64_t at = 0;
    for (int64_t id = 0; id < c && at < cwidth; ++id) {
      if (a[id]) out[at++] = id;
    }
    for (int64_t id = 0; id < c && at < cwidth; ++id) {
      if (!a[id]) out[at++] = id;
    }
  }
  info[3] = cwidth;
  info[4] = n_approx;
  return 0;
}

int kvstash_dp_select(const int32_t* order, const double* m, const double* total, const int32_t* sizes,
                      const int32_t* starts, const uint8_t* nonempty, const int32_t* perm, int64_t rows, int64_t hkv,
                      int64_t c, int64_t groups, double p1, double p2, int64_t budget, int64_t pad, int64_t fallback,
                      int64_t* tokens, int64_t tok_cap, int64_t* counts, int64_t* cids, int64_t* ccounts,
                      int64_t* info) {
  return dp_select(order, m, total, sizes, starts, nonempty, perm, rows, hkv, c, groups, p1, p2, budget, pad,
                   fallback, tokens, tok_cap, counts, cids, ccounts, info);
}

// kvstash_dp_rank, torch's row totals (clamped to at least 1e-300) with vectors of `sum_width` lanes, then
// kvstash_dp_select, in one call (exact_all: no totals, every cluster exact). Outputs as kvstash_dp_select's.
int kvstash_dp_pick(const float* mass, int64_t sum_width, int64_t exact_all, const int32_t* sizes,
                    const int32_t* starts, const uint8_t* nonempty, const int32_t* perm, int64_t rows, int64_t hkv,
                    int64_t c, int64_t groups, double p1, double p2, int64_t budget, int64_t pad, int64_t fallback,
                    int64_t* tokens, int64_t tok_cap, int64_t* counts, int64_t* cids, int64_t* ccounts,
                    int64_t* info) {
  if (sum_width < 1 || sum_width > 8 || rows <= 0) return 3;
  std::vector<int32_t> order(static_cast<size_t>(rows * c));
  std::vector<double> m(static_cast<size_t>(rows * c)), total(static_cast<size_t>(rows));
  kvstash_dp_rank(mass, rows, c, order.data(), m.data());
  if (!exact_all) {
    for (int64_t r = 0; r < rows; ++r) total[r] = std::max(torch_sum(m.data() + r * c, c, sum_width), 1e-300);
  }
  return dp_select(order.data(), m.data(), exact_all ? nullptr : total.data(), sizes, starts, nonempty, perm, rows,
                   hkv, c, groups, p1, p2, budget, pad, fallback, tokens, tok_cap, counts, cids, ccounts, info);
}

// torch's sum of one contiguous float64 row with vectors of `width` lanes (ops.py checks the width against torch).
double kvstash_dp_torch_sum(const double* x, int64_t n, int64_t width) { return torch_sum(x, n, width); }

}  // extern "C"
