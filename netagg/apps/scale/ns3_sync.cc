// One gradient synchronisation at packet level on ns-3, compiled by cppyy (apps/scale/ns3.py).
//
// A star: every host (workers, and dedicated parameter servers) on its own point-to-point link
// to one switch node, which forwards by IPv4 (global routing) and, for in-network aggregation,
// runs the aggregator itself. Hosts pace their own sends at line rate from one FIFO (a NIC);
// the switch's output queues are deep (lossless, as with PFC), so incast shows as queueing.
//
// Schemes: 0 ring (2(N-1) steps of S/N; a step's packet j leaves as soon as the previous
// step's packet j arrived), 1 parameter server (P dedicated servers, or P = 0: one shard on
// every worker; results leave a server as soon as every worker's packet j arrived), 2
// in-network aggregation (every worker keeps `window` slots in flight; the switch adds a
// slot's N contributions, each through its ingress port's pipeline at the RTL's beats per
// second, and sends the sum back after the RTL's latency).

#include <deque>
#include <map>
#include <vector>

namespace netagg_ns3 {

using namespace ns3;

struct Meta {
    uint32_t kind;   // 0 data, 1 result
    uint32_t step;
    uint32_t index;
    uint32_t src;
};

struct Config {
    int scheme = 0;
    int workers = 8;
    int servers = 0;             // parameter servers (0: one shard on every worker)
    double bytes = 1 << 22;      // gradient bytes per worker
    double gbps = 10;
    double delay_us = 0.5;       // propagation per link
    int payload = 1024;          // gradient bytes per packet
    int wire = 1122;             // bytes per packet on the wire
    int window = 64;             // in-network aggregation: slots in flight per worker
    double switch_latency_ns = 112;   // aggregator: last contribution -> result
    double switch_port_gbps = 0;      // aggregator: ingress pipeline rate (0: no limit)
};

struct Result {
    double mean_s = 0;
    double max_s = 0;
    double packets = 0;
    double peak_queue = 0;
};

class Sim;

class Host {
public:
    Sim* sim;
    int id;
    Ptr<Socket> socket;
    std::deque<std::pair<Ipv4Address, Meta>> fifo;
    bool busy = false;
    // ring
    uint32_t received = 0;
    // parameter server (as a server): contributions per packet index
    std::vector<uint32_t> counts;
    uint32_t results = 0;
    uint32_t shard_done = 0;
    double finish = -1;

    void Enqueue(Ipv4Address dst, Meta m);
    void Pump();
    void Receive(Ptr<Socket> s);
};

class Sim {
public:
    Config cfg;
    NodeContainer hosts;
    Ptr<Node> sw;
    std::vector<Ipv4Address> host_addr;
    std::vector<Ipv4Address> sw_addr;     // the switch's address on host i's link
    std::vector<Host*> h;
    Ptr<Socket> agg_socket;
    std::map<uint32_t, uint32_t> agg_counts;
    std::vector<double> port_busy;
    uint32_t chunk_packets = 0;           // ring: packets per step; ps: per server shard;
                                          // ina: per worker
    uint32_t peak_queue = 0;
    double packets = 0;

    int n_hosts() const { return cfg.workers + cfg.servers; }
    double wire_time() const { return cfg.wire * 8.0 / (cfg.gbps * 1e9); }

    void Send(Ptr<Socket> s, Ipv4Address dst, const Meta& m) {
        std::vector<uint8_t> buf(cfg.wire - 30, 0);
        std::memcpy(buf.data(), &m, sizeof(Meta));
        s->SendTo(Create<Packet>(buf.data(), buf.size()), 0, InetSocketAddress(dst, 4791));
        packets += 1;
    }

    void Build() {
        hosts.Create(n_hosts());
        NodeContainer swc;
        swc.Create(1);
        sw = swc.Get(0);
        InternetStackHelper stack;
        stack.Install(hosts);
        stack.Install(sw);
        PointToPointHelper p2p;
        std::ostringstream rate;
        rate << cfg.gbps << "Gbps";
        p2p.SetDeviceAttribute("DataRate", StringValue(rate.str()));
        p2p.SetChannelAttribute("Delay", TimeValue(NanoSeconds(cfg.delay_us * 1000)));
        p2p.SetQueue("ns3::DropTailQueue<Packet>", "MaxSize", StringValue("1000000p"));
        TrafficControlHelper tch;
        tch.SetRootQueueDisc("ns3::FifoQueueDisc", "MaxSize", StringValue("1000000p"));
        Ipv4AddressHelper ip;
        for (int i = 0; i < n_hosts(); ++i) {
            NetDeviceContainer d = p2p.Install(hosts.Get(i), sw);
            tch.Install(d);
            DynamicCast<PointToPointNetDevice>(d.Get(1))->GetQueue()->TraceConnectWithoutContext(
                "PacketsInQueue", MakeCallback(&Sim::QueueLength, this));
            std::ostringstream net;
            net << "10." << (1 + i / 250) << "." << (i % 250) << ".0";
            ip.SetBase(net.str().c_str(), "255.255.255.0");
            Ipv4InterfaceContainer a = ip.Assign(d);
            host_addr.push_back(a.GetAddress(0));
            sw_addr.push_back(a.GetAddress(1));
            port_busy.push_back(0);
        }
        Ipv4GlobalRoutingHelper::PopulateRoutingTables();
        for (int i = 0; i < n_hosts(); ++i) {
            Host* x = new Host();
            x->sim = this;
            x->id = i;
            x->socket = Socket::CreateSocket(hosts.Get(i), UdpSocketFactory::GetTypeId());
            x->socket->Bind(InetSocketAddress(Ipv4Address::GetAny(), 4791));
            x->socket->SetRecvCallback(MakeCallback(&Host::Receive, x));
            h.push_back(x);
        }
        if (cfg.scheme == 2) {
            agg_socket = Socket::CreateSocket(sw, UdpSocketFactory::GetTypeId());
            agg_socket->Bind(InetSocketAddress(Ipv4Address::GetAny(), 4791));
            agg_socket->SetRecvCallback(MakeCallback(&Sim::Aggregate, this));
        }
    }

    void QueueLength(uint32_t, uint32_t now) {
        if (now > peak_queue) peak_queue = now;
    }

    uint32_t packets_for(double bytes) const {
        return (uint32_t)std::ceil(bytes / cfg.payload);
    }

    void Start() {
        int n = cfg.workers;
        if (cfg.scheme == 0) {
            chunk_packets = packets_for(cfg.bytes / n);
            for (int i = 0; i < n; ++i)
                for (uint32_t j = 0; j < chunk_packets; ++j)
                    h[i]->Enqueue(host_addr[(i + 1) % n], Meta{0, 0, j, (uint32_t)i});
        } else if (cfg.scheme == 1) {
            int p = cfg.servers ? cfg.servers : n;
            chunk_packets = packets_for(cfg.bytes / p);
            for (int s = 0; s < p; ++s) {
                Host* srv = h[cfg.servers ? n + s : s];
                srv->counts.assign(chunk_packets, 0);
            }
            for (int i = 0; i < n; ++i)
                for (uint32_t j = 0; j < chunk_packets; ++j)
                    for (int k = 1; k <= p; ++k) {
                        int s = (i + k) % p;                 // start at a different server
                        int dst = cfg.servers ? n + s : s;
                        if (dst == i) {
                            Contribute(h[i], j);             // the worker's own shard
                            continue;
                        }
                        h[i]->Enqueue(host_addr[dst], Meta{0, 0, j, (uint32_t)i});
                    }
        } else {
            chunk_packets = packets_for(cfg.bytes);
            for (int i = 0; i < n; ++i)
                for (uint32_t j = 0; j < std::min<uint32_t>(cfg.window, chunk_packets); ++j)
                    h[i]->Enqueue(sw_addr[i], Meta{0, 0, j, (uint32_t)i});
        }
    }

    // A parameter server's packet j got one more contribution; all in: send the sums.
    void Contribute(Host* srv, uint32_t j) {
        int n = cfg.workers;
        bool colocated = cfg.servers == 0;
        if (++srv->counts[j] < (uint32_t)n) return;
        srv->shard_done++;
        for (int k = 1; k <= n; ++k) {
            int w = (srv->id + k) % n;
            if (colocated && w == srv->id) continue;
            srv->Enqueue(host_addr[w], Meta{1, 0, j, (uint32_t)srv->id});
        }
        if (colocated) CheckPsDone(srv);
    }

    void CheckPsDone(Host* x) {
        int n = cfg.workers;
        int p = cfg.servers ? cfg.servers : n;
        uint32_t remote = cfg.servers ? p : p - 1;
        bool own = cfg.servers || x->shard_done == chunk_packets;
        if (own && x->results == remote * chunk_packets && x->finish < 0)
            x->finish = Simulator::Now().GetSeconds();
    }

    void Aggregate(Ptr<Socket> s) {
        Ptr<Packet> pkt;
        while ((pkt = s->Recv())) {
            Meta m;
            pkt->CopyData((uint8_t*)&m, sizeof(Meta));
            double now = Simulator::Now().GetSeconds();
            double t = now;
            if (cfg.switch_port_gbps > 0) {         // the ingress pipeline of its port
                double busy = std::max(now, port_busy[m.src]);
                t = busy + cfg.wire * 8.0 / (cfg.switch_port_gbps * 1e9);
                port_busy[m.src] = t;
            }
            if (++agg_counts[m.index] < (uint32_t)cfg.workers) continue;
            agg_counts.erase(m.index);
            t += cfg.switch_latency_ns * 1e-9;
            Simulator::Schedule(Seconds(t - now), &Sim::Multicast, this, m.index);
        }
    }

    void Multicast(uint32_t index) {
        for (int i = 0; i < cfg.workers; ++i)
            Send(agg_socket, host_addr[i], Meta{1, 0, index, 0});
    }
};

void Host::Enqueue(Ipv4Address dst, Meta m) {
    fifo.emplace_back(dst, m);
    if (!busy) Pump();
}

void Host::Pump() {
    if (fifo.empty()) {
        busy = false;
        return;
    }
    busy = true;
    auto item = fifo.front();
    fifo.pop_front();
    sim->Send(socket, item.first, item.second);
    Simulator::Schedule(Seconds(sim->wire_time()), &Host::Pump, this);
}

void Host::Receive(Ptr<Socket> s) {
    Ptr<Packet> pkt;
    int n = sim->cfg.workers;
    while ((pkt = s->Recv())) {
        Meta m;
        pkt->CopyData((uint8_t*)&m, sizeof(Meta));
        if (sim->cfg.scheme == 0) {
            received++;
            uint32_t steps = 2 * (n - 1);
            if (m.step + 1 < steps)
                Enqueue(sim->host_addr[(id + 1) % n], Meta{0, m.step + 1, m.index, (uint32_t)id});
            if (received == steps * sim->chunk_packets)
                finish = Simulator::Now().GetSeconds();
        } else if (sim->cfg.scheme == 1) {
            if (m.kind == 0) {
                sim->Contribute(this, m.index);
            } else {
                results++;
                sim->CheckPsDone(this);
            }
        } else {
            results++;
            uint32_t next = m.index + sim->cfg.window;
            if (next < sim->chunk_packets)
                Enqueue(sim->sw_addr[id], Meta{0, 0, next, (uint32_t)id});
            if (results == sim->chunk_packets) finish = Simulator::Now().GetSeconds();
        }
    }
}

Result run(Config cfg) {
    Sim sim;
    sim.cfg = cfg;
    sim.Build();
    Simulator::Schedule(Seconds(0), &Sim::Start, &sim);
    Simulator::Run();
    Result r;
    double sum = 0;
    for (int i = 0; i < cfg.workers; ++i) {
        double f = sim.h[i]->finish;
        if (f < 0) f = 1e9;                  // never finished: reported as such
        sum += f;
        r.max_s = std::max(r.max_s, f);
    }
    r.mean_s = sum / cfg.workers;
    r.packets = sim.packets;
    r.peak_queue = sim.peak_queue;
    for (Host* x : sim.h) delete x;
    Simulator::Destroy();
    return r;
}

}  // namespace netagg_ns3
