"""Stand-ins for the eval tests (not a test module): a byte tokenizer with a chat template for tiny
random models, a level that sleeps (an inserted model too slow to pay for itself; on the test's clock under the
`virtual_clock` fixture), a lossy level, and a small Spec-Bench question set."""
from __future__ import annotations

import time

from omegaconf import OmegaConf

from data.prompts import Question
from decode.engine.levels import ModelLevel

VOCAB = 300
EOS = 299


class ByteTokenizer:
    """Bytes are token ids 0..255; a minimal chat template, so data.sharegpt.chat_prompt_ids works."""

    eos_token_id = EOS

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(text.encode("utf-8"))}

    def decode(self, ids, skip_special_tokens=False):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class SlowModel:
    """A model whose every forward first sleeps: the engine times the sleep as part of T_i."""

    def __init__(self, model, delay_s: float):
        self._model, self._delay = model, delay_s

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, *args, **kwargs):
        time.sleep(self._delay)
        return self._model(*args, **kwargs)

    def get_decoder(self):  # what a model level's runner calls
        return SlowModel(self._model.get_decoder(), self._delay)


class AcceptEverything(ModelLevel):
    """A broken verifier: takes the whole draft without looking, then adds its own next token."""

    def verify(self, ctx, proposal, sampling, gen, record=True):
        logits = self.forward(ctx + proposal.tokens, 1, "verify")
        tokens = proposal.tokens + [int(logits[-1].argmax())]
        self._record(len(proposal.tokens), len(proposal.tokens), record)
        return tokens, None


QUESTIONS = [
    Question(1, "writing", ("Write one line about the sea.", "Now about the mountains.")),
    Question(2, "math", ("What is 12 times 7?",)),
    Question(3, "math", ("Name a prime number above 40.",)),
    Question(4, "qa", ("Which planet is the largest?", "And the smallest?")),
    Question(5, "qa", ("How many legs has a spider?",)),
    Question(6, "writing", ("Describe a quiet morning.",)),
]


def eval_cfg(run_dir, chains: dict, force: bool = False, tolerance: float = 0.3, rule: str = "both",
             publish: str = "best", stacks: int = 2):
    """The eval config as decode.eval.conclude and plan_chains read it (the chains' level lists only carry
    names and sources here)."""
    return OmegaConf.create({
        "run_name": "test", "run_dir": str(run_dir), "model": {"name": "tiny", "dtype": "float32"},
        "wandb": {"mode": "disabled", "dir": f"{run_dir}/wandb"},
        "decode": {"draft_defaults": {"chain": {"length": 4}, "tree": {"depth": 2, "top_k": 2, "total_tokens": 6}}},
        "eval": {
            "prompts": None, "max_new_tokens": 12, "out_dir": f"{run_dir}/eval", "chains": chains, "confidence": 0.95,
            "checks": {"near_tie_relative": {"float32": 1e-4}, "insertion_rule": rule,
                       "agreement_tolerance": tolerance},
            "plan": {"enabled": True, "chains": None, "questions": 2, "max_new_tokens": 12, "mu": [1, 2, 4],
                     "lengths": [1, 2, 4], "min_gain": 0.0, "trees": [], "costs": None, "ks": [1, 4, 8], "repeats": 1,
                     "context": 32, "stacks": stacks},
            "theorem_3_3": {"questions": 2, "temperature": 1.0, "seed": 0},
            "publish": {"chain": publish, "dir": f"{run_dir}/publish", "force": force, "lineage": []},
        },
    })
