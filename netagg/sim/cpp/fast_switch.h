// The fast switch's common contribution, compiled (sim/fast.py drives it through fast.cpp).
//
// `Switch::run` takes a run of frames of one length that arrived on one port, row by row, as
// `GoldenSwitch.receive` takes each (sim/golden.py, steps 1 to 7): a contribution (opcode
// 0x2B) that the parser passes (every header check of `sim.codec.checks`, no pad, the ICRC)
// and that the job table takes (payload length, job enabled, rank and source IPv4 address,
// RETH.rkey the job's KEY, slot) is counted on its port, nulled by priority where its class's
// drop threshold is 0 (the queue holds nothing ahead of it), checked against the job's
// credit, and applied to its slot copy: a new use, an add (saturating int32 lanes, the
// exponent's maximum, the overflow flag), a duplicate, a stale message, a replay, a wrong
// length, a use closed late at its deadline, the use completed at its quorum. Every result
// is written from its worker's template: the lengths and the IPv4 checksum, BTH.psn the
// credit limit, RETH, ImmDt, the sums and the ICRC. It stops at the first row that is not
// such a contribution (a control request, a parser drop, a refused contribution, an
// oversized one), before changing anything for it, and hands it back (`STOP_GOLDEN`): the
// golden model's code decides and counts it.
//
// The switch's state is the Python objects' own numpy arrays (sim/fast.py): the job table as
// Python last wrote it, the slot copies and the counters, which the golden model's code
// reads and writes too. Every field position, opcode, ImmDt field and counter comes in
// fast_abi.h from the Python declarations (netagg/sim/fast_build.py, from the contract,
// netagg.contract); the CRC-32 is the host's (netagg/host/cpp/crc_sliced.h).
#pragma once
#include <cstdint>
#include <cstring>

#include "crc_sliced.h"
#include "fast_abi.h"

namespace {

template <class T> T *at(int64_t address) { return reinterpret_cast<T *>(address); }

uint32_t get_be16(const uint8_t *p) { return uint32_t(p[0]) << 8 | p[1]; }

uint32_t get_be32(const uint8_t *p) {
    return uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 | p[3];
}

uint64_t get_be64(const uint8_t *p) { return uint64_t(get_be32(p)) << 32 | get_be32(p + 4); }

void put_be16(uint8_t *p, uint32_t v) { p[0] = v >> 8; p[1] = v; }

void put_be32(uint8_t *p, uint32_t v) { p[0] = v >> 24; p[1] = v >> 16; p[2] = v >> 8; p[3] = v; }

void put_be64(uint8_t *p, uint64_t v) { put_be32(p, uint32_t(v >> 32)); put_be32(p + 4, uint32_t(v)); }

// The ones' complement sum of an IPv4 header's 16-bit words, folded.
uint32_t ip_sum(const uint8_t *ip) {
    uint32_t sum = 0;
    for (int i = 0; i < IP_LEN; i += 2) sum += get_be16(ip + i);
    while (sum >> 16) sum = (sum & 0xFFFF) + (sum >> 16);
    return sum;
}

inline uint32_t bits(uint32_t word, int shift, int width) {
    return (word >> shift) & ((1u << width) - 1);
}

inline int64_t sign_extend(uint32_t v, int width) {
    return v >> (width - 1) ? int64_t(v) - (int64_t(1) << width) : int64_t(v);
}

const int64_t INT32_LO = -(int64_t(1) << 31), INT32_HI = (int64_t(1) << 31) - 1;

struct Switch {
    State &s;
    CrcFn crc;
    int64_t *job, *worker, *bitmap, *count, *data, *length, *msn16, *exponent, *overflow,
        *begun, *sums, *port_counters, *job_counters, *sent;
    const int64_t *thresholds;
    const uint8_t *templates;
    uint8_t *out;
    int64_t frame_bytes;        // the run's frames (and their results)

    explicit Switch(State &state)
        : s(state), crc(crc_sliced),
          job(at<int64_t>(s.job)), worker(at<int64_t>(s.worker)), bitmap(at<int64_t>(s.bitmap)),
          count(at<int64_t>(s.count)), data(at<int64_t>(s.data)), length(at<int64_t>(s.length)),
          msn16(at<int64_t>(s.msn16)), exponent(at<int64_t>(s.exponent)),
          overflow(at<int64_t>(s.overflow)), begun(at<int64_t>(s.begun)),
          sums(at<int64_t>(s.sums)), port_counters(at<int64_t>(s.port_counters)),
          job_counters(at<int64_t>(s.job_counters)), sent(at<int64_t>(s.sent)),
          thresholds(at<int64_t>(s.thresholds)), templates(at<uint8_t>(s.templates)),
          out(at<uint8_t>(s.out)), frame_bytes(BTH_OFFSET + s.size) {
        crc = s.crc32 ? reinterpret_cast<CrcFn>(s.crc32) : crc_sliced;
    }

    // The ICRC of a frame whose headers (Ethernet, IPv4, UDP) are `head` and whose datagram
    // (BTH .. ICRC) of `size` bytes is `datagram`: its lead of ones, the masked headers,
    // the rest of the datagram but the ICRC.
    uint32_t icrc(const uint8_t *head, const uint8_t *datagram, int64_t size) const {
        uint8_t lead[8 + ICRC_HEADERS];
        std::memset(lead, 0xFF, 8);
        std::memcpy(lead + 8, head + IP_OFFSET, IP_LEN + UDP_LEN);
        std::memcpy(lead + 8 + IP_LEN + UDP_LEN, datagram, ICRC_HEADERS - IP_LEN - UDP_LEN);
        for (int b : ICRC_MASKED) lead[8 + b] = 0xFF;
        const int64_t covered = ICRC_HEADERS - IP_LEN - UDP_LEN;
        return crc(crc(0, lead, sizeof lead), datagram + covered,
                   uint32_t(size - covered - ICRC_LEN));
    }

    // Whether the parser passes the frame as a contribution without pad that its port's
    // queue holds (`sim.codec.checks` and the ICRC, `GoldenSwitch.receive`'s OVERSIZE); its
    // payload length in `payload`.
    bool parsed(const uint8_t *h, const uint8_t *d, int64_t &payload) const {
        const int64_t n = BTH_OFFSET + s.size;
        if (s.size < BTH_LEN + EXT_CONTRIBUTION + ICRC_LEN) return false;
        const uint8_t *ip = h + IP_OFFSET, *udp = h + UDP_OFFSET;
        if (get_be16(h + IP_OFFSET - 2) != ETHERTYPE_IPV4 || ip[0] != IPV4_FIRST_BYTE ||
            get_be16(ip + 6) & 0x3FFF || ip[9] != IP_PROTO_UDP || ip_sum(ip) != 0xFFFF ||
            get_be16(udp + 2) != ROCEV2_PORT || d[1] & 0x3F || d[0] != OP_CONTRIBUTION)
            return false;               // (flags & 0x30: a pad, which no good payload has)
        const int64_t total = get_be16(ip + 2), udp_length = get_be16(udp + 4);
        const int64_t padded = udp_length - (UDP_LEN + BTH_LEN + ICRC_LEN) - EXT_CONTRIBUTION;
        if (n != IP_OFFSET + total || udp_length != total - IP_LEN || padded < 0 || padded % 4 ||
            padded > s.queue_capacity)
            return false;
        uint32_t field;
        std::memcpy(&field, d + s.size - ICRC_LEN, 4);      // little-endian, as `ICRC_WORD`
        if (icrc(h, d, s.size) != field) return false;
        payload = padded;
        return true;
    }

    void count_result(int64_t j, int64_t port) {
        job_counters[j * N_JOB_COUNTERS + JC_RESULTS]++;
        port_counters[port * N_PORT_COUNTERS + PC_TX]++;
    }

    // The result of copy `c`'s use to rank `rank` of job `j` (`GoldenSwitch._results`).
    void result(int64_t j, int64_t rank, int64_t c, uint32_t psn, uint32_t offset,
                uint32_t imm) {
        const int64_t *w = worker + (j * s.max_workers + rank) * WORKER_WORDS;
        if (w[WK_PORT] >= s.ports) return;           // no such port: the result cannot leave
        uint8_t *f = out + s.results * frame_bytes;
        std::memcpy(f, templates + (j * s.max_workers + rank) * TEMPLATE_BYTES, TEMPLATE_BYTES);
        uint8_t *ip = f + IP_OFFSET;
        put_be16(ip + 2, uint32_t(frame_bytes - IP_OFFSET));
        put_be16(ip + 10, 0);
        put_be16(ip + 10, ~ip_sum(ip) & 0xFFFF);
        put_be16(f + UDP_OFFSET + 4, uint32_t(frame_bytes - UDP_OFFSET));
        uint8_t *t = f + BTH_OFFSET + 8;
        put_be32(t, psn & 0xFFFFFF);
        put_be64(t + 4, uint64_t(w[WK_VA]) + offset);
        put_be32(t + 12, uint32_t(w[WK_RKEY]));
        const int64_t n = length[c] / 4, *lanes = sums + c * s.lanes;
        put_be32(t + 16, uint32_t(length[c]));
        put_be32(t + 20, imm);
        uint8_t *payload = f + PAYLOAD_OFFSET;
        for (int64_t i = 0; i < n; i++) {
            const int32_t v = int32_t(lanes[i]);
            std::memcpy(payload + 4 * i, &v, 4);
        }
        const uint32_t icrc_value = icrc(f, f + BTH_OFFSET, s.size);
        std::memcpy(f + frame_bytes - ICRC_LEN, &icrc_value, 4);
        sent[2 * s.results] = w[WK_PORT];
        sent[2 * s.results + 1] = j * s.max_workers + rank;
        s.results++;
        count_result(j, w[WK_PORT]);
    }

    // The results of copy `c`'s use (job j, slot, version) to `ranks` ranks from `first`.
    void results(int64_t j, int64_t c, int64_t version, int64_t slot, uint32_t offset,
                 int64_t first, int64_t ranks) {
        const int64_t *row = job + j * JOB_WORDS;
        const uint32_t imm =
            uint32_t(j) << RES_JOB_SHIFT | uint32_t(data[c]) << RES_COUNT_SHIFT |
            uint32_t(version) << RES_VERSION_SHIFT | uint32_t(slot) << RES_SLOT_SHIFT |
            (uint32_t(exponent[c]) & ((1u << RES_EXPONENT_BITS) - 1)) << RES_EXPONENT_SHIFT |
            uint32_t(overflow[c] != 0) << RES_OVERFLOW_SHIFT;
        const uint32_t psn = uint32_t(row[J_COMPLETED] + row[J_CREDITS]);
        for (int64_t r = first; r < first + ranks; r++) result(j, r, c, psn, offset, imm);
    }

    // A use of copy `c` of job j is complete (`GoldenSwitch._complete`).
    void complete(int64_t j, int64_t c) {
        int64_t *counters = job_counters + j * N_JOB_COUNTERS, *row = job + j * JOB_WORDS;
        count[c] = 0;
        counters[JC_COMPLETED]++;
        row[J_COMPLETED] = (row[J_COMPLETED] + 1) & 0xFFFFFFFF;
        counters[JC_OVERFLOWS] += overflow[c] != 0;
    }

    // One row; false when it is not the compiled core's (or its results would not fit).
    bool take(const uint8_t *h, const uint8_t *d, Stop &why) {
        why = STOP_GOLDEN;
        int64_t bytes;
        if (!parsed(h, d, bytes)) return false;
        const uint8_t *reth = d + (RETH_OFFSET - BTH_OFFSET);
        const uint64_t va = get_be64(reth);
        const uint32_t rkey = get_be32(reth + 8), dma_length = get_be32(reth + 12);
        const uint32_t imm = get_be32(d + (IMM_OFFSET - BTH_OFFSET));
        const int64_t j = bits(imm, REQ_JOB_SHIFT, REQ_JOB_BITS);
        const int64_t rank = bits(imm, REQ_RANK_SHIFT, REQ_RANK_BITS);
        const int64_t slot = bits(imm, REQ_SLOT_SHIFT, REQ_SLOT_BITS);
        const int64_t version = bits(imm, REQ_VERSION_SHIFT, REQ_VERSION_BITS);
        // the job table's refusals (`GoldenSwitch._refusal`) are the golden model's
        if (bytes < 4 || bytes > s.max_payload || bytes % 4 || dma_length != bytes ||
            j >= s.jobs)
            return false;
        int64_t *row = job + j * JOB_WORDS;
        if (!row[J_ENABLE] || rank >= row[J_WORKERS] ||
            get_be32(h + IP_OFFSET + 12) !=
                uint32_t(worker[(j * s.max_workers + rank) * WORKER_WORDS + WK_IP]) ||
            rkey != uint32_t(row[J_KEY]) || slot >= row[J_SLOT_COUNT] ||
            row[J_SLOT_BASE] + slot >= s.slots)
            return false;
        why = STOP_FULL;
        if (s.results + row[J_WORKERS] > s.out_rows) return false;
        // taken: counted on its port, nulled by priority, then the credit and the copy
        int64_t *rx = port_counters + s.port * N_PORT_COUNTERS;
        int64_t *counters = job_counters + j * N_JOB_COUNTERS;
        rx[PC_RX]++;
        const bool null = bits(imm, REQ_DROPPABLE_SHIFT, REQ_DROPPABLE_BITS) &&
                          thresholds[h[IP_OFFSET + 1] >> 5] == 0;
        if (null) rx[PC_DROP_PRIORITY]++;
        const uint32_t msn = uint32_t(va >> VA_MSN_SHIFT), offset = uint32_t(va);
        if (row[J_CREDITS] && int32_t(msn - uint32_t(row[J_COMPLETED])) >= row[J_CREDITS]) {
            counters[JC_DROP_CREDIT]++;
            return true;
        }
        const int64_t c = (row[J_SLOT_BASE] + slot) * 2 + version, bit = int64_t(1) << rank;
        const int64_t d16 = int16_t(uint16_t(msn - uint32_t(msn16[c])));
        const int32_t *lanes = reinterpret_cast<const int32_t *>(d + (PAYLOAD_OFFSET - BTH_OFFSET));
        int64_t *copy_sums = sums + c * s.lanes;
        const int64_t n = bytes / 4;
        const int64_t exp = sign_extend(bits(imm, REQ_EXPONENT_SHIFT, REQ_EXPONENT_BITS),
                                        REQ_EXPONENT_BITS);
        const int64_t workers = row[J_WORKERS];
        if (count[c] == 0) {
            if (bitmap[c] && d16 == 0 && bytes != length[c]) {
                counters[JC_DROP_BAD_LENGTH]++;
                return true;
            }
            if (bitmap[c] && d16 == 0) {
                counters[JC_REPLAYS]++;
                results(j, c, version, slot, offset, rank, 1);
                return true;
            }
            if (bitmap[c] && d16 < 0) {
                counters[JC_DROP_STALE]++;
                return true;
            }
            bitmap[c] = bit, count[c] = 1, data[c] = !null, length[c] = bytes;
            msn16[c] = msn & 0xFFFF, exponent[c] = exp, overflow[c] = 0, begun[c] = s.now;
            if (null) {
                for (int64_t i = 0; i < n; i++) copy_sums[i] = 0;
            } else {
                for (int64_t i = 0; i < n; i++) {
                    int32_t v;
                    std::memcpy(&v, lanes + i, 4);
                    copy_sums[i] = v;
                }
            }
        } else if (d16 != 0) {
            counters[JC_DROP_STALE]++;
            return true;
        } else if (bitmap[c] & bit && row[J_DEADLINE] &&
                   ((s.now - begun[c]) & ((1 << DEADLINE_BITS) - 1)) >= row[J_DEADLINE] &&
                   bytes == length[c]) {
            counters[JC_CLOSED_LATE]++;
            complete(j, c);
            results(j, c, version, slot, offset, 0, workers);
            return true;
        } else if (bitmap[c] & bit) {
            counters[JC_DUPLICATES]++;
            return true;
        } else if (bytes != length[c]) {
            counters[JC_DROP_BAD_LENGTH]++;
            return true;
        } else {
            if (!null) {
                int64_t saturated = 0;
                for (int64_t i = 0; i < n; i++) {
                    int32_t v;
                    std::memcpy(&v, lanes + i, 4);
                    const int64_t t = copy_sums[i] + v;
                    const int64_t clamped = t < INT32_LO ? INT32_LO : t > INT32_HI ? INT32_HI : t;
                    saturated |= clamped ^ t;
                    copy_sums[i] = clamped;
                }
                overflow[c] |= saturated != 0;
            }
            if (exp > exponent[c]) exponent[c] = exp;
            bitmap[c] |= bit;
            count[c]++;
            data[c] += !null;
        }
        counters[JC_CONTRIBUTIONS]++;
        if (count[c] < row[J_NEEDED]) return true;
        complete(j, c);
        results(j, c, version, slot, offset, 0, workers);
        return true;
    }

    // Rows `first` .. `rows` - 1 of the run whose headers are `heads` (BTH_OFFSET bytes a
    // row) and whose datagrams are `body` (`size` bytes a row); `taken`: the row it stopped
    // at.
    Stop run(const uint8_t *heads, const uint8_t *body) {
        s.results = 0;
        for (s.taken = s.first; s.taken < s.rows; s.taken++) {
            Stop why;
            if (!take(heads + s.taken * BTH_OFFSET, body + s.taken * s.size, why)) return why;
        }
        return STOP_DONE;
    }
};

}  // namespace
