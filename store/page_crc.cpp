// Keyed CRC-32 of every page of a run of page-file bytes, in one call (store/page_crc_native.py loads it).
//
// The values are zlib's: crc32(data, value) = ~R(~value, data), with R the reflected register update of the
// polynomial 0xEDB88320 (no inversion). A page's CRC is crc32(payload, seed), seed = crc32("{prefix}:{layer}:
// {head}:{page}") (store/pages.py: page_crc, page_crc_seed).
//
// R runs 64 bytes at a time with carry-less multiplies where the build has PCLMUL (-march=native on x86-64):
// four 128-bit lanes, each folded forward over 512 bits per step (x.lo * k1 ^ x.hi * k2, k1 = x^(512+32) and
// k2 = x^(512-32) mod P, bit-reflected), then the lanes folded into one over 128 bits (k3 = x^(128+32),
// k4 = x^(128-32) mod P). The folded 128 bits are congruent to the bytes they replace, so the register of the
// whole is the table CRC of those 16 bytes from register 0, then of the tail. Elsewhere, and for short buffers:
// slicing-by-8 tables.

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__PCLMUL__) && defined(__SSE2__)
#include <immintrin.h>
#define KVSTASH_CLMUL 1
#else
#define KVSTASH_CLMUL 0
#endif

namespace {

constexpr uint32_t kPoly = 0xEDB88320u;

struct Tables {
    uint32_t t[8][256];
    Tables() {
        for (uint32_t i = 0; i < 256; ++i) {
            uint32_t c = i;
            for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
            t[0][i] = c;
        }
        for (int s = 1; s < 8; ++s)
            for (int i = 0; i < 256; ++i) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
    }
};

const Tables& tables() {
    static const Tables tab;  // thread-safe initialisation (C++11)
    return tab;
}

uint32_t load32(const uint8_t* p) {  // little-endian load (x86-64 and aarch64 Linux)
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

// R(r, p[0:n]) with slicing-by-8.
uint32_t register_tables(uint32_t r, const uint8_t* p, size_t n) {
    const auto& t = tables().t;
    for (; n >= 8; p += 8, n -= 8) {
        uint32_t a = load32(p) ^ r, b = load32(p + 4);
        r = t[7][a & 0xFF] ^ t[6][(a >> 8) & 0xFF] ^ t[5][(a >> 16) & 0xFF] ^ t[4][a >> 24] ^
            t[3][b & 0xFF] ^ t[2][(b >> 8) & 0xFF] ^ t[1][(b >> 16) & 0xFF] ^ t[0][b >> 24];
    }
    for (; n; ++p, --n) r = t[0][(r ^ *p) & 0xFF] ^ (r >> 8);
    return r;
}

#if KVSTASH_CLMUL
inline __m128i fold(__m128i x, __m128i k) {
    return _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11));
}

inline __m128i load128(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

uint32_t register_clmul(uint32_t r, const uint8_t* p, size_t n) {
    if (n < 64) return register_tables(r, p, n);
    const __m128i k12 = _mm_set_epi64x(0x1c6e41596LL, 0x154442bd4LL);  // (hi, lo) = (k2, k1)
    const __m128i k34 = _mm_set_epi64x(0x0ccaa009eLL, 0x1751997d0LL);  // (hi, lo) = (k4, k3)
    __m128i x0 = _mm_xor_si128(load128(p), _mm_cvtsi32_si128(static_cast<int>(r)));
    __m128i x1 = load128(p + 16), x2 = load128(p + 32), x3 = load128(p + 48);
    for (p += 64, n -= 64; n >= 64; p += 64, n -= 64) {
        x0 = _mm_xor_si128(fold(x0, k12), load128(p));
        x1 = _mm_xor_si128(fold(x1, k12), load128(p + 16));
        x2 = _mm_xor_si128(fold(x2, k12), load128(p + 32));
        x3 = _mm_xor_si128(fold(x3, k12), load128(p + 48));
    }
    __m128i x = _mm_xor_si128(fold(x0, k34), x1);
    x = _mm_xor_si128(fold(x, k34), x2);
    x = _mm_xor_si128(fold(x, k34), x3);
    for (; n >= 16; p += 16, n -= 16) x = _mm_xor_si128(fold(x, k34), load128(p));
    alignas(16) uint8_t folded[16];
    _mm_store_si128(reinterpret_cast<__m128i*>(folded), x);
    return register_tables(register_tables(0, folded, 16), p, n);
}
#endif

uint32_t crc32(uint32_t value, const uint8_t* p, size_t n) {
#if KVSTASH_CLMUL
    return ~register_clmul(~value, p, n);
#else
    return ~register_tables(~value, p, n);
#endif
}

// Decimal digits of v >= 0 into out (no terminator); their count.
int decimal(int64_t v, char* out) {
    char rev[24];
    int n = 0;
    do {
        rev[n++] = static_cast<char>('0' + v % 10);
        v /= 10;
    } while (v);
    for (int i = 0; i < n; ++i) out[i] = rev[n - 1 - i];
    return n;
}

}  // namespace

extern "C" {

// zlib's crc32(data[0:n], value).
uint32_t kvstash_crc32(uint32_t value, const uint8_t* data, int64_t n) {
    return crc32(value, data, static_cast<size_t>(n));
}

// Whether this build folds with carry-less multiplies (else slicing-by-8 tables only).
int kvstash_crc32_clmul() { return KVSTASH_CLMUL; }

// out[i] = page_crc(prefix, layer, head, page, data[i * page_bytes : (i + 1) * page_bytes]) for i < count, where
// (head, page) = divmod(first + i, n_pages). Returns 0, or -1 for arguments out of range (nothing written).
int kvstash_page_crcs(const char* prefix, int64_t prefix_len, int64_t layer, int64_t n_pages, int64_t first,
                      int64_t count, int64_t page_bytes, const uint8_t* data, uint32_t* out) {
    if (prefix_len < 0 || prefix_len > 256 || layer < 0 || n_pages < 1 || first < 0 || count < 0 || page_bytes < 0)
        return -1;
    char key[320];
    std::memcpy(key, prefix, static_cast<size_t>(prefix_len));
    int stem = static_cast<int>(prefix_len);
    key[stem++] = ':';
    stem += decimal(layer, key + stem);
    key[stem++] = ':';
    int64_t head = -1;
    uint32_t head_reg = 0;  // R(~0, "{prefix}:{layer}:{head}:")
    for (int64_t i = 0; i < count; ++i) {
        const int64_t lin = first + i, h = lin / n_pages, page = lin % n_pages;
        if (h != head) {
            head = h;
            int m = stem + decimal(h, key + stem);
            key[m++] = ':';
            head_reg = register_tables(0xFFFFFFFFu, reinterpret_cast<const uint8_t*>(key), static_cast<size_t>(m));
        }
        char digits[24];
        const int nd = decimal(page, digits);
        const uint32_t seed = ~register_tables(head_reg, reinterpret_cast<const uint8_t*>(digits),
                                               static_cast<size_t>(nd));
        out[i] = crc32(seed, data + i * page_bytes, static_cast<size_t>(page_bytes));
    }
    return 0;
}

}  // extern "C"
