"""The learning curve of a training run as a PNG (held-out top-1 per depth and acceptance length against
tokens seen)."""
from __future__ import annotations


def learning_curve_png(curve: list[dict[str, float]], depth: int) -> bytes:
    """Held-out top-1 per depth and acceptance length against tokens seen, as PNG bytes."""
    import io

    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = [p["tokens_seen"] for p in curve]
    fig, (top1, length) = plt.subplots(1, 2, figsize=(10, 4))
    for j in range(1, depth + 1):
        top1.plot(tokens, [p[f"top1_depth{j}"] for p in curve], marker="o", label=f"depth {j}")
    top1.set(xlabel="training tokens seen", ylabel="held-out top-1", title="draft top-1 per depth")
    top1.legend()
    length.plot(tokens, [p["acceptance_length"] for p in curve], marker="o")
    length.set(xlabel="training tokens seen", ylabel="tokens per verification",
               title=f"expected acceptance length, depth-{depth} chain")
    for ax in (top1, length):
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x / 1000:.0f}k"))
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()
