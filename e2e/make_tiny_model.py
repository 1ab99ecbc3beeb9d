"""Build a tiny random-weight Llama and its tokenizer offline, for the end-to-end test.

Nothing is downloaded from a model hub: a byte-level BPE is trained with `tokenizers`
on a few built-in sentences, wrapped in `PreTrainedTokenizerFast` with a chat template,
and a `LlamaForCausalLM` is initialised from a fixed seed. Its output is random text,
but the same at temperature 0 every time, which is what the test checks.

Run inside `.e2e/venv` (it needs torch, transformers and tokenizers):
    .e2e/venv/bin/python e2e/make_tiny_model.py OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SEED = 1234
VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
CORPUS = [
    "The inference unit forms when the leader and every follower have joined.",
    "A leader serves the OpenAI API; followers hold shards of the model.",
    "Tensor parallel splits each layer across the nodes of one unit.",
    "When a node is lost the unit is no longer whole and the proxy answers 503.",
    "The supervisor restarts the tasks and the unit forms again with a new session.",
    "Streams in flight complete while the proxy drains after SIGTERM.",
    "Hello, how are you today? I am fine, thank you, and you?",
    "Count with me: one, two, three, four, five, six, seven, eight, nine, ten.",
    "Trainium instances are bound by EFA into a placement group.",
    "Cells are deployed one at a time; a canary cell goes first.",
]


def build(out: Path) -> dict[str, object]:
    """Write config, weights and tokenizer files into out; return a summary."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        model_max_length=512,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        # Head size 32 is one the CPU attention backend takes; 4 heads split over TP 2.
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        # Larger than the usual 0.02 so that logits are peaked: greedy decoding then
        # does not hinge on rounding differences.
        initializer_range=0.3,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    summary = {
        "path": str(out),
        "vocab_size": len(fast),
        "parameters": sum(p.numel() for p in model.parameters()),
        "seed": SEED,
    }
    (out / "e2e-model.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory to write the model into")
    args = parser.parse_args(argv)
    print(json.dumps(build(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
