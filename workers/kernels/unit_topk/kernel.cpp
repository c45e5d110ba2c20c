// The unit top-k on the CPU (reference.py: top_units_ref's ids exactly): per row of scores, the ids of the k highest
// scores, ties to the lower id, in ascending id order; one call instead of two torch sorts. Scores hold no NaN.
// C++ with an extern "C" entry point, loaded through ctypes (workers/kernels/index_page_mass/build.py).
#include <algorithm>
#include <cstdint>
#include <vector>

// scores [r, u] (row stride rs, float32), out [r, k] int64 contiguous, 0 <= k <= u.
extern "C" int kvstash_top_units(const float* scores, int64_t r, int64_t u, int64_t rs, int64_t k, int64_t* out) {
  std::vector<int64_t> ids(static_cast<size_t>(u));
  for (int64_t row = 0; row < r; ++row) {
    const float* s = scores + row * rs;
    for (int64_t i = 0; i < u; ++i) ids[i] = i;
    // the order of a stable descending sort: higher score first, equal scores by id
    auto before = [s](int64_t a, int64_t b) { return s[a] > s[b] || (s[a] == s[b] && a < b); };
    if (k < u) std::nth_element(ids.begin(), ids.begin() + k, ids.end(), before);
    std::sort(ids.begin(), ids.begin() + k);
    std::copy(ids.begin(), ids.begin() + k, out + row * k);
  }
  return 0;
}
