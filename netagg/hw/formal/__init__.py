"""Formal proofs of the switch's invariants: harnesses around the real stages, with the
properties as Amaranth `Assert`s, the environment's obligations as `Assume`s and the states
that must be reachable as `Cover`s (`hw.formal.aggregate`: the aggregation's, on the lookup
and decide stages; `hw.formal.sums`: the rows of a result, on the sums stage;
`hw.formal.control`: the control path's, on `Control`). They are gateware, so they live
beside the stages they check and are built by the same package; `netagg prove`
(`apps.prove`) runs them with SymbiYosys."""
