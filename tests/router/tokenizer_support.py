"""A tokenizer trained on the spot (no downloads): byte-level BPE, BOS added by its
post-processor, a chat template writing ``bos_token`` itself; saved as a Hugging Face model
directory (``tokenizer.json`` + ``tokenizer_config.json``) that both the router and
transformers load."""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' and not loop.first %}{{ raise_exception('system first') }}{% endif %}"
    "<|{{ m['role'] }}|>\n{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
    "{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{{ eos_token }}\n{% endfor %}"
    "{% if tools %}<|tools|>{{ tools | tojson }}\n{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% if thinking %}<think>{% endif %}{% endif %}"
)
CORPUS = [
    f"the quick brown fox {i} jumps over the lazy dog; système: café <|user|> hello assistant"
    for i in range(300)
]


def train_tokenizer(directory: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(CORPUS, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": "</s>", "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE}  # fmt: skip
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory
