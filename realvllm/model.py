"""Make a random-weight Llama and a locally trained BPE tokenizer that vLLM can serve.

No hub: the tokenizer is trained here with `tokenizers` on a deterministic corpus and
saved through `PreTrainedTokenizerFast` with a ChatML chat template; the weights are
drawn from a seeded generator. Same arguments, same files, so answers are reproducible.

Runs in the real-vLLM venv (it needs torch, transformers and tokenizers):

    python -m realvllm.model OUT_DIR [--hidden 128 --layers 2 ...]
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Words the tests' prompts use, so that they tokenize to a few tokens each.
_WORDS = (
    "you are a careful assistant who reads every file tell me about go on and cite the "
    "kv cache decode prefill block token turn conversation history answer question model "
    "system user agent tool call result error line function test retention pull engine"
)


@dataclass(frozen=True)
class ModelSpec:
    """The shape of the model; head_dim (hidden / heads) must be >= 32 on vLLM's CPU backend."""

    hidden: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 4
    intermediate: int = 256
    vocab: int = 2048
    max_len: int = 65536
    seed: int = 0

    def key(self) -> str:
        """A name for a directory of this model (the same spec, the same name)."""
        return "-".join(f"{k}{v}" for k, v in asdict(self).items())

    def flags(self) -> list[str]:
        """The command-line flags of `main` that make this spec."""
        return [f"--{name.replace('_', '-')}={value}" for name, value in asdict(self).items()]


def corpus(seed: int, lines: int = 4000) -> list[str]:
    """Deterministic English-like lines: the tests' words and made-up ones."""
    rng = random.Random(seed)
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    made = ["".join(rng.choices(letters[:16], k=rng.randint(2, 8))) for _ in range(600)]
    vocab = _WORDS.split() * 4 + made
    return [" ".join(rng.choices(vocab, k=rng.randint(5, 25))) + rng.choice(".,?!:;") for _ in range(lines)]


def make_tokenizer(spec: ModelSpec, out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab,
        special_tokens=[IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(spec.seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=IM_END, bos_token=None, unk_token=None
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = spec.max_len
    fast.save_pretrained(out)
    return int(tok.get_vocab_size())


def make_model(spec: ModelSpec, out: Path, vocab_size: int, eos_id: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_len,
        # Wide initial weights: peaked logits, so that greedy answers do not hinge on float noise.
        initializer_range=0.2,
        tie_word_embeddings=False,
        eos_token_id=eos_id,
        bos_token_id=None,
        pad_token_id=eos_id,
        torch_dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)


def make(spec: ModelSpec, out: Path) -> Path:
    """Write the model and tokenizer into `out` (made anew if a previous run did not finish)."""
    done = out / "kvferry-model.json"
    if done.exists() and json.loads(done.read_text()) == asdict(spec):
        return out
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = make_tokenizer(spec, out)
    eos_id = json.loads((out / "tokenizer.json").read_text())["added_tokens"][1]["id"]
    make_model(spec, out, vocab_size, eos_id)
    done.write_text(json.dumps(asdict(spec)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    for name, value in asdict(ModelSpec()).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    args = vars(p.parse_args())
    out = args.pop("out")
    print(make(ModelSpec(**args), out))


if __name__ == "__main__":
    main()
