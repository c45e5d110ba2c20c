// A decode row's attended entries gathered from a CPU K/V pool in one call (see ops.py for the contract).
//
// Why a kernel: the sparse path's torch form joins a step's exact rows and its extra rows (Double-P's centroids)
// and gathers them in about fifteen small ops (a concatenation and two scatters, index arithmetic, two row
// gathers, the masks), each costing more in dispatch than in copying at a few hundred rows. Only copies here: the
// gathered keys and values are the same bits as the torch form's, and the bias row marks padding with -inf (what
// its masking writes), so the attention's float ops that follow are unchanged.
//
// Plain C++ with an extern "C" entry point, loaded through ctypes (workers/kernels/index_page_mass/build.py).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

extern "C" {

// Pool row r of head h: (k|v) + h * head_stride + r * d, rows < pool_rows. Per head h, entry slots [0, wa + wb):
// rows_a[h, :n_a[h]] (bias 0), then the extra entries ids_b[h, :n_b[h]] (ids_b null: none): entry id e has pool row
// table_b[h, e] (table_b null: e itself) and bias bias_b[h, e] (both [hkv, m_b]), then padding (the key of pool
// row 0, value 0, bias -inf). Writes kg, vg [Hkv, wa + wb, d] and bias [Hkv, wa + wb]. Returns nonzero on a valid
// row outside the pool or an extra id outside [0, m_b).
int kvstash_gather_entries(const float* k, const float* v, int64_t head_stride, int64_t pool_rows, int64_t hkv,
                           int64_t d, const int64_t* rows_a, const int64_t* n_a, int64_t wa, const int64_t* ids_b,
                           const int64_t* n_b, int64_t wb, const int64_t* table_b, const float* bias_b, int64_t m_b,
                           float* kg, float* vg, float* bias) {
  const int64_t w = wa + wb;
  const size_t row_bytes = static_cast<size_t>(d) * sizeof(float);
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t h = 0; h < hkv; ++h) {
    const int64_t na = std::min(std::max<int64_t>(n_a[h], 0), wa);
    const int64_t nb = ids_b ? std::min(std::max<int64_t>(n_b[h], 0), wb) : 0;
    const float* kh = k + h * head_stride;
    const float* vh = v + h * head_stride;
    float* ko = kg + h * w * d;
    float* vo = vg + h * w * d;
    float* bo = bias + h * w;
    for (int64_t j = 0; j < w; ++j) {
      int64_t row = 0;
      if (j < na) {
        row = rows_a[h * wa + j];
        bo[j] = 0.0f;
      } else if (j < na + nb) {
        const int64_t e = ids_b[h * wb + j - na];
        if (e < 0 || e >= m_b) return 2;
        row = table_b ? table_b[h * m_b + e] : e;
        bo[j] = bias_b[h * m_b + e];
      } else {
        bo[j] = ninf;
      }
      if (j < na + nb) {
        if (row < 0 || row >= pool_rows) return 1;
        std::memcpy(vo + j * d, vh + row * d, row_bytes);
      } else {
        std::memset(vo + j * d, 0, row_bytes);
      }
      std::memcpy(ko + j * d, kh + row * d, row_bytes);
    }
  }
  return 0;
}

}  // extern "C"
