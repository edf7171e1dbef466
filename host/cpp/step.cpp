// The plain window's steady state, compiled (host/compiled.py builds and drives it).
//
// `step_run` runs whole steps of a `PlainWindow` (host/window.py) over the worker's UDP
// socket, with the GIL released: it starts every slot whose next message may start
// (quantising its chunk straight into the datagram, headers from the writer's template,
// the ICRC continued from the writer's cached state), sends the step's datagrams as GSO
// runs, writes the sums of the results it took into the tensor, waits for the socket,
// and takes each result exactly as `PlainWindow.take` does. The window's state arrays are
// the Python objects themselves, so they are up to date whenever it returns. It returns
// (`Status`) at the first thing that is not the plain case: a datagram it does not take
// (handed back whole, from where it stopped), a deadline, a message outside its span, an
// exponent message, a non-finite block, the end of its tag table, an idle window.
//
// Every field position, shift and constant of the wire comes in `Run` from the Python
// declarations (hw/headers.py through sim/wire.py and host/wire_arrays.py); `Run`,
// `Status` and `Fmt` themselves are generated from host/compiled.py into step_abi.h.
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <ctime>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include "step_abi.h"

namespace {

typedef uint32_t (*CrcFn)(uint32_t, const uint8_t *, uint32_t);

const double POLL_SECONDS = 0.002;  // the longest wait between looks at `Run.interrupt`

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

double monotonic() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

void put_be32(uint8_t *p, uint32_t v) {
    p[0] = v >> 24; p[1] = v >> 16; p[2] = v >> 8; p[3] = v;
}

void put_be64(uint8_t *p, uint64_t v) {
    put_be32(p, uint32_t(v >> 32));
    put_be32(p + 4, uint32_t(v));
}

uint32_t get_be32(const uint8_t *p) {
    return uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 | p[3];
}

template <class T> T *at(int64_t address) { return reinterpret_cast<T *>(address); }

double half_value(uint16_t h) {
    int e = (h >> 10) & 0x1F, m = h & 0x3FF;
    double v = e == 0 ? std::ldexp(double(m), -24)
             : e == 31 ? (m ? NAN : INFINITY) : std::ldexp(double(m | 0x400), e - 25);
    return h & 0x8000 ? -v : v;
}

double bf16_value(uint16_t h) {
    uint32_t bits = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// One element of source `s`, exact as a double.
inline double element(const Run &r, int64_t s, int64_t i) {
    const int64_t src = at<int64_t>(r.sources)[s];
    switch (r.fmt) {
        case FMT_FLOAT32: return at<float>(src)[i];
        case FMT_FLOAT16: return half_value(at<uint16_t>(src)[i]);
        default: return bf16_value(at<uint16_t>(src)[i]);
    }
}

enum Quantised { Q_OK, Q_SATURATED, Q_NAN };

// `Work._quantize` of one chunk into `lanes` (the data lanes; the tail past the tensor 0).
Quantised quantise(const Run &r, int64_t chunk, int64_t exponent, int32_t *lanes) {
    const int64_t lo = chunk * r.lanes, count = std::min<int64_t>(r.lanes, r.n - lo);
    const double top = double(r.int32_max), bottom = -double(r.int32_max) - 1;
    bool saturated = false;
    if (r.fmt == FMT_INT32 && r.nsources == 1) {
        std::memcpy(lanes, at<int32_t>(at<int64_t>(r.sources)[0]) + lo, size_t(count) * 4);
    } else if (r.fmt == FMT_INT32) {
        for (int64_t j = 0; j < count; j++) {
            int64_t acc = 0;
            for (int64_t s = 0; s < r.nsources; s++)
                acc += at<int32_t>(at<int64_t>(r.sources)[s])[lo + j];
            if (acc > r.int32_max || acc < -r.int32_max - 1) {
                saturated = true;
                acc = acc > 0 ? r.int32_max : -r.int32_max - 1;
            }
            lanes[j] = int32_t(acc);
        }
    } else {
        const double scale = std::ldexp(1.0, int(r.frac - exponent));
        bool nan = false;
        if (r.fmt == FMT_FLOAT32 && r.nsources == 1) {
            const float *x = at<float>(at<int64_t>(r.sources)[0]) + lo;
            int outside = 0;            // (a loop the compiler vectorises)
            for (int64_t j = 0; j < count; j++) {
                const double v = std::nearbyint(double(x[j]) * scale);
                outside |= int(v > top) | int(v < bottom) | int(v != v);
                double c = v < bottom ? bottom : v;
                c = c > top ? top : c;
                lanes[j] = int32_t(c);
            }
            if (outside)
                for (int64_t j = 0; j < count; j++) {
                    const double v = std::nearbyint(double(x[j]) * scale);
                    nan |= v != v;
                    saturated |= v > top || v < bottom;
                }
        } else {
            for (int64_t j = 0; j < count; j++) {
                double v = 0;
                for (int64_t s = 0; s < r.nsources; s++)
                    v += std::nearbyint(element(r, s, lo + j) * scale);
                nan |= v != v;
                if (v > top || v < bottom) { saturated = true; v = v > 0 ? top : bottom; }
                lanes[j] = int32_t(v);
            }
        }
        if (nan) return Q_NAN;
    }
    for (int64_t j = count; j < r.lanes; j++) lanes[j] = 0;
    return saturated ? Q_SATURATED : Q_OK;
}

// `numerics.from_float64` of bfloat16 bits: through float32, rounded to nearest even.
uint16_t bf16_bits(double v, int64_t nan) {
    if (v != v) return uint16_t(nan);
    float f = float(v);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    uint64_t b = bits;
    return uint16_t((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
}

// `deliver_rows` of one chunk: its sums into the tensor.
void deliver(Run &r, int64_t chunk, const int32_t *sums, int64_t exponent) {
    const int64_t lo = chunk * r.lanes, count = std::min<int64_t>(r.lanes, r.n - lo);
    if (r.fmt == FMT_INT32) {
        std::memcpy(at<int32_t>(r.out) + lo, sums, count * 4);
        r.tensor_bytes += count * 4;
        return;
    }
    const double scale = std::ldexp(1.0, int(exponent - r.frac));
    const double world = double(r.world_size);
    if (r.fmt == FMT_FLOAT32) {
        float *out = at<float>(r.out) + lo;
        if (r.mean)
            for (int64_t j = 0; j < count; j++) out[j] = float(sums[j] * scale / world);
        else
            for (int64_t j = 0; j < count; j++) out[j] = float(sums[j] * scale);
        r.tensor_bytes += count * 4;
        return;
    }
    uint16_t *out = at<uint16_t>(r.out) + lo;
    for (int64_t j = 0; j < count; j++) {
        double v = sums[j] * scale;
        if (r.mean) v = v / world;
        if (r.fmt == FMT_BFLOAT16) {
            out[j] = bf16_bits(v, r.bf16_nan);
        } else {
#ifdef __FLT16_MAX__
            _Float16 h = _Float16(v);
            std::memcpy(out + j, &h, 2);
#endif
        }
    }
    r.tensor_bytes += count * 2;
}

struct Step {
    Run &r;
    CrcFn crc;
    int64_t *next, *cur, *use, *cur_use, *tag, *whole, *last_psn, *tag_base;
    double *sent_at, *deadline;
    int64_t *seal_table, *whole_table;
    const int64_t *chunk_of, *needs, *carries, *field, *offset;
    uint8_t *known, *started;
    int64_t *shared;
    uint8_t *pkt, *run;
    int64_t pending[1024][3];    // results taken, sums not yet written: (chunk, row, exponent)
    int npending = 0;

    explicit Step(Run &run_) : r(run_) {
        crc = r.crc32 ? reinterpret_cast<CrcFn>(r.crc32) : crc_sliced;
        next = at<int64_t>(r.next); cur = at<int64_t>(r.cur); use = at<int64_t>(r.use);
        cur_use = at<int64_t>(r.cur_use); tag = at<int64_t>(r.tag);
        whole = at<int64_t>(r.whole); last_psn = at<int64_t>(r.last_psn);
        tag_base = at<int64_t>(r.tag_base);
        sent_at = at<double>(r.sent_at); deadline = at<double>(r.deadline);
        seal_table = at<int64_t>(r.seal_table); whole_table = at<int64_t>(r.whole_table);
        chunk_of = at<int64_t>(r.chunk); needs = at<int64_t>(r.needs);
        carries = at<int64_t>(r.carries); field = at<int64_t>(r.field);
        offset = at<int64_t>(r.offset); known = at<uint8_t>(r.known);
        shared = at<int64_t>(r.shared); started = at<uint8_t>(r.started);
        pkt = at<uint8_t>(r.packets); run = at<uint8_t>(r.run_buffer);
    }

    bool in_span(int64_t g) const { return g >= r.first && g < r.first + r.count; }

    void flush() {
        const uint8_t *rx = at<uint8_t>(r.rx);
        for (int i = 0; i < npending; i++) {
            deliver(r, pending[i][0],
                    reinterpret_cast<const int32_t *>(rx + pending[i][1] + r.off_lanes),
                    pending[i][2]);
            r.chunks_done++;
        }
        npending = 0;
    }

    void send_one(const uint8_t *d, sockaddr_in &dst) {
        for (;;) {
            if (sendto(int(r.fd), d, size_t(r.size), 0, reinterpret_cast<sockaddr *>(&dst),
                       sizeof dst) >= 0 || errno != EINTR)
                return;     // a full buffer (EAGAIN) drops it: a lost packet
        }
    }

    // `GsoSender.send` of the k datagrams in `run`.
    void send(int64_t k) {
        sockaddr_in dst{};
        dst.sin_family = AF_INET;
        dst.sin_port = htons(uint16_t(r.dst_port));
        dst.sin_addr.s_addr = htonl(uint32_t(r.dst_ip));
        const int64_t size = r.size;
        if (!r.gso || k == 1 || size % 4) {
            for (int64_t i = 0; i < k; i++) send_one(run + i * size, dst);
            return;
        }
        const uint32_t *deltas = at<uint32_t>(r.deltas);
        for (int64_t first = 0; first < k; first += r.per_run) {
            const int64_t rows = std::min(r.per_run, k - first);
            uint8_t *buf = run + first * size;
            if (rows == 1) { send_one(buf, dst); continue; }
            if (r.renumber)
                for (int64_t i = 1; i < rows; i++) {
                    uint32_t icrc;
                    std::memcpy(&icrc, buf + i * size + r.off_icrc, 4);
                    icrc ^= deltas[i];
                    std::memcpy(buf + i * size + r.off_icrc, &icrc, 4);
                }
            iovec iov{buf, size_t(rows * size)};
            alignas(cmsghdr) char control[CMSG_SPACE(sizeof(uint16_t))] = {};
            msghdr msg{};
            msg.msg_name = &dst;
            msg.msg_namelen = sizeof dst;
            msg.msg_iov = &iov;
            msg.msg_iovlen = 1;
            msg.msg_control = control;
            msg.msg_controllen = sizeof control;
            cmsghdr *c = CMSG_FIRSTHDR(&msg);
            c->cmsg_level = int(r.sol_udp);
            c->cmsg_type = int(r.udp_segment);
            c->cmsg_len = CMSG_LEN(sizeof(uint16_t));
            const uint16_t segment = uint16_t(size);
            std::memcpy(CMSG_DATA(c), &segment, sizeof segment);
            ssize_t sent;
            do sent = sendmsg(int(r.fd), &msg, 0); while (sent < 0 && errno == EINTR);
            if (sent >= 0 || errno == EAGAIN || errno == EWOULDBLOCK) continue;
            r.gso = 0;                  // no GSO here: one by one from now on
            r.gso_failed = 1;
            if (r.renumber)
                for (int64_t i = 1; i < rows; i++) {
                    uint32_t icrc;
                    std::memcpy(&icrc, buf + i * size + r.off_icrc, 4);
                    icrc ^= deltas[i];
                    std::memcpy(buf + i * size + r.off_icrc, &icrc, 4);
                }
            for (int64_t i = 0; i < rows; i++) send_one(buf + i * size, dst);
        }
    }

    // `PlainWindow._start`: start every slot that may, build and send their datagrams.
    int start(double now) {
        const int64_t slots = r.nslots, size = r.size;
        for (int64_t s = 0; s < slots; s++) {           // what only Python does
            if (cur[s] >= 0 || next[s] >= r.total) continue;
            const int64_t g = next[s];
            if (!in_span(g)) return ST_BOUNDARY;
            const int64_t i = g - r.first;
            if (i < r.leading) return ST_PYTHON;
            const int64_t nd = needs[i];
            if (nd >= 0 && known[nd] && shared[nd] == r.exp_nonfinite) return ST_NONFINITE;
            const int64_t col = use[s] - tag_base[s];
            if (col < 0 || col >= r.tag_cols) return ST_TAGS;
        }
        int64_t k = 0;
        int status = ST_RUNNING;
        for (int64_t s = 0; s < slots; s++) {
            if (cur[s] >= 0 || next[s] >= r.total) continue;
            const int64_t g = next[s], i = g - r.first, nd = needs[i];
            if (nd >= 0 && !known[nd]) continue;
            if (r.credits && r.dealt + g >= r.limit) { r.credit_waits++; continue; }
            uint8_t *d = run + k * size;
            const int64_t exponent = nd >= 0 ? shared[nd] : 0;
            int32_t *lanes = reinterpret_cast<int32_t *>(d + r.off_lanes);
            const Quantised q = quantise(r, chunk_of[i], exponent, lanes);
            if (q == Q_NAN) { status = ST_NONFINITE; break; }
            const int64_t u = use[s], col = u - tag_base[s];
            cur[s] = g; cur_use[s] = u; use[s] = u + 1; next[s] = g + slots;
            tag[s] = at<int64_t>(r.tag_table)[s * r.tag_cols + col];
            whole[s] = whole_table[s * r.tag_cols + col];
            lanes[r.lanes] = q == Q_SATURATED ? int32_t(r.int32_max)
                                              : int32_t(seal_table[s * r.tag_cols + col]);
            std::memcpy(d, at<uint8_t>(r.tx_head), 8);
            r.psn = (r.psn + 1) & r.psn_mask;
            put_be32(d + r.off_psn, uint32_t(r.psn));
            const uint64_t msn = uint64_t(r.dealt + g) & uint64_t(r.msn_mask);
            put_be64(d + r.off_va, msn << r.va_msn_shift |
                                   (uint64_t(offset[i]) & uint64_t(r.va_offset_mask)));
            put_be32(d + r.off_rkey, uint32_t(r.key));
            put_be32(d + r.off_dma, uint32_t(4 * (r.lanes + 1)));
            put_be32(d + r.off_imm, uint32_t(r.imm_base | (u & 1) << r.sh_version |
                                             s << r.sh_slot |
                                             (field[i] & r.exp_mask) << r.sh_exponent));
            const uint32_t icrc = crc(uint32_t(r.tx_state), d + 8, uint32_t(size - 8 - 4));
            std::memcpy(d + r.off_icrc, &icrc, 4);
            std::memcpy(pkt + s * size, d, size_t(size));
            started[s] = 1;
            sent_at[s] = now;
            deadline[s] = now + r.rto;
            k++;
        }
        if (k) {
            send(k);
            r.packets_sent += k;
            int64_t inflight = 0;
            for (int64_t s = 0; s < slots; s++) inflight += cur[s] >= 0;
            if (inflight > r.max_inflight) r.max_inflight = inflight;
        }
        return status;
    }

    // `PlainWindow.take` of the datagram at `rx + at`: whether it was taken.
    bool take(const uint8_t *d, int64_t at_, int64_t near, double now, bool &sampled) {
        if (std::memcmp(d, at<uint8_t>(r.rx_head), 8)) return false;
        uint32_t icrc;
        std::memcpy(&icrc, d + r.off_icrc, 4);
        if (crc(uint32_t(r.rx_state), d + 8, uint32_t(r.size - 8 - 4)) != icrc) return false;
        if (get_be32(d + r.off_rkey) != uint32_t(r.rkey)) return false;
        const int64_t imm = get_be32(d + r.off_imm);
        const int64_t job = imm >> r.rs_job & r.rm_job, count = imm >> r.rs_count & r.rm_count;
        const int64_t version = imm >> r.rs_version & r.rm_version;
        const int64_t slot = imm >> r.rs_slot & r.rm_slot;
        int64_t exponent = imm >> r.rs_exponent & r.rm_exponent;
        exponent -= (exponent & r.exp_sign) << 1;
        const bool flag = (imm >> r.rs_overflow & r.rm_overflow) != 0;
        if (job != r.job || slot >= r.nslots) return false;
        const int64_t span = r.psn_mask + 1;
        int64_t delta = ((int64_t(get_be32(d + r.off_psn) & r.psn_mask) - near) % span + span) % span;
        const int64_t limit = near + (delta >= span / 2 ? delta - span : delta);
        const int32_t check = *reinterpret_cast<const int32_t *>(d + r.off_lanes + 4 * r.lanes);
        const int64_t g = cur[slot];
        if (g < 0 || version != (cur_use[slot] & 1) || check != whole[slot] ||
            count != r.workers || flag || check == r.int32_max || limit < last_psn[slot] ||
            !in_span(g) || npending >= 1024)
            return false;
        if (!sampled) {
            double *samples = at<double>(r.samples);
            if (r.nsamples < r.samples_cap) samples[r.nsamples++] = now - sent_at[slot];
            sampled = true;
        }
        r.progress_at = now;
        cur[slot] = -1;
        deadline[slot] = INFINITY;
        last_psn[slot] = limit;
        if (limit > r.limit) r.limit = limit;
        const int64_t i = g - r.first;
        if (i < r.leading) {
            known[i] = 1;
            shared[i] = exponent;
            return true;
        }
        if (r.leading) {
            const int64_t b = carries[i];
            if (b >= 0 && exponent != r.exp_none && !known[b]) { known[b] = 1; shared[b] = exponent; }
        }
        pending[npending][0] = chunk_of[i];
        pending[npending][1] = at_;
        pending[npending][2] = r.leading ? shared[needs[i]] : 0;
        npending++;
        return true;
    }

    int loop() {
        uint8_t *rx = at<uint8_t>(r.rx);
        alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int)) + 64];
        for (;;) {
            double now = monotonic();
            const int status = start(now);
            flush();
            if (status != ST_RUNNING) return status;
            double first_due = INFINITY;
            int64_t inflight = 0;
            for (int64_t s = 0; s < r.nslots; s++)
                if (cur[s] >= 0) { inflight++; first_due = std::min(first_due, deadline[s]); }
            if (!inflight) return ST_IDLE;
            now = monotonic();
            if (first_due <= now) return ST_DUE;
            if (now >= r.until || __atomic_load_n(&r.interrupt, __ATOMIC_RELAXED))
                return ST_UNTIL;
            const double wait = std::min({first_due, r.until, now + POLL_SECONDS}) - now;
            pollfd p{int(r.fd), POLLIN, 0};
            if (poll(&p, 1, int(std::ceil(wait * 1000))) <= 0) continue;
            sockaddr_in sender{};
            iovec iov{rx, size_t(r.rx_cap)};
            msghdr msg{};
            msg.msg_name = &sender;
            msg.msg_namelen = sizeof sender;
            msg.msg_iov = &iov;
            msg.msg_iovlen = 1;
            msg.msg_control = control;
            msg.msg_controllen = sizeof control;
            const ssize_t got = recvmsg(int(r.fd), &msg, MSG_DONTWAIT);
            if (got < 0) continue;      // EAGAIN, EINTR: wait again
            int64_t seg = 0;
            for (cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c))
                if (c->cmsg_level == int(r.sol_udp) && c->cmsg_type == int(r.udp_gro)) {
                    int v;
                    std::memcpy(&v, CMSG_DATA(c), sizeof v);
                    seg = v;
                }
            r.rx_len = got;
            r.rx_seg = seg;
            r.rx_ip = ntohl(sender.sin_addr.s_addr);
            r.rx_port = ntohs(sender.sin_port);
            r.rx_from = 0;
            if (r.rx_ip != r.result_ip || r.rx_port != r.result_port) return ST_HANDED;
            const int64_t step = seg && got > seg ? seg : got;
            const int64_t near = r.limit;
            now = monotonic();
            bool sampled = false;
            for (int64_t a = 0; a < got; a += step) {
                if (step != r.size || a + step > got || !take(rx + a, a, near, now, sampled)) {
                    r.rx_from = a;
                    flush();
                    return ST_HANDED;
                }
                r.packets_received++;
            }
            r.steps++;
        }
    }
};

}  // namespace

extern "C" int step_float16() {
#ifdef __FLT16_MAX__
    return 1;
#else
    return 0;
#endif
}

extern "C" int step_run(Run *r) {
    Step step(*r);
    r->status = step.loop();
    return int(r->status);
}
