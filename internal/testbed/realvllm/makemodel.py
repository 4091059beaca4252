"""Make the tiny model the real-vLLM test tier serves, offline and reproducibly.

Writes into --out:
  model/  a Llama-architecture causal LM with random bf16 weights (2 layers,
          hidden 128), a byte-level BPE tokenizer trained here on text made
          here, and a ChatML-style chat template;
  lora/   a LoRA adapter for it in PEFT's layout, random too.

Nothing comes from a model hub. Every random choice has a fixed seed, so the
same script and packages make byte-identical files (its tests compare two
runs). The answers are noise, but deterministic at temperature 0: the same
prompt gives the same tokens on every engine serving this model, which is
what a prefill/decode hand-off check needs.

Run by `make vllm-model` with the Python of the vLLM install:
  python makemodel.py --out DIR
"""

import argparse
import json
import os
import random

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SEED = 35
VOCAB = 4096
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LORA_RANK = 8
LORA_TARGETS = ["q_proj", "v_proj"]


def corpus(rng: random.Random, sentences: int = 20000):
    """Sentences of made-up words, so the tokenizer learns merges without any
    outside text (the Python sources would change with the Python version)."""
    onsets = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w",
              "br", "ch", "cl", "dr", "fl", "gr", "pl", "qu", "sh", "st", "th", "tr"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "io", "oo", "ou"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "ng", "st", "nd", "ck"]
    words = sorted({
        "".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
                for _ in range(rng.randint(1, 3)))
        for _ in range(3000)
    })
    punct = [".", ".", ".", "?", "!", ",", ";", ":"]
    for _ in range(sentences):
        n = rng.randint(4, 16)
        s = " ".join(rng.choice(words) for _ in range(n))
        if rng.random() < 0.2:
            s += " " + str(rng.randint(0, 99999))
        yield s[0].upper() + s[1:] + rng.choice(punct)


def make_tokenizer(out: str):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(random.Random(SEED)), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=2048,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def make_model(out: str, tokenizer):
    torch.manual_seed(SEED)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(SEED + 2)
    with torch.no_grad():
        # Weights far larger than a trained model's initialization (0.02):
        # with those, the residual stream is the last token's embedding and
        # little else, so prompts that end alike get the same answer, and
        # the best next tokens' logits lie hundredths apart, where the
        # rounding of bf16 KV computed in another batch can swap them. With
        # these, answers follow the whole prompt and the best logit leads
        # by about 2 (the median; 12 tokens of 16 prompts).
        for name, p in model.named_parameters():
            if p.dim() == 2:
                std = 1.0 if ("embed" in name or "lm_head" in name) else 0.1
                p.copy_(torch.randn(p.shape, generator=g) * std)
        # Random logits put the special tokens among the others; zero rows
        # give them logit 0, below the best of thousands of random ones, so
        # at temperature 0 no answer stops early on an end-of-turn token and
        # every answer is as long as asked.
        for t in SPECIAL:
            model.lm_head.weight[tokenizer.convert_tokens_to_ids(t)].zero_()
    model = model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


def make_lora(out: str, base: str):
    """A PEFT-layout adapter: adapter_config.json and adapter_model.safetensors
    with lora_A (rank x in) and lora_B (out x rank) per target projection.
    lora_B is not zero (as a fresh PEFT adapter's is), so the adapter changes
    the answers."""
    with open(os.path.join(base, "config.json")) as f:
        cfg = json.load(f)
    hidden, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = hidden // heads
    out_dims = {"q_proj": heads * head_dim, "k_proj": kv_heads * head_dim, "v_proj": kv_heads * head_dim}
    g = torch.Generator().manual_seed(SEED + 1)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for m in LORA_TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{m}"
            tensors[prefix + ".lora_A.weight"] = (torch.randn(LORA_RANK, hidden, generator=g) * 0.1).to(torch.bfloat16)
            tensors[prefix + ".lora_B.weight"] = (torch.randn(out_dims[m], LORA_RANK, generator=g) * 0.1).to(torch.bfloat16)
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": "pdx-tiny-llama",
        "r": LORA_RANK,
        "lora_alpha": 2 * LORA_RANK,
        "lora_dropout": 0.0,
        "target_modules": LORA_TARGETS,
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory to write model/ and lora/ into")
    args = p.parse_args()
    model_dir = os.path.join(args.out, "model")
    os.makedirs(model_dir, exist_ok=True)
    tokenizer = make_tokenizer(model_dir)
    make_model(model_dir, tokenizer)
    make_lora(os.path.join(args.out, "lora"), model_dir)


if __name__ == "__main__":
    main()
