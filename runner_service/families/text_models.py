"""In-memory tokenizers and tiny text encoders, standing in for the ones diffusers' tests fetch.

Every tokenizer here is built from a vocabulary written in code (nothing is downloaded): a
byte-level CLIP BPE, a T5 Unigram, a byte-fallback Gemma BPE, a byte-level Qwen2 or GLM BPE, or a
WordPiece BERT vocabulary. The text encoders are the tests' tiny configs, sized to them.
"""

from __future__ import annotations

import string
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE
from transformers import (
    BertTokenizer,
    CLIPTextConfig,
    CLIPTokenizer,
    GemmaTokenizer,
    PreTrainedTokenizerFast,
    Qwen2Tokenizer,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

# The characters every in-memory vocabulary has a token for (others become byte or unknown tokens).
_CHARS = string.ascii_letters + string.digits + string.punctuation


def _byte_chars() -> list[str]:
    """The 256 characters GPT-2's byte-level BPEs (CLIP, Qwen2, GLM) stand for the bytes with."""
    return list(bytes_to_unicode().values())


def clip_tokenizer() -> CLIPTokenizer:
    """A byte-level CLIP BPE with no merges: every byte, alone or ending a word, is one token."""
    chars = _byte_chars()
    tokens = chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"]
    vocab = {token: index for index, token in enumerate(tokens)}
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77, pad_token="<|endoftext|>")


def t5_tokenizer() -> T5Tokenizer:
    """A T5 SentencePiece-style Unigram over single characters, with and without the word-start mark."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [("\u2581" + c, -3.0) for c in _CHARS] + [(c, -4.0) for c in _CHARS]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=512)


def word_clip_tokenizer(words: tuple[str, ...], max_length: int) -> CLIPTokenizer:
    """The byte-level CLIP BPE of ``clip_tokenizer`` with merges learned from ``words`` until each is
    one token (BPE replays its merges in the order learned, so a word splits as it did in training):
    a model trained on a small vocabulary reads words, not letters."""
    chars = _byte_chars()
    tokens = chars + [c + "</w>" for c in chars]
    words_pieces = [[*word[:-1], word[-1] + "</w>"] for word in words]
    merges: list[tuple[str, str]] = []
    while any(len(pieces) > 1 for pieces in words_pieces):
        counts: dict[tuple[str, str], int] = {}
        for pieces in words_pieces:
            for pair in zip(pieces, pieces[1:], strict=False):
                counts[pair] = counts.get(pair, 0) + 1
        best = max(counts, key=lambda pair: (counts[pair], [-ord(c) for c in "".join(pair)]))
        merges.append(best)
        tokens.append("".join(best))
        for pieces in words_pieces:
            index = 0
            while index < len(pieces) - 1:
                if (pieces[index], pieces[index + 1]) == best:
                    pieces[index:index + 2] = ["".join(best)]
                index += 1
    tokens = list(dict.fromkeys([*tokens, "<|startoftext|>", "<|endoftext|>"]))
    # transformers annotates merges as strings; its BPE backend takes (left, right) pairs.
    return CLIPTokenizer(vocab={token: index for index, token in enumerate(tokens)}, merges=merges,
                         model_max_length=max_length, pad_token="<|endoftext|>")


def word_t5_tokenizer(words: tuple[str, ...], max_length: int) -> T5Tokenizer:
    """The character Unigram of ``t5_tokenizer`` with a piece for each of ``words``, scored so that a
    known word is always one token."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [("\u2581" + word, -1.0) for word in words]
    pieces += [("\u2581" + c, -30.0) for c in _CHARS] + [(c, -40.0) for c in _CHARS]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=max_length)


def gemma_tokenizer() -> GemmaTokenizer:
    """A Gemma BPE with byte fallback and no merges, starting texts with ``<bos>`` as Gemma's does."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + ["\u2581"] + list(_CHARS)
    vocab = {token: index for index, token in enumerate(tokens)}
    return GemmaTokenizer(vocab=vocab, merges=[], add_bos_token=True, model_max_length=8192)


def _byte_level_vocab(specials: list[str]) -> dict[str, int]:
    tokens = _byte_chars() + specials
    return {token: index for index, token in enumerate(tokens)}


_QWEN_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]


def qwen_tokenizer() -> Qwen2Tokenizer:
    """A byte-level Qwen2 BPE with no merges, plus Qwen's chat and vision tokens."""
    tokenizer = Qwen2Tokenizer(vocab=_byte_level_vocab(_QWEN_SPECIALS), merges=[], model_max_length=32768)
    tokenizer.add_tokens([AddedToken(token, special=True, normalized=False) for token in _QWEN_SPECIALS[1:]])
    return tokenizer


def glm_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE standing in for GLM-4's tokenizer: it prefixes every text with ``[gMASK]<sop>``."""
    specials = ["<|endoftext|>", "[gMASK]", "<sop>"]
    vocab = _byte_level_vocab(specials)
    backend = Tokenizer(BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])
    backend.post_processor = processors.TemplateProcessing(
        single="[gMASK] <sop> $A",
        pair="[gMASK] <sop> $A $B",
        special_tokens=[("[gMASK]", vocab["[gMASK]"]), ("<sop>", vocab["<sop>"])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        padding_side="left",
        model_max_length=8192,
    )


def bert_tokenizer() -> BertTokenizer:
    """A lower-casing WordPiece BERT vocabulary of single characters and their ``##`` continuations."""
    chars = string.ascii_lowercase + string.digits + string.punctuation
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list(chars) + ["##" + c for c in chars]
    return BertTokenizer(vocab={token: index for index, token in enumerate(tokens)}, model_max_length=77)


# --- text encoders ------------------------------------------------------------------------------------------


def clip_config(tokenizer: CLIPTokenizer, hidden_size: int = 32, projection_dim: int = 32) -> CLIPTextConfig:
    """The tests' tiny CLIP text config, sized to the in-memory tokenizer."""
    return CLIPTextConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        hidden_size=hidden_size,
        intermediate_size=37,
        layer_norm_eps=1e-05,
        num_attention_heads=4,
        num_hidden_layers=5,
        vocab_size=len(tokenizer),
        max_position_embeddings=77,
        hidden_act="gelu",
        projection_dim=projection_dim,
    )


def tiny_t5_sizes(tokenizer: T5Tokenizer) -> dict[str, Any]:
    """The sizes of ``hf-internal-testing/tiny-random-t5`` (d_model 32), for a T5 or UMT5 config."""
    return {"vocab_size": len(tokenizer), "d_model": 32, "d_ff": 37, "d_kv": 8, "num_heads": 4, "num_layers": 5,
            "relative_attention_num_buckets": 8, "pad_token_id": tokenizer.pad_token_id,
            "eos_token_id": tokenizer.eos_token_id}


def t5_encoder(tokenizer: T5Tokenizer) -> T5EncoderModel:
    """A T5 encoder shaped like ``hf-internal-testing/tiny-random-t5`` (d_model 32), with random weights
    from torch's generator as it stands."""
    encoder = T5EncoderModel(T5Config(**tiny_t5_sizes(tokenizer)))
    encoder.eval()
    return encoder
