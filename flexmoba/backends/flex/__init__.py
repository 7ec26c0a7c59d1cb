"""The FlexAttention backends ``flex`` and ``flex_union``: the regrouped plan (:mod:`.plan`) and its
recomputed pieces (:mod:`.recompute`), the union BlockMask (:mod:`.block_mask`), the compiled flex call
(:mod:`.compiled`) and the registry entries (:mod:`.backend`)."""

__all__: list[str] = []
