// One decode row's page entries on the CPU (ops.page_entries; the torch reference's integers and bias, exactly),
// plus, for φ completion's kernel, the picked entries' pool rows and mid mask in its layout: one call in place of
// the reference's ~15 small torch ops. C++ with an extern "C" entry point, loaded through ctypes (no torch headers).
#include <algorithm>
#include <cstdint>
#include <limits>

// picked [hkv, n] (strides ps0, ps1), first [hkv, n + na] (fs0, fs1), anchor_slot/offset [n_anchor] (as, ao).
// Writes rows, bias [hkv, E] (E = n * page + n_anchor), tokens, mid_rows [hkv, n * page], valid [hkv, n * page]
// (1: token in [lo, hi)), all contiguous, and the count of valid entries (n_distinct) to *n_distinct.
extern "C" int kvstash_page_entries(int64_t hkv, int64_t n, int64_t page, int64_t n_anchor, const int64_t* picked,
                                    int64_t ps0, int64_t ps1, const int64_t* first, int64_t fs0, int64_t fs1,
                                    const int64_t* anchor_slot, int64_t as, const int64_t* anchor_offset, int64_t ao,
                                    int64_t lo, int64_t hi, int64_t pool_rows, int64_t* rows, float* bias,
                                    int64_t* tokens, int64_t* mid_rows, uint8_t* valid, int64_t* n_distinct) {
  const int64_t np = n * page, e = np + n_anchor, top = std::max(lo, hi - 1), last = pool_rows - 1;
  const float ninf = -std::numeric_limits<float>::infinity();
  int64_t n_mid = 0;
  for (int64_t h = 0; h < hkv; ++h) {
    int64_t* r = rows + h * e;
    float* b = bias + h * e;
    int64_t* tk = tokens + h * np;
    int64_t* mr = mid_rows + h * np;
    uint8_t* va = valid + h * np;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t t0 = picked[h * ps0 + j * ps1] * page, r0 = first[h * fs0 + j * fs1];
      for (int64_t o = 0; o < page; ++o) {
        const int64_t i = j * page + o, tok = t0 + o;
        const bool in = tok >= lo && tok < hi;
        const int64_t row = std::min(std::max<int64_t>(r0 + o, 0), last);
        r[i] = row;
        mr[i] = row;
        b[i] = in ? 0.0f : ninf;
        va[i] = in;
        tk[i] = std::min(std::max(tok, lo), top);
        n_mid += in;
      }
    }
    for (int64_t a = 0; a < n_anchor; ++a) {
      const int64_t row = first[h * fs0 + (n + anchor_slot[a * as]) * fs1] + anchor_offset[a * ao];
      r[np + a] = std::min(std::max<int64_t>(row, 0), last);
      b[np + a] = 0.0f;
    }
  }
  *n_distinct = n_mid;
  return 0;
}
