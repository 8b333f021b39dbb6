"""``sagelmi tiny-model DIR``: write a tiny random-weight Llama with its own
tokenizer and chat template, without any download (``--arch``: a T5, a BERT, or an
Idefics3 vision-language model instead).

It exists to run the real engine anywhere (a laptop CPU, CI): two layers,
hidden size 128, two attention heads of size 64 (the CPU attention kernels need
64), one KV head, and a 512-token byte-level BPE tokenizer trained on a small
built-in text. Weights are random from a fixed seed, so every machine writes the
same model. It answers with gibberish, quickly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SEED = 1234
VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_WORDS = (
    "the a an of to in on for with and or but not is are was were be been being have has had do does did "
    "model server request response token tokens stream batch worker engine queue prompt answer question "
    "large language small tiny fast slow quick brown fox jumps over lazy dog sea sky river mountain city "
    "one two three four five six seven eight nine ten hundred thousand first second last next "
    "hello world please thank you yes no maybe always never today tomorrow yesterday morning evening "
    "red green blue yellow black white light dark warm cold new old good bad big little long short "
    "read write run serve send receive open close start stop begin end wait ready healthy error"
).split()


def _corpus(lines: int = 4000) -> list[str]:
    """Deterministic pseudo-sentences covering the word list and punctuation."""
    state = SEED
    out = []
    for _ in range(lines):
        words = []
        for _ in range(8 + state % 9):
            state = (state * 1103515245 + 12345) % (1 << 31)
            words.append(_WORDS[state % len(_WORDS)])
        out.append(" ".join(words).capitalize() + ".,!?"[state % 4] + f" {state % 1000}")
    return out


def _llama_config(max_model_len: int, ids: dict[str, int], **extra: Any) -> Any:
    """The tiny Llama's config (also the text model of the tiny vision model): head size 64."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=max_model_len,
        bos_token_id=ids["<s>"],
        eos_token_id=ids["</s>"],
        pad_token_id=ids["<pad>"],
        # Wider than the usual 0.02 so next-token scores are well separated and greedy
        # decoding does not hinge on rounding differences between batch shapes.
        initializer_range=0.1,
        tie_word_embeddings=False,
        **extra,
    )


def _tokenizer(directory: Path, max_model_len: int, extra_tokens: tuple[str, ...] = ()) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS + list(extra_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=max_model_len,
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(directory)


def write_tiny_model(directory: str | Path, max_model_len: int = 1024, extra_tokens: tuple[str, ...] = ()) -> Path:
    """Write the model and tokenizer into ``directory`` (created if needed). ``extra_tokens``:
    more special tokens in the vocabulary (``<think>``, ``<tool_call>`` ... for the parsers
    that need them); another vocabulary, so another model."""
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _tokenizer(directory, max_model_len, extra_tokens)
    ids = {name: i for i, name in enumerate(SPECIAL_TOKENS)}
    config = _llama_config(max_model_len, ids, torch_dtype="float32")
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(directory, safe_serialization=True)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(directory)
    # Written last: its presence means the model is complete.
    (directory / "sagelmi-tiny-model.json").write_text(json.dumps({"seed": SEED, "max_model_len": max_model_len}))
    return directory


# -- the Accelerate engine's test models: an encoder-decoder (T5) and an encoder (BERT) ----

BERT_SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
BERT_LABELS = ["NEGATIVE", "POSITIVE", "NEUTRAL"]


def write_tiny_t5(directory: str | Path, max_model_len: int = 512) -> Path:
    """A tiny random-weight T5 (text2text-generation) with the Llama's BPE tokenizer
    (``<pad>`` is id 0, the decoder's start token, as T5 wants)."""
    import torch
    from transformers import GenerationConfig, T5Config, T5ForConditionalGeneration

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _tokenizer(directory, max_model_len)
    ids = {name: i for i, name in enumerate(SPECIAL_TOKENS)}
    config = T5Config(  # type: ignore[call-arg]  # transformers' typed config lacks keys its **kwargs take
        vocab_size=VOCAB_SIZE,
        d_model=64,
        d_kv=32,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        pad_token_id=ids["<pad>"],
        eos_token_id=ids["</s>"],
        decoder_start_token_id=ids["<pad>"],
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(SEED)
    model = T5ForConditionalGeneration(config).eval()
    model.save_pretrained(directory, safe_serialization=True)
    GenerationConfig(
        decoder_start_token_id=config.decoder_start_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(directory)
    (directory / "sagelmi-tiny-model.json").write_text(json.dumps({"seed": SEED, "arch": "t5"}))
    return directory


def _bert_tokenizer(directory: Path, max_model_len: int) -> None:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=VOCAB_SIZE, special_tokens=BERT_SPECIAL_TOKENS, show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    from tokenizers import decoders

    tok.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=max_model_len,
    )
    fast.save_pretrained(directory)


def write_tiny_bert(directory: str | Path, max_model_len: int = 512) -> Path:
    """A tiny random-weight BERT whose one checkpoint holds every head the
    Accelerate engine's encoder tasks need: the masked-LM head (fill-mask; the
    config's architecture), a pooler and a 3-label classifier (text- and
    token-classification load the same ``classifier`` weights), and the encoder
    (feature-extraction, text-embedding). Every task loads fixed weights."""
    import torch
    from safetensors.torch import save_file
    from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _bert_tokenizer(directory, max_model_len)
    config = BertConfig(  # type: ignore[call-arg]  # transformers' typed config lacks keys its **kwargs take
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=max_model_len,
        pad_token_id=0,
        initializer_range=0.1,
        id2label=dict(enumerate(BERT_LABELS)),
        label2id={label: i for i, label in enumerate(BERT_LABELS)},
        torch_dtype="float32",
    )
    torch.manual_seed(SEED)
    classifier = BertForSequenceClassification(config).eval()
    masked = BertForMaskedLM(config).eval()
    masked.bert.load_state_dict(classifier.bert.state_dict(), strict=False)  # one shared encoder
    tensors = {**masked.state_dict(), **classifier.state_dict()}
    # Tied tensors share memory, which safetensors refuses: store each one on its own.
    save_file(
        {name: t.detach().clone().contiguous() for name, t in tensors.items()},
        str(directory / "model.safetensors"),
        metadata={"format": "pt"},
    )
    config.architectures = ["BertForMaskedLM"]
    config.save_pretrained(directory)
    (directory / "sagelmi-tiny-model.json").write_text(json.dumps({"seed": SEED, "arch": "bert"}))
    return directory


# -- a vision-language model: Idefics3 (a SigLIP-like vision tower, pixel shuffle, the Llama) --
# Idefics3 because vLLM 0.32's CPU build imports it without torchvision, which does not fit the
# CPU torch (LLaVA, Qwen2-VL, Gemma 3 ... import it); the image processor has a PIL backend.

IMAGE_TOKENS = ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>")
VISION_IMAGE_SIZE = 56  # pixels a side: 4 x 4 patches of 14, shuffled into 4 image tokens
# The Llama's template, with OpenAI-style content parts: an image part becomes <image>.
VISION_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def write_tiny_idefics3(directory: str | Path, max_model_len: int = 1024) -> Path:
    """A tiny random-weight Idefics3 (``Idefics3ForConditionalGeneration``): the tiny Llama as
    its text model, a two-layer vision tower (head size 64) on 56-pixel images, each image
    4 tokens (no tiling), and its processor (PIL image processor, tokenizer, chat template)."""
    import torch
    from transformers import GenerationConfig, PreTrainedTokenizerFast
    from transformers.models.idefics3 import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _tokenizer(directory, max_model_len, IMAGE_TOKENS)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(directory)
    ids = {name: i for i, name in enumerate(SPECIAL_TOKENS)}
    text = _llama_config(max_model_len, ids)
    vision = Idefics3VisionConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=VISION_IMAGE_SIZE,
        patch_size=14,
        initializer_range=0.1,
    )
    config = Idefics3Config(  # type: ignore[call-arg]  # transformers' typed config lacks keys its **kwargs take
        vision_config=vision.to_dict(),
        text_config=text.to_dict(),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=2,
        pad_token_id=ids["<pad>"],
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(SEED)
    Idefics3ForConditionalGeneration(config).eval().save_pretrained(directory, safe_serialization=True)
    size = {"longest_edge": VISION_IMAGE_SIZE}
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size=size, max_image_size=size)
    processor = Idefics3Processor(images, tokenizer, image_seq_len=4, chat_template=VISION_CHAT_TEMPLATE)
    processor.save_pretrained(directory)
    GenerationConfig(bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"]).save_pretrained(
        directory
    )
    (directory / "sagelmi-tiny-model.json").write_text(json.dumps({"seed": SEED, "arch": "idefics3"}))
    return directory


WRITERS = {"llama": write_tiny_model, "t5": write_tiny_t5, "bert": write_tiny_bert, "idefics3": write_tiny_idefics3}
