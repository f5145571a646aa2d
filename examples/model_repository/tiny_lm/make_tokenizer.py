"""Writes tokenizer.json: tiny_lm's byte-level tokenizer (one token per UTF-8 byte), made with the
``tokenizers`` package. pyserve counts usage tokens with it when ``tokenizers`` is installed, and
benchmark clients (aiperf, genai-perf) load this folder as a local Hugging Face tokenizer, with
``tokenizer_config.json`` beside it. Run it again only to change the tokenizer:
``python examples/model_repository/tiny_lm/make_tokenizer.py``.
"""

from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

END_OF_TEXT = "<|endoftext|>"


def byte_alphabet() -> dict[int, str]:
    """Byte → the printable character Hugging Face's byte-level tokenizers write it as."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in alphabet:
            alphabet[b] = chr(256 + extra)
            extra += 1
    return alphabet


def build() -> Tokenizer:
    vocab = {char: byte for byte, char in byte_alphabet().items()}
    vocab[END_OF_TEXT] = 256
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=END_OF_TEXT))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),  # bytes as characters
        pre_tokenizers.Split(Regex("."), "isolated"),  # then every character a token
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([END_OF_TEXT])
    return tokenizer


if __name__ == "__main__":
    build().save(str(Path(__file__).with_name("tokenizer.json")))
