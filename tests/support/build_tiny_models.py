#!/usr/bin/env python3
"""Build tiny random-weight bf16 models that the vLLM CPU server can serve.

Run with the vLLM venv's python (needs torch, transformers, tokenizers,
safetensors); imports nothing from this repository:

    python tests/support/build_tiny_models.py OUT_DIR [--only NAME ...] [--list]

Every model lands in OUT_DIR/NAME with config.json, model.safetensors,
generation_config.json and a byte-level BPE tokenizer (``<|endoftext|>`` as
eos/pad, a simple chat template).  Everything is seeded, so two builds give
byte-identical weights.  A model whose directory already holds the marker file
(written last, carrying a hash of the model's spec) is skipped, so the script
is idempotent; a changed spec rebuilds just that model.  Building happens in
NAME.tmp-build and is renamed into place, so an interrupted build leaves no
half-complete NAME directory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

MARKER = ".kvgate-tiny-model-complete"
BUILDER_VERSION = 1
SEED = 1234
VOCAB_TARGET = 1000
CONFIG_VOCAB = 1024  # embedding rows (>= tokenizer size, multiple of 64)
MAX_POS = 4096
EOS = "<|endoftext|>"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Fixed training text for the tokenizer (deterministic, English).
_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A journey of a thousand miles begins with a single step.",
    "All that glitters is not gold, and not all who wander are lost.",
    "The cache holds keys and values for every token of every request.",
    "Large language models generate text one token at a time.",
    "The server answered the request after a short wait in the queue.",
    "Memory is a finite resource, so the scheduler must plan ahead.",
    "She sells sea shells by the sea shore on a sunny summer morning.",
    "Peter Piper picked a peck of pickled peppers from the garden.",
    "How much wood would a woodchuck chuck if a woodchuck could chuck wood?",
    "Every block stores the attention state for a fixed number of tokens.",
    "Once upon a time there was a little robot who loved to count numbers.",
    "The weather today is cloudy with a chance of rain in the afternoon.",
    "Please write a short story about a cat, a dog and a friendly dragon.",
    "What is the capital of France? The capital of France is Paris.",
    "One, two, three, four, five, six, seven, eight, nine, ten.",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday.",
    "January February March April May June July August September October "
    "November December.",
    "The user asked a question and the assistant gave a helpful answer.",
    "Hello, world! This is a tiny model with random weights for testing.",
    "Sliding window attention only looks at the most recent tokens.",
    "Experts in a mixture of experts layer are chosen by a small router.",
    "Concurrency is the number of requests that can run at the same time.",
    "If the cache runs out of space, a request may be preempted and resumed.",
]


def _corpus():
    # A few passes with different casing give the BPE enough material for
    # ~1000 merges without any external data.
    out = []
    for s in _SENTENCES:
        out.append(s)
        out.append(s.lower())
        out.append(s.upper())
        out.append(" ".join(reversed(s.split())))
    return out


# --------------------------------------------------------------------------
# Model specifications.  Only fields that differ from transformers' defaults
# (or that matter for vLLM's KV cache) are given; token ids are filled in.
# --------------------------------------------------------------------------
_COMMON = dict(
    vocab_size=CONFIG_VOCAB,
    hidden_size=128,
    intermediate_size=256,
    max_position_embeddings=MAX_POS,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
)

MODELS: dict[str, dict] = {
    # A llama large enough for its prefill to be compute-bound on these cores
    # (~14 M parameters): the calibration tests use it.
    "small-llama": dict(
        model_type="llama",
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
    ),
    # llama, GQA 4 query heads / 2 KV heads, head_dim 32 (= 128 / 4).
    "tiny-llama": dict(
        model_type="llama",
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    ),
    # qwen3 with an explicit head_dim (64) != hidden / heads (32).
    "tiny-qwen3": dict(
        model_type="qwen3",
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=3,
        layer_types=["full_attention"] * 3,
    ),
    # mistral: sliding window on every layer.
    "tiny-mistral": dict(
        model_type="mistral",
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=256,
    ),
    # gemma2: alternating sliding (even layers) / full attention.
    "tiny-gemma2": dict(
        model_type="gemma2",
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 2,
        tie_word_embeddings=True,
    ),
    # gemma3 (text only): 2 sliding layers then 1 full, twice.
    "tiny-gemma3": dict(
        model_type="gemma3_text",
        sliding_window_pattern=3,  # consistent with layer_types (vLLM reads layer_types)
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        query_pre_attn_scalar=64,
        sliding_window=128,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        tie_word_embeddings=True,
    ),
    # qwen3 MoE: 4 experts, top-2, every layer sparse.
    "tiny-qwen3moe": dict(
        model_type="qwen3_moe",
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        use_sliding_window=False,
        sliding_window=None,
    ),
    # mixtral: 4 experts, top-2, no sliding window.
    "tiny-mixtral": dict(
        model_type="mixtral",
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=None,
    ),
    # gpt-oss: unquantized bf16 MoE, layer_types sliding/full, attention sinks.
    # vLLM renders gpt-oss chat requests with the Harmony encoding (o200k ids up
    # to ~200k) whatever the chat_template says, and rejects ids >= vocab_size
    # ("Token id 200008 is out of vocabulary"), so the embedding must cover the
    # o200k_harmony range (201088) for /v1/chat/completions to work.  Costs
    # ~100 MB (gpt-oss has no tied lm_head in vLLM).
    "tiny-gptoss": dict(
        model_type="gpt_oss",
        vocab_size=201088,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=128,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 1.0,
            "original_max_position_embeddings": MAX_POS,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
        quantization_config=None,
    ),
}


def _build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_TARGET,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=EOS,
        unk_token=EOS,
        model_max_length=MAX_POS,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _spec_fields(name: str, eos_id: int) -> dict:
    spec = dict(_COMMON)
    spec.update(MODELS[name])
    spec.update(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    return spec


def spec_hash(name: str) -> str:
    """Changes whenever anything that shapes the built model changes."""
    import hashlib

    blob = json.dumps(
        {"v": BUILDER_VERSION, "seed": SEED, "vocab": VOCAB_TARGET, "eos": EOS,
         "chat": CHAT_TEMPLATE, "corpus": _SENTENCES, "spec": _spec_fields(name, -1)},
        sort_keys=True, default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _is_complete(name: str, d: str) -> bool:
    p = os.path.join(d, MARKER)
    if not os.path.isfile(p):
        return False
    try:
        with open(p) as f:
            return json.load(f).get("spec_hash") == spec_hash(name)
    except (OSError, ValueError):
        return False


def build_one(name: str, out_dir: str) -> str:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    final = os.path.join(out_dir, name)
    if _is_complete(name, final):
        return f"{name}: already complete in {final} (skipped)"

    t0 = time.time()
    tmp = final + ".tmp-build"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)

    tokenizer = _build_tokenizer()
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    fields = _spec_fields(name, eos_id)
    model_type = fields.pop("model_type")
    quant = "quantization_config" in fields and fields["quantization_config"] is None
    if quant:
        fields.pop("quantization_config")
    fields.pop("torch_dtype")

    torch.manual_seed(SEED)
    cfg = AutoConfig.for_model(model_type, **fields)
    # transformers >= 4.56 calls it "dtype"; older ones "torch_dtype".
    cfg.dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(cfg)
    model = model.to(torch.bfloat16)
    model.eval()
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)

    # Make sure nothing in config.json points at a quantization scheme
    # (gpt-oss defaults to mxfp4 in some transformers versions).
    cfg_path = os.path.join(tmp, "config.json")
    with open(cfg_path) as f:
        cfg_json = json.load(f)
    if quant:
        cfg_json.pop("quantization_config", None)
    cfg_json.setdefault("torch_dtype", "bfloat16")
    with open(cfg_path, "w") as f:
        json.dump(cfg_json, f, indent=2, sort_keys=True)
        f.write("\n")

    n_params = sum(p.numel() for p in model.parameters())
    with open(os.path.join(tmp, MARKER), "w") as f:
        json.dump(
            {"builder_version": BUILDER_VERSION, "spec_hash": spec_hash(name),
             "name": name, "seed": SEED,
             "params": n_params, "tokenizer_vocab": len(tokenizer)},
            f, indent=2, sort_keys=True,
        )
        f.write("\n")

    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    c = cfg_json
    return (
        f"{name}: built {model_type} in {time.time() - t0:.1f}s -> {final} "
        f"(layers={c.get('num_hidden_layers')} heads={c.get('num_attention_heads')} "
        f"kv_heads={c.get('num_key_value_heads')} head_dim={c.get('head_dim')} "
        f"sliding_window={c.get('sliding_window')} params={n_params} "
        f"tok_vocab={len(tokenizer)})"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", nargs="?")
    ap.add_argument("--only", nargs="+", metavar="NAME", choices=sorted(MODELS))
    ap.add_argument("--list", action="store_true", help="print model names and exit")
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(MODELS))
        return 0
    if not args.out_dir:
        ap.error("OUT_DIR is required")
    os.makedirs(args.out_dir, exist_ok=True)
    names = args.only or list(MODELS)
    failed = 0
    for name in names:
        try:
            print(build_one(name, args.out_dir), flush=True)
        except Exception as e:
            failed += 1
            print(f"{name}: FAILED: {type(e).__name__}: {e}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
