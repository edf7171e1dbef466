// zlib's CRC-32, sliced by 8: the ICRC's CRC where the caller gave no faster one (zlib-ng's,
// `netagg.host.cpp_build.crc32_address`). Included by the host's step (`step.cpp`) and the
// fast switch (`netagg/sim/cpp/fast_switch.h`): one translation unit each, so its names stay
// in an anonymous namespace.
#pragma once

#include <cstdint>
#include <cstring>

namespace {

typedef uint32_t (*CrcFn)(uint32_t, const uint8_t *, uint32_t);

uint32_t crc_table[8][256];

void make_crc_table() {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            crc_table[t][i] = crc_table[0][crc_table[t - 1][i] & 0xFF] ^ (crc_table[t - 1][i] >> 8);
}

// zlib's crc32 (slice by 8), where the caller gave no faster one
uint32_t crc_sliced(uint32_t crc, const uint8_t *p, uint32_t n) {
    if (!crc_table[0][1]) make_crc_table();
    crc = ~crc;
    while (n >= 8) {
        uint32_t a, b;
        std::memcpy(&a, p, 4);
        std::memcpy(&b, p + 4, 4);
        a ^= crc;
        crc = crc_table[7][a & 0xFF] ^ crc_table[6][(a >> 8) & 0xFF] ^
              crc_table[5][(a >> 16) & 0xFF] ^ crc_table[4][a >> 24] ^
              crc_table[3][b & 0xFF] ^ crc_table[2][(b >> 8) & 0xFF] ^
              crc_table[1][(b >> 16) & 0xFF] ^ crc_table[0][b >> 24];
        p += 8;
        n -= 8;
    }
    while (n--) crc = crc_table[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    return ~crc;
}

}  // namespace
