"""``dtree-jax demo``: the tree core on the card's example (10-node tree vs 4-token chain on an H100): the
tree, its ancestor mask in the three forms the code uses (dense, DFS intervals, the kernels' ancestor bits,
each unpacked and checked against the dense one), the verify mask of one step, expected tokens and the
break-even batch."""

from __future__ import annotations

import numpy as np

from dtree_jax.cost import DEVICES, break_even_batch, ridge_tokens
from dtree_jax.tree import (
    ancestor_bits,
    depths_from_mask,
    dfs_intervals,
    expected_accept_length,
    mask_from_bits,
    mask_from_intervals,
    tree_from_paths,
    verify_mask,
)

CARD_TREE_PATHS = ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 0, 0, 0))
CARD_CHAIN_PATHS = ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))


def run_demo(rank_probs=(0.7, 0.15), device: str = "h100-sxm") -> str:
    tree, chain = tree_from_paths(CARD_TREE_PATHS), tree_from_paths(CARD_CHAIN_PATHS)
    dev = DEVICES[device]
    ridge = ridge_tokens(dev.peak_flops, dev.hbm_bandwidth)
    lines = [f"tree of {tree.num_nodes} nodes (root + rank paths):"]
    for i, (parent, depth) in enumerate(zip(tree.parents, tree.depths)):
        path = "()" if i == 0 else str(tree.paths[i - 1])
        row = "".join("x" if v else "." for v in tree.mask[i])
        lines.append(f"  node {i}: path {path:<14} parent {parent:>2}  depth {depth}  mask {row}")
    pre, end = (np.asarray(x) for x in dfs_intervals(tree.parents))
    bits = np.asarray(ancestor_bits(tree.mask))
    for name, unpacked in (("DFS intervals", mask_from_intervals(pre, end)),
                           ("ancestor bits", mask_from_bits(bits, tree.num_nodes))):
        if not np.array_equal(np.asarray(unpacked), tree.mask):
            raise AssertionError(f"the {name} form does not round-trip")  # a bug, never a user error
    if not np.array_equal(np.asarray(depths_from_mask(tree.mask)), tree.depths):
        raise AssertionError("depths from the mask disagree with the tree's")
    lines += [
        f"compact forms (both unpack to the mask above): DFS pre {pre.tolist()} end {end.tolist()}; "
        f"ancestor bits (one uint32 per node) {[hex(int(b)) for b in bits[:, 0]]}",
    ]
    step = np.asarray(verify_mask(tree.mask, 3, 5))  # 3 committed tokens in a 5-row cache
    lines.append(f"verify mask of node 9 after 3 committed tokens (5-row cache | tree): "
                 f"{''.join('x' if v else '.' for v in step[9, :5])} | {''.join('x' if v else '.' for v in step[9, 5:])}")
    tau_tree = expected_accept_length(tree, rank_probs)
    tau_chain = expected_accept_length(chain, rank_probs)
    lines += [
        f"expected tokens per step (r = {list(rank_probs)}): chain of 4 = {tau_chain:.2f} "
        f"({chain.num_nodes} verified), tree = {tau_tree:.2f} ({tree.num_nodes} verified), "
        f"gain {tau_tree / tau_chain:.2f}x",
        f"{dev.name}: ridge {ridge:.0f} tokens/step; break-even batch tree {break_even_batch(tree.num_nodes, ridge)}"
        f", chain {break_even_batch(chain.num_nodes, ridge)}",
    ]
    return "\n".join(lines)


def add_cli(sub) -> None:
    p = sub.add_parser("demo", help="print the card's tree, its mask, expected tokens per step and break-even batch")
    p.add_argument("--device", default="h100-sxm", choices=sorted(DEVICES),
                   help="device preset of the roofline model (default: h100-sxm)")
    p.add_argument("--rank-probs", default="0.7,0.15",
                   help="comma-separated acceptance probabilities of the rank-1, rank-2, ... child (default: 0.7,0.15)")
    p.set_defaults(func=lambda a: print(run_demo(tuple(float(x) for x in a.rank_probs.split(",")), a.device)))


if __name__ == "__main__":
    print(run_demo())
