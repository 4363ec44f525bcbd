"""``dtree-jax demo``: the tree core on the card's example (10-node tree vs 4-token chain on an H100)."""

from __future__ import annotations

from dtree_jax.cost import DEVICES, break_even_batch, ridge_tokens
from dtree_jax.tree import expected_accept_length, tree_from_paths

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
    p.add_argument("--device", default="h100-sxm", choices=sorted(DEVICES))
    p.add_argument("--rank-probs", default="0.7,0.15", help="comma-separated rank acceptance probabilities")
    p.set_defaults(func=lambda a: print(run_demo(tuple(float(x) for x in a.rank_probs.split(",")), a.device)))


if __name__ == "__main__":
    print(run_demo())
