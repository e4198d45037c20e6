"""rlk-collectives: deterministic collectives for tensor- and context-parallel rlk routes.

Planned contents (not implemented in this version — nothing here pretends otherwise):
fixed-rank-order fp32 all-reduce and reduce-scatter with one rounding, exact all-gather, and the
context-parallel attention transport (all-gather of K/V shards in global position order).
"""

__version__ = "0.1.0"

# Names of the collectives this version provides. Empty until they are implemented and tested.
AVAILABLE: tuple[str, ...] = ()
