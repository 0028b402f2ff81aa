"""The mesh dimension names, outermost first, and the flattened views built from them."""

MESH_DIM_NAMES: tuple[str, ...] = ("dp_replicate", "dp_shard", "cp", "tp")
FLATTENED_DIMS: dict[str, tuple[str, ...]] = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}
