"""EAGLE-2 dynamic draft trees: building (expand the best nodes, then rerank) and verifying.

Tree nodes are drafted tokens; node i continues its parent (-1 = the last token of the context). The
cache layout while a tree is fed is [context][tree nodes in index order], so a node's keys sit at
position base + i; the attention mask lets a node see the context and its own ancestors only.
Tree drafts are deterministic (top-k, not sampled), so under sampling each node's children are
verified as one-hot proposals in turn (see `sampling.verify_children`), which keeps the output exact.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from decode.engine.spec import Draft
from decode.engine.sampling import Sampling, probabilities, sample, verify_children


@dataclass
class Tree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)  # depth 1 = a child of the context's last token
    ancestry: list[list[int]] = field(default_factory=list)  # ancestors of each node, itself included

    def add(self, token: int, parent: int) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        self.ancestry.append((self.ancestry[parent] if parent >= 0 else []) + [len(self.tokens) - 1])
        return len(self.tokens) - 1

    def attention_mask(self, past: int, base: int, dtype: torch.dtype, lo: int = 0, hi: int | None = None,
                       device: torch.device | str = "cpu") -> torch.Tensor:
        """Additive mask [1, 1, Q, K] for feeding context tokens past..base-1, then nodes lo..hi-1,
        when the cache holds `past` tokens (and nodes 0..lo-1 after the context)."""
        hi = len(self.tokens) if hi is None else hi
        q_ctx, k = base - past, base + hi
        allowed = torch.zeros(q_ctx + hi - lo, k, dtype=torch.bool)
        allowed[:q_ctx, :base] = torch.ones(q_ctx, base, dtype=torch.bool).tril(past)
        allowed[q_ctx:, :base] = True
        for row, node in enumerate(range(lo, hi), start=q_ctx):
            allowed[row, [base + a for a in self.ancestry[node]]] = True
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
        return mask[None, None].to(device)

    def position_ids(self, past: int, base: int, lo: int = 0, hi: int | None = None,
                     device: torch.device | str = "cpu") -> torch.Tensor:
        hi = len(self.tokens) if hi is None else hi
        return torch.tensor([list(range(past, base)) + [base - 1 + d for d in self.depths[lo:hi]]], device=device)


# step(None, 0, 0) -> log-probs [V] after the context; step(tree, lo, hi) feeds nodes lo..hi-1 (their
# ancestors were fed before) and returns their log-probs [hi - lo, V].
Step = Callable[[Tree | None, int, int], torch.Tensor]


def build(step: Step, draft: Draft, budget: int) -> Tree | None:
    """EAGLE-2: expand the top_k best frontier nodes per depth, keep every candidate with its cumulative
    log-probability, then keep the total_tokens best candidates (a node always scores below its parent,
    so the kept set is a tree). None when the budget leaves no depth to draft."""
    depth, top_k, total = min(draft.depth, budget), draft.top_k, draft.total_tokens
    if depth <= 0:
        return None
    fed = Tree()
    cand_tok, cand_parent, cand_score = [], [], []  # candidates; parents index candidates (-1 = root)
    cand_fed: dict[int, int] = {}  # candidate index -> fed-tree index
    values, tokens = step(None, 0, 0).topk(top_k)
    frontier = []
    for v, t in zip(values.tolist(), tokens.tolist()):
        frontier.append(len(cand_tok))
        cand_tok.append(t), cand_parent.append(-1), cand_score.append(v)
    for _ in range(depth - 1):
        lo = len(fed.tokens)
        for c in frontier:
            parent = cand_parent[c]
            cand_fed[c] = fed.add(cand_tok[c], cand_fed[parent] if parent >= 0 else -1)
        logp = step(fed, lo, len(fed.tokens))
        values, tokens = logp.topk(top_k, dim=-1)
        scores = values + torch.tensor([cand_score[c] for c in frontier], device=values.device)[:, None]
        children = []
        for row, c in enumerate(frontier):
            for s, t in zip(scores[row].tolist(), tokens[row].tolist()):
                children.append(len(cand_tok))
                cand_tok.append(t), cand_parent.append(c), cand_score.append(s)
        best = torch.tensor([cand_score[c] for c in children]).topk(min(top_k, len(children))).indices.tolist()
        frontier = [children[i] for i in best]
    keep = sorted(sorted(range(len(cand_tok)), key=lambda c: -cand_score[c])[:total])
    tree, index = Tree(), {}
    for c in keep:  # candidates are numbered parents-first, so ancestors are added before children
        parent = cand_parent[c]
        if parent >= 0 and parent not in index:
            continue  # only possible on exact score ties: drop the orphan (and so its subtree)
        index[c] = tree.add(cand_tok[c], index[parent] if parent >= 0 else -1)
    return tree


def walk(tree: Tree, logits: torch.Tensor, sampling: Sampling, gen: torch.Generator | None):
    """Verify a tree: logits [1 + len(tree), V] (row 0 after the context, row 1 + i after node i).

    Returns (accepted node path, the verifier's next token, per-position distributions or None)."""
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(tree.parents):
        children.setdefault(parent, []).append(i)
    path, node, dists = [], -1, []
    if sampling.greedy:
        best = logits.argmax(dim=-1).tolist()
        while True:
            nxt = best[node + 1]
            match = [c for c in children.get(node, []) if tree.tokens[c] == nxt]
            if not match:
                return path, nxt, None
            node = match[0]
            path.append(node)
    p_all = probabilities(logits, sampling)
    while True:
        p = p_all[node + 1]
        dists.append(p)
        kids = children.get(node, [])
        chosen, rest = verify_children(p, [tree.tokens[c] for c in kids], gen)
        if chosen is None:
            return path, sample(rest, gen), torch.stack(dists)
        node = kids[chosen]
        path.append(node)
