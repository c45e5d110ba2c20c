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

extern "C" {

// Rank each row's masses [R, C] (non-negative float32): descending, ties to the lower id (the numpy form's unique
// int64 keys: the float's bits below, the id above), then m = the masses in rank order as float64 and csum their
// sequential prefix sums (torch's CPU cumsum order).
int kvstash_dp_rank(const float* mass, int64_t rows, int64_t c, int64_t* order, double* m, double* csum) {
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
    int64_t* o = order + r * c;
    double* mr = m + r * c;
    double* cs = csum + r * c;
    double acc = 0.0;
    for (int64_t j = 0; j < c; ++j) {
      const int64_t id = key[j] & 0xFFFFFFFF;
      o[j] = id;
      mr[j] = static_cast<double>(x[id]);
      acc += mr[j];
      cs[j] = acc;
    }
  }
  return 0;
}

// The selection after the ranking. Rows r are (query token, KV head), heads fastest: head r % hkv. total == nullptr:
// every cluster exact (a budget covering the mid region). budget < 0: none. Writes each row's exact token ids
// ascending then `pad` (row stride info[0]) into tokens (capacity tok_cap), counts [R], and with fallback the
// approximated clusters' ids ascending then the other ids ascending (row stride info[3]) into cids (capacity R * C),
// ccounts [R]. info: [token width, exact tokens in all, exact clusters in all, centroid width, centroids in all].
int kvstash_dp_select(const int64_t* order, const double* m, const double* csum, const double* total,
                      const int64_t* sizes, const int64_t* starts, const uint8_t* nonempty, const int32_t* perm,
                      int64_t rows, int64_t hkv, int64_t c, int64_t groups, double p1, double p2, int64_t budget,
                      int64_t pad, int64_t fallback, int64_t* tokens, int64_t tok_cap, int64_t* counts,
                      int64_t* cids, int64_t* ccounts, int64_t* info) {
  if (rows <= 0 || hkv <= 0 || rows % hkv || groups <= 0 || rows % groups) return 1;
  std::vector<int64_t> stage1(rows), n_exact(rows);
  for (int64_t r = 0; r < rows; ++r) {
    if (total == nullptr) {
      stage1[r] = n_exact[r] = c;
      continue;
    }
    const double* cs = csum + r * c;
    const double tot = total[r];
    int64_t below1 = 0, below2 = 0;
    for (int64_t j = 0; j < c; ++j) {
      const double cum = cs[j] / tot;
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
          entry.emplace_back((csum[r * c + j] - m[r * c + j]) / total[r], i * w + j);
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

}  // extern "C"
