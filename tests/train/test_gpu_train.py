"""train.eagle on CUDA: NCCL on one GPU, and torchrun over two equal to one GPU at the same global batch. Marked
`gpu`; skipped without CUDA."""
from __future__ import annotations


import pytest
import torch
from test_train_eagle import REPO, head_weights, one_rank_and_two, overrides, settings, tiny_setup  # noqa: F401,F811 (a fixture)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU (torch.cuda.is_available() is False)")]


def test_train_eagle_on_cuda_writes_a_loadable_head(tiny_setup, tmp_path):  # noqa: F811
    """One GPU, NCCL, bf16 head weights: a head that the chain loads on the GPU and drafts with."""
    import train.eagle as eagle
    from heads.eagle import EagleHead
    from data.models import load_model

    metrics = eagle.train(settings(tiny_setup, tmp_path, "device=cuda", "train.epochs=1", "train.precision=bf16"))
    assert metrics["train/steps"] > 0 and metrics["train/tokens_per_s"] > 0
    assert {t.dtype for t in head_weights(tmp_path).values()} == {torch.bfloat16}
    target, tokenizer = load_model(str(tiny_setup / "target"), "float32", "cuda")
    head = EagleHead.from_pretrained(tmp_path / "eagle", target, tokenizer)
    assert next(head.parameters()).device.type == "cuda"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_two_gpu_torchrun_matches_one_gpu_with_the_same_global_batch(tiny_setup, tmp_path):  # noqa: F811
    """As the gloo test in test_train_eagle.py, over NCCL: 2 GPUs x accum 1 vs 1 GPU x accum 2."""
    one, two = one_rank_and_two(tiny_setup, tmp_path, ["device=cuda", "train.epochs=1", "train.max_conversations=24",
                                                       "train.zero_stage=2"], {})
    assert one["train/steps"] == two["train/steps"] and two["train/world_size"] == 2
    assert two["train/loss"] == pytest.approx(one["train/loss"], rel=1e-3)
    w1, w2 = head_weights(tmp_path / "one"), head_weights(tmp_path / "two")
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=0, atol=1e-3)




def test_gpu_recipe_fits_its_batches_to_the_card_and_checkpoints(tiny_setup, tmp_path, capsys):  # noqa: F811
    """train=gpu on one GPU: the batches sized from the card's total memory (the line names it), bf16, a checkpoint,
    and the store's and the head's tokens/s printed."""
    import train.eagle as eagle

    metrics = eagle.train(settings(tiny_setup, tmp_path, "train=gpu", "device=cuda", "train.max_steps=3",
                                   "train.eval.conversations=2"))
    out = capsys.readouterr().out
    name = torch.cuda.get_device_properties(0).name
    assert f"train.fit_memory: {name}, " in out and "tokens/s" in out.split("feature store: built")[1]
    assert "head: 3 steps" in out and (tmp_path / "eagle_checkpoints" / "latest").read_text() == "step0000003"
    assert metrics["train/steps"] == 3 and {t.dtype for t in head_weights(tmp_path).values()} == {torch.bfloat16}
