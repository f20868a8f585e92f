"""A character-level tokenizer over the `VOCAB` ids of conftest's tiny models, with a chat template, built offline."""

from conftest import VOCAB
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def char_tokenizer() -> PreTrainedTokenizerFast:
    # Id 0 is the unknown character; ids 1..VOCAB-1 are printable ASCII.
    vocab = {"\x00": 0, **{chr(32 + i): i + 1 for i in range(VOCAB - 1)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="\x00"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="\x00")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
