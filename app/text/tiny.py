"""A tiny byte-level BPE tokenizer with a ChatML template, trained in milliseconds for tests and toys."""

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHATML_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

_SAMPLE_TEXT = '''
The river town woke slowly. Fishermen pulled their boats onto the gravel, and the baker opened her shutters
before the bells rang six. A small dog followed the milk cart from house to house, hoping for a spill.
Nobody in the town remembered who had planted the old chestnut tree by the bridge, but everyone agreed that
it was the best place to sit in the afternoon, when the shade was deep and the water below ran quiet.

Questions are cheap and answers are expensive, the teacher liked to say. She asked her students to write
down what they expected before every experiment: how far the ball would roll, how long the candle would
burn, how many seeds would sprout in the dark cupboard. Then they measured, compared, and argued. The best
lessons came from the wrong guesses, because a wrong guess tells you which part of your picture is broken.

A good assistant listens first. When a user asks for help, the assistant should restate the problem in a
sentence, ask about anything that is unclear, and then answer plainly. Short answers are better than long
ones when they are complete. If a question has no safe or honest answer, the assistant should say so.

Hello! How can I help you today? I would like to know the weather in Paris, please. It is sunny and warm,
about twenty-four degrees, with a light wind from the west. Thank you! You are welcome. Is there anything
else you need? Yes: can you explain how a tokenizer works? A tokenizer splits text into small pieces called
tokens, and maps each piece to a number that the model can read.

Numbers appear everywhere: 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 42, 100, 256, 1024, 2048, 65536, 3.14159, -7.5.
Dates such as 2024-03-15 and times such as 09:30 or 17:45 are common in logs and letters alike.

def fibonacci(n: int) -> list[int]:
    """Return the first n Fibonacci numbers."""
    numbers = [0, 1]
    while len(numbers) < n:
        numbers.append(numbers[-1] + numbers[-2])
    return numbers[:n]


class Counter:
    """Count how often each word appears in a text."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def add(self, text: str) -> None:
        for word in text.lower().split():
            self.counts[word] = self.counts.get(word, 0) + 1

    def most_common(self, k: int = 3) -> list[tuple[str, int]]:
        return sorted(self.counts.items(), key=lambda item: (-item[1], item[0]))[:k]


def read_lines(path: str) -> list[str]:
    with open(path, encoding="utf-8") as handle:
        return [line.rstrip("\\n") for line in handle if line.strip()]


if __name__ == "__main__":
    counter = Counter()
    counter.add("the cat and the dog and the bird")
    for word, count in counter.most_common():
        print(f"{word}: {count}")
    print(fibonacci(10))
'''


def write_tiny_tokenizer(out_dir: Path, vocab_size: int = 512, texts: Iterable[str] | None = None) -> None:
    """Train a deterministic byte-level BPE on a built-in sample (or `texts`) and write it as a Hugging Face
    tokenizer.

    Token ids: the special tokens come first (`<|endoftext|>` = 0, `<|im_start|>` = 1, `<|im_end|>` = 2), then
    the 256 byte symbols (3..258), then the learned merges.

    Writes `tokenizer.json` and `tokenizer_config.json` (eos `<|im_end|>`, pad `<|endoftext|>`, no bos, ChatML
    template) into `out_dir`, loadable by `transformers.AutoTokenizer`. The vocabulary, special tokens
    included, has exactly `vocab_size` tokens when the sample offers enough merges (it does for 512), and at
    most `vocab_size` otherwise; `vocab_size` must be at least 259 (3 special tokens + 256 bytes).
    """
    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab_size must be at least {len(SPECIAL_TOKENS) + 256}, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_SAMPLE_TEXT] if texts is None else texts, trainer)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 32768,
        "chat_template": CHATML_TEMPLATE,
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
