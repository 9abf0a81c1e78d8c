"""The model presets `--model` names: transformers configurations with the published dimensions (Qwen3 through
`Qwen3Config`, Llama-architecture ones through `LlamaConfig`), trained from random weights, and their default
sequence lengths. models/build.py builds them.
"""

from __future__ import annotations

# Qwen3 dense models as published (config.json of Qwen/Qwen3-*): dimensions, GQA, head_dim 128, QK-norm, tied
# embeddings for the small ones. Presets start from random weights (pretraining from scratch).
QWEN3_COMMON = dict(
    vocab_size=151936, head_dim=128, num_key_value_heads=8, hidden_act="silu", max_position_embeddings=40960,
    rope_theta=1_000_000.0, rms_norm_eps=1e-6, attention_bias=False, attention_dropout=0.0, initializer_range=0.02,
    bos_token_id=151643, eos_token_id=151645,
)


PRESETS: dict[str, dict] = {
    "qwen3-0.6b": dict(QWEN3_COMMON, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, tie_word_embeddings=True),
    "qwen3-1.7b": dict(QWEN3_COMMON, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, tie_word_embeddings=True),
    "qwen3-4b": dict(QWEN3_COMMON, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, tie_word_embeddings=True),
    "qwen3-8b": dict(QWEN3_COMMON, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, tie_word_embeddings=False),
    # Llama 3.2 1B's dimensions (config.json of meta-llama/Llama-3.2-1B: GQA, head_dim 64, tied embeddings, its
    # vocabulary size) without its RoPE scaling, in transformers' Llama architecture (no QK-norm), with the
    # tokenizer the run uses (PRESET_ARCHITECTURES).
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=64, hidden_act="silu",
                     max_position_embeddings=131072, rope_theta=500_000.0, rms_norm_eps=1e-5, attention_bias=False,
                     mlp_bias=False, attention_dropout=0.0, initializer_range=0.02, tie_word_embeddings=True,
                     bos_token_id=128000, eos_token_id=128001),
    # Llama 2 7B's dimensions (config.json of meta-llama/Llama-2-7b-hf: multi-head attention, untied embeddings, its
    # vocabulary size), the seeds' ZeRO-3 model, in transformers' Llama architecture with the run's tokenizer.
    "llama-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=32, head_dim=128, hidden_act="silu",
                     max_position_embeddings=4096, rope_theta=10_000.0, rms_norm_eps=1e-5, attention_bias=False,
                     mlp_bias=False, attention_dropout=0.0, initializer_range=0.02, tie_word_embeddings=False,
                     bos_token_id=1, eos_token_id=2),
    # Llama 3.1 8B's dimensions (config.json of meta-llama/Llama-3.1-8B: GQA, untied embeddings, its vocabulary size and
    # 131,072 positions) without its RoPE scaling (`--rope_scaling` scales it past them), in transformers' Llama
    # architecture with the run's tokenizer: the long-sequence model.
    "llama-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_act="silu",
                     max_position_embeddings=131072, rope_theta=500_000.0, rms_norm_eps=1e-5, attention_bias=False,
                     mlp_bias=False, attention_dropout=0.0, initializer_range=0.02, tie_word_embeddings=False,
                     bos_token_id=128000, eos_token_id=128001),
    # CPU-sized Qwen3 (same code path, ~3M parameters): the embedded default. Vocabulary follows the tokenizer.
    "tiny": dict(vocab_size=None, hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=48, hidden_act="silu", max_position_embeddings=2048,
                 rope_theta=10_000.0, rms_norm_eps=1e-6, attention_dropout=0.0, initializer_range=0.02,
                 tie_word_embeddings=True),
}


# Vision-language presets (models/vision/build.py): the Qwen2.5-VL architecture (its processor's mRoPE, window
# attention in the tower, the patch merger as projector) from random weights, with the shipped tokenizer and the vision
# tokens added (data/vision/processor.py). tiny-vl is the CPU-sized one of the embedded journey (~0.7M parameters);
# qwen2.5-vl-7b has Qwen2.5-VL-7B-Instruct's dimensions (its config.json) and vocabulary size.
VISION_PRESETS: dict[str, dict] = {
    "tiny-vl": dict(
        text_config=dict(vocab_size=None, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "mrope_section": [2, 3, 3]},
                         rms_norm_eps=1e-6, attention_dropout=0.0, initializer_range=0.02, tie_word_embeddings=True),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[1], initializer_range=0.02)),
    "qwen2.5-vl-7b": dict(
        text_config=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                         num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000,
                         rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0,
                                          "mrope_section": [16, 24, 24]},
                         rms_norm_eps=1e-6, attention_dropout=0.0, initializer_range=0.02, tie_word_embeddings=False,
                         hidden_act="silu"),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu", in_chans=3,
                           tokens_per_second=2, initializer_range=0.02)),
}


# The transformers architecture of each preset not in Qwen3's.
PRESET_ARCHITECTURES = {"llama-1b": "llama", "llama-7b": "llama", "llama-8b": "llama"}


DEFAULT_SEQ_LEN = {"tiny": 256, "tiny-vl": 256}


DEFAULT_SEQ_LEN_QWEN3 = 4096


DEFAULT_SEQ_LEN_PRETRAINED = 2048


def is_preset(name: str) -> bool:
    return name.lower() in PRESETS or name.lower() in VISION_PRESETS


def is_vision_preset(name: str) -> bool:
    return name.lower() in VISION_PRESETS


def preset_names() -> str:
    """The presets, comma-separated (for help texts and problems)."""
    return ", ".join([*PRESETS, *VISION_PRESETS])


def default_seq_len(model: str) -> int:
    if is_preset(model):
        return DEFAULT_SEQ_LEN.get(model.lower(), DEFAULT_SEQ_LEN_QWEN3)
    return DEFAULT_SEQ_LEN_PRETRAINED
