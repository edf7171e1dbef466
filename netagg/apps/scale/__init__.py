"""`netagg scale`: gradient synchronisation at scale, from 8 to 1,024 workers.

cluster.py (what is asked about), topology.py (the topologies' shapes), flow.py (the
flow-level model), loss.py (loss, incast and tail latency), ns3.py with ns3_sync.cc (the
packet-level engine on ns-3, optional), reproduce.py (the papers' claims beside the model),
cli.py (the command's sweep and output; its options are apps/commands/scale.py's).
docs/scale.md has the equations and the calibration.
"""
