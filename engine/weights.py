"""Full (unsharded) Llama weights under Hugging Face `LlamaForCausalLM` names.

Weights come from the config's seed, or from a local safetensors / HF directory. Nothing is
downloaded. Every rank builds or loads the same full state dict and keeps its own shard.
"""
from __future__ import annotations

import json
import os

import torch

from engine.config import ConfigError, EngineConfig


def layer_names(i: int) -> dict[str, str]:
    p = f"model.layers.{i}."
    return {k: p + k for k in (
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight")}


def make_state_dict(cfg: EngineConfig) -> dict[str, torch.Tensor]:
    """Seeded weights, scaled so logits have a spread of a few units (greedy tokens vary)."""
    g = torch.Generator().manual_seed(cfg.seed)
    H, D, I, V = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads

    def lin(out_f: int, in_f: int, gain: float = 1.0) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=g) * (gain / in_f ** 0.5)

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    sd = {"model.embed_tokens.weight": torch.randn(V, H, generator=g)}
    for i in range(cfg.num_hidden_layers):
        n = layer_names(i)
        # Attention projections get a gain > 1 so softmax is not uniform over keys.
        sd[n["self_attn.q_proj.weight"]] = lin(nq * D, H, 2.0)
        sd[n["self_attn.k_proj.weight"]] = lin(nkv * D, H, 2.0)
        sd[n["self_attn.v_proj.weight"]] = lin(nkv * D, H)
        sd[n["self_attn.o_proj.weight"]] = lin(H, nq * D)
        sd[n["mlp.gate_proj.weight"]] = lin(I, H)
        sd[n["mlp.up_proj.weight"]] = lin(I, H)
        sd[n["mlp.down_proj.weight"]] = lin(H, I)
        sd[n["input_layernorm.weight"]] = norm(H)
        sd[n["post_attention_layernorm.weight"]] = norm(H)
    sd["model.norm.weight"] = norm(H)
    sd["lm_head.weight"] = lin(V, H, 1.0)
    return _cast(sd, cfg)


def _cast(sd: dict[str, torch.Tensor], cfg: EngineConfig) -> dict[str, torch.Tensor]:
    """To the compute dtype, through the storage dtype first when the config names one."""
    dtype = cfg.torch_dtype()
    if cfg.weights_dtype is not None:
        store = getattr(torch, cfg.weights_dtype)
        return {k: v.to(store).to(dtype) for k, v in sd.items()}
    return {k: v.to(dtype) for k, v in sd.items()}


def load_state_dict(cfg: EngineConfig) -> dict[str, torch.Tensor]:
    if cfg.model_path is None:
        return make_state_dict(cfg)
    from safetensors.torch import load_file

    files = sorted(f for f in os.listdir(cfg.model_path) if f.endswith(".safetensors"))
    if not files:
        raise ConfigError(f"model_path: no .safetensors file in {cfg.model_path}")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(os.path.join(cfg.model_path, f)))
    if "lm_head.weight" not in sd:  # tied embeddings
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    expected = expected_shapes(cfg)
    missing = [k for k in expected if k not in sd]
    if missing:
        raise ConfigError(f"model_path: checkpoint lacks {missing[0]}")
    for name, want in expected.items():
        if tuple(sd[name].shape) != want:
            raise ConfigError(f"model_path: {name} has shape {tuple(sd[name].shape)} but the config needs {want}")
    extra = sorted(k for k in sd if k.startswith("model.layers.") and k not in expected)
    if extra:
        raise ConfigError(f"model_path: checkpoint has {extra[0]} beyond num_hidden_layers={cfg.num_hidden_layers}")
    return _cast(sd, cfg)


def expected_shapes(cfg: EngineConfig) -> dict[str, tuple[int, ...]]:
    H, D, I, V = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
    nq, nkv = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    out = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    per_layer = {"self_attn.q_proj.weight": (nq, H), "self_attn.k_proj.weight": (nkv, H),
                 "self_attn.v_proj.weight": (nkv, H), "self_attn.o_proj.weight": (H, nq),
                 "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I),
                 "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,)}
    for i in range(cfg.num_hidden_layers):
        for short, full in layer_names(i).items():
            out[full] = per_layer[short]
    return out


def hf_config_dict(cfg: EngineConfig) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_model_len, "hidden_act": "silu",
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "torch_dtype": cfg.dtype,
    }


def save_hf_checkpoint(cfg: EngineConfig, path: str) -> None:
    """Write the seeded weights as a Hugging Face directory (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    sd = {k: v.contiguous() for k, v in make_state_dict(cfg).items()}
    save_file(sd, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config_dict(cfg), f, indent=1)
