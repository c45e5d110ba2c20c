// A step's token ids -> pool rows of the host-tier view, and the distinct pages read (see ops.py for the contract).
//
// Why a kernel: on the CPU the host view turns each step's token ids into pool rows and counts the distinct pages
// the valid ones touch; in numpy that is some ten array ops and a sort (np.unique) per layer and step, at a few
// hundred ids. Here one pass, pages marked in a byte map. Integer arithmetic only: the same rows and count.
//
// Plain C++ with an extern "C" entry point, loaded through ctypes (workers/kernels/index_page_mass/build.py).
#include <cstddef>
#include <cstdint>
#include <vector>

extern "C" {

// tokens [R, n] (rows r of KV head r % hkv), counts [R]; first_rows [hkv, n_pages]: the pool row of each page's
// first token. out [R, n]: first_rows[h, t / page] + t % page for ids 0 <= t < n_tokens, else -1. Returns the number
// of distinct (head, page) pairs of the valid entries (j < counts[r]), or -1 when a valid id lies outside
// [0, n_tokens).
int64_t kvstash_token_rows(const int64_t* tokens, const int64_t* counts, int64_t rows, int64_t hkv, int64_t n,
                           const int64_t* first_rows, int64_t n_pages, int64_t page_size, int64_t n_tokens,
                           int64_t* out) {
  std::vector<uint8_t> seen(static_cast<size_t>(hkv * n_pages), 0);
  int64_t distinct = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t h = r % hkv;
    const int64_t* t = tokens + r * n;
    int64_t* o = out + r * n;
    const int64_t* first = first_rows + h * n_pages;
    uint8_t* mark = seen.data() + h * n_pages;
    const int64_t valid = counts[r];
    for (int64_t j = 0; j < n; ++j) {
      const int64_t id = t[j];
      if (id < 0 || id >= n_tokens) {
        if (j < valid) return -1;
        o[j] = -1;
        continue;
      }
      const int64_t page = id / page_size;
      o[j] = first[page] + id % page_size;
      if (j < valid && !mark[page]) {
        mark[page] = 1;
        ++distinct;
      }
    }
  }
  return distinct;
}

// pages [hkv, n] (strides s0, s1; ids, negative: padding); first_rows [hkv, n_pages]. out [hkv, n] contiguous:
// first_rows[h, page], -1 for padding. Returns the number of distinct (head, page) pairs of the ids >= 0, or -1 when
// an id is >= n_pages.
int64_t kvstash_page_rows(const int64_t* pages, int64_t s0, int64_t s1, int64_t hkv, int64_t n,
                          const int64_t* first_rows, int64_t n_pages, int64_t* out) {
  std::vector<uint8_t> seen(static_cast<size_t>(hkv * n_pages), 0);
  int64_t distinct = 0;
  for (int64_t h = 0; h < hkv; ++h) {
    const int64_t* first = first_rows + h * n_pages;
    uint8_t* mark = seen.data() + h * n_pages;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t page = pages[h * s0 + j * s1];
      if (page >= n_pages) return -1;
      if (page < 0) {
        out[h * n + j] = -1;
        continue;
      }
      out[h * n + j] = first[page];
      if (!mark[page]) {
        mark[page] = 1;
        ++distinct;
      }
    }
  }
  return distinct;
}

}  // extern "C"
