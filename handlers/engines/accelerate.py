"""The Hugging Face Accelerate engine: a model run by ``transformers`` itself,
as LMI's ``option.rolling_batch=disable`` does (or for a task vLLM cannot serve).

Tasks (``option.task``, else inferred from the model's architecture):

- ``text-generation``, ``text2text-generation``: LMI's schema
  (``handlers.engines.lmi_schema``: ``{"inputs", "parameters", "stream"}`` in,
  ``generated_text`` and ``details`` out; streams as JSON lines or SSE);
- ``text-classification``, ``token-classification``, ``fill-mask``,
  ``feature-extraction``: ``{"inputs", "parameters"}`` in, the ``transformers``
  pipeline's answer out (as LMI answers them);
- ``text-embedding``: ``{"inputs"}`` in, one vector per input (mean pooled over
  the tokens, L2-normalised unless ``option.normalize=false``) out: ``[[...], ...]``.

Requests reach the model in batches: the worker's dynamic batching
(``batch_size``, ``max_batch_delay``) hands one ``Input`` with several items,
and items that can share a model call (same task parameters, not streaming)
share it. Each batch is logged with its size.

The model loads with ``option.dtype``, ``option.revision``,
``option.trust_remote_code`` and ``option.device_map`` (default: ``auto``,
accelerate's placement across the group's GPUs, when there are several; the one
GPU or the CPU otherwise).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from container.core.dtypes import canonical_dtype
from container.core.errors import InputError
from container.core.logs import redacted_json
from container.core.settings import Settings
from handlers.api import Input, Output
from handlers.api.context import WorkerContext
from handlers.api.engine import Engine, Formatters
from handlers.engines.invocation_forms import check_prompt_count
from handlers.engines.lmi_schema import Formatter, Generation, LmiRequest, TokenInfo, parse_request
from handlers.engines.token_streamer import TokenStreamer

log = logging.getLogger("sagelmi.accelerate")

# The task a model's architecture (by the end of its name) is served for; as LMI infers it.
ARCHITECTURES_2_TASK = {
    "TapasForQuestionAnswering": "table-question-answering",
    "ForQuestionAnswering": "question-answering",
    "ForTokenClassification": "token-classification",
    "ForSequenceClassification": "text-classification",
    "ForMultipleChoice": "multiple-choice",
    "ForMaskedLM": "fill-mask",
    "ForCausalLM": "text-generation",
    "ForConditionalGeneration": "text2text-generation",
    "MTModel": "text2text-generation",
    "EncoderDecoderModel": "text2text-generation",
    "GPT2LMHeadModel": "text-generation",
    "T5WithLMHeadModel": "text2text-generation",
    "BloomModel": "text-generation",
}
GENERATION_TASKS = {"text-generation": "AutoModelForCausalLM", "text2text-generation": "AutoModelForSeq2SeqLM"}
PIPELINE_TASKS = {
    "text-classification": "AutoModelForSequenceClassification",
    "token-classification": "AutoModelForTokenClassification",
    "fill-mask": "AutoModelForMaskedLM",
    "feature-extraction": "AutoModel",
}
EMBEDDING_TASKS = {"text-embedding": "AutoModel"}
TASKS = {**GENERATION_TASKS, **PIPELINE_TASKS, **EMBEDDING_TASKS}
TORCH_DTYPES = {"auto", "float32", "float16", "bfloat16"}  # what transformers loads weights as (container.core.dtypes)


def infer_task(model: str, revision: str | None = None, trust_remote_code: bool = False) -> str:
    """The task ``model``'s architecture is served for (``ValueError`` if none)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model, revision=revision, trust_remote_code=trust_remote_code)
    architecture = (getattr(config, "architectures", None) or [""])[0]
    task = task_of_architecture(architecture)
    if task is None:
        raise ValueError(f"the task of {architecture or 'this model'} cannot be inferred: set option.task")
    return task


def task_of_architecture(architecture: str) -> str | None:
    """The task a model of ``architecture`` (config.json's first) is served for, as LMI infers it."""
    for suffix, task in ARCHITECTURES_2_TASK.items():
        if architecture.endswith(suffix):
            return task
    return None


def load_kwargs(options: dict[str, str], revision: str | None, trust_remote_code: bool, gpus: int) -> dict[str, Any]:
    """``from_pretrained`` arguments from the settings (``ValueError`` for a bad dtype)."""
    import torch

    kwargs: dict[str, Any] = {"revision": revision, "trust_remote_code": trust_remote_code}
    dtype = options.get("dtype")
    if dtype:
        name = canonical_dtype(dtype)
        if name not in TORCH_DTYPES:
            raise ValueError(f"option.dtype={dtype}: the Accelerate engine loads fp32, fp16, bf16 or auto")
        kwargs["dtype"] = name if name == "auto" else getattr(torch, name)
    device_map = options.get("device_map") or ("auto" if gpus > 1 else "cuda:0" if gpus == 1 else None)
    if device_map:
        kwargs["device_map"] = device_map
    return kwargs


@dataclass
class _Item:
    """One request of a batch: its index in the batch and its parsed body."""

    index: int
    body: Any
    request: LmiRequest | None = None  # a generation task's (parse_request)

    @property
    def generation(self) -> LmiRequest:
        """The request of an item of a generation task."""
        assert self.request is not None, "not a generation task's item"
        return self.request


class AccelerateEngine(Engine):
    dynamic_batching = True  # the worker's dynamic batching feeds it (vLLM batches continuously)

    def __init__(self, task: str, model, tokenizer, formatter: Formatter) -> None:
        import transformers

        self.task = task
        self.model = model
        self.tokenizer = tokenizer
        self.formatter = formatter
        self.normalize = True  # text-embedding: L2-normalised vectors unless option.normalize=false
        self.max_prompts = Settings().max_prompts_per_request  # inputs per request; load() sets the server's
        self.known_generation = set(transformers.GenerationConfig().to_dict())
        self.pipeline: Callable[..., Any] | None = None
        if task in PIPELINE_TASKS:
            # transformers types ``task`` as one of its Literal task names: this one is a PIPELINE_TASKS key
            self.pipeline = transformers.pipeline(task, model=model, tokenizer=tokenizer)  # type: ignore[call-overload]
        if task == "text-generation":
            self.tokenizer.padding_side = "left"  # a batch of prompts ends where generation starts
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token

    @classmethod
    def load(cls, context: WorkerContext) -> AccelerateEngine:
        import torch
        import transformers

        settings, model_path = context.settings, context.launch.model_location
        task = settings.task or infer_task(model_path, settings.revision, settings.trust_remote_code)
        if task not in TASKS:
            raise ValueError(
                f"option.task={task} is not served by the Accelerate engine (it serves {', '.join(TASKS)})"
            )
        kwargs = load_kwargs(settings.options, settings.revision, settings.trust_remote_code, torch.cuda.device_count())
        log.info(
            "Accelerate engine: loading %s for %s with %s",
            model_path,
            task,
            redacted_json(kwargs),
        )
        started = time.monotonic()
        auto = getattr(transformers, TASKS[task])
        model = auto.from_pretrained(model_path, **kwargs).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            model_path, revision=settings.revision, trust_remote_code=settings.trust_remote_code
        )
        log.info(
            "Accelerate engine ready in %.1fs (%s on %s)",
            time.monotonic() - started,
            type(model).__name__,
            getattr(model, "hf_device_map", None) or model.device,
        )
        engine = cls(task, model, tokenizer, Formatter(settings.output_formatter, settings.tgi_compat))
        engine.normalize = settings.normalize is not False
        engine.max_prompts = settings.max_prompts_per_request
        return engine

    @classmethod
    async def start(cls, context: WorkerContext, formatters: Formatters) -> AccelerateEngine:
        if formatters:
            log.warning("the Accelerate engine answers with its own formatting; model.py's formatters are not used")
        # Loading blocks: keep the worker's loop (status, /ping) free meanwhile.
        return await asyncio.to_thread(cls.load, context)

    # -- requests
    def handle(self, inputs: Input) -> Output | None:
        return None if inputs.is_empty() else self.answer(inputs)

    def answer(self, inputs: Input) -> Output:
        """One request, or a batch of them (``batch_<i>.`` answers, one per item)."""
        batch = inputs.get_batches()
        log.info("model call: batch of %d (%s)", len(batch), self.task)
        if not inputs.is_batch():
            return self._one(batch[0])
        outputs = Output()
        items: list[_Item] = []
        for i, item in enumerate(batch):
            try:
                items.append(self._parse(i, item))
            except InputError as exc:
                outputs.error(str(exc), code=400, message="Bad Request", batch_index=i)
        streams = [it for it in items if it.request is not None and it.request.stream]
        for it in streams:  # a stream in a batch of several is answered whole, in its line format
            outputs.add(b"".join(self._stream_lines(it.generation)), batch_index=it.index)
        groups: dict[str, list[_Item]] = {}
        for it in items:
            if it not in streams:
                groups.setdefault(self._group_key(it), []).append(it)
        for group in groups.values():
            try:
                for it, answer in zip(group, self._run(group)):
                    outputs.add_as_json(answer, batch_index=it.index)
            except InputError as exc:
                for it in group:
                    outputs.error(str(exc), code=400, message="Bad Request", batch_index=it.index)
        return outputs

    def _one(self, item: Input) -> Output:
        parsed = self._parse(0, item)
        if parsed.request is not None and parsed.request.stream:
            lines = self._stream_lines(parsed.request)
            first = next(lines)  # errors before the first token are the request's, not a broken stream
            return (
                Output()
                .add_property("content-type", self.formatter.stream_content_type)
                .add_stream_content(_prepend(first, lines), None)
            )
        return Output().add_as_json(self._run([parsed])[0])

    def _parse(self, index: int, item: Input) -> _Item:
        body = item.get_as_json()
        if not isinstance(body, dict) or "inputs" not in body:
            raise InputError("the request body must be a JSON object with 'inputs'")
        check_prompt_count(body, "lmi", self.max_prompts)
        if self.task in GENERATION_TASKS:
            return _Item(index, body, parse_request(body, self.known_generation))
        inputs = body["inputs"]
        if not (isinstance(inputs, str) and inputs) and not (
            isinstance(inputs, list) and inputs and all(isinstance(p, str) and p for p in inputs)
        ):
            raise InputError("'inputs' must be a non-empty string or a non-empty list of strings")
        if not isinstance(body.get("parameters") or {}, dict):
            raise InputError("'parameters' must be a JSON object")
        return _Item(index, body)

    def _group_key(self, item: _Item) -> str:
        params = item.request.parameters.model_dump() if item.request else item.body.get("parameters") or {}
        return json.dumps(params, sort_keys=True, default=str)

    def _run(self, group: list[_Item]) -> list[Any]:
        """Answer items that share their parameters, with one model call."""
        if self.task in GENERATION_TASKS:
            return self._generate_answers(group)
        texts = [[b] if isinstance(b, str) else b for b in (it.body["inputs"] for it in group)]
        flat = [t for ts in texts for t in ts]
        parameters = group[0].body.get("parameters") or {}
        if self.task in EMBEDDING_TASKS:
            results = self._embed(flat)
        else:
            pipeline = self.pipeline
            assert pipeline is not None  # load(): a task neither generation nor embedding is a pipeline's
            try:
                results = pipeline(flat, **parameters)
            except (TypeError, ValueError, KeyError) as exc:
                raise InputError(f"{self.task}: {type(exc).__name__}: {exc}") from None
            except Exception as exc:
                if type(exc).__name__ == "PipelineException":  # e.g. fill-mask without the mask token
                    raise InputError(f"{self.task}: {exc}") from None
                raise
            if len(flat) == 1 and self.task == "fill-mask":  # the pipeline unwraps a list of one here only
                results = [results]
        results = _plain(results)
        answers, at = [], 0
        for it, ts in zip(group, texts):
            part = results[at : at + len(ts)]
            at += len(ts)
            if isinstance(it.body["inputs"], list):
                answers.append(part)
            else:  # what the pipeline answers for one text: text-classification keeps its list
                answers.append(part if self.task == "text-classification" else part[0])
        return answers

    # -- embeddings
    def _embed(self, texts: list[str]) -> list[list[float]]:
        import torch

        encoded = self.tokenizer(texts, padding=True, truncation=True, return_tensors="pt").to(self.model.device)
        with torch.inference_mode():
            hidden = self.model(**encoded).last_hidden_state
        mask = encoded["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
        pooled = pooled.float()
        return (torch.nn.functional.normalize(pooled, dim=-1) if self.normalize else pooled).tolist()

    # -- generation
    def generate_kwargs(self, request: LmiRequest) -> dict[str, Any]:
        """``model.generate`` arguments for LMI's ``parameters``."""
        p = request.parameters
        kwargs: dict[str, Any] = {"max_new_tokens": p.max_new_tokens}
        sample = p.do_sample if p.do_sample is not None else bool(p.temperature)
        kwargs["do_sample"] = sample
        if sample:
            for name in ("temperature", "top_p", "top_k"):
                if getattr(p, name) is not None:
                    kwargs[name] = getattr(p, name)
        if p.repetition_penalty is not None:
            kwargs["repetition_penalty"] = p.repetition_penalty
        if p.stop_sequences:
            kwargs["stop_strings"] = [p.stop_sequences] if isinstance(p.stop_sequences, str) else p.stop_sequences
            kwargs["tokenizer"] = self.tokenizer
        if p.ignore_eos_token:
            kwargs["min_new_tokens"] = p.max_new_tokens
        if p.decoder_input_details:
            raise InputError("parameters.decoder_input_details is not supported by the Accelerate engine")
        if p.priority:  # the worker's queue orders requests before their bodies are read
            raise InputError(
                "parameters.priority is not read by the Accelerate engine; send the X-Priority header "
                "(with option.scheduling_policy=priority), which orders the requests waiting for it"
            )
        for name, value in (p.model_extra or {}).items():
            if name in self.known_generation:
                kwargs[name] = value
        return kwargs

    def _seed(self, request: LmiRequest) -> None:
        if request.parameters.seed is not None:
            import torch

            torch.manual_seed(request.parameters.seed)

    def _generate_answers(self, group: list[_Item]) -> list[Any]:
        import torch

        request = group[0].generation
        prompts = [p for it in group for p in it.generation.prompts]
        kwargs = self.generate_kwargs(request)
        encoded = self.tokenizer(prompts, return_tensors="pt", padding=True).to(self.model.device)
        self._seed(request)
        try:
            with torch.inference_mode():
                out = self.model.generate(**encoded, **kwargs, return_dict_in_generate=True, output_scores=True)
        except (TypeError, ValueError) as exc:
            raise InputError(f"invalid generation parameters: {exc}") from None
        start = encoded["input_ids"].shape[1] if self.task == "text-generation" else 1
        steps = torch.stack(out.scores, dim=1).float().log_softmax(-1)  # [prompts, steps, vocab]
        generations = [
            self._generation(prompt, out.sequences[i, start:], steps[i], request) for i, prompt in enumerate(prompts)
        ]
        answers, at = [], 0
        for it in group:
            n = len(it.generation.prompts)
            answers.append(self.formatter.body(generations[at : at + n], it.generation))
            at += n
        return answers

    def _generation(self, prompt: str, ids, logprobs, request: LmiRequest) -> Generation:
        gen = Generation(prompt=prompt)
        eos = _eos_ids(self.model)
        top_n = request.parameters.top_n_tokens
        for step, token_id in enumerate(ids.tolist()):
            if gen.finish_reason is not None:  # what follows the end is padding
                break
            gen.tokens.append(self._token(token_id, logprobs[step], top_n))
            if token_id in eos:
                gen.finish_reason = "eos_token"
        token_ids = [t.id for t in gen.tokens]
        gen.text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        if gen.finish_reason is None:
            stops = request.parameters.stop_sequences
            stops = [stops] if isinstance(stops, str) else stops or []
            gen.finish_reason = "stop_sequence" if any(gen.text.endswith(s) for s in stops) else "length"
        return gen

    def _token(self, token_id: int, logprobs, top_n: int) -> TokenInfo:
        top = []
        if top_n:
            values, indices = logprobs.topk(top_n)
            top = [TokenInfo(int(i), self.tokenizer.decode([int(i)]), float(v)) for v, i in zip(values, indices)]
        return TokenInfo(token_id, self.tokenizer.decode([token_id]), float(logprobs[token_id]), top)

    def _stream_lines(self, request: LmiRequest) -> Iterator[bytes]:
        """The stream's lines (or events), token by token, as generation runs in a thread."""
        import torch

        kwargs = self.generate_kwargs(request)
        encoded = self.tokenizer(request.prompts, return_tensors="pt").to(self.model.device)
        streamer = TokenStreamer()
        stop = threading.Event()
        scores: list[Any] = []

        def record(input_ids, step_scores):  # a logits processor: the step's log-probs, then its token
            scores.append(step_scores[0].float().log_softmax(-1))
            return step_scores

        def run() -> None:
            try:
                self._seed(request)
                with torch.inference_mode():
                    self.model.generate(
                        **encoded,
                        **kwargs,
                        streamer=streamer,
                        logits_processor=[record],
                        stopping_criteria=[lambda ids, s, **kw: stop.is_set()],
                    )
            except Exception as exc:
                streamer.fail(exc)
            finally:
                streamer.end()

        threading.Thread(target=run, name="accelerate-stream", daemon=True).start()
        return self._stream_items(request, streamer, scores, stop)

    def _stream_items(
        self, request: LmiRequest, streamer: TokenStreamer, scores: list, stop: threading.Event
    ) -> Iterator[bytes]:
        gen = Generation(prompt=request.prompts[0])
        params, eos = request.parameters, _eos_ids(self.model)
        previous = ""
        try:
            tokens = iter(streamer)
            token_id = next(tokens, None)
            while token_id is not None:
                after = next(tokens, None)
                token = self._token(token_id, scores[len(gen.tokens)], params.top_n_tokens)
                gen.tokens.append(token)
                text = self.tokenizer.decode([t.id for t in gen.tokens], skip_special_tokens=True)
                token.text, previous = text[len(previous) :], text
                gen.text = text
                if after is None:
                    stops = params.stop_sequences
                    stops = [stops] if isinstance(stops, str) else stops or []
                    gen.finish_reason = (
                        "eos_token"
                        if token_id in eos
                        else "stop_sequence"
                        if any(text.endswith(s) for s in stops)
                        else "length"
                    )
                yield self.formatter.stream_item(token, gen, params, last=after is None)
                token_id = after
        finally:
            stop.set()  # a client that left stops the generation


def _eos_ids(model) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


def _prepend(first: bytes, rest: Iterator[bytes]) -> Iterator[bytes]:
    yield first
    yield from rest


def _plain(value: Any) -> Any:
    """Pipeline answers as JSON-ready values (numpy scalars and arrays included)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "tolist"):
        return value.tolist()
    return value
