"""Token streaming for models run with ``transformers`` (LMI's
``StreamingUtils``): generation runs on a thread and its tokens come out of an
iterator as they are made."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)

try:  # transformers comes with vLLM; the base class only marks the streamer for generate()
    from transformers.generation.streamers import BaseStreamer
except ImportError:  # pragma: no cover
    BaseStreamer = object  # type: ignore[misc,assignment]  # without transformers: a plain base class


class HFStreamer(BaseStreamer):
    """A ``generate(streamer=...)`` target: each step's tokens, decoded, come out
    of this iterator as a list of texts (one per sequence)."""

    _STOP = None

    def __init__(self, tokenizer, **decode_kwargs) -> None:
        self.tokenizer = tokenizer
        self.decode_kwargs = decode_kwargs
        self.queue: queue.Queue = queue.Queue()

    def put(self, value) -> None:
        rows = [value] if len(value.shape) == 1 else value
        self.queue.put([self.tokenizer.decode(row, **self.decode_kwargs) for row in rows])

    def put_text(self, value: Any) -> None:
        self.queue.put(value)

    def end(self) -> None:
        self.queue.put(self._STOP)

    def __iter__(self) -> HFStreamer:
        return self

    def __next__(self):
        value = self.queue.get()
        if value is self._STOP:
            raise StopIteration
        return value


class StreamingUtils:
    DEFAULT_MAX_NEW_TOKENS = 50
    SUPPORTED_MODEL_ARCH_SUFFIXES_CAUSAL_LM = ("CausalLM", "GPT2LMHeadModel")
    SUPPORTED_MODEL_ARCH_SUFFIXES_SEQ_2_SEQ_LM = ("T5ForConditionalGeneration",)
    SUPPORTED_MODEL_ARCH_SUFFIXES = SUPPORTED_MODEL_ARCH_SUFFIXES_CAUSAL_LM + SUPPORTED_MODEL_ARCH_SUFFIXES_SEQ_2_SEQ_LM
    BUILTIN_ENGINES = {"Accelerate"}

    @staticmethod
    def use_hf_default_streamer(model, tokenizer, inputs, device, **kwargs) -> HFStreamer:
        """Start ``model.generate`` on a thread; return the streamer its tokens come out of."""
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        encoded = tokenizer(inputs, padding=True, return_tensors="pt")
        if device is not None:
            encoded = encoded.to(device)
        streamer = HFStreamer(tokenizer, skip_special_tokens=True)

        def generate() -> None:
            try:
                model.generate(**encoded, streamer=streamer, **kwargs)
            except Exception as exc:
                log.exception("generation failed")
                streamer.put_text(str(exc))
            finally:
                streamer.end()

        threading.Thread(target=generate, name="hf-generate", daemon=True).start()
        return streamer

    @staticmethod
    def get_stream_generator(execution_engine: str) -> Callable[..., Iterator[list[str]]]:
        if execution_engine not in StreamingUtils.BUILTIN_ENGINES:
            raise ValueError(f"{execution_engine} engine is not supported for streaming")
        return _hf_model_stream_generator


def _hf_model_stream_generator(model, tokenizer, inputs, device=None, **parameters) -> Iterator[list[str]]:
    """Yield each step's new token texts (one per input) until generation ends."""
    if parameters.get("num_beams", 1) > 1:
        raise NotImplementedError("beam search is not supported yet!")
    parameters.setdefault("max_new_tokens", StreamingUtils.DEFAULT_MAX_NEW_TOKENS)
    yield from StreamingUtils.use_hf_default_streamer(model, tokenizer, inputs, device, **parameters)
