"""Tiny randomly initialised Llama-family folders with a byte-level tokenizer, built in milliseconds."""

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the KV cache in blocks; continuous batching keeps the GPU busy.",
    "Bonjour, ça va? Très bien, merci! 世界 🌍 héllo naïve café",
    "def add(a, b):\n    return a + b\n",
] * 4
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
VOCAB_SIZE = 320
# Larger than the usual 0.02 so the random model's logits have clear winners and greedy decoding does
# not hinge on float rounding.
INIT_STD = 0.3


def _tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def make_tiny_model(folder: Path, model_type: str = "llama", seed: int = 0) -> Path:
    """Write a random ``llama``, ``qwen2`` or ``mistral`` model (2 layers, GQA 4:2) and its tokenizer to ``folder``."""
    tokenizer = _tokenizer()
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        initializer_range=INIT_STD,
    )
    torch.manual_seed(seed)
    if model_type == "llama":
        model = LlamaForCausalLM(LlamaConfig(rms_norm_eps=1e-6, **common))
    elif model_type == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(rms_norm_eps=1e-6, **common))
        with torch.no_grad():  # random biases, so the test sees whether they are applied
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, INIT_STD)
    elif model_type == "mistral":
        model = MistralForCausalLM(MistralConfig(rms_norm_eps=1e-6, sliding_window=None, **common))
    else:
        raise ValueError(f"unknown tiny model type {model_type!r}")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
