"""HotSPa: strategies switched between sequence-length buckets inside one step (Ge et al., REFERENCE.md).

``hot`` runs a step bucket by bucket, each under its own layout, accumulating gradients into the home layout;
``reshard`` moves weights and gradients between two layouts (all-gathers and slices planned once per pair).
"""
