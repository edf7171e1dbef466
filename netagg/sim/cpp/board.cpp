// netagg: the cycle loop of a board's Verilator model, each Ethernet port bridged to a file
// descriptor that carries whole frames (a TAP device; see sim/board.py).
//
// The model is a Verilator --cc build of sim.tops.BoardTop: clocks `eth_clk` (125 MHz: every
// MAC's GMII side) and `clk` (the core), reset `rst`, and per port i the MAC's GMII,
// gmii{i}_rx_{d,dv,er} in and gmii{i}_tx_{d,en,er} out, and the core's counters
// rx_crc_errors{i} and arp_replies{i}.
//
// Clocks: one call of cycle() is one eth_clk cycle (two evaluations: falling and rising
// edge). The core clock rises with eth_clk once every `ratio` cycles and falls half-way.
//
// Receive (fd -> model): a frame read from the port's fd (Ethernet header to payload, no
// preamble, no FCS) is queued as the bytes a PHY would give the MAC: 7 x 0x55, 0xD5, the
// frame padded to 60 bytes, its FCS (CRC-32, least significant byte first); they go out on
// gmii_rx one per cycle with rx_dv high, followed by 12 idle cycles. Transmit (model -> fd):
// the bytes the MAC sends with tx_en high are gathered; when tx_en falls, the preamble and
// SFD are stripped, the FCS is checked and stripped, and the frame is written to the fd.
// Frames with a wrong FCS, no SFD or tx_er are counted and dropped.
//
// nb_serve polls the fds, clocks the model while anything is in flight (frames queued or
// being driven, a frame being sent, and for `tail` cycles after the last of those, time for
// the switch to finish what it holds), and sleeps in poll() otherwise, so an idle board
// costs nothing. It returns after `max_ms` of wall time, or at once when a signal interrupts
// poll(), so that the caller can handle it; Python calls it through ctypes.CDLL, which
// releases the GIL.
//
// netagg_board.h is written by sim/board.py from the verilated header: NETAGG_PORTS and
// NETAGG_FOR_EACH_PORT(X), which expands X(i) for every port index i.

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <deque>
#include <vector>

#include <poll.h>
#include <unistd.h>

#include "verilated.h"
#include "Vtop.h"
#include "netagg_board.h"

namespace {

constexpr uint8_t kPreamble = 0x55;
constexpr uint8_t kSfd = 0xD5;
constexpr unsigned kPreambleBytes = 7;
constexpr size_t kMinFrame = 60;       // bytes before the FCS
constexpr unsigned kIdleCycles = 12;   // between frames driven on gmii_rx
constexpr size_t kMaxQueued = 256;     // frames per port waiting to be driven; the rest wait
                                       // in the fd's own queue
constexpr size_t kReadBytes = 65536;   // bigger than any frame a TAP gives
constexpr uint64_t kChunk = 512;       // cycles between two looks at the fds and the clock
// Per-port statistics, in this order (sim/board.py names them).
constexpr int kPortStats = 7;

struct Crc32 {
    uint32_t table[256];
    Crc32() {
        for (uint32_t n = 0; n < 256; ++n) {
            uint32_t c = n;
            for (int k = 0; k < 8; ++k) c = (c >> 1) ^ ((c & 1) ? 0xEDB88320u : 0);
            table[n] = c;
        }
    }
    // zlib's crc32(0, data, len): IEEE 802.3, reflected, initial and final inversion.
    uint32_t operator()(const uint8_t* data, size_t len) const {
        uint32_t c = 0xFFFFFFFFu;
        for (size_t k = 0; k < len; ++k) c = table[(c ^ data[k]) & 0xFF] ^ (c >> 8);
        return c ^ 0xFFFFFFFFu;
    }
};
const Crc32 crc32;

struct Port {
    CData* rx_d;
    CData* rx_dv;
    CData* rx_er;
    CData* tx_d;
    CData* tx_en;
    CData* tx_er;
    IData* rx_crc_errors;
    IData* arp_replies;
    int fd = -1;

    // Receive: frames as GMII bytes (preamble to FCS), the one on the wire, idle cycles left.
    std::deque<std::vector<uint8_t>> queue;
    std::vector<uint8_t> wire;
    size_t pos = 0;
    unsigned idle = 0;

    // Transmit: the bytes of the frame being sent (preamble included), tx_er seen in it.
    std::vector<uint8_t> sending;
    bool sending_er = false;

    int64_t frames_in = 0;     // driven into the MAC whole
    int64_t frames_out = 0;    // sent by the MAC with a good FCS, written to the fd
    int64_t bad_fcs = 0;       // sent by the MAC with a wrong FCS
    int64_t malformed = 0;     // sent by the MAC without an SFD, or with tx_er
    int64_t write_errors = 0;  // good frames the fd did not take (or none was open)

    bool receiving() const { return pos < wire.size() || idle || !queue.empty(); }

    // Queue `frame` (len bytes, no FCS) as the GMII bytes of a PHY.
    void push(const uint8_t* frame, size_t len) {
        size_t body = len < kMinFrame ? kMinFrame : len;
        std::vector<uint8_t> bytes(kPreambleBytes + 1 + body + 4, 0);
        std::memset(bytes.data(), kPreamble, kPreambleBytes);
        bytes[kPreambleBytes] = kSfd;
        uint8_t* data = bytes.data() + kPreambleBytes + 1;
        std::memcpy(data, frame, len);
        uint32_t fcs = crc32(data, body);
        for (int k = 0; k < 4; ++k) data[body + k] = uint8_t(fcs >> (8 * k));
        queue.push_back(std::move(bytes));
    }

    // This cycle's gmii_rx.
    void drive() {
        if (pos == wire.size() && !idle && !queue.empty()) {
            wire = std::move(queue.front());
            queue.pop_front();
            pos = 0;
        }
        if (pos < wire.size()) {
            *rx_d = wire[pos++];
            *rx_dv = 1;
            if (pos == wire.size()) {
                idle = kIdleCycles;
                frames_in++;
            }
        } else {
            *rx_d = 0;
            *rx_dv = 0;
            if (idle) idle--;
        }
    }

    // This cycle's gmii_tx, after the rising edge. Returns whether tx_en was high.
    bool sample() {
        if (*tx_en) {
            sending.push_back(*tx_d);
            sending_er |= *tx_er != 0;
            return true;
        }
        if (!sending.empty()) finish();
        return false;
    }

    void finish() {
        size_t k = 0;
        while (k < sending.size() && sending[k] == kPreamble) ++k;
        if (k == sending.size() || sending[k] != kSfd || sending_er ||
            sending.size() - (k + 1) < 4) {
            malformed++;
        } else {
            const uint8_t* frame = sending.data() + k + 1;
            size_t len = sending.size() - (k + 1) - 4;
            uint32_t fcs = frame[len] | frame[len + 1] << 8 | frame[len + 2] << 16 |
                           uint32_t(frame[len + 3]) << 24;
            if (crc32(frame, len) != fcs) {
                bad_fcs++;
            } else if (fd < 0 || write(fd, frame, len) != ssize_t(len)) {
                write_errors++;
            } else {
                frames_out++;
            }
        }
        sending.clear();
        sending_er = false;
    }
};

}  // namespace

struct Board {
    VerilatedContext* ctx;
    Vtop* top;
    Port ports[NETAGG_PORTS];
    unsigned ratio;            // eth_clk cycles per core clock cycle
    unsigned phase = 0;        // this cycle's place in the core clock's period
    uint64_t tail;             // cycles clocked after the last activity
    uint64_t quiet;            // cycles since the last activity
    uint64_t cycles = 0;       // eth_clk cycles since the last reset
    std::vector<uint8_t> buffer = std::vector<uint8_t>(kReadBytes);

    Board(unsigned ratio_, uint64_t tail_) : ratio(ratio_ ? ratio_ : 1), tail(tail_) {
        quiet = tail;
        ctx = new VerilatedContext;
        top = new Vtop{ctx, "top"};
#define NETAGG_BIND(i)                                                                   \
        {                                                                                \
            Port& p = ports[i];                                                          \
            p.rx_d = &top->gmii##i##_rx_d;                                               \
            p.rx_dv = &top->gmii##i##_rx_dv;                                             \
            p.rx_er = &top->gmii##i##_rx_er;                                             \
            p.tx_d = &top->gmii##i##_tx_d;                                               \
            p.tx_en = &top->gmii##i##_tx_en;                                             \
            p.tx_er = &top->gmii##i##_tx_er;                                             \
            p.rx_crc_errors = &top->rx_crc_errors##i;                                    \
            p.arp_replies = &top->arp_replies##i;                                        \
        }
        NETAGG_FOR_EACH_PORT(NETAGG_BIND)
#undef NETAGG_BIND
        for (Port& p : ports) *p.rx_er = 0;
    }

    ~Board() {
        top->final();
        delete top;
        delete ctx;
    }

    // One eth_clk cycle. Returns whether a port was driving a frame (or the gap after it,
    // or had one queued) or the MAC sent a byte.
    bool cycle() {
        bool active = false;
        for (Port& p : ports) {
            active |= p.receiving();
            p.drive();
        }
        top->eth_clk = 0;
        if (phase == ratio / 2) top->clk = 0;
        top->eval();
        top->eth_clk = 1;
        if (phase == 0) top->clk = 1;
        top->eval();
        for (Port& p : ports) active |= p.sample();
        phase = phase + 1 == ratio ? 0 : phase + 1;
        cycles++;
        return active;
    }

    bool busy() const { return quiet < tail; }

    // Clock up to `n` cycles, stopping early once the tail has passed.
    void run(uint64_t n) {
        for (uint64_t k = 0; k < n && busy(); ++k) {
            if (cycle()) quiet = 0;
            else quiet++;
        }
    }

    // Hold rst for `core_cycles` core cycles, frames dropped; the cycle count starts at 0.
    void reset(unsigned core_cycles) {
        for (Port& p : ports) {
            p.queue.clear();
            p.wire.clear();
            p.pos = 0;
            p.idle = 0;
        }
        top->rst = 1;
        for (uint64_t k = 0; k < uint64_t(core_cycles) * ratio; ++k) cycle();
        top->rst = 0;
        for (Port& p : ports) {
            p.sending.clear();
            p.sending_er = false;
            p.frames_in = p.frames_out = p.bad_fcs = p.malformed = p.write_errors = 0;
        }
        cycles = 0;
        quiet = tail;
    }

    // Read what `p`'s fd holds into its queue, up to kMaxQueued frames. Returns 0 or -errno.
    int take(Port& p) {
        while (p.queue.size() < kMaxQueued) {
            ssize_t n = read(p.fd, buffer.data(), buffer.size());
            if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR
                                  ? 0 : -errno;
            if (n == 0) return -EPIPE;  // the other end of a socket is gone
            p.push(buffer.data(), size_t(n));
            quiet = 0;
        }
        return 0;
    }

    void stats(int64_t* out) const {
        out[0] = int64_t(cycles);
        for (int i = 0; i < NETAGG_PORTS; ++i) {
            const Port& p = ports[i];
            int64_t* s = out + 1 + i * kPortStats;
            s[0] = p.frames_in;
            s[1] = p.frames_out;
            s[2] = p.bad_fcs;
            s[3] = p.malformed;
            s[4] = p.write_errors;
            s[5] = *p.rx_crc_errors;
            s[6] = *p.arp_replies;
        }
    }
};

extern "C" {

int nb_ports() { return NETAGG_PORTS; }
int nb_port_stats() { return kPortStats; }

Board* nb_create(unsigned ratio, uint64_t tail) { return new Board(ratio, tail); }
void nb_destroy(Board* b) { delete b; }
void nb_reset(Board* b, unsigned core_cycles) { b->reset(core_cycles); }

// [eth_clk cycles, then per port: frames in, frames out, bad FCS out, malformed out, write
// errors, the MAC's rx_crc_errors, the ARP responder's replies].
void nb_stats(Board* b, int64_t* stats) { b->stats(stats); }

// Serve the ports for up to `max_ms` milliseconds of wall time: fds[i] (non-blocking, one
// frame per read and per write) is port i's. Fills `stats` (as nb_stats) and returns 0, or
// -errno when an fd fails (-EINVAL when nfds is not the number of ports).
int nb_serve(Board* b, const int* fds, int nfds, int max_ms, int64_t* stats) {
    if (nfds != NETAGG_PORTS) return -EINVAL;
    using clock = std::chrono::steady_clock;
    auto deadline = clock::now() + std::chrono::milliseconds(max_ms);
    pollfd polled[NETAGG_PORTS];
    for (int i = 0; i < NETAGG_PORTS; ++i) b->ports[i].fd = fds[i];
    int rc = 0;
    while (rc == 0) {
        int wait = 0;
        if (!b->busy()) {
            auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                deadline - clock::now()).count();
            if (left <= 0) break;
            wait = int(left);
        }
        for (int i = 0; i < NETAGG_PORTS; ++i) {
            polled[i].fd = fds[i];
            polled[i].events = b->ports[i].queue.size() < kMaxQueued ? POLLIN : 0;
            polled[i].revents = 0;
        }
        int ready = poll(polled, NETAGG_PORTS, wait);
        if (ready < 0) {
            if (errno != EINTR) rc = -errno;
            break;              // a signal: back to the caller, which handles it
        }
        if (ready == 0 && !b->busy()) break;     // the deadline, idle
        for (int i = 0; i < NETAGG_PORTS && rc == 0; ++i) {
            short ev = polled[i].revents;
            if (ev & POLLNVAL) rc = -EBADF;
            else if (ev & (POLLIN | POLLERR | POLLHUP)) rc = b->take(b->ports[i]);
        }
        b->run(kChunk);
        if (clock::now() >= deadline) break;
    }
    for (Port& p : b->ports) p.fd = -1;
    b->stats(stats);
    return rc;
}

}  // extern "C"
