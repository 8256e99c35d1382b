"""Tiny random-weight models of every family, built from transformers configs (no download), for the
parity tests: `build_hf(model_type, overrides)` gives transformers' own model (fp32, eager attention),
`save_folder` writes it as a Hugging Face folder with the default model's tokenizer."""

from __future__ import annotations

import os
import shutil

import torch

from shared.model_files import TOKENIZER_FILES

NEW = 12
WINDOW = 12
COMMON = dict(
    vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, eos_token_id=2, bos_token_id=1, pad_token_id=0,
)  # fmt: skip
# family -> (transformers model_type, its config beyond COMMON)
FAMILIES = {
    "llama": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "mistral": ("mistral", {"sliding_window": WINDOW}),
    "qwen2": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 2}),
    "qwen3": ("qwen3", {"head_dim": 32, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
              "original_max_position_embeddings": 32}}),
    "phi3": ("phi3", {"sliding_window": WINDOW}),
    "gemma2": ("gemma2", {"head_dim": 16, "sliding_window": WINDOW, "query_pre_attn_scalar": 24,
               "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}),
    "gemma3": ("gemma3_text", {"head_dim": 16, "sliding_window": WINDOW, "query_pre_attn_scalar": 24,
               "sliding_window_pattern": 2, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW}),
    "qwen3_moe": ("qwen3_moe", {"num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 48,
                  "norm_topk_prob": True, "mlp_only_layers": [1]}),
}  # fmt: skip


def build_hf(model_type: str, overrides: dict, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **{**COMMON, **overrides})
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():  # larger than the init's std 0.02, so attention and routing matter
        for name, p in model.named_parameters():
            if "embed" in name and model_type.startswith("gemma"):  # scaled by sqrt(hidden) = 8
                p.normal_(0.0, 0.01)
            elif p.dim() > 1:
                p.normal_(0.0, 0.08)
            elif "norm" in name:  # Gemma's norms scale by 1 + w
                p.normal_(0.0 if model_type.startswith("gemma") else 1.0, 0.1)
            else:  # biases
                p.normal_(0.0, 0.1)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def hf_greedy(model, prompt: list[int]) -> list[int]:
    x = torch.tensor([prompt])
    with torch.inference_mode():
        y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, do_sample=False)
    return y[0, len(prompt) :].tolist()


def save_folder(model, folder: str, tokenizer_from: str, **save_options) -> str:
    model.save_pretrained(folder, **save_options)
    for name in TOKENIZER_FILES:
        if os.path.isfile(src := os.path.join(tokenizer_from, name)):
            shutil.copy(src, folder)
    return folder


# a tiny LLaVA: a CLIP tower of 56x56 images in 14x14 patches (16 rows an image) and a small Llama
IMAGE = 49151  # its image token


def build_llava(seed: int = 0):
    """transformers' LlavaForConditionalGeneration, fp32, weights drawn larger than the init's."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(seed)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                              num_attention_heads=4, image_size=56, patch_size=14)  # fmt: skip
    text = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE)
    model = LlavaForConditionalGeneration(config).float().eval()
    return redraw(model)


# its processor: CLIP's, at the tower's size
PREPROCESSOR = {
    "size": {"shortest_edge": 56}, "crop_size": {"height": 56, "width": 56}, "do_center_crop": True,
    "do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "do_convert_rgb": True, "image_processor_type": "CLIPImageProcessor",
}  # fmt: skip


def give_image_token(folder: str) -> None:
    """Make the saved tokenizer (the default model's, SmolLM2) encode `<image>` as IMAGE, as a LLaVA's
    does: id 49151 is a plain piece there (its vocabulary's last, made by its last merge), so the piece
    is renamed `<image>`, that merge dropped, and `<image>` made an added special token (tokenizer.json)
    that tokenizer_config.json names."""
    import json

    with open(os.path.join(folder, "tokenizer.json")) as f:
        tokenizer = json.load(f)
    bpe = tokenizer["model"]
    (piece,) = [p for p, i in bpe["vocab"].items() if i == IMAGE]
    del bpe["vocab"][piece]
    bpe["vocab"]["<image>"] = IMAGE
    bpe["merges"] = [m for m in bpe["merges"] if "".join(m.split(" ") if isinstance(m, str) else m) != piece]
    token = {"content": "<image>", "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}  # fmt: skip
    tokenizer["added_tokens"].append({"id": IMAGE, **token})
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        json.dump(tokenizer, f)
    with open(os.path.join(folder, "tokenizer_config.json")) as f:
        config = json.load(f)
    config.setdefault("added_tokens_decoder", {})[str(IMAGE)] = token
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)


def llava_greedy(hf, prompt: list[int], images: list[bytes], tokens: int = 16) -> list[int]:
    """transformers' greedy NEW tokens for a prompt whose image tokens stand for `images` (encoded
    files): each token expanded to the image's `tokens` slots, the pixels CLIP's processor's."""
    import io

    import numpy as np
    from PIL import Image

    from shared.media import ClipPreprocess

    ids = [t for x in prompt for t in ([IMAGE] * tokens if x == IMAGE else [x])]
    proc = ClipPreprocess(PREPROCESSOR)
    pixels = np.stack([proc.pixels(Image.open(io.BytesIO(b)).convert("RGB")) for b in images])
    x = torch.tensor([ids])
    with torch.inference_mode():
        y = hf.generate(x, pixel_values=torch.from_numpy(pixels), attention_mask=torch.ones_like(x),
                        max_new_tokens=NEW, do_sample=False)  # fmt: skip
    return y[0, len(ids) :].tolist()


def redraw(model):
    """A vision-language model's weights drawn larger than its init (so the images and attention
    matter): matrices std 0.08, norm weights about 1, the rest (biases, embeddings' vectors) std 0.1."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
            elif "norm" in name and name.endswith("weight"):
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.1)
    return model


def prefill_with_rows(runner, prompt: list[int], image_token: int, rows, chunks: list[int]):
    """Logits of every prompt token through a ModelRunner, computed in chunks of these sizes (one
    request, row 0), the image rows [M, hidden] put where the prompt has image_token, in order (its
    slots hold an id past the vocabulary, as the gateway's hashed placeholders do)."""
    import dataclasses

    from services.scheduler.forward_batch import ForwardBatch, MultimodalBatch

    slots = [i for i, t in enumerate(prompt) if t == image_token]
    ids = [10**6 + 7 if t == image_token else t for t in prompt]
    out, start = [], 0
    for n in chunks:
        mine = [j for j, s in enumerate(slots) if start <= s < start + n]
        loc = runner.kv.alloc(n)
        fb = ForwardBatch.build(ids[start : start + n], [0], [start], [n], loc, None, [], runner.device)
        if mine:
            mm = MultimodalBatch(rows[mine], torch.tensor([slots[j] - start for j in mine]))
            fb = dataclasses.replace(fb, mm=mm)
        fb.store_slots(runner.req_to_token.table)
        out.append(runner.forward(fb).logits)
        start += n
    return torch.cat(out)


def llava_folder(tmp_path_factory, tokenizer_from: str, name: str, seed: int = 1):
    """(transformers' tiny LLaVA, its saved folder with PREPROCESSOR's preprocessor_config.json)."""
    import json

    hf = build_llava(seed=seed)
    folder = save_folder(hf, str(tmp_path_factory.mktemp(name)), tokenizer_from)
    with open(os.path.join(folder, "preprocessor_config.json"), "w") as f:
        json.dump(PREPROCESSOR, f)
    return hf, folder


# llava-hf/llava-1.5-7b-hf's preprocessor_config.json (less the processor's class names): CLIP at 336
LLAVA_15_PREPROCESSOR = {
    "crop_size": {"height": 336, "width": 336}, "do_center_crop": True, "do_convert_rgb": True,
    "do_normalize": True, "do_rescale": True, "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "resample": 3, "rescale_factor": 0.00392156862745098, "size": {"shortest_edge": 336},
}  # fmt: skip
